"""The fanout as a Structured Streaming query: every topic row into each of its channels.

Exactly once: Spark's checkpoint replays an unfinished micro-batch with the same offsets, the
registry routes it the same way (queue_engine.fanout), and each channel append carries the
app transaction ("deltaq-fanout", batch id), so a channel that already has the batch skips it.

Two ways to write a micro-batch's channel rows:
- on the driver (the default here): the batch collected as Arrow, routed, and each channel's
  rows appended through delta-rs. Lowest latency; a batch is capped (maxRowsPerTrigger) to fit
  the driver.
- by Spark's writer (``channel_format``): each channel's rows selected with DataFrame filters
  and written with ``df.write.format(channel_format)`` and the app transaction as delta-spark's
  ``txnAppId``/``txnVersion``: executors write, nothing is collected. The default where
  delta-spark's jars load ("delta"); ``format("deltaq")`` takes the same options, which is how
  this path is tested here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructField, StructType

from queue_engine.fanout import (
    CHANNEL_COLUMNS,
    CHANNEL_WRITES,
    MAX_FILES_PER_TRIGGER,
    fields_of,
    filter_sql,
    receivers,
    route_noted,
    topic_schema,
)
from queue_engine.registry import ChannelInfo, Registry
from queue_engine.spark.checkpoint_mirror import CheckpointMirror
from queue_engine.spark.checkpoint_sync import (
    local_checkpoint,
    logged_offsets,
    repair_checkpoint,
    sync_batch,
)
from queue_engine.spark.session import (
    CheckpointLocationError,
    Engine,
    checkpoint_has_batches,
    checkpoint_location,
    engine,
)
from queue_engine.spark.source import TopicsBatchReader
from queue_engine.spark.trigger_log import TriggerLog
from queue_engine.store.delta import (
    IdempotentAppender,
    app_transaction_version,
    latest_version,
    open_or_create,
)
from queue_engine.store.storage import StoreError, is_remote, sync_commits
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    NoticeWriter,
    RegistryReader,
    Warehouse,
    batch_note,
)
from queue_engine.topic_schema import TopicSchema, parse_schema

log = logging.getLogger(__name__)

FANOUT_APP_ID = "deltaq-fanout"
FANOUT_QUERY = "deltaq-fanout"
# Channel tables a micro-batch appends to at once.
WRITE_THREADS = 8


class ChannelSinks:
    """One idempotent appender per channel table, kept across micro-batches.

    Keyed by the channel's creation time too: a channel deleted and created again has a new,
    empty table, which an appender of the old one (its next version number) must never touch.
    """

    def __init__(self, warehouse: Warehouse) -> None:
        self.warehouse = warehouse
        self._sinks: dict[tuple[str, int], IdempotentAppender] = {}
        self._schemas: dict[tuple[str, int], pa.Schema] = {}
        # Notes of batches a filter kept wholly out, not committed yet (see append_all), and
        # when each channel last had a note committed (monotonic seconds).
        self._kept_pending: dict[tuple[str, str], int] = {}
        self._noted_at: dict[tuple[str, str], float] = {}
        # Checkpoints off the micro-batch's path (one replays up to 100 commits).
        self._upkeep = ThreadPoolExecutor(1, thread_name_prefix="deltaq-fanout-checkpoint")
        # A batch over many channels appends to their tables side by side: each append is
        # mostly file-system calls outside the GIL (measured: ~5 ms each, one after the
        # other, made a batch over 150 channels take ~1 s).
        self._writers = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="deltaq-fanout-write")

    def append_all(
        self,
        registry: Registry,
        routed: dict[tuple[str, str], pa.Table],
        batch_id: int,
        notes: dict[tuple[str, str], tuple[int, int]] | None = None,
    ) -> int:
        """Append each channel's rows of the batch (``notes``: filtered channels' counts of
        rows kept out and topic versions reached, committed as batch_notes); the rows written
        (a channel that already has this batch, a replay, is skipped). Every append is tried
        before the first error is raised: what committed stays committed, and the replay
        skips it.

        A batch a filter keeps wholly out of a channel is a commit of no rows, made at most
        every NOTE_EVERY_S per channel (its count joins the next note): each such commit is a
        version of the channel's table, which the sweep folds again."""
        notes = notes or {}
        now = time.monotonic()
        jobs = []
        for (topic, channel), selected in routed.items():
            note = None
            if (topic, channel) in notes:
                kept, reached = notes[(topic, channel)]
                kept += self._kept_pending.pop((topic, channel), 0)
                last = self._noted_at.get((topic, channel))
                if not selected.num_rows and last is not None and now - last < NOTE_EVERY_S:
                    self._kept_pending[(topic, channel)] = kept
                    continue
                note = batch_note(kept, reached)
                self._noted_at[(topic, channel)] = now
            info = registry.topics[topic].channels[channel]
            jobs.append((topic, info, selected, note))
        futures = [
            (
                selected.num_rows,
                self._writers.submit(self.append, topic, info, selected, batch_id, note),
            )
            for topic, info, selected, note in jobs
        ]
        written = 0
        error: BaseException | None = None
        for rows, future in futures:
            try:
                if future.result():
                    written += rows
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return written

    def append(
        self,
        topic: str,
        channel: ChannelInfo,
        rows: pa.Table,
        batch_id: int,
        note: str | None = None,
    ) -> bool:
        key = self._key(topic, channel)
        # A typed topic's fields follow the channel's own columns (queue_engine.fanout.route).
        schema = channel_schema(rows)
        sink = self._sinks.get(key)
        if sink is not None and self._schemas.get(key) != schema:
            # The topic's schema gained fields: the table gains their columns first.
            self._sinks.pop(key).close()
            sink = None
        if sink is None:
            open_or_create(key[0], schema)
            sink = self._sinks[key] = IdempotentAppender(
                key[0], FANOUT_APP_ID, schedule_checkpoint=self._upkeep.submit
            )
            self._schemas[key] = schema
        try:
            return sink.append(rows.cast(schema), batch_id, note)
        except Exception:
            # A storage error: the next attempt starts from a freshly read table.
            del self._sinks[key]
            sink.close()
            raise

    def _key(self, topic: str, channel: ChannelInfo) -> tuple[str, int]:
        return (self.warehouse.channel_messages_path(topic, channel.name), channel.created_at_us)

    def retain(self, registry: Registry) -> None:
        """Close the appenders of channels the registry no longer has."""
        live = {
            self._key(t, c) for t, info in registry.topics.items() for c in info.channels.values()
        }
        for key in [k for k in self._sinks if k not in live]:
            self._sinks.pop(key).close()
            self._schemas.pop(key, None)


def with_typed_columns(df: DataFrame, schema: TopicSchema) -> DataFrame:
    """``df`` (topic rows) with the typed topic's fields as columns, converted from ``body``."""
    fields = [
        StructField(f.name, from_arrow_type(f.type), nullable=True) for f in schema.arrow_fields
    ]
    out = StructType([*df.schema.fields, *fields])
    return df.mapInArrow(functools.partial(_typed_batches, schema.ddl), out)


def _typed_batches(ddl: str, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    schema = parse_schema(ddl)
    for batch in batches:
        columns = schema.lenient_columns(batch.column("body").to_pylist())
        yield pa.RecordBatch.from_arrays(
            [*batch.columns, *columns],
            schema=pa.schema([*batch.schema, *schema.arrow_fields]),
        )


def channel_schema(rows: pa.Table) -> pa.Schema:
    """A channel table's schema for ``rows``: its own columns, then a typed topic's fields."""
    typed = [f for f in rows.schema if f.name not in CHANNEL_MESSAGES_SCHEMA.names]
    return pa.schema([*CHANNEL_MESSAGES_SCHEMA, *typed]) if typed else CHANNEL_MESSAGES_SCHEMA


# A filtered channel whose filter keeps every row out gets a commit of no rows (its note) at
# most this often: with batches ~1 s apart, one sweep in two or three folds it again, not every
# one. Its lag in /metrics lags by as much.
NOTE_EVERY_S = 10.0


def fanout_batch(
    read: Callable[[], pa.Table],
    batch_id: int,
    registry_reader: RegistryReader,
    sinks: ChannelSinks,
    notices: NoticeWriter | None = None,
    before_writes: Callable[[], object] | None = None,
    log_level: int = logging.INFO,
) -> int:
    """Write one micro-batch, the rows ``read`` returns, into the channel tables; return the
    number of topic rows it held. ``notices``: where to tell the API nodes which channels got
    rows; ``before_writes``: what must be done before the first channel commit (waited for
    after the batch is read); ``log_level``: of the batch's log line."""
    started = time.perf_counter()
    rows = read()
    read_s = time.perf_counter() - started
    if before_writes is not None:
        before_writes()
    if rows.num_rows == 0:
        return 0
    registry = registry_reader.get()
    sinks.retain(registry)
    routed, notes = route_noted(rows, registry)
    written = sinks.append_all(registry, routed, batch_id, notes)
    if notices is not None:
        # A replayed batch too: its rows may have landed after the nodes last looked. Posted
        # off the batch's path (a hint; one PUT on an object store).
        notices.post_soon(routed)
    log.log(
        log_level,
        "fanout batch %d: %d rows in, %d channel rows out to %d channels "
        "(read %.0f ms, write %.0f ms)",
        batch_id,
        rows.num_rows,
        written,
        len(routed),
        read_s * 1000,
        (time.perf_counter() - started - read_s) * 1000,
    )
    return int(rows.num_rows)


def fanout_batch_by_spark(
    df: DataFrame,
    batch_id: int,
    registry_reader: RegistryReader,
    warehouse: Warehouse,
    channel_format: str,
    created: set[tuple[str, int, int]],
    notices: NoticeWriter | None = None,
    before_writes: Callable[[], object] | None = None,
    versions: dict[tuple[str, int], int] | None = None,
) -> int:
    """Write one micro-batch into the channel tables with Spark's writer; return the number of
    topic rows it held. ``created``: the (table, channel creation, columns) known to exist,
    kept across batches (opening a table to check replays its log); ``versions``: their newest
    versions known, kept the same way (the commits a write added are synced from there)."""
    versions = {} if versions is None else versions
    started = time.perf_counter()
    if before_writes is not None:
        before_writes()
    registry = registry_reader.get()
    # Read once, written to several channels (Spark's advice for foreachBatch fanouts).
    df.persist()
    try:
        # The batch's topics and newest version each: which channels get rows at all.
        counted = df.groupBy("topic").agg(
            F.max("topic_version").alias("newest"), F.count(F.lit(1)).alias("rows")
        )
        by_topic = counted.collect()
        newest = {row["topic"]: row["newest"] for row in by_topic}
        written = 0
        wrote: list[tuple[str, str]] = []
        for topic in sorted(newest):
            schema = topic_schema(registry, topic)
            of_topic = df.filter(F.col("topic") == topic)
            columns = list(CHANNEL_COLUMNS)
            table_schema = CHANNEL_MESSAGES_SCHEMA
            if schema is not None:
                # Converted by the same code as on the other paths, on the executors.
                of_topic = with_typed_columns(of_topic, schema)
                columns += [f.name for f in schema.arrow_fields]
                table_schema = pa.schema([*CHANNEL_MESSAGES_SCHEMA, *schema.arrow_fields])
            for name, channel in receivers(registry, topic):
                if newest[topic] <= channel.start_version:
                    continue
                path = warehouse.channel_messages_path(topic, name)
                # Fields are only ever added: their count tells whether the table has them.
                known = (path, channel.created_at_us, len(table_schema))
                if known not in created:
                    open_or_create(path, table_schema)
                    created.add(known)
                key = (path, channel.created_at_us)
                before = versions.get(key)
                if before is None:
                    before = latest_version(path)
                rows = of_topic.filter(
                    (F.col("topic_version") > F.lit(channel.start_version))
                    & (F.col("to_channel").isNull() | (F.col("to_channel") == F.lit(name)))
                )
                condition = filter_sql(channel, fields_of(schema))
                writer = None
                if condition is not None:
                    # The rows the filter keeps out are counted, and recorded with the commit,
                    # which is made even when it keeps every row out (route_noted's note).
                    passes = F.expr(condition)
                    counts = rows.agg(
                        F.count(F.lit(1)).alias("eligible"),
                        F.count(F.when(passes, True)).alias("taken"),
                    ).collect()[0]
                    rows = rows.filter(passes)
                    note = batch_note(counts["eligible"] - counts["taken"], newest[topic])
                    writer = rows.select(*columns).write.option("userMetadata", note)
                (
                    (writer or rows.select(*columns).write)
                    .format(channel_format)
                    .mode("append")
                    .option("txnAppId", FANOUT_APP_ID)
                    .option("txnVersion", str(batch_id))
                    .save(path)
                )
                # delta-spark does not sync what it writes: before Spark records the batch.
                versions[key] = latest_version(path, before)
                sync_commits(path, before + 1, versions[key])
                written += 1
                wrote.append((topic, name))
    finally:
        df.unpersist()
    if notices is not None:
        notices.post_soon(wrote)
    log.info(
        "fanout batch %d: %d topics, %d channel tables written with format(%s) (%.0f ms)",
        batch_id,
        len(newest),
        written,
        channel_format,
        (time.perf_counter() - started) * 1000,
    )
    return sum(int(row["rows"]) for row in by_topic)


def channel_format_for(spark: SparkSession, channel_writes: str = "auto") -> str | None:
    """``start_fanout``'s ``channel_format`` for a ``--channel-writes`` choice.

    "driver": the driver appends each channel's rows (None), the low-latency path (a Spark
    write per channel table costs hundreds of milliseconds per micro-batch); its memory is
    bounded by the micro-batch's row cap. "delta" or "deltaq": Spark's writer of that format,
    so the executors write the rows' files and the driver only commits ("delta" needs
    delta-spark's jars, which build_session provides, and a Hadoop FileSystem for the
    warehouse). "auto": the driver on a local master, where driver and executors share one
    machine; on a cluster "deltaq", whose commit is deltaq's own (put-if-absent on every
    store, so safe beside the API's and the sweep's writers of the same tables, where
    delta-spark's default S3 log store is not).
    """
    if channel_writes not in CHANNEL_WRITES:
        raise ValueError(f"channel writes: one of {', '.join(CHANNEL_WRITES)}")
    if channel_writes == "delta" and engine(spark) is not Engine.DELTA_SPARK:
        raise ValueError("--channel-writes delta needs delta-spark's jars on Spark's classpath")
    if channel_writes == "auto":
        return None if (spark.sparkContext.master or "local").startswith("local") else "deltaq"
    return None if channel_writes == "driver" else channel_writes


class ForeignCheckpointError(StoreError):
    """The fanout would start from an empty checkpoint over channels another run fed."""


def refuse_foreign_history(warehouse: Warehouse, registry: Registry, location: str) -> None:
    """Raise if a channel already records fanout batches while the checkpoint is empty.

    Channel commits record the micro-batch id as an app transaction, and a batch id at or below
    the recorded one is skipped as a replay. A new checkpoint numbers batches from 0 again, so
    its first batches, which hold every message the old run had not fanned out yet, would be
    skipped without a trace.
    """
    for topic, info in sorted(registry.topics.items()):
        for name in sorted(info.channels):
            path = warehouse.channel_messages_path(topic, name)
            recorded = app_transaction_version(path, FANOUT_APP_ID)
            if recorded is not None:
                raise ForeignCheckpointError(
                    f"channel {topic}/{name} holds fanout batches up to {recorded} from another "
                    f"checkpoint, and {location} has none: starting there would skip new "
                    "messages. Run the fanout with the checkpoint it ran with (--checkpoint, or "
                    "the fanout_checkpoint setting)"
                )


# Sessions with a TriggerLog already (one session may run several fanouts in turn).
_logged_sessions: set[int] = set()


def start_fanout(
    spark: SparkSession,
    warehouse: Warehouse,
    *,
    once: bool,
    checkpoint: str | None = None,
    max_files_per_trigger: int = MAX_FILES_PER_TRIGGER,
    channel_format: str | None = None,
) -> StreamingQuery:
    """Start the query; with ``once`` it processes what is available now and stops.

    ``channel_format`` None writes channel rows from the driver through delta-rs, and where the
    checkpoint is on the driver's disk the driver reads each micro-batch's rows itself; a
    format name ("delta", "deltaq") writes them with Spark's writer of that format, and tasks
    on the executors read the rows.
    """
    location, mirror = _checkpoint(spark, checkpoint or f"{warehouse.checkpoints_root}/fanout")
    # Where the driver writes the channel rows and the checkpoint is on its disk, it reads each
    # micro-batch's rows itself, from the offsets Spark logged for it: Spark plans the batches
    # and keeps the checkpoint, and no batch's rows go through the JVM.
    local_root = local_checkpoint(location) if channel_format is None else None
    source = (
        spark.readStream.format("deltaq")
        .option("warehouse", warehouse.root)
        .option("kind", "topics")
        .option("maxFilesPerTrigger", str(max_files_per_trigger))
        .load()
    )

    registry_reader = RegistryReader(warehouse.registry_path)
    log.info(
        "fanout: topic rows read %s",
        "by the driver, from the offsets Spark logged"
        if local_root is not None
        else "by tasks on the executors",
    )
    log.info(
        "fanout: channel rows written %s",
        "on the driver through delta-rs"
        if channel_format is None
        else f"by Spark's writer, format({channel_format})",
    )
    notices = NoticeWriter(warehouse.root, "fanout")
    moved = Moved()
    if channel_format is None:
        sinks = ChannelSinks(warehouse)
        batches = TopicsBatchReader(warehouse.root)

        def write(df: DataFrame, batch_id: int, ready: Callable[[], object] | None) -> None:
            def read() -> pa.Table:
                if local_root is None:
                    return df.toArrow()
                return batches.rows(
                    logged_offsets(local_root, batch_id - 1), logged_offsets(local_root, batch_id)
                )

            moved.rows += fanout_batch(read, batch_id, registry_reader, sinks, notices, ready)
            moved.batches += 1

    else:
        format_name = channel_format
        created: set[tuple[str, int, int]] = set()
        versions: dict[tuple[str, int], int] = {}

        def write(df: DataFrame, batch_id: int, ready: Callable[[], object] | None) -> None:
            moved.rows += fanout_batch_by_spark(
                df,
                batch_id,
                registry_reader,
                warehouse,
                format_name,
                created,
                notices,
                ready,
                versions=versions,
            )
            moved.batches += 1

    pushing = ThreadPoolExecutor(1, thread_name_prefix="deltaq-checkpoint-push")

    def each_batch(df: DataFrame, batch_id: int) -> None:
        if mirror is None:
            sync_batch(location, batch_id)
            write(df, batch_id, None)
            return
        # This batch's offsets in the store before any channel commits its rows; put while
        # the batch is read.
        write(df, batch_id, pushing.submit(mirror.push).result)

    try:
        if mirror is None:
            repair_checkpoint(location)
        if not checkpoint_has_batches(spark, location):
            shown = mirror.url if mirror else location
            refuse_foreign_history(warehouse, registry_reader.get(), shown)
        writer = source.writeStream.foreachBatch(each_batch).option("checkpointLocation", location)
        writer = (
            writer.trigger(availableNow=True)
            if once
            else writer.trigger(processingTime="0 seconds")
        )
        if id(spark) not in _logged_sessions:
            spark.streams.addListener(TriggerLog(FANOUT_QUERY))
            _logged_sessions.add(id(spark))
        query = writer.queryName(FANOUT_QUERY).start()
    except BaseException:
        if mirror is not None:
            mirror.discard()
        raise
    if mirror is not None:
        _mirrors[str(query.id)] = mirror
    _moved[str(query.id)] = moved
    return query


@dataclass
class Moved:
    """What a fanout query's micro-batches moved: batches, and the topic rows they held."""

    batches: int = 0
    rows: int = 0


# What each query started here moved, by its id.
_moved: dict[str, Moved] = {}


def moved_by(query: StreamingQuery) -> Moved:
    """What ``query`` (started by ``start_fanout``) has written so far."""
    return _moved.get(str(query.id), Moved())


# Checkpoints mirrored to a store, by the id of the query running on them.
_mirrors: dict[str, CheckpointMirror] = {}
# Stores whose checkpoint a local copy can mirror (obstore reaches them).
MIRRORED_SCHEMES = ("s3", "s3a", "gs", "abfs", "abfss")


def _checkpoint(spark: SparkSession, requested: str) -> tuple[str, CheckpointMirror | None]:
    """Where Spark checkpoints the stream, and the mirror keeping it in a store (None: Spark
    writes ``requested`` itself)."""
    try:
        return checkpoint_location(spark, requested), None
    except CheckpointLocationError:
        if not is_remote(requested) or requested.split("://", 1)[0] not in MIRRORED_SCHEMES:
            raise
    mirror = CheckpointMirror(requested)
    mirror.restore()
    return mirror.local, mirror


def finish_fanout(query: StreamingQuery) -> None:
    """After the query stopped: a mirrored checkpoint gets its last files (the last batch's
    commit), and its local copy is removed."""
    mirror = _mirrors.pop(str(query.id), None)
    if mirror is not None:
        mirror.close()
