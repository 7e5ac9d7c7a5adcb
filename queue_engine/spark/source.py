"""``format("deltaq")``: a PySpark Python Data Source over delta-rs.

- ``spark.read.format("deltaq").load(path)``: batch read of one Delta table; one input partition
  per group of data files, Arrow record batches. No filter pushdown: Spark 4.2 reuses a
  reader that had filters pushed into it for later queries of the same DataFrame or view
  (measured: wrong counts), so Spark filters the rows itself.
  Time travel: ``versionAsOf`` or ``timestampAsOf`` (ISO 8601); only the rows that versions
  (a, b] added: ``afterVersion`` a and ``toVersion`` b (the sweep's incremental reads).
- ``spark.readStream.format("deltaq").load(path)``: offsets are Delta versions; each micro-batch
  reads only the files that versions (start, end] added, skipping compaction commits; read
  limit ``maxFilesPerTrigger``; supports Trigger.AvailableNow.
- ``.option("kind", "channels")`` / ``"topic_counts"``: one batch read over many channel tables
  or every topic's row count, for the SQL views (queue_engine/spark/channel_tables.py).
- ``.option("warehouse", W).option("kind", "topics")``: one stream over every topic of a deltaq
  warehouse (the fanout's source); the offset is a version per topic, new topics join as they
  are created, paused topics do not advance, and rows carry ``topic`` and ``topic_version``.
- ``df.write.format("deltaq")`` / ``writeStream``: each task writes a data file straight into
  the table's storage, the driver commits them in one log entry (through delta-rs); a streaming
  batch is committed with the app transaction (``appId``, batch id) so a replayed batch is
  skipped.
  A batch write takes delta-spark's idempotent-write options ``txnAppId`` / ``txnVersion``
  with delta-spark's meaning, so ``foreachBatch`` code writes alike with either format.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from queue_engine.fanout import MAX_FILES_PER_TRIGGER
from queue_engine.registry import Registry
from queue_engine.spark import fold_inputs
from queue_engine.spark.channel_tables import (
    TOPIC_COUNTS_SCHEMA,
    ChannelTablesReader,
    TopicCountsReader,
    channels_schema,
)
from queue_engine.store.delta import (
    AddedFilesCache,
    RefusedCommit,
    WrittenFile,
    added_files,
    commit_written_files,
    conform,
    discard_files,
    file_uris,
    latest_version,
    table_schema,
    write_data_file,
)
from queue_engine.store.storage import (
    filesystem,
    is_remote,
    parquet_dataset,
    read_objects,
)
from queue_engine.store.tables import (
    TOPIC_SCHEMA,
    NoticeReader,
    RegistryReader,
    Warehouse,
    topic_notice_writers,
)

log = logging.getLogger(__name__)

# Each Python task costs ~30 ms to start: group files so a task has real work.
DEFAULT_FILES_PER_PARTITION = 256
# Over more topics than PROBE_ALL_TOPICS, a topics stream's trigger probes for new versions only
# the topics the API nodes' notices name plus a slice of the others, so that every topic is
# probed at least every FULL_PROBE_S (a lost notice costs that much latency, never a message);
# at or below it, every topic every time (a probe is a file check).
PROBE_ALL_TOPICS = 1_000
FULL_PROBE_S = 10.0
# How often the stream looks for API nodes that started posting notices.
NOTICE_WRITERS_S = 10.0
DEFAULT_MAX_FILES_PER_TRIGGER = MAX_FILES_PER_TRIGGER
# The rows of a micro-batch are collected on the driver by the fanout: cap them so a backlog
# is moved in bounded steps (200k rows of 200 bytes ~ 40 MB) instead of one OOM-sized batch.
DEFAULT_MAX_ROWS_PER_TRIGGER = 200_000
# A micro-batch read by tasks is split over at least this many (a backlog is read on every
# core).
DEFAULT_MIN_PARTITIONS = 2

TOPICS_STREAM_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        *TOPIC_SCHEMA,
        pa.field("topic_version", pa.int64(), nullable=False),
    ]
)


# (data file, topic or None, Delta version, files whose rows' ids are not read from it: see
# commit_log.AddedFile.exclude_ids_of)
FileRef = tuple[str, str | None, int, tuple[str, ...]]


def _groups(files: Sequence[FileRef], size: int) -> list[InputPartition]:
    """One input partition (one Spark task) per ``size`` files."""
    return [InputPartition(tuple(files[i : i + size])) for i in range(0, len(files), size)]


def _files(partition: InputPartition) -> tuple[FileRef, ...]:
    files: tuple[FileRef, ...] = partition.value
    return files


class DeltaqDataSource(DataSource):
    """Delta tables through delta-rs, for batch and streaming reads and writes."""

    @classmethod
    def name(cls) -> str:
        return "deltaq"

    def _topics_stream(self) -> bool:
        return str(self.options.get("kind", "table")) == "topics"

    def schema(self) -> StructType:
        kind = str(self.options.get("kind", "table"))
        if self._topics_stream():
            return from_arrow_schema(TOPICS_STREAM_SCHEMA)
        if kind == "channels":
            return from_arrow_schema(channels_schema(self.options))
        if kind == "topic_counts":
            return from_arrow_schema(TOPIC_COUNTS_SCHEMA)
        if kind == "fold_inputs":
            return from_arrow_schema(fold_inputs.INPUT_ARROW_SCHEMA)
        return from_arrow_schema(table_schema(self.options["path"]))

    def reader(self, schema: StructType) -> DataSourceReader:
        kind = str(self.options.get("kind", "table"))
        if kind == "channels":
            return ChannelTablesReader(self.options)
        if kind == "topic_counts":
            return TopicCountsReader(self.options)
        if kind == "fold_inputs":
            return fold_inputs.FoldInputsReader(self.options)
        return TableReader(
            self.options["path"],
            int(self.options.get("filesPerPartition", DEFAULT_FILES_PER_PARTITION)),
            _selection(self.options),
        )

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if self._topics_stream():
            max_rows = int(self.options.get("maxRowsPerTrigger", DEFAULT_MAX_ROWS_PER_TRIGGER))
            return TopicsStreamReader(
                self.options["warehouse"],
                self._files_per_partition(),
                self._max_files(),
                max_rows,
                min_partitions=int(self.options.get("minPartitions", DEFAULT_MIN_PARTITIONS)),
            )
        return TableStreamReader(
            self.options["path"], self._files_per_partition(), self._max_files()
        )

    def _files_per_partition(self) -> int:
        return int(self.options.get("filesPerPartition", DEFAULT_FILES_PER_PARTITION))

    def _max_files(self) -> int:
        return int(self.options.get("maxFilesPerTrigger", DEFAULT_MAX_FILES_PER_TRIGGER))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return TableWriter(
            self.options["path"],
            overwrite,
            _app_transaction(self.options),
            self.options.get("userMetadata"),
        )

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return TableStreamWriter(self.options["path"], str(self.options.get("appId", "deltaq")))


# -- batch reading -------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which files a batch read covers: a snapshot (latest, a version or a timestamp) or the
    files versions (after, to] added."""

    version_as_of: int | None = None
    timestamp_as_of: str | None = None
    after_version: int | None = None
    to_version: int | None = None

    def files(self, path: str) -> list[str]:
        if self.to_version is not None:
            start = -1 if self.after_version is None else self.after_version
            return [f.path for f in added_files(path, start, self.to_version)]
        as_of: int | datetime | None = self.version_as_of
        if as_of is None and self.timestamp_as_of is not None:
            as_of = datetime.fromisoformat(self.timestamp_as_of.replace("Z", "+00:00"))
        return file_uris(path, as_of)


def _selection(options: Any) -> Selection:
    def number(key: str) -> int | None:
        value = options.get(key)
        return None if value is None else int(value)

    return Selection(
        version_as_of=number("versionAsOf"),
        timestamp_as_of=options.get("timestampAsOf"),
        after_version=number("afterVersion"),
        to_version=number("toVersion"),
    )


class TableReader(DataSourceReader):
    def __init__(self, path: str, files_per_partition: int, selection: Selection) -> None:
        self.path = path
        self.files_per_partition = files_per_partition
        self.selection = selection

    def partitions(self) -> Sequence[InputPartition]:
        uris = self.selection.files(self.path)
        return _groups([(u, None, -1, ()) for u in uris], self.files_per_partition) or [
            InputPartition(())
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        files = _files(partition)
        if not files:
            return
        dataset = parquet_dataset([f[0] for f in files], table_schema(self.path))
        yield from dataset.to_batches()


# -- streaming reading ---------------------------------------------------------------------


def _read_files(
    files: Sequence[FileRef], schema: pa.Schema, with_topic: bool
) -> Iterator[pa.RecordBatch]:
    """The rows of ``files``, as few large batches.

    Each batch handed to Spark has a fixed cost (measured ~10 ms), so one batch per small file
    made a 500-file micro-batch take seconds; and opening files one ``pq.read_table`` at a time
    costs ~0.6 ms each, so all of them are read at once, in order (a dataset scan on local
    disk; on an object store one GET per file, concurrently).
    """
    if not files:
        return
    file_schema = TOPIC_SCHEMA if with_topic else schema
    read = _remote_batches if is_remote(files[0][0]) else _local_batches
    batches: list[pa.RecordBatch] = []
    topics: list[str | None] = []
    versions: list[int] = []
    # A rewrite's rows that the reader had already, through the files it rewrote.
    read_before: dict[tuple[str, ...], pa.Array] = {}
    for rows, topic, version, earlier in read(files, file_schema):
        batch = rows
        if earlier:
            if earlier not in read_before:
                read_before[earlier] = _ids_of(earlier)
            batch = rows.filter(pc.invert(pc.is_in(rows["id"], value_set=read_before[earlier])))
        batches.append(batch)
        if with_topic:
            topics.extend([topic] * batch.num_rows)
            versions.extend([version] * batch.num_rows)
    table = pa.Table.from_batches(batches, schema=file_schema)
    if with_topic:
        table = table.add_column(0, "topic", pa.array(topics, pa.string()))
        table = table.append_column("topic_version", pa.array(versions, pa.int64()))
    combined = table.cast(schema).combine_chunks()
    yield from combined.to_batches(max_chunksize=_BATCH_ROWS)


def _ids_of(paths: Sequence[str]) -> pa.Array:
    """The message ids the data files hold (a vacuumed file: none, and a warning)."""
    ids: list[pa.Array] = []
    for path in paths:
        fs, local = filesystem(path)
        try:
            ids.append(pq.read_table(local, columns=["id"], filesystem=fs)["id"].combine_chunks())
        except FileNotFoundError:
            log.warning("%s was vacuumed: its rows cannot be told from a rewrite's", path)
    return pa.concat_arrays(ids) if ids else pa.array([], pa.string())


def _local_batches(
    files: Sequence[FileRef], file_schema: pa.Schema
) -> Iterator[tuple[pa.RecordBatch, str | None, int, tuple[str, ...]]]:
    """Each file's batches with the rest of its FileRef, through one dataset scan."""
    owners = {filesystem(ref[0])[1]: ref[1:] for ref in files}
    dataset = parquet_dataset([path for path, _, _, _ in files], file_schema)
    for tagged in dataset.scanner().scan_batches():
        topic, version, earlier = owners[tagged.fragment.path]
        yield tagged.record_batch, topic, version, earlier


def _remote_batches(
    files: Sequence[FileRef], file_schema: pa.Schema
) -> Iterator[tuple[pa.RecordBatch, str | None, int, tuple[str, ...]]]:
    """The same from an object store: each file fetched whole with one GET, all at once (a
    dataset scan asks a HEAD and two ranged GETs per file, one file after another)."""
    datas = read_objects([path for path, _, _, _ in files])
    for (path, topic, version, earlier), data in zip(files, datas, strict=True):
        if data is None:
            raise FileNotFoundError(path)
        table = conform(pq.read_table(pa.BufferReader(data)), file_schema)
        for batch in table.to_batches():
            yield batch, topic, version, earlier


# Rows per Arrow batch handed to Spark: large enough to amortise the per-batch cost, small
# enough (with 200-byte bodies, ~13 MB) to keep a Python worker's memory modest.
_BATCH_ROWS = 65_536


class TableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"version": v}``; a micro-batch reads what versions (start, end] added."""

    def __init__(self, path: str, files_per_partition: int, max_files: int) -> None:
        self.path = path
        self.files_per_partition = files_per_partition
        self.max_files = max_files
        self.target: int | None = None

    def initialOffset(self) -> dict[str, int]:
        return {"version": -1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxFiles(self.max_files)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = latest_version(self.path)

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        latest = latest_version(
            self.path, max(start["version"], 0) if start["version"] >= 0 else -1
        )
        if self.target is not None:
            latest = min(latest, self.target)
        if isinstance(limit, ReadMaxFiles):
            # One append is one file, so a version budget is a file budget.
            latest = min(latest, start["version"] + max(1, limit.max_files))
        return {"version": max(latest, start["version"])}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        files = added_files(self.path, start["version"], end["version"])
        return _groups(
            [(f.path, None, f.version, f.exclude_ids_of) for f in files], self.files_per_partition
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read_files(_files(partition), table_schema(self.path), with_topic=False)

    def commit(self, end: dict[str, int]) -> None:
        return None


def _begin_version(start: dict[str, list[int]], topic: str, seq: int) -> int:
    """The version a topic's part of a micro-batch starts after: its offset in ``start`` if that
    names the same creation of the topic, else -1 (a new or re-created topic, read from 0)."""
    begin = start.get(topic)
    return begin[1] if begin is not None and begin[0] == seq else -1


class TopicsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Every topic of a warehouse as one stream.

    The offset maps each topic to ``[create_seq, version]``: ``create_seq`` (the registry seq
    of the topic's creation) tells a re-created topic from the deleted one it replaced, whose
    versions started again from 0.
    """

    def __init__(
        self,
        warehouse: str,
        files_per_partition: int,
        max_files: int,
        max_rows: int,
        min_partitions: int = 1,
    ) -> None:
        self.warehouse = Warehouse(warehouse)
        self.min_partitions = min_partitions
        self.max_rows = max_rows
        self.files_per_partition = files_per_partition
        self.max_files = max_files
        self.target: dict[str, list[int]] | None = None
        self.registry_reader = RegistryReader(self.warehouse.registry_path)
        self._known: dict[str, int] = {}
        # The next budgeted trigger hands out files from the topic after this one ("": first).
        self._budget_after = ""
        self._log = AddedFilesCache()
        self._notices = NoticeReader(warehouse, writers=())
        self._writers_listed = -math.inf
        self._probed_at = time.monotonic()
        self._cursor = 0
        # (topic, version) of the refused commits already logged.
        self._refused: set[tuple[str, int]] = set()

    def _registry(self) -> Registry:
        return self.registry_reader.get()

    def initialOffset(self) -> dict[str, list[int]]:
        return {}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxFiles(self.max_files)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self.latestOffset({}, ReadAllAvailable(), paused_ok=True)

    def latestOffset(
        self, start: dict[str, list[int]], limit: ReadLimit, paused_ok: bool = False
    ) -> dict[str, list[int]]:
        registry = self._registry()
        budget = limit.max_files if isinstance(limit, ReadMaxFiles) else None
        rows_left = self.max_rows
        end: dict[str, list[int]] = {}
        names = sorted(registry.topics)
        probed = self._to_probe(names, everything=paused_ok)
        # The budget goes round: when it ran out, the next trigger begins after the last topic
        # it reached, so busy topics early in name order cannot keep the later ones waiting.
        turn = bisect.bisect_right(names, self._budget_after)
        cut_short = False
        reached = ""
        for name in names[turn:] + names[:turn]:
            info = registry.topics[name]
            seq = info.created_seq
            begin_version = _begin_version(start, name, seq)
            # A paused topic, or one with no channel, holds its messages (nsqd's topic buffer):
            # its offset stays put, so a channel created later still receives them.
            if (info.paused and not paused_ok) or not info.channels:
                end[name] = [seq, begin_version]
                continue
            path = self.warehouse.topic_path(name)
            # Probe onwards from the newest version seen, not from the batch start: probing
            # costs one file check per version.
            known = max(begin_version, self._known.get(f"{seq}:{name}", -1))
            if probed is None or name in probed:
                latest = latest_version(path, known if known >= 0 else -1)
                self._known[f"{seq}:{name}"] = latest
            else:
                latest = known
            if self.target is not None:
                target = self.target.get(name)
                latest = min(latest, target[1]) if target and target[0] == seq else begin_version
            latest = self._before_refusal(name, path, begin_version, latest)
            if budget is not None:
                capped = min(latest, begin_version + max(budget, 0))
                capped, rows = self._row_capped(path, begin_version, capped, rows_left)
                cut_short = cut_short or capped < latest
                if capped > begin_version:
                    reached = name
                latest = capped
                budget -= max(0, latest - begin_version)
                rows_left -= rows
            end[name] = [seq, max(latest, begin_version)]
        if budget is not None:
            self._budget_after = reached if cut_short else ""
        return end

    def _before_refusal(self, name: str, path: str, begin: int, latest: int) -> int:
        """``latest``, or the version before the first commit of (begin, latest] that the
        stream cannot follow (a deletion vector, a feature: ``RefusedCommit``). The topic
        stays there, saying why once, while every other topic moves on."""
        if latest <= begin:
            return latest
        for commit in self._log.commits(path, begin, latest):
            if commit.refusal is not None:
                key = (name, commit.version)
                if key not in self._refused:
                    self._refused.add(key)
                    log.error(
                        "topic %s is held before version %d: %s",
                        name,
                        commit.version,
                        RefusedCommit(path, commit.version, commit.refusal),
                    )
                return commit.version - 1
        return latest

    def _to_probe(self, names: list[str], everything: bool) -> set[str] | None:
        """The topics this trigger probes for new versions (None: all): those named in the
        API nodes' notices since the last trigger, and the next slice of the rest."""
        now = time.monotonic()
        if now - self._writers_listed >= NOTICE_WRITERS_S:
            self._writers_listed = now
            try:
                self._notices.follow(topic_notice_writers(self.warehouse.root))
            except Exception as exc:
                log.debug("topic notices not listed: %s", exc)
        changed = self._notices.changes()
        elapsed, self._probed_at = now - self._probed_at, now
        if everything or changed is None or len(names) <= PROBE_ALL_TOPICS:
            return None
        share = min(len(names), max(1, math.ceil(len(names) * elapsed / FULL_PROBE_S)))
        start = self._cursor % len(names)
        self._cursor = start + share
        rest = names[start : start + share] + names[: max(0, start + share - len(names))]
        return {topic for topic, _ in changed} | set(rest)

    def _row_capped(self, path: str, begin: int, latest: int, rows_left: int) -> tuple[int, int]:
        """The highest version <= ``latest`` whose rows since ``begin`` fit ``rows_left`` (at
        least one version, so a single large commit still moves), and those rows."""
        total = 0
        self._log.added(path, begin, latest)  # every commit in the range read at once
        for version in range(begin + 1, latest + 1):
            rows = sum(f.num_records or 0 for f in self._log.added(path, version - 1, version))
            if total + rows > rows_left and version > begin + 1:
                return version - 1, total
            total += rows
        return latest, total

    def planned(self, start: dict[str, list[int]], end: dict[str, list[int]]) -> list[FileRef]:
        """The files of the micro-batch (start, end], with their topic and version, topics in
        name order."""
        # Most topics of a batch over many did not move: only those that did are looked up.
        moved = [
            (name, begin, version)
            for name, (seq, version) in sorted(end.items())
            if (begin := _begin_version(start, name, seq)) < version
        ]
        return [
            (f.path, name, f.version, f.exclude_ids_of)
            for name, begin, version in moved
            for f in self._log.added(self.warehouse.topic_path(name), begin, version)
        ]

    def partitions(
        self, start: dict[str, list[int]], end: dict[str, list[int]]
    ) -> Sequence[InputPartition]:
        files = self.planned(start, end)
        # At least min_partitions tasks, so a large batch is read (and converted) on every core.
        size = max(1, min(self.files_per_partition, -(-len(files) // self.min_partitions)))
        return _groups(files, size)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read_files(_files(partition), TOPICS_STREAM_SCHEMA, with_topic=True)

    def commit(self, end: dict[str, list[int]]) -> None:
        paths = set()
        for name, (_, version) in end.items():
            path = self.warehouse.topic_path(name)
            paths.add(path)
            self._log.forget_through(path, version)
        self._log.forget_all_but(paths)


class TopicsBatchReader:
    """The rows of one topics-stream micro-batch, read by the process that asks, from the
    offsets Spark logged for it: what the fanout's driver reads instead of collecting the
    batch's DataFrame (that round trip through the JVM cost 0.3-2.5 s a micro-batch on two
    cores). The same offsets give the same files, as they do for Spark's own read."""

    def __init__(self, warehouse: str) -> None:
        self.offsets = TopicsStreamReader(warehouse, DEFAULT_FILES_PER_PARTITION, 0, 0)

    def rows(self, start: dict[str, list[int]], end: dict[str, list[int]]) -> pa.Table:
        """Rows of (start, end], as Spark's read of the stream would give them."""
        batches = list(_read_files(self.offsets.planned(start, end), TOPICS_STREAM_SCHEMA, True))
        # Read once: the commit log of those versions is not needed again.
        self.offsets.commit(end)
        return pa.Table.from_batches(batches, schema=TOPICS_STREAM_SCHEMA)


# -- writing -------------------------------------------------------------------------------


@dataclass
class AddedFiles(WriterCommitMessage):
    """Data files a task wrote into the table's directory, not yet part of the table: each as
    (name relative to the table, size in bytes, Delta statistics JSON)."""

    files: list[WrittenFile]


@dataclass(frozen=True)
class AppTransaction:
    """delta-spark's idempotent-write options (``txnAppId``, ``txnVersion``): the write commits
    with this app transaction, or not at all if the table already recorded ``version`` or a
    later one for ``app_id`` (a replayed ``foreachBatch``)."""

    app_id: str
    version: int


def _app_transaction(options: Any) -> AppTransaction | None:
    app_id, version = options.get("txnAppId"), options.get("txnVersion")
    if app_id is None and version is None:
        return None
    if app_id is None or version is None:
        raise ValueError("txnAppId and txnVersion go together")
    return AppTransaction(str(app_id), int(version))


class TableWriter(DataSourceArrowWriter):
    """Batch writes as Delta writers do: each task writes its rows as a data file in the
    table's directory (on the executor, straight to the table's storage), and the driver
    commits all the tasks' files in one log entry. Nothing goes through the driver's disk or
    memory, so it works wherever executors and driver share only the table's storage."""

    def __init__(
        self,
        path: str,
        overwrite: bool,
        transaction: AppTransaction | None,
        user_metadata: str | None = None,
    ) -> None:
        if overwrite and transaction is not None:
            raise ValueError("txnAppId/txnVersion apply to appends only")
        self.path = path
        self.overwrite = overwrite
        self.transaction = transaction
        # The commitInfo's userMetadata (delta-spark's write option of that name).
        self.user_metadata = user_metadata

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AddedFiles:
        return AddedFiles(write_data_file(self.path, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _commit_files(
            self.path,
            messages,
            self.transaction,
            overwrite=self.overwrite,
            user_metadata=self.user_metadata,
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _discard(self.path, messages)


class TableStreamWriter(DataSourceStreamArrowWriter):
    """Streaming appends, exactly once: commit carries (appId, batchId); replays are skipped."""

    def __init__(self, path: str, app_id: str) -> None:
        self.path = path
        self.app_id = app_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AddedFiles:
        return AddedFiles(write_data_file(self.path, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _commit_files(self.path, messages, AppTransaction(self.app_id, batchId), overwrite=False)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _discard(self.path, messages)


def _files_of(messages: list[WriterCommitMessage | None]) -> list[WrittenFile]:
    return [f for m in messages if isinstance(m, AddedFiles) for f in m.files]


def _commit_files(
    path: str,
    messages: list[WriterCommitMessage | None],
    transaction: AppTransaction | None,
    *,
    overwrite: bool,
    user_metadata: str | None = None,
) -> None:
    """Commit the tasks' files in one log entry (recording ``transaction``), unless the table
    already recorded that transaction: then the files are removed, the write was done before."""
    txn = None if transaction is None else (transaction.app_id, transaction.version)
    commit_written_files(
        path, _files_of(messages), txn, overwrite=overwrite, user_metadata=user_metadata
    )


def _discard(path: str, messages: list[WriterCommitMessage | None]) -> None:
    discard_files(path, [name for name, _, _ in _files_of(messages)])


__all__ = ["DeltaqDataSource"]
