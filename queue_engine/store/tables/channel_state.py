"""A channel's ``state`` table: the fold of its ledger, checkpointed by the sweep job.

One row per live message (ready, in flight, deferred or dead; FIN'd messages leave it) with the
columns of ``queue_engine.lease.MessageState``. Each sweep overwrites the table in one commit
whose commit info carries the positions it reflects (``StateMeta``): the ledger version folded
and the channel-table version read. A restarting API loads the rows and replays only the ledger
after that version; Delta's history of the table answers "what was in flight at 03:12?".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError

from queue_engine.lease import FRESH, MessageState, Status
from queue_engine.store.delta.commit_log import commit_info
from queue_engine.store.storage.fs_sync import sync_commits, sync_created

_TS = pa.timestamp("us", tz="UTC")

STATE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("attempts", pa.int32(), nullable=False),
        pa.field("lease", pa.string(), nullable=True),
        pa.field("lease_owner", pa.string(), nullable=True),
        pa.field("delivered_at", _TS, nullable=True),
        pa.field("lease_expires_at", _TS, nullable=True),
        pa.field("lease_duration_us", pa.int64(), nullable=False),
        pa.field("deliver_at", _TS, nullable=True),
        pa.field("timed_out", pa.bool_(), nullable=False),
        pa.field("requeues", pa.int32(), nullable=False),
        pa.field("timeouts", pa.int32(), nullable=False),
        pa.field("published_at", _TS, nullable=True),
        # The fanout's position of the message's row (the restart cursor; see StateMeta).
        pa.field("topic_version", pa.int64(), nullable=True),
        pa.field("ledger_version", pa.int64(), nullable=False),
        pa.field("swept_at", _TS, nullable=False),
    ]
)

# Columns that come from MessageState, in ``state_from_values`` order.
STATE_FIELDS = [
    "attempts",
    "lease",
    "lease_owner",
    "delivered_at",
    "lease_expires_at",
    "lease_duration_us",
    "deliver_at",
    "timed_out",
    "requeues",
    "timeouts",
]

# Commit-info keys of a sweep's state commit and of its ledger (TIMEOUT) commits.
_META_PREFIX = "deltaq."
WRITER_KEY = "deltaq.writer"
SWEEP_WRITER = "sweep"


@dataclass(frozen=True)
class StateMeta:
    """What a state commit reflects, so a reader knows what to replay on top of it."""

    # Ledger versions <= this are folded into the rows.
    ledger_version: int
    # Channel-table versions <= this were read: a row there is live iff it is in ``state``.
    messages_version: int
    # The highest topic_version among those rows (-1: none); rows above it are newer.
    topic_version: int
    # requeue/timeout counters of messages that were FIN'd and left the table (nsqd's
    # requeue_count and timeout_count count every message the channel has had).
    finished_requeues: int
    finished_timeouts: int
    # The earliest lease expiry or deferral end among the rows (µs; None: nothing pending),
    # so a sweep with nothing new and nothing due can skip the channel.
    next_due_us: int | None
    swept_at_us: int
    # The state table's own version holding these rows.
    state_version: int = -1
    # How long the sweep run had been going when it wrote these rows (s).
    sweep_seconds: float = 0.0

    def to_commit_info(self) -> dict[str, str]:
        return {
            f"{_META_PREFIX}ledger_version": str(self.ledger_version),
            f"{_META_PREFIX}messages_version": str(self.messages_version),
            f"{_META_PREFIX}topic_version": str(self.topic_version),
            f"{_META_PREFIX}finished_requeues": str(self.finished_requeues),
            f"{_META_PREFIX}finished_timeouts": str(self.finished_timeouts),
            f"{_META_PREFIX}next_due_us": "" if self.next_due_us is None else str(self.next_due_us),
            f"{_META_PREFIX}swept_at_us": str(self.swept_at_us),
            f"{_META_PREFIX}sweep_seconds": f"{self.sweep_seconds:.3f}",
        }

    @classmethod
    def from_commit_info(cls, info: dict[str, object], state_version: int) -> StateMeta | None:
        def get(key: str) -> str | None:
            value = info.get(f"{_META_PREFIX}{key}")
            return None if value is None else str(value)

        ledger = get("ledger_version")
        if ledger is None:
            return None
        due = get("next_due_us")
        return cls(
            ledger_version=int(ledger),
            messages_version=int(get("messages_version") or -1),
            topic_version=int(get("topic_version") or -1),
            finished_requeues=int(get("finished_requeues") or 0),
            finished_timeouts=int(get("finished_timeouts") or 0),
            next_due_us=int(due) if due else None,
            swept_at_us=int(get("swept_at_us") or 0),
            state_version=state_version,
            sweep_seconds=float(get("sweep_seconds") or 0.0),
        )


def read_meta(path: str) -> StateMeta | None:
    """The newest sweep commit's meta (None: never swept)."""
    try:
        dt = DeltaTable(path)
    except Exception:
        return None
    return meta_of(dt)


def meta_of(dt: DeltaTable) -> StateMeta | None:
    """The meta of the newest sweep commit at or before the version ``dt`` has loaded (time
    travel included). Other commits (upkeep) are skipped, so they cannot hide it."""
    loaded = dt.version()
    for entry in dt.history(50):
        version = int(entry.get("version", loaded))
        if version > loaded:
            continue
        meta = StateMeta.from_commit_info(entry, version)
        if meta is not None:
            return meta
    return None


def meta_as_of(path: str, latest: StateMeta, swept_by_us: int) -> StateMeta | None:
    """The newest sweep commit of the state table at ``path`` swept at or before
    ``swept_by_us`` (None: none is left in the log). ``latest`` is the table's newest.

    A binary search over the versions reading one commit file per step: a state table takes
    a commit per sweep, tens of thousands in a week, too many to read its whole history."""
    if latest.swept_at_us <= swept_by_us:
        return latest
    best: StateMeta | None = None
    low, high = 0, latest.state_version - 1
    while low <= high:
        middle = (low + high) // 2
        found = _sweep_meta_at_or_before(path, middle, low)
        if found is None or found.swept_at_us <= swept_by_us:
            if found is not None:
                best = found
            low = middle + 1
        else:
            high = middle - 1
    return best


def _sweep_meta_at_or_before(path: str, version: int, floor: int) -> StateMeta | None:
    """The meta of the newest sweep commit in versions ``floor..version`` (upkeep commits
    such as compaction carry none); None when there is none, or the log there is gone."""
    for v in range(version, max(floor, version - 50) - 1, -1):
        info = commit_info(path, v)
        if info is None:
            return None
        meta = StateMeta.from_commit_info(info, v)
        if meta is not None:
            return meta
    return None


def read_state(path: str, meta: StateMeta) -> pa.Table:
    """The rows of the state commit ``meta`` describes."""
    dt = DeltaTable(path)
    if meta.state_version >= 0 and meta.state_version != dt.version():
        dt.load_as_version(meta.state_version)
    return dt.to_pyarrow_table()


@dataclass(frozen=True)
class StateSnapshot:
    """The state table at one version: its files' row counts (to size a fold) and its rows."""

    path: str
    version: int

    def record_counts(self) -> list[int]:
        dt = DeltaTable(self.path, version=self.version)
        counts: list[int] = pa.table(dt.get_add_actions(flatten=True))["num_records"].to_pylist()
        return counts

    def read(self) -> pa.Table:
        return DeltaTable(self.path, version=self.version).to_pyarrow_table()


def write_state(path: str, rows: pa.Table, meta: StateMeta) -> int:
    """Replace the table's rows with ``rows`` in one commit carrying ``meta``."""
    target: DeltaTable | str = path
    before = -1
    with contextlib.suppress(TableNotFoundError):  # the first sweep creates it
        target = DeltaTable(path)
        before = int(target.version())
    write_deltalake(
        target,
        rows.select(STATE_SCHEMA.names).cast(STATE_SCHEMA),
        mode="overwrite",
        schema_mode="overwrite",
        commit_properties=CommitProperties(custom_metadata=meta.to_commit_info()),
    )
    version = int(DeltaTable(path).version()) if isinstance(target, str) else int(target.version())
    if before < 0:
        sync_created(path)
    sync_commits(path, before + 1, version)
    return version


# -- rows <-> states ------------------------------------------------------------------------


def state_from_values(values: Sequence[Any], status: str) -> MessageState:
    """A state row's MessageState from its ``STATE_FIELDS`` values (timestamps as µs)."""
    (
        attempts,
        lease,
        lease_owner,
        delivered_at,
        lease_expires_at,
        lease_duration_us,
        deliver_at,
        timed_out,
        requeues,
        timeouts,
    ) = values
    dead = status == Status.DEAD
    # Never delivered, or redriven (attempts start again) with no counts to keep.
    if attempts == 0 and deliver_at is None and not requeues and not timeouts and not dead:
        return FRESH
    return MessageState(
        attempts=attempts,
        in_flight=status == Status.IN_FLIGHT,
        lease=lease,
        lease_owner=lease_owner,
        delivered_at_us=delivered_at,
        lease_expires_at_us=lease_expires_at,
        lease_duration_us=lease_duration_us or 0,
        deliver_at_us=deliver_at,
        timed_out=bool(timed_out),
        requeues=requeues or 0,
        timeouts=timeouts or 0,
        dead=dead,
    )


def columns_as_lists(table: pa.Table | pa.RecordBatch, names: list[str]) -> list[list[object]]:
    """Columns as Python lists, timestamps as µs since the epoch."""
    out: list[list[object]] = []
    for name in names:
        column = table.column(name)
        if pa.types.is_timestamp(column.type):
            column = column.cast(pa.int64())
        out.append(column.to_pylist())
    return out


def load_states(table: pa.Table) -> tuple[dict[str, MessageState], set[str], int | None]:
    """State rows as (states of messages delivered or deferred, ids of messages that were
    ready and never delivered, lowest topic_version). Vectorised where it can be: a restart
    reads a million rows."""
    if table.num_rows == 0:
        return {}, set(), None
    fresh = pc.and_(
        pc.and_(pc.equal(table["attempts"], 0), pc.is_null(table["deliver_at"])),
        pc.and_(
            pc.and_(pc.equal(table["requeues"], 0), pc.equal(table["timeouts"], 0)),
            pc.not_equal(table["status"], Status.DEAD.value),
        ),
    )
    unstarted = set(table.filter(fresh)["id"].to_pylist())
    lowest = pc.min(table["topic_version"]).as_py()
    rest = table.filter(pc.invert(fresh))
    ids, status, *fields = columns_as_lists(rest, ["id", "status", *STATE_FIELDS])
    states = {
        str(row[0]): state_from_values(row[2:], str(row[1]))
        for row in zip(ids, status, *fields, strict=True)
    }
    return states, unstarted, None if lowest is None else int(lowest)
