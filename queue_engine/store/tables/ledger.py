"""A channel's ledger table: lease events written in group commits, and read back for a fold."""

from __future__ import annotations

import json
import os
import threading

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake

from queue_engine.lease import EventKind, LeaseEvent
from queue_engine.metrics import ledger_histogram
from queue_engine.store.delta.commit_log import added_files, commit_file, latest_version
from queue_engine.store.delta.group_commit import GroupCommitter, Notify
from queue_engine.store.delta.open_table import open_or_create
from queue_engine.store.storage.files import filesystem, parquet_dataset
from queue_engine.store.storage.fs_sync import sync_commits
from queue_engine.store.tables.channel_state import SWEEP_WRITER, WRITER_KEY
from queue_engine.store.tables.schemas import LEDGER_SCHEMA

_TS = pa.timestamp("us", tz="UTC")
# Rough bytes per event, for the commit size cap.
EVENT_BYTES = 96


def events_to_arrow(events: list[LeaseEvent]) -> pa.Table:
    if not events:
        return LEDGER_SCHEMA.empty_table()
    # One transpose (in LeaseEvent's field order), then one array per column; timestamps are
    # built from µs integers directly.
    ids, kinds, attempts, at, leases, expires, deliver_at, consumers = zip(*events, strict=True)
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.string()),
            pa.array(kinds, pa.string()),
            pa.array(attempts, pa.int32()),
            pa.array(leases, pa.string()),
            pa.array(expires, _TS),
            pa.array(deliver_at, _TS),
            pa.array(consumers, pa.string()),
            pa.array(at, _TS),
        ],
        schema=LEDGER_SCHEMA,
    )


def events_from_arrow(table: pa.Table) -> list[LeaseEvent]:
    """Ledger rows as events (timestamps as µs since the epoch)."""
    columns = {
        name: table[name].cast(pa.int64()).to_pylist()
        if pa.types.is_timestamp(table.schema.field(name).type)
        else table[name].to_pylist()
        for name in LEDGER_SCHEMA.names
    }
    kinds = {kind.value: kind for kind in EventKind}
    return [
        LeaseEvent(
            message_id,
            kinds[event],
            attempt,
            at,
            lease=lease,
            lease_expires_at_us=expires,
            deliver_at_us=deliver_at,
            consumer=consumer,
        )
        for message_id, event, attempt, lease, expires, deliver_at, consumer, at in zip(
            columns["id"],
            columns["event"],
            columns["attempt"],
            columns["lease"],
            columns["lease_expires_at"],
            columns["deliver_at"],
            columns["consumer"],
            columns["at"],
            strict=True,
        )
    ]


def read_ledger(path: str) -> tuple[list[LeaseEvent], int]:
    """Every event of the ledger at ``path`` and the version read (-1 if there is none)."""
    try:
        dt = DeltaTable(path)
    except Exception:
        return [], -1
    return events_from_arrow(dt.to_pyarrow_table()), int(dt.version())


def read_ledger_after(path: str, after: int) -> tuple[list[LeaseEvent], int]:
    """The events versions ``(after, latest]`` added (from the commit log) and the latest
    version: what a restart replays on top of the sweep's state."""
    latest = latest_version(path, after) if after >= 0 else latest_version(path)
    return read_versions(path, after, latest), latest


def read_versions(path: str, after: int, upto: int) -> list[LeaseEvent]:
    files = [f.path for f in added_files(path, after, upto)] if upto > after else []
    if not files:
        return []
    return events_from_arrow(parquet_dataset(files, LEDGER_SCHEMA).to_table())


def append_sweep_events(path: str, events: pa.Table) -> tuple[int, int]:
    """Commit the sweep's events (``LEDGER_SCHEMA`` rows) to the ledger at ``path``, marked as
    the sweep's (``is_sweep_commit``) and synced. Returns the versions before and after."""
    ledger = DeltaTable(path)
    before = int(ledger.version())
    write_deltalake(
        ledger,
        events,
        mode="append",
        commit_properties=CommitProperties(custom_metadata={WRITER_KEY: SWEEP_WRITER}),
    )
    after = int(ledger.version())
    sync_commits(path, before + 1, after)
    return before, after


def is_sweep_commit(path: str, version: int) -> bool:
    """Whether ledger version ``version`` was written by the sweep (its TIMEOUT events)."""
    if "://" in path:
        fs, base = filesystem(path)
        with fs.open_input_stream(f"{base}/{commit_file(version)}") as stream:
            first = stream.read().decode().split("\n", 1)[0]
    else:
        with open(os.path.join(os.path.abspath(path), commit_file(version)), "rb") as f:
            first = f.readline().decode()
    try:
        info = json.loads(first).get("commitInfo") or {}
    except ValueError:
        return False
    return bool(info.get(WRITER_KEY) == SWEEP_WRITER)


class OwnVersions:
    """The ledger versions a writer committed itself: a follower of the ledger (looking for the
    sweep's commits) skips them. Thread-safe: the threaded writer adds from its commit thread."""

    def __init__(self) -> None:
        self._versions: set[int] = set()
        self._lock = threading.Lock()

    def add(self, version: int) -> None:
        with self._lock:
            self._versions.add(version)

    def __contains__(self, version: object) -> bool:
        with self._lock:
            return version in self._versions

    def forget_through(self, version: int) -> None:
        """The follower has passed ``version``: versions up to there are not needed."""
        with self._lock:
            self._versions = {v for v in self._versions if v > version}


class LedgerWriter(GroupCommitter[list[LeaseEvent]]):
    """Appends lease events to one channel's ledger, many requests per Delta commit."""

    def __init__(self, path: str, notify: Notify, *, name: str = "") -> None:
        # The newest version this writer knows of (its own commits move it).
        self.version = int(open_or_create(path, LEDGER_SCHEMA).version())
        self.own = OwnVersions()
        super().__init__(
            path,
            notify,
            commit_max_bytes=64 * 1024 * 1024,
            name=name,
            histogram=ledger_histogram(name) if name else None,
        )
        self._start()

    def submit_events(self, events: list[LeaseEvent], token: object, *, lazy: bool = False) -> None:
        """``lazy`` is the loop writer's: here every commit takes what arrived during the last."""
        self.submit(events, len(events) * EVENT_BYTES, token)

    def _commit(self, batch: list[list[LeaseEvent]]) -> None:
        events = [event for events in batch for event in events]
        version = self._append(events_to_arrow(events))
        self.own.add(version)
        self.version = max(self.version, version)
