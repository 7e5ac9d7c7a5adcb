"""The sweep: every channel's ledger folded into its ``state`` table.

One fold per run covers all channels that changed or have something due: the previous state
rows, the channel-table rows and the ledger events added since. Up to ``driver_fold_rows``
input rows it runs on the driver (``queue_engine.quick_fold``); past that, as one Spark job
that partitions them by (channel, id), sorts them by event time and folds them with
``queue_engine.state_fold`` (the same ``apply`` as the API). The driver then, per channel

1. appends the TIMEOUT events for leases that had ended (one ledger commit tagged
   ``deltaq.writer=sweep``; the API follows those commits and redelivers), then
2. overwrites ``state`` with the live rows, its commit info naming the ledger and channel
   versions folded (``StateMeta``).

Crash safety: a sweep killed before (1) changed nothing; killed between (1) and (2), the next
sweep folds those TIMEOUTs from the ledger like any event; a TIMEOUT applied twice is invalid the
second time (the attempt is no longer in flight), so none counts twice. A FIN or TOUCH that lands
while the sweep runs is folded after the sweep's TIMEOUT of the same attempt and wins over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from queue_engine.quick_fold import fold_quickly
from queue_engine.spark import fold_inputs
from queue_engine.spark.session import LazySession
from queue_engine.state_fold import (
    FINISHED,
    FOLD_OUTPUT_SCHEMA,
    fold_sorted,
)
from queue_engine.store.delta import (
    AddedFile,
    added_files,
    commit_info,
    latest_version,
    repair_once,
)
from queue_engine.store.storage import parquet_dataset
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    LEDGER_SCHEMA,
    Mark,
    Marks,
    NoticeWriter,
    RegistryReader,
    StateMeta,
    StateSnapshot,
    Warehouse,
    append_sweep_events,
    current_meta,
    load_marks,
    max_topic_version,
    save_marks,
    write_state,
)
from queue_engine.store.upkeep import Maintenance, RetentionPolicy, RetentionReport, apply_retention

log = logging.getLogger(__name__)

_TS = pa.timestamp("us", tz="UTC")
# The fold's input carries the channel's index in this run (rows group by channel, then id).
CHANNEL_COLUMN = fold_inputs.CHANNEL_COLUMN
# Channels whose TIMEOUTs and state a sweep commits at once.
COMMIT_THREADS = 8
# A sweep whose inputs (previous state rows + channel rows + ledger events added since, from
# the commit log's statistics) total at most this many rows is folded on the driver by the
# same fold (queue_engine.quick_fold, state_fold's fold with its shortcuts), like Spark runs a
# small local relation on the driver: the Spark job costs 0.7-3 s of both cores even for a few
# rows, and under `deltaq up` the fanout's micro-batches wait behind it. This bound is a
# cluster's; a local master folds more on the driver (below).
LOCAL_FOLD_MAX_ROWS = 20_000
# On a local master the Spark job runs on this machine's cores anyway, at several times the
# driver's cost (a consumed backlog of 1,000,000 messages: ~60 s of both cores in Spark, ~5 s
# of one on the driver with queue_engine.quick_fold), so the driver folds up to this many rows,
# fewer where half the memory available holds fewer (FOLD_PEAK_BYTES_PER_ROW).
LOCAL_MASTER_FOLD_MAX_ROWS = 4_000_000
# The driver's memory a fold input row takes at the fold's peak (bench: 1,000,000 state rows
# and 2,000,000 ledger rows peaked at ~1.5 GB).
FOLD_PEAK_BYTES_PER_ROW = 512
# A repeating sweep (``pace_backlog``) refolds a channel whose only change is new messages (no
# ledger event, nothing due) once its last sweep is this many times that sweep's duration old,
# when that sweep took at least BACKLOG_PACE_MIN_S. A backlog of unconsumed messages is read
# and written again whole each time (its rows are live): when such folds ran as Spark jobs
# under `deltaq up`, 20,708 unconsumed rows took 12 s of both cores every 10 s interval,
# beside the API answering publishers. New messages need no sweep to be delivered or
# restored (a restart reads the rows newer than the state); only `state` and `queue_stats`
# show them later.
BACKLOG_PACE_FACTOR = 6
BACKLOG_PACE_MIN_S = 2.0
# However slow that sweep was (or whatever its commit info says), the wait ends by then.
BACKLOG_PACE_MAX_S = 900.0


@dataclass(frozen=True)
class ChannelPlan:
    """One channel's share of a sweep: what it reads, from where to where."""

    index: int
    topic: str
    channel: str
    created_at_us: int
    state_path: str
    messages_path: str
    ledger_path: str
    meta: StateMeta | None
    ledger_version: int
    messages_version: int


@dataclass
class SweepReport:
    channels_swept: int = 0
    channels_skipped: int = 0
    live: int = 0
    timeouts: int = 0
    finished: int = 0
    seconds: float = 0.0
    folded_on: str = "spark"  # or "driver" (inputs of at most driver_fold_rows(...) rows)
    # What the retention pass after the sweep removed (None: no pass this time).
    retention: RetentionReport | None = None


def driver_fold_rows(local_master: bool, available_bytes: int | None = None) -> int:
    """How many input rows a sweep folds on the driver rather than in a Spark job: on a local
    master, as many as half the memory available now holds at the fold's peak, up to
    LOCAL_MASTER_FOLD_MAX_ROWS (never fewer than a cluster's LOCAL_FOLD_MAX_ROWS)."""
    if not local_master:
        return LOCAL_FOLD_MAX_ROWS
    if available_bytes is None:
        available_bytes = int(psutil.virtual_memory().available)
    fits = available_bytes // (2 * FOLD_PEAK_BYTES_PER_ROW)
    return max(LOCAL_FOLD_MAX_ROWS, min(LOCAL_MASTER_FOLD_MAX_ROWS, fits))


def _local_master(spark: SparkSession | LazySession) -> bool:
    """Whether a Spark job of this sweep would run on this machine. A session not built yet is
    a local one (jobs/sweep.py builds a cluster's at once)."""
    if isinstance(spark, LazySession):
        if not spark.built:
            return True
        spark = spark.get()
    return str(spark.sparkContext.master).startswith("local")


def now_us() -> int:
    return time.time_ns() // 1000


def _backlog_paced(meta: StateMeta, now: int) -> bool:
    """A channel whose state's sweep was slow and recent: new messages alone wait (see
    BACKLOG_PACE_FACTOR). ``sweep_seconds`` is how long that sweep's run had taken when it
    committed this channel (its planning and its one fold of every channel included)."""
    if not BACKLOG_PACE_MIN_S <= meta.sweep_seconds < float("inf"):
        return False
    wait_s = min(BACKLOG_PACE_FACTOR * meta.sweep_seconds, BACKLOG_PACE_MAX_S)
    # A state stamped ahead of this clock (another host's) paces nothing.
    return 0 <= now - meta.swept_at_us < wait_s * 1_000_000


def plan(
    warehouse: Warehouse,
    now: int,
    *,
    force: bool = False,
    marks: Marks | None = None,
    pace_backlog: bool = False,
) -> tuple[list[ChannelPlan], int]:
    """The channels to sweep now, and how many were skipped (nothing new, nothing due; with
    ``pace_backlog``, also new messages alone right after a slow sweep of the channel).

    ``marks`` (queue_engine.store.tables.sweep_marks) spare opening the state table of a channel
    whose state did not change since the marks were written; on return they hold every
    channel's current mark (the plans' channels are marked again by ``sweep``)."""
    registry = RegistryReader(warehouse.registry_path).get()
    plans: list[ChannelPlan] = []
    skipped = 0
    known = dict(marks or {})
    if marks is not None:
        marks.clear()
    for topic in sorted(registry.topics.values(), key=lambda t: t.name):
        for channel in sorted(topic.channels):
            root = warehouse.channel_root(topic.name, channel)
            state_path = warehouse.channel_state_path(topic.name, channel)
            for table in (state_path, f"{root}/ledger", f"{root}/messages"):
                repair_once(table)  # what a power cut left at a table's tail
            created = topic.channels[channel].created_at_us
            meta = current_meta(known.get((topic.name, channel)), created, state_path)
            if meta is not None and marks is not None:
                marks[(topic.name, channel)] = Mark(created, meta)
            # The ledger's version is taken before the channel table's: every event up to it
            # refers to a message whose row is in the channel table by then.
            ledger_version = latest_version(f"{root}/ledger", meta.ledger_version if meta else -1)
            messages_version = latest_version(
                f"{root}/messages", meta.messages_version if meta else -1
            )
            if ledger_version < 0 and messages_version < 0:
                skipped += 1  # nothing delivered, nothing fanned out yet
                continue
            unchanged = (
                meta is not None
                and meta.ledger_version == ledger_version
                and (meta.next_due_us is None or meta.next_due_us > now)
                and (
                    meta.messages_version == messages_version
                    or (pace_backlog and _backlog_paced(meta, now))
                )
            )
            if unchanged and not force:
                skipped += 1
                continue
            plans.append(
                ChannelPlan(
                    len(plans),
                    topic.name,
                    channel,
                    created,
                    state_path,
                    f"{root}/messages",
                    f"{root}/ledger",
                    meta,
                    ledger_version,
                    messages_version,
                )
            )
    return plans, skipped


_OUTPUT_ARROW_SCHEMA = FOLD_OUTPUT_SCHEMA.append(pa.field(CHANNEL_COLUMN, pa.int32()))
_OUTPUT_SPARK_SCHEMA = from_arrow_schema(_OUTPUT_ARROW_SCHEMA)


def fold_frame(
    spark: SparkSession, plans: list[ChannelPlan], now: int, partitions: int
) -> DataFrame | None:
    """The Spark plan: union of every channel's inputs, folded per (channel, id)."""
    inputs: list[fold_inputs.Input] = []
    for p in plans:
        if p.meta is not None:
            inputs.append(("state", p.state_path, p.index, p.meta.state_version, -1))
        after_m = _messages_after(p)
        if p.messages_version > after_m:
            inputs.append(("messages", p.messages_path, p.index, after_m, p.messages_version))
        after_l = _ledger_after(p)
        if p.ledger_version > after_l:
            inputs.append(("ledger", p.ledger_path, p.index, after_l, p.ledger_version))
    if not inputs:
        return None
    # One scan over every table and range (a union of one DataFrame each took Spark minutes to
    # analyse over thousands of channels).
    union = (
        spark.read.format("deltaq")
        .option("kind", "fold_inputs")
        .option("inputs", fold_inputs.encode(inputs))
        .load()
    )
    versions = {p.index: p.ledger_version for p in plans}

    def fold(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # Rows arrive sorted by (chan, id, ...): fold one channel's run at a time.
        def runs() -> Iterator[tuple[int, list[pa.RecordBatch]]]:
            current: int | None = None
            pending: list[pa.RecordBatch] = []
            for batch in batches:
                chans = batch.column(CHANNEL_COLUMN)
                for value in pc.unique(chans).to_pylist():
                    piece = batch.filter(pc.equal(chans, value))
                    if value != current and pending:
                        assert current is not None
                        yield current, pending
                        pending = []
                    current = value
                    pending.append(piece)
            if pending and current is not None:
                yield current, pending

        for chan, pieces in runs():
            for out in fold_sorted(pieces, now, versions[chan]):
                yield out.append_column(CHANNEL_COLUMN, pa.array([chan] * out.num_rows, pa.int32()))

    return (
        union.repartition(partitions, CHANNEL_COLUMN, "id")
        .sortWithinPartitions(CHANNEL_COLUMN, "id", "src", "e_at", "e_rank")
        .mapInArrow(fold, _OUTPUT_SPARK_SCHEMA)
    )


def sweep(
    spark: SparkSession | LazySession,
    warehouse: Warehouse,
    *,
    now: int | None = None,
    force: bool = False,
    partitions: int | None = None,
    maintenance: Maintenance | None = None,
    local_max_rows: int | None = None,
    progress: Callable[[str], None] | None = None,
    retention: RetentionPolicy | None = None,
    pace_backlog: bool = False,
) -> SweepReport:
    """One sweep of every channel that needs it; with ``maintenance``, the swept channels'
    tables are then checkpointed, compacted and vacuumed by its policy; with ``retention``,
    every table then loses the files past keeping (queue_engine/retention.py). Inputs of at most
    ``local_max_rows`` rows are folded on the driver (0: always by a Spark job; None: by
    where Spark runs, ``driver_fold_rows``).
    ``progress`` is told what the sweep is doing, a line at a time. ``pace_backlog``: for a
    sweep that runs again and again (BACKLOG_PACE_FACTOR)."""
    started = time.perf_counter()
    tell = progress or (lambda _: None)
    now = now_us() if now is None else now
    tell("sweep: planning")
    marks = load_marks(warehouse.root)
    plans, skipped = plan(warehouse, now, force=force, marks=marks, pace_backlog=pace_backlog)
    report = SweepReport(channels_skipped=skipped)
    if not plans:
        save_marks(warehouse.root, marks)
        _retain(warehouse, retention, now, report, tell)
        report.seconds = time.perf_counter() - started
        return report
    if local_max_rows is None:
        local_max_rows = driver_fold_rows(_local_master(spark))
    inputs = _driver_inputs(plans, local_max_rows) if local_max_rows > 0 else None
    if inputs is not None:
        report.folded_on = "driver"
        tell(f"sweep: folding {len(plans)} channels on the driver")
        results = [i.fold(now) for i in inputs]
    else:
        tell(f"sweep: folding {len(plans)} channels in a Spark job")
        session = spark.get() if isinstance(spark, LazySession) else spark
        parallelism = partitions or max(2, session.sparkContext.defaultParallelism)
        results = _fold_with_spark(session, plans, now, parallelism)
    timed_out: list[tuple[str, str]] = []
    # Channels commit side by side: each is a few Delta commits, mostly I/O outside the GIL
    # (one after the other, a first sweep over ten thousand channels took minutes).
    with ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="deltaq-sweep-commit") as pool:
        committed = pool.map(
            lambda pair: _commit_channel(pair[0], pair[1], now, started),
            zip(plans, results, strict=True),
        )
        outcomes = list(_told(committed, len(plans), tell))
    for p, (live, timeouts, finished, written) in zip(plans, outcomes, strict=True):
        if written is not None:
            marks[(p.topic, p.channel)] = Mark(p.created_at_us, written)
        report.channels_swept += 1
        report.live += live
        report.timeouts += timeouts
        report.finished += finished
        if timeouts:
            timed_out.append((p.topic, p.channel))
    # The nodes serving these channels read the TIMEOUT commits now rather than later.
    NoticeWriter(warehouse.root, "sweep").post(timed_out)
    save_marks(warehouse.root, marks)
    if maintenance is not None:
        tell(f"sweep: upkeep of {len(plans)} channels' tables")
        for p in plans:
            for path in (p.messages_path, p.ledger_path, p.state_path):
                try:
                    maintenance.upkeep(path)
                except Exception:
                    # A compaction racing the API's own upkeep of the ledger loses its commit;
                    # the next sweep tries again.
                    log.warning("upkeep of %s failed", path, exc_info=True)
    _retain(warehouse, retention, now, report, tell)
    report.seconds = time.perf_counter() - started
    log.info(
        "sweep: %d channels swept, %d skipped; %d live, %d timed out, %d finished "
        "(folded by %s, %.1f s)",
        report.channels_swept,
        report.channels_skipped,
        report.live,
        report.timeouts,
        report.finished,
        report.folded_on,
        report.seconds,
    )
    return report


def _told(
    committed: Iterator[tuple[int, int, int, StateMeta | None]],
    total: int,
    tell: Callable[[str], None],
) -> Iterator[tuple[int, int, int, StateMeta | None]]:
    for n, outcome in enumerate(committed, 1):
        tell(f"sweep: committed channel {n} of {total}")
        yield outcome


def _retain(
    warehouse: Warehouse,
    policy: RetentionPolicy | None,
    now: int,
    report: SweepReport,
    tell: Callable[[str], None],
) -> None:
    """The retention pass, after the states it relies on were written."""
    if policy is None:
        return
    tell("sweep: retention")
    try:
        registry = RegistryReader(warehouse.registry_path).get()
        report.retention = apply_retention(warehouse, registry, policy, now)
    except Exception:
        # Nothing half-done: each removal is one commit. The next pass tries again.
        log.warning("retention failed", exc_info=True)


def _fold_with_spark(
    spark: SparkSession, plans: list[ChannelPlan], now: int, partitions: int
) -> list[pa.Table]:
    """Each plan's fold output, from one Spark job over all of them."""
    frame = fold_frame(spark, plans, now, partitions)
    collected = frame.toArrow() if frame is not None else None
    result = (
        collected.cast(_OUTPUT_ARROW_SCHEMA).sort_by(CHANNEL_COLUMN)
        if collected is not None and collected.num_rows
        else _OUTPUT_ARROW_SCHEMA.empty_table()
    )
    # Plans are numbered 0..n-1: each channel's rows are one slice of the sorted result.
    bounds = np.searchsorted(
        result[CHANNEL_COLUMN].to_numpy(), np.arange(len(plans) + 1), side="left"
    )
    return [
        result.slice(int(bounds[p.index]), int(bounds[p.index + 1]) - int(bounds[p.index]))
        for p in plans
    ]


@dataclass(frozen=True)
class _DriverInputs:
    """One plan's fold inputs, located through the commit log once: counted to choose where
    to fold, then read from the same files if the driver folds."""

    plan: ChannelPlan
    state: StateSnapshot | None
    messages: list[AddedFile]
    ledger: list[AddedFile]

    @classmethod
    def of(cls, p: ChannelPlan) -> _DriverInputs:
        state = StateSnapshot(p.state_path, p.meta.state_version) if p.meta else None
        return cls(
            p,
            state,
            added_files(p.messages_path, _messages_after(p), p.messages_version),
            added_files(p.ledger_path, _ledger_after(p), p.ledger_version),
        )

    def rows(self, unknown: int) -> int:
        """The rows ``fold_frame`` would read, from Delta statistics (a file without a row
        count counts as ``unknown`` + 1: too many to fold on the driver)."""
        counts = [f.num_records for f in (*self.messages, *self.ledger)]
        if self.state is not None:
            counts += self.state.record_counts()
        return sum(unknown + 1 if n is None else int(n) for n in counts)

    def fold(self, now: int) -> pa.Table:
        """The plan's fold output, computed here from the same inputs as ``fold_frame`` reads."""
        p = self.plan
        rows = fold_quickly(
            self.state.read() if self.state is not None else None,
            _rows(self.messages, CHANNEL_MESSAGES_SCHEMA),
            _rows(self.ledger, LEDGER_SCHEMA),
            now,
            p.ledger_version,
        )
        chan = pa.array([p.index] * rows.num_rows, pa.int32())
        return rows.append_column(CHANNEL_COLUMN, chan).cast(_OUTPUT_ARROW_SCHEMA)


def _driver_inputs(plans: list[ChannelPlan], max_rows: int) -> list[_DriverInputs] | None:
    """The plans' inputs if they total at most ``max_rows`` rows, else None (counting stops
    once past it)."""
    inputs: list[_DriverInputs] = []
    total = 0
    for p in plans:
        inputs.append(_DriverInputs.of(p))
        total += inputs[-1].rows(max_rows)
        if total > max_rows:
            return None
    return inputs


def _rows(files: list[AddedFile], schema: pa.Schema) -> pa.Table | None:
    return parquet_dataset([f.path for f in files], schema).to_table() if files else None


def _messages_after(p: ChannelPlan) -> int:
    return p.meta.messages_version if p.meta else -1


def _ledger_after(p: ChannelPlan) -> int:
    return p.meta.ledger_version if p.meta else -1


def _commit_channel(
    p: ChannelPlan, rows: pa.Table, now: int, started: float
) -> tuple[int, int, int, StateMeta | None]:
    """Write one channel's TIMEOUTs, then its state. Returns (live, timeouts, finished, the
    meta as committed, None if another commit landed on the state table meanwhile)."""
    timed_out = rows.filter(rows["swept_timeout"])
    ledger_version = p.ledger_version
    if timed_out.num_rows:
        n = timed_out.num_rows
        events = pa.Table.from_arrays(
            [
                timed_out["id"],
                pa.array(["TIMEOUT"] * n, pa.string()),
                timed_out["attempts"],
                pa.nulls(n, pa.string()),
                pa.nulls(n, _TS),
                pa.nulls(n, _TS),
                pa.nulls(n, pa.string()),
                pa.array([now] * n, pa.int64()).cast(_TS),
            ],
            schema=LEDGER_SCHEMA,
        )
        _, after = append_sweep_events(p.ledger_path, events)
        if after == p.ledger_version + 1:
            # Nobody committed in between: the rows are exactly the fold of the ledger up to
            # the TIMEOUT commit, so the next sweep need not read it back.
            ledger_version = after
    is_finished = pc.equal(rows["status"], FINISHED)
    done = rows.filter(is_finished)
    live = rows.filter(pc.invert(is_finished))
    previous = p.meta
    meta = StateMeta(
        ledger_version=ledger_version,
        messages_version=p.messages_version,
        topic_version=max(_max_topic_version(p), previous.topic_version if previous else -1),
        finished_requeues=(previous.finished_requeues if previous else 0)
        + int(pc.sum(done["requeues"]).as_py() or 0),
        finished_timeouts=(previous.finished_timeouts if previous else 0)
        + int(pc.sum(done["timeouts"]).as_py() or 0),
        next_due_us=_next_due(live),
        swept_at_us=now,
        sweep_seconds=time.perf_counter() - started,
    )
    version = write_state(p.state_path, live, meta)
    committed = StateMeta.from_commit_info(commit_info(p.state_path, version) or {}, version)
    written = committed if committed is not None and committed.swept_at_us == now else None
    return live.num_rows, timed_out.num_rows, done.num_rows, written


def _next_due(live: pa.Table) -> int | None:
    """The earliest lease expiry or deferral end among the live rows."""
    ends = [
        pc.min(live.filter(pc.equal(live["status"], status))[column].cast(pa.int64())).as_py()
        for status, column in (("in_flight", "lease_expires_at"), ("deferred", "deliver_at"))
    ]
    return min((int(end) for end in ends if end is not None), default=None)


def _max_topic_version(p: ChannelPlan) -> int:
    """The highest topic_version of the channel table at the version swept: the restart
    cursor (a row at or below it is live iff it has a state row; FIN'd rows are gone)."""
    return max_topic_version(p.messages_path, p.messages_version)
