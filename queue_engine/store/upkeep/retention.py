"""Retention: the tables stay bounded under a steady load, by removing whole files.

What may go (all decided from the tables themselves, so any process can run it):

- A topic's rows, ``retention_hours`` after publishing (a row's id carries its publish time),
  and with the ``taken`` rule only once every channel has taken them: a file is removed only
  if it was already in the topic table at the newest version every channel's fanout has
  passed (the channel's start version, or the highest ``topic_version`` it holds, its
  sweep's state recorded, or a filtered channel's newest fanout commit noted: a batch its
  filter kept wholly out is committed with no rows, noting the version it reached). A topic
  without channels keeps what a future first channel would receive (nsqd buffers for it).
- A channel's messages-table and ledger rows, ``finished_retention_hours`` after the message
  was FIN'd or expired (messages-table rows also after it was dead-lettered). The proof is a
  sweep's state at least that old ("old"): a row in the channel-table files of versions <=
  old's ``messages_version`` is live iff old lists it, so a file of that snapshot with no id
  in old (nor in the newest state) holds only messages that had ended by then; likewise a
  ledger file of the snapshot at old's ``ledger_version``. A message dead in old and in the
  newest state loses its messages-table row too (the dead-letter table has its body; a
  redrive reads it from there) but keeps its ledger rows (the ``dead_letters`` view proves a
  dead letter by its DEAD event). Live messages keep every row, so a restart (newest state +
  the ledger after it) and the sweep lose nothing they need.
- A channel's dead-letter rows, once the message was redriven ``finished_retention_hours``
  ago: written well before old was swept, and dead in neither old nor the newest state.

Rows are never rewritten: a file goes only when every row in it may go (``remove_files``),
which keeps retention free of conflicts with the appends going on meanwhile. Compaction makes
files of rows of a similar age, so little lingers. A channel never swept keeps everything.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from queue_engine.lease import Status
from queue_engine.message import id_from_hex, id_timestamp_ms
from queue_engine.registry import ChannelInfo, Registry, TopicInfo
from queue_engine.settings import RetentionMode, Settings
from queue_engine.store.delta.commit_log import absolute_path
from queue_engine.store.delta.removal import RemovalConflict, removal_supported, remove_files
from queue_engine.store.storage.files import filesystem, parquet_dataset
from queue_engine.store.tables.batch_notes import noted_topic_version
from queue_engine.store.tables.channel_state import StateMeta, meta_as_of, read_meta
from queue_engine.store.tables.warehouse import Warehouse

log = logging.getLogger(__name__)

_HOUR_US = 3_600_000_000
# A dead-letter row is committed just before its DEAD event: rows older than this before a
# sweep began have their events in that sweep's state.
_DEAD_EVENT_MARGIN_MS = 60_000


@dataclass(frozen=True)
class RetentionPolicy:
    topic_hours: float
    topic_mode: RetentionMode
    finished_hours: float

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        return cls(settings.retention_hours, settings.retention, settings.finished_retention_hours)

    def for_topic(self, topic: TopicInfo) -> tuple[float, RetentionMode]:
        """The topic's retention hours and rule: its own where set, else the policy's."""
        hours = self.topic_hours if topic.retention_hours is None else topic.retention_hours
        mode = self.topic_mode if topic.retention is None else RetentionMode(topic.retention)
        return hours, mode


@dataclass
class RetentionReport:
    tables: int = 0
    files_removed: int = 0
    rows_removed: int = 0
    bytes_removed: int = 0
    # "<table>: why it was left as it is" for tables retention could not judge.
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def removed(self, files: int, rows: int, nbytes: int) -> None:
        self.files_removed += files
        self.rows_removed += rows
        self.bytes_removed += nbytes


@dataclass(frozen=True)
class _Files:
    """A table's current data files, from its add actions."""

    paths: list[str]
    sizes: list[int]
    rows: list[int]
    max_ids: list[str | None]
    max_topic_versions: list[int | None]
    # When each file was written (ms since the epoch).
    written_ms: list[int]

    @classmethod
    def of(cls, dt: DeltaTable) -> _Files:
        actions = pa.table(dt.get_add_actions(flatten=True))
        n = actions.num_rows

        def column(name: str) -> list[Any]:
            if name in actions.column_names:
                return list(actions[name].to_pylist())
            return [None] * n

        return cls(
            [str(p) for p in column("path")],
            [int(s or 0) for s in column("size_bytes")],
            [int(r or 0) for r in column("num_records")],
            [None if m is None else str(m) for m in column("max.id")],
            [None if v is None else int(v) for v in column("max.topic_version")],
            [int(t or 0) for t in column("modification_time")],
        )


def apply_retention(
    warehouse: Warehouse, registry: Registry, policy: RetentionPolicy, now_us: int
) -> RetentionReport:
    """One retention pass over every topic and channel of ``registry``."""
    started = time.perf_counter()
    report = RetentionReport()
    for topic in sorted(registry.topics.values(), key=lambda t: t.name):
        taken: list[int] = []
        for _, channel in sorted(topic.channels.items()):
            taken.append(_channel(warehouse, topic.name, channel, policy, now_us, report))
        hours, mode = policy.for_topic(topic)
        if hours <= 0:
            continue
        if mode is RetentionMode.FIXED:
            through = None
        elif taken:
            through = min(taken)
        else:
            # No channel: only what no future channel receives (drained or emptied) may go.
            through = max(topic.drained_version, topic.empty_version)
        _topic(warehouse.topic_path(topic.name), hours, through, now_us, report)
    report.seconds = time.perf_counter() - started
    if report.files_removed:
        log.info(
            "retention: %d files removed (%d rows, %d bytes) from %d tables in %.1f s",
            report.files_removed,
            report.rows_removed,
            report.bytes_removed,
            report.tables,
            report.seconds,
        )
    return report


def _topic(
    path: str, hours: float, through: int | None, now_us: int, report: RetentionReport
) -> None:
    """Remove the topic's files published over ``hours`` ago (and, unless ``through`` is
    None, already in the table at version ``through``)."""
    if through is not None and through < 0:
        return
    dt = _open(path, report)
    if dt is None:
        return
    files = _Files.of(dt)
    cutoff_ms = (now_us - int(hours * _HOUR_US)) // 1000
    old = {
        p
        for p, top in zip(files.paths, files.max_ids, strict=True)
        if top is not None and id_timestamp_ms(id_from_hex(top)) < cutoff_ms
    }
    if old and through is not None:
        old &= _paths_at(path, min(through, dt.version()), report)
    _remove(path, dt, files, old, "topic retention", report)


def _channel(
    warehouse: Warehouse,
    topic: str,
    channel: ChannelInfo,
    policy: RetentionPolicy,
    now_us: int,
    report: RetentionReport,
) -> int:
    """Remove the channel's rows of messages that ended ``finished_hours`` ago; return the
    newest topic version the fanout has given the channel (its start version at least)."""
    state_path = warehouse.channel_state_path(topic, channel.name)
    messages_path = warehouse.channel_messages_path(topic, channel.name)
    newest = read_meta(state_path)
    messages = _open(messages_path, report, missing_ok=True)
    files = None if messages is None else _Files.of(messages)
    taken = max(channel.start_version, newest.topic_version if newest else -1)
    if files is not None:
        taken = max([taken, *(v for v in files.max_topic_versions if v is not None)])
    if messages is not None and channel.filters:
        taken = max(taken, noted_topic_version(messages_path, int(messages.version()), 10))
    if newest is None or policy.finished_hours <= 0 or messages is None or files is None:
        return taken
    old = meta_as_of(state_path, newest, now_us - int(policy.finished_hours * _HOUR_US))
    if old is None:
        return taken
    try:
        (old_ids, old_dead), (new_ids, new_dead) = (
            _state_ids(state_path, old),
            _state_ids(state_path, newest),
        )
    except Exception as exc:  # its files vacuumed: nothing can be proved
        report.skipped.append(f"{state_path}: state v{old.state_version} unreadable ({exc})")
        return taken
    live = old_ids | new_ids
    # Dead then and dead still: its body is in the dead-letter table (a redrive reads it from
    # there), so its messages-table row may go. Its ledger rows stay: the dead_letters view
    # proves a dead letter by its DEAD event.
    _finished(
        messages_path, messages, files, old.messages_version, live - (old_dead & new_dead), report
    )
    ledger_path = warehouse.channel_ledger_path(topic, channel.name)
    ledger = _open(ledger_path, report, missing_ok=True)
    if ledger is not None:
        _finished(ledger_path, ledger, _Files.of(ledger), old.ledger_version, live, report)
    dead_path = warehouse.channel_dead_path(topic, channel.name)
    dead = _open(dead_path, report, missing_ok=True)
    if dead is not None:
        # A dead letter written well before old was swept had its DEAD event folded into old
        # (the event follows its row within moments); if neither old nor the newest state has
        # the message dead, it was redriven that long ago, and its row is history.
        dead_files = _Files.of(dead)
        before_ms = old.swept_at_us // 1000 - _DEAD_EVENT_MARGIN_MS
        written = {
            p for p, t in zip(dead_files.paths, dead_files.written_ms, strict=True) if t < before_ms
        }
        still_dead = old_dead | new_dead
        _without_live(dead_path, dead, dead_files, written, still_dead, "dead retention", report)
    return taken


def _finished(
    path: str, dt: DeltaTable, files: _Files, then: int, live: set[str], report: RetentionReport
) -> None:
    """Remove the files of ``dt`` (``files``, its add actions) that were in the table at
    version ``then`` and hold no row of a ``live`` message."""
    if then < 0:
        return
    candidates = set(files.paths) & _paths_at(path, min(then, dt.version()), report)
    _without_live(path, dt, files, candidates, live, "finished retention", report)


def _without_live(
    path: str,
    dt: DeltaTable,
    files: _Files,
    candidates: set[str],
    live: set[str],
    reason: str,
    report: RetentionReport,
) -> None:
    """Remove the ``candidates`` among ``files`` that hold no row of a ``live`` message."""
    if not candidates:
        return
    ordered = sorted(candidates)
    scan = parquet_dataset([absolute_path(path, p) for p in ordered])
    ids = scan.to_table(columns=["id", "__filename"])
    holding = set(
        ids.filter(pc.is_in(ids["id"], pa.array(sorted(live), pa.string())))["__filename"]
        .unique()
        .to_pylist()
    )
    # A dataset names each row's file (``__filename``) by its path within the filesystem.
    gone = {p for p in ordered if filesystem(absolute_path(path, p))[1] not in holding}
    _remove(path, dt, files, gone, reason, report)


def _remove(
    path: str, dt: DeltaTable, files: _Files, gone: set[str], reason: str, report: RetentionReport
) -> None:
    report.tables += 1
    if not gone:
        return
    chosen = [
        (p, size, rows)
        for p, size, rows in zip(files.paths, files.sizes, files.rows, strict=True)
        if p in gone
    ]
    try:
        remove_files(path, dt, [(p, size) for p, size, _ in chosen], reason)
    except RemovalConflict as exc:
        # Compaction took some of the same files: the next pass judges the new ones.
        report.skipped.append(f"{path}: {exc}")
        return
    report.removed(len(chosen), sum(r for _, _, r in chosen), sum(s for _, s, _ in chosen))


def _open(path: str, report: RetentionReport, *, missing_ok: bool = False) -> DeltaTable | None:
    try:
        dt = DeltaTable(path)
    except Exception:
        if not missing_ok:
            report.skipped.append(f"{path}: no table")
        return None
    refused = removal_supported(dt)
    if refused is not None:
        report.skipped.append(f"{path}: {refused}")
        return None
    return dt


def _paths_at(path: str, version: int, report: RetentionReport) -> set[str]:
    """The table's data files as of ``version`` (empty when that version is gone)."""
    try:
        then = DeltaTable(path, version=version)
    except Exception as exc:
        report.skipped.append(f"{path}: version {version} unreadable ({exc})")
        return set()
    return set(_Files.of(then).paths)


def _state_ids(path: str, meta: StateMeta) -> tuple[set[str], set[str]]:
    """The ids a state holds, and those of them that were dead."""
    table = DeltaTable(path, version=meta.state_version).to_pyarrow_table(columns=["id", "status"])
    dead = table.filter(pc.equal(table["status"], Status.DEAD.value))
    return set(table["id"].to_pylist()), set(dead["id"].to_pylist())
