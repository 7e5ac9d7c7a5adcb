"""Reading a channel's messages table in order, a window at a time, and following its tail.

The API does not hold a whole backlog in memory (nsqd's mem-queue-size plus disk queue): it
keeps a list of the data files it has not read yet and reads the next rows when its in-memory
queue runs low. New versions written by the fanout are found by probing for the next commit
file (~0.5 ms locally) and read from the commit log (only the files they added).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from queue_engine.shares import ALL_LANES, in_lanes, keep_lanes
from queue_engine.store.delta.commit_log import (
    absolute_path,
    commit_file,
    latest_version,
    parse_commits,
    resolve,
)
from queue_engine.store.delta.open_table import conform
from queue_engine.store.storage.files import filesystem, parquet_dataset
from queue_engine.store.tables.batch_notes import (
    KEPT_OUT,
    note_reached,
    noted_topic_version,
    read_note,
)
from queue_engine.store.tables.schemas import CHANNEL_MESSAGES_SCHEMA

COLUMNS = ["id", "body", "published_at", "deliver_at", "topic_version", "expires_at", "headers"]
_SCHEMA = pa.schema([CHANNEL_MESSAGES_SCHEMA.field(c) for c in COLUMNS])
# Bytes read from a channel file at a time while its rows are taken in windows.
READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class _File:
    path: str
    rows: int
    # Part of the table as it was when this reader started (holds messages the ledger knows).
    from_snapshot: bool


class ChannelReader:
    """The unread rows of one channel table: a file list, a cursor in the current file.

    ``lanes``: only the rows of these id lanes (a node's shares of the channel; None: every
    row). Then each file's rows are counted by reading its ids, files without such rows are
    never read, and every figure here counts those rows only."""

    def __init__(self, path: str, lanes: frozenset[int] | None = None) -> None:
        self.path = path
        self.lanes = None if lanes == ALL_LANES else lanes
        self.version = -1
        self.message_count = 0
        # The newest topic version whose messages the fanout has put in this table (-1: none),
        # or whose batch the fanout recorded here with every row kept out by the filter.
        self.max_topic_version = -1
        # Rows the channel's filter kept out, in the commits read since this reader started.
        self.kept_out = 0
        # Rows in files not yet read, plus the rest of the current file.
        self.unread_rows = 0
        self._pending: deque[_File] = deque()
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._current: _File | None = None
        self._snapshot_files_left = 0
        # Every file queued so far (read or not): where a body is looked up by id.
        self.paths: list[str] = []

    def snapshot(self, skip_below_topic_version: int = -1) -> list[str]:
        """Start from the table's current files; return the paths it will read (empty: no
        table yet). Files whose rows all have a topic_version below ``skip_below_topic_version``
        (all FIN'd, per the sweep's state) are not read: restart cost follows the live
        messages, not the channel's whole history."""
        try:
            dt = DeltaTable(self.path)
        except Exception:
            return []
        self.version = int(dt.version())
        # A filtered channel whose filter kept the last batches out: its newest commit notes
        # how far the fanout has taken the topic (its rows cannot say).
        reached = noted_topic_version(self.path, self.version, lookback=1)
        self.max_topic_version = max(self.max_topic_version, reached)
        actions = pa.table(dt.get_add_actions(flatten=True))
        paths = [absolute_path(self.path, p) for p in actions["path"].to_pylist()]
        rows = actions["num_records"].to_pylist()
        highest = (
            actions["max.topic_version"].to_pylist()
            if "max.topic_version" in actions.column_names
            else [None] * len(paths)
        )
        kept: list[str] = []
        for path, count, top in zip(paths, rows, highest, strict=True):
            if top is not None:
                self.max_topic_version = max(self.max_topic_version, int(top))
            if top is not None and int(top) < skip_below_topic_version:
                # All FIN'd: counted without being read (a share's count leaves them out).
                self.message_count += int(count or 0) if self.lanes is None else 0
                continue
            mine = self._count(path, int(count or 0))
            self.message_count += mine
            if not mine:
                continue
            self._pending.append(_File(path, mine, from_snapshot=True))
            self.unread_rows += mine
            kept.append(path)
        self._snapshot_files_left = len(kept)
        self.paths.extend(kept)
        return kept

    def poll(self) -> int:
        """Queue the files of versions committed since the last poll; return their rows."""
        latest = self._latest()
        if latest <= self.version:
            return 0
        rows = 0
        versions = list(range(self.version + 1, latest + 1))
        parsed = parse_commits(self.path, versions)
        commits = [parsed[v] for v in versions]
        for added in resolve(self.path, commits):
            count = added.num_records
            if count is None:
                fs, local = filesystem(added.path)
                count = pq.ParquetFile(fs.open_input_file(local)).metadata.num_rows
            count = self._count(added.path, count)
            self.paths.append(added.path)
            if count:
                self._pending.append(_File(added.path, count, from_snapshot=False))
            if added.max_topic_version is not None:
                self.max_topic_version = max(self.max_topic_version, added.max_topic_version)
            rows += count
        # Once every commit was read: a poll that fails reads them all again next time.
        for commit in commits:
            self._note(commit.user_metadata)
        self.version = latest
        self.message_count += rows
        self.unread_rows += rows
        return rows

    def _note(self, user_metadata: str | None) -> None:
        """What the fanout recorded with a commit (queue_engine.fanout.batch_note): the rows
        the channel's filter kept out of that batch, and the topic version the batch reached,
        which a commit of no rows (every row kept out) carries alone."""
        note = read_note(user_metadata)
        kept_out = note.get(KEPT_OUT)
        if isinstance(kept_out, int) and kept_out > 0:
            self.kept_out += kept_out
        reached = note_reached(note)
        if reached is not None:
            self.max_topic_version = max(self.max_topic_version, reached)

    def _count(self, path: str, rows: int) -> int:
        """``path``'s rows in this reader's lanes (``rows``: all of them)."""
        if self.lanes is None or not rows:
            return rows
        if not self.lanes:
            return 0
        fs, local = filesystem(path)
        ids = pq.ParquetFile(fs.open_input_file(local)).read(columns=["id"])["id"]
        return int(pc.sum(in_lanes(ids, self.lanes)).as_py() or 0)

    def probe(self) -> bool:
        """Whether a new version may exist: one file-existence check on local disk (cheap
        enough for the event loop); always True elsewhere (``poll`` then finds out)."""
        if "://" in self.path:
            return True
        return os.path.exists(f"{self.path}/{commit_file(self.version + 1)}")

    def _latest(self) -> int:
        if self.version >= 0:
            return latest_version(self.path, self.version)
        # No table yet: the fanout creates it with its first write (version 0).
        if "://" not in self.path and not os.path.exists(f"{self.path}/{commit_file(0)}"):
            return -1
        return latest_version(self.path, 0) if self._exists() else -1

    def _exists(self) -> bool:
        try:
            DeltaTable(self.path)
        except Exception:
            return False
        return True

    @property
    def has_unread(self) -> bool:
        return bool(self._pending) or self._batches is not None

    @property
    def snapshot_read(self) -> bool:
        """Every file of the starting snapshot has been read."""
        return self._snapshot_files_left == 0

    def read(self, max_rows: int) -> pa.Table | None:
        """The next up to ``max_rows`` unread rows, in table order (None: nothing unread)."""
        while True:
            if self._batches is None:
                if not self._pending:
                    return None
                self._current = self._pending.popleft()
                fs, local = filesystem(self._current.path)
                # Buffered: pages are decoded as the batches are taken, rather than a whole row
                # group at once (Spark writes up to 128 MiB per row group: a fanned-out backlog
                # of 400,000 messages is one, ~170 MiB decoded).
                parquet = pq.ParquetFile(
                    fs.open_input_file(local), buffer_size=READ_BUFFER_BYTES, pre_buffer=False
                )
                # Files written before a column was added lack it: it reads as null.
                present = [c for c in COLUMNS if c in parquet.schema_arrow.names]
                self._batches = parquet.iter_batches(batch_size=max_rows, columns=present)
            batch = next(self._batches, None)
            if batch is not None and batch.num_rows:
                table = keep_lanes(pa.Table.from_batches([batch]), self.lanes)
                if not table.num_rows:
                    continue
                self.unread_rows = max(0, self.unread_rows - table.num_rows)
                return conform(table, _SCHEMA)
            if batch is None:
                self._batches = None
                if self._current is not None and self._current.from_snapshot:
                    self._snapshot_files_left -= 1

    @staticmethod
    def count_new(
        paths: list[str],
        above_topic_version: int,
        known: set[str],
        lanes: frozenset[int] | None = None,
    ) -> int:
        """Rows of ``paths`` (in ``lanes``) above ``above_topic_version`` whose id is not in
        ``known``."""
        if not paths:
            return 0
        ids = keep_lanes(
            parquet_dataset(paths).to_table(
                columns=["id"], filter=pc.field("topic_version") > above_topic_version
            ),
            lanes,
        )["id"]
        if not known:
            return len(ids)
        return len(ids) - int(pc.sum(pc.is_in(ids, pa.array(list(known)))).as_py() or 0)

    @staticmethod
    def read_ids(paths: list[str], ids: list[str]) -> pa.Table:
        """The rows of ``ids`` among ``paths`` (the bodies of messages the ledger knows)."""
        if not paths or not ids:
            return _SCHEMA.empty_table()
        return parquet_dataset(paths, CHANNEL_MESSAGES_SCHEMA).to_table(
            columns=COLUMNS, filter=pc.field("id").isin(ids)
        )


def max_topic_version(path: str, version: int) -> int:
    """The highest ``topic_version`` of the channel table at ``path`` as of ``version`` (the
    newest when negative); -1 when it has none (or there is no table)."""
    try:
        dt = DeltaTable(path)
    except Exception:
        return -1
    if version >= 0 and dt.version() != version:
        dt.load_as_version(version)
    actions = pa.table(dt.get_add_actions(flatten=True))
    column = "max.topic_version"
    if column in actions.column_names and actions.num_rows:
        value = pc.max(actions[column]).as_py()
        if value is not None:
            return int(value)
    if not actions.num_rows:
        return -1
    return int(pc.max(dt.to_pyarrow_table(columns=["topic_version"])["topic_version"]).as_py())
