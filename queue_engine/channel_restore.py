"""Rebuilding a channel's queue from its tables: what a (re)starting API does per channel.

The queue is the fold of the ledger plus the rows of the messages table. A channel that was
swept starts from the sweep's ``state`` and folds only the ledger after it, reading only the
channel-table files that can hold live messages: the cost follows the live messages, not the
channel's whole history. Never swept, it folds the whole ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.channel_queue import ChannelQueue
from queue_engine.headers import Headers
from queue_engine.lease import FRESH, LeaseEvent, fold
from queue_engine.shares import ALL_LANES, keep_lanes, lane_of
from queue_engine.store.delta import repair_once
from queue_engine.store.tables import (
    ChannelReader,
    StateMeta,
    load_states,
    read_ledger,
    read_ledger_after,
    read_meta,
    read_state,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    queue: ChannelQueue
    reader: ChannelReader
    # Unread rows of messages the ledger already knew (they are not depth).
    known_unread: int
    # The ledger version the queue reflects.
    ledger_version: int


def restore_channel(
    name: str,
    messages_path: str,
    ledger_path: str,
    state_path: str | None,
    now: int,
    lanes: frozenset[int] | None = None,
) -> Restored:
    """The channel's queue as of ``now`` from its tables (blocking I/O); ``lanes``: only the
    messages of these shares (queue_engine.shares; None: all)."""
    started = time.perf_counter()
    if lanes == ALL_LANES:
        lanes = None
    for path in (messages_path, ledger_path, state_path):
        if path is not None:
            repair_once(path)  # what a power cut left at a table's tail, before it is read
    meta = read_meta(state_path) if state_path else None
    queue = ChannelQueue()
    reader = ChannelReader(messages_path, lanes)
    if meta is None or state_path is None:
        # Never swept: the fold of the whole ledger.
        events, version = read_ledger(ledger_path)
        events = _in_lanes(events, lanes)
        states = fold(events)
        queue.restore(states, now)
        paths = reader.snapshot()
        # Every message the ledger mentions was delivered, so its row is in the snapshot.
        known = len(states)
        source = f"ledger v{version} ({len(events)} events)"
    else:
        events, version, paths, known = _from_state(
            meta, state_path, ledger_path, queue, reader, now, lanes
        )
        source = (
            f"state v{meta.state_version} + ledger v{meta.ledger_version}..v{version} "
            f"({len(events)} events)"
        )
    if events:
        queue.clock(max(e.at_us for e in events))
    if reader.snapshot_read:
        queue.forget_finished()
    missing = queue.needs_body()
    if missing:
        add_rows(queue, ChannelReader.read_ids(paths, missing), now)
    live = len(queue) + queue.unstarted_count
    # A node over thousands of empty channels would log thousands of lines at each start.
    level = logging.INFO if live or reader.unread_rows - known else logging.DEBUG
    log.log(
        level,
        "channel %s: %s folded, %d live, %d in flight, %d unread rows (%.0f ms)",
        name,
        source,
        live,
        len(queue.in_flight),
        reader.unread_rows - known,
        (time.perf_counter() - started) * 1000,
    )
    return Restored(queue, reader, known, version)


def _from_state(
    meta: StateMeta,
    state_path: str,
    ledger_path: str,
    queue: ChannelQueue,
    reader: ChannelReader,
    now: int,
    lanes: frozenset[int] | None,
) -> tuple[list[LeaseEvent], int, list[str], int]:
    """The sweep's state plus the ledger after it: bounded by the live messages, however
    long the channel has lived."""
    states, unstarted, oldest = load_states(keep_lanes(read_state(state_path, meta), lanes))
    lowest = meta.topic_version + 1 if oldest is None else min(oldest, meta.topic_version + 1)
    events, version = read_ledger_after(ledger_path, meta.ledger_version)
    events = _in_lanes(events, lanes)
    folded = fold(events, states)
    for message_id, state in list(folded.items()):
        if state is FRESH:
            # Only invalid events (late answers to messages FIN'd before the state).
            del folded[message_id]
        else:
            unstarted.discard(message_id)
    queue.restore(folded, now)
    queue.requeue_count += meta.finished_requeues
    queue.timeout_count += meta.finished_timeouts
    queue.restore_checkpoint(unstarted, meta.topic_version)
    paths = reader.snapshot(skip_below_topic_version=lowest)
    # Retention may have removed the files of every FIN'd row: the fanout's position is then
    # known from the state alone.
    reader.max_topic_version = max(reader.max_topic_version, meta.topic_version)
    # Unread rows that will not enter the queue as new: all but the unstarted ones and
    # the rows newer than the state that no event has touched.
    new_rows = ChannelReader.count_new(paths, meta.topic_version, set(folded), lanes)
    known = reader.unread_rows - len(unstarted) - new_rows
    return events, version, paths, known


def _in_lanes(events: list[LeaseEvent], lanes: frozenset[int] | None) -> list[LeaseEvent]:
    """The events of messages in ``lanes`` (None: all)."""
    if lanes is None:
        return events
    return [e for e in events if lane_of(e.id) in lanes]


def add_rows(queue: ChannelQueue, table: pa.Table, now: int) -> int:
    """Give the queue the rows of a channel table it has not seen; returns how many were new."""
    published = table["published_at"].cast(pa.int64()).to_pylist()
    # Columns the queue looks at only where they say something are not turned into a Python
    # object per row otherwise (a backlog is read 5,000 rows at a time while it is consumed).
    versions = None
    if "topic_version" in table.column_names and table.num_rows:
        column = table["topic_version"]
        if pc.min(column).as_py() <= queue.covered_through:
            versions = column.to_pylist()
    return queue.add(
        table["id"].to_pylist(),
        table["body"].to_pylist(),
        published,
        _nullable_us(table["deliver_at"]),
        now,
        versions,
        expires_at(table),
        headers_of(table),
    )


def headers_of(table: pa.Table) -> list[Headers | None] | None:
    """The rows' headers as dicts (None: no row has any, or a table from before them)."""
    if "headers" not in table.column_names:
        return None
    column = table["headers"]
    if column.null_count == len(column):
        return None
    return [None if pairs is None else dict(pairs) for pairs in column.to_pylist()]


def expires_at(table: pa.Table) -> list[int | None] | None:
    """The rows' own expiries in µs (None: a table from before the column existed)."""
    if "expires_at" not in table.column_names:
        return None
    return _nullable_us(table["expires_at"])


def _nullable_us(column: pa.ChunkedArray) -> list[int | None]:
    """A timestamp column as µs, None where null (all None without a look at each row)."""
    if column.null_count == len(column):
        return [None] * len(column)
    values: list[int | None] = column.cast(pa.int64()).to_pylist()
    return values
