"""The topic writer: published messages, many publishes per Delta commit (group commit).

Ids are allocated at commit time, in commit order, so a topic's ids increase with its versions.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.schema import Field as DeltaField
from deltalake.transaction import Transaction

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.headers import Headers, headers_bytes
from queue_engine.json_columns import checked_columns
from queue_engine.message import LANES, IdAllocator, id_from_hex
from queue_engine.metrics import TOPIC_COMMIT_SECONDS
from queue_engine.store.delta.append import DeltaRsAppender
from queue_engine.store.delta.commit_log import messages_added
from queue_engine.store.delta.group_commit import GroupCommitter, Notify, WriterClosedError
from queue_engine.store.delta.open_table import add_missing_columns, conform, open_or_create
from queue_engine.store.journal.records import Record
from queue_engine.store.tables.ids import hex_id_array
from queue_engine.store.tables.schemas import HEADERS_TYPE, TOPIC_SCHEMA
from queue_engine.topic_schema import TopicSchema

log = logging.getLogger(__name__)

_TS = pa.timestamp("us", tz="UTC")

__all__ = ["CommitStats", "TopicWriter", "WriterClosedError"]


@dataclass
class _Publish:
    bodies: list[bytes]
    nbytes: int
    published_at_us: int
    deliver_at_us: int | None
    expires_at_us: int | None = None
    # The publish's position in the node journal (None: not journaled).
    position: int | None = None
    # One entry per body (None: no message of the publish has headers).
    headers: list[Headers | None] | None = None
    # The typed topic's schema the bodies fitted when published (None: not checked, as a
    # recovered journal's or a replay's: converted leniently at commit).
    checked: TopicSchema | None = None


@dataclass(frozen=True)
class CommitStats:
    version: int
    message_count: int
    commits: int
    committed_messages: int
    committed_bytes: int
    # The newest version known to have added messages (-1: none since open, or none at all).
    data_version: int = -1
    # Messages submitted (acknowledged, with ack = "journal" or "buffer") and not committed yet.
    queued: int = 0


class TopicWriter(GroupCommitter[_Publish]):
    """Appends published messages to one topic table, many publishes per Delta commit."""

    def __init__(
        self,
        path: str,
        notify: Notify,
        *,
        commit_max_bytes: int,
        fast_appends: bool = True,
        name: str = "",
        id_lane: int = 0,
        schema_of: Callable[[], TopicSchema | None] = lambda: None,
    ) -> None:
        dt = open_or_create(path, TOPIC_SCHEMA)
        # The topic's declared schema (queue_engine.topic_schema), asked at each commit: its
        # fields are columns of the rows committed from then on.
        self._schema_of = schema_of
        # The schema whose columns the table is known to have.
        self._evolved: TopicSchema | None = None
        # The table's columns, where they are more than a commit's rows have (a field's
        # column added by a declare whose schema was never recorded): filled with nulls.
        self._columns = pa.schema(dt.schema().to_arrow())
        # Commits of journaled publishes record this app transaction (queue_engine.store
        # .journal): version = the newest journal position the commit carries. Set by the
        # node once its journal runs.
        self.journal_app_id: str | None = None
        floor, count = _scan(dt)
        super().__init__(
            path,
            notify,
            commit_max_bytes=commit_max_bytes,
            fast_appends=fast_appends,
            name=name,
            histogram=TOPIC_COMMIT_SECONDS.labels(name) if name else None,
        )
        self._ids = IdAllocator(floor, id_lane)
        self._version = dt.version()
        self._message_count = count
        # (version, messages in the table through that version), one per commit since open,
        # ascending: how many messages a reader that reached a version has passed. Versions
        # before open are counted from the commit log when first asked (``messages_through``).
        self._marks: list[tuple[int, int]] = [(self._version, count)]
        # A table opened with messages: its newest version may be one that added none
        # (compaction, a property change); the version is the bound a reader can reach.
        self._data_version = self._version if count else -1
        # Rows each version added, read from the commit log for versions older than the marks.
        self._log_counts: dict[int, int] = {}
        self._commits = 0
        self._queued = 0
        self._committed_messages = 0
        self._committed_bytes = 0
        self._start()

    def submit_publish(
        self,
        bodies: list[bytes],
        published_at_us: int,
        deliver_at_us: int | None,
        token: Any,
        expires_at_us: int | None = None,
        position: int | None = None,
        headers: list[Headers | None] | None = None,
        checked: TopicSchema | None = None,
    ) -> None:
        """Queue messages for the next commit; ``token`` comes back through ``notify``."""
        # Headers count: a commit's size and the backlog's bound are what it writes.
        nbytes = sum(map(len, bodies)) + headers_bytes(headers)
        with self._cond:
            self._queued += len(bodies)
        try:
            self.submit(
                _Publish(
                    bodies,
                    nbytes,
                    published_at_us,
                    deliver_at_us,
                    expires_at_us,
                    position,
                    headers,
                    checked,
                ),
                nbytes,
                token,
            )
        except WriterClosedError:
            with self._cond:
                self._queued -= len(bodies)
            raise

    def _must_land(self, items: list[_Publish]) -> bool:
        return any(p.position is not None for p in items)

    @property
    def validates(self) -> bool:
        """Only the commit can tell whether rows are accepted (the table has CHECK
        constraints or features only delta-rs writes): publishes wait for it."""
        return isinstance(self._appender, DeltaRsAppender)

    def commit_recovered(self, records: list[Record], app: str) -> int:
        """Commit the publishes of a journal being recovered (``app``: its app transaction)
        that no commit carried yet; returns how many were committed. Blocking; ordered with
        the group commits, in commits of at most ``commit_max_bytes``."""
        with self.exclusive():
            done = DeltaTable(self.path).transaction_version(app)
            todo = [r for r in records if done is None or r.position > done]
            committed = 0
            while todo:
                size = 0
                take = 0
                for record in todo:
                    if take and size + record.nbytes > self._commit_max_bytes:
                        break
                    take += 1
                    size += record.nbytes
                chunk, todo = todo[:take], todo[take:]
                batch = [
                    _Publish(
                        r.bodies,
                        r.nbytes,
                        r.published_at_us,
                        r.deliver_at_us,
                        r.expires_at_us,
                        r.position,
                        r.headers,
                    )
                    for r in chunk
                ]
                count = sum(len(p.bodies) for p in batch)
                first = self._ids.allocate(count, time.time_ns() // 1_000_000)
                txn = Transaction(app, chunk[-1].position)
                version = self._append(self._typed(_to_arrow(batch, first, count)), txn)
                self._committed(version, count, size)
                committed += count
            return committed

    def stats(self) -> CommitStats:
        with self._cond:
            return CommitStats(
                self._version,
                self._message_count,
                self._commits,
                self._committed_messages,
                self._committed_bytes,
                self._data_version,
                self._queued,
            )

    def messages_through(self, version: int) -> int:
        """Messages the table held as of ``version`` (0 before the first version).

        The API's topic depth is the messages no channel has taken yet; a reader reports the
        topic version it reached, and this turns that into a count. Marks older than the
        version asked are dropped (readers move forward); a version older than every mark
        (before this writer opened, after a restart) is counted back from the commit log.
        """
        if version < 0:
            return 0
        with self._cond:
            anchor_version, anchor_count = self._marks[0]
            if version >= anchor_version:
                at = bisect.bisect_right(self._marks, (version, 1 << 62)) - 1
                del self._marks[:at]
                return self._marks[0][1]
        missing = [v for v in range(version + 1, anchor_version + 1) if v not in self._log_counts]
        if missing:
            self._log_counts.update(messages_added(self.path, missing[0] - 1, missing[-1]))
        later = sum(self._log_counts.get(v, 0) for v in range(version + 1, anchor_version + 1))
        return max(0, anchor_count - later)

    def commit_copies(
        self,
        bodies: pa.Array,
        replay_of: pa.Array,
        to_channel: str,
        app_id: str,
        headers: pa.Array | None = None,
    ) -> int | None:
        """Append copies of messages (new ids, published now) for one channel in one commit
        of their own that records ``app_id`` as a Delta app transaction; None (nothing
        written) if a commit recorded it before. Blocking; ordered with the group commits."""
        count = len(bodies)
        with self.exclusive():
            if DeltaTable(self.path).transaction_version(app_id) is not None:
                return None
            now = time.time_ns()
            first = self._ids.allocate(count, now // 1_000_000)
            table = pa.Table.from_arrays(
                [
                    hex_id_array(first, count, LANES),
                    bodies.cast(pa.binary()),
                    pa.repeat(pa.scalar(now // 1000, _TS), count),
                    pa.nulls(count, _TS),
                    pa.nulls(count, _TS),
                    pa.array([to_channel] * count, pa.string()),
                    replay_of.cast(pa.string()),
                    pa.nulls(count, HEADERS_TYPE) if headers is None else headers,
                ],
                schema=TOPIC_SCHEMA,
            )
            version = self._append(self._typed(table), Transaction(app_id, 1))
            self._committed(version, count, int(pc.sum(pc.binary_length(bodies)).as_py() or 0))
            return version

    def _commit(self, batch: list[_Publish]) -> None:
        count = sum(len(p.bodies) for p in batch)
        first = self._ids.allocate(count, time.time_ns() // 1_000_000)
        positions = [p.position for p in batch if p.position is not None]
        txn = None
        if positions and self.journal_app_id is not None:
            txn = Transaction(self.journal_app_id, max(positions))
        version = self._append(self._typed(_to_arrow(batch, first, count), batch), txn)
        # Leaving the queue and joining the count in one step: stats never miss them between.
        self._committed(version, count, sum(p.nbytes for p in batch), was_queued=count)

    def declare(self, schema: TopicSchema) -> None:
        """Add the columns of ``schema`` the table lacks (blocking; ordered with the commits);
        SCHEMA_CHANGE_REFUSED if the table has one of them under another type or spelling (a
        declare whose schema was never recorded, then another with a different type)."""
        with self.exclusive():
            have = {f.name.lower(): f for f in DeltaTable(self.path).schema().fields}
            for wanted in schema.arrow_fields:
                existing = have.get(wanted.name.lower())
                if existing is None:
                    continue
                expected = DeltaField.from_arrow(wanted)
                if existing.name != wanted.name or str(existing.type) != str(expected.type):
                    raise QueueError(
                        ErrorCode.SCHEMA_CHANGE_REFUSED,
                        f"field {wanted.name}: the topic's table has a column "
                        f"{existing.name} of type {existing.type}",
                    )
            self._evolve(schema)

    def _evolve(self, schema: TopicSchema) -> None:
        if schema != self._evolved:
            dt = add_missing_columns(DeltaTable(self.path), _with_fields(schema))
            self._columns = pa.schema(dt.schema().to_arrow())
            self._appender.reopen()
            self._evolved = schema

    def _typed(self, table: pa.Table, batch: list[_Publish] | None = None) -> pa.Table:
        """``table`` with the typed columns of the topic's schema, converted from the bodies
        of its publishes (``batch``, in order): by Arrow's JSON reader where every publish
        fitted this schema when it was checked, else leniently (a value that does not fit,
        possible only for a field declared after its message was taken, reads null); the
        table gains the columns first. With the commit lock held."""
        schema = self._schema_of()
        if schema is not None:
            self._evolve(schema)
            columns = None
            if batch is not None and all(p.checked == schema for p in batch):
                columns = checked_columns(
                    schema, list(itertools.chain.from_iterable(p.bodies for p in batch))
                )
            if columns is None:
                columns = schema.lenient_columns(table["body"].to_pylist())
            for field, column in zip(schema.arrow_fields, columns, strict=True):
                table = table.append_column(field, column)
        if len(self._columns) > table.num_columns:
            # delta-rs refuses an append that lacks a column of the table.
            table = conform(table, self._columns)
        return table

    def _dropped(self, items: list[_Publish]) -> None:
        with self._cond:
            self._queued -= sum(len(p.bodies) for p in items)

    def _committed(self, version: int, count: int, nbytes: int, *, was_queued: int = 0) -> None:
        with self._cond:
            self._queued -= was_queued
            self._version = max(self._version, version)
            self._message_count += count
            self._marks.append((version, self._message_count))
            if count:
                self._data_version = max(self._data_version, version)
            self._commits += 1
            self._committed_messages += count
            self._committed_bytes += nbytes


def _with_fields(schema: TopicSchema) -> pa.Schema:
    return pa.schema([*TOPIC_SCHEMA, *schema.arrow_fields])


def _to_arrow(batch: list[_Publish], first_id: int, count: int) -> pa.Table:
    bodies = pa.array(
        list(itertools.chain.from_iterable(p.bodies for p in batch)), type=pa.binary()
    )
    # Publishes of no message (none are taken, but a run must not be empty) are left out.
    batch = [p for p in batch if p.bodies]
    run_ends = pa.array(list(itertools.accumulate(len(p.bodies) for p in batch)), pa.int32())
    published = _per_publish([p.published_at_us for p in batch], run_ends, count)
    deliver = _per_publish([p.deliver_at_us for p in batch], run_ends, count)
    expires = _per_publish([p.expires_at_us for p in batch], run_ends, count)
    return pa.Table.from_arrays(
        [
            hex_id_array(first_id, count, LANES),
            bodies,
            published,
            deliver,
            expires,
            pa.nulls(count, pa.string()),
            pa.nulls(count, pa.string()),
            _headers(batch, count),
        ],
        schema=TOPIC_SCHEMA,
    )


def _headers(batch: list[_Publish], count: int) -> pa.Array:
    """The headers column: null for every message of a publish without headers."""
    if all(p.headers is None for p in batch):
        return pa.nulls(count, HEADERS_TYPE)
    values: list[Headers | None] = []
    for p in batch:
        values.extend(p.headers if p.headers is not None else [None] * len(p.bodies))
    return pa.array(values, HEADERS_TYPE)


def _per_publish(values: list[int | None], run_ends: pa.Array, count: int) -> pa.Array:
    """A timestamp column: each publish's value (or null) repeated for each of its messages
    (``run_ends``: where each publish's messages end)."""
    if all(v is None for v in values):
        return pa.nulls(count, type=_TS)
    if len(values) == 1:
        return pa.repeat(pa.scalar(values[0], _TS), count)
    runs = pa.RunEndEncodedArray.from_arrays(run_ends, pa.array(values, _TS))
    return pc.run_end_decode(runs)


def _scan(dt: DeltaTable) -> tuple[int, int]:
    """(one past the largest message id, number of messages) from the table's file stats."""
    actions = pa.table(dt.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return 0, 0
    count = int(pc.sum(actions["num_records"]).as_py() or 0)
    largest = pc.max(actions["max.id"]).as_py() if "max.id" in actions.column_names else None
    return (id_from_hex(largest) + 1 if largest else 0), count
