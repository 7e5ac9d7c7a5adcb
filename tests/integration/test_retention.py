"""Retention on real Delta tables: which whole files go, and that everything reading the
tables (appenders, time travel, a restarting channel) is unharmed by it."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from queue_engine.channel_queue import DeadLetter
from queue_engine.channel_restore import restore_channel
from queue_engine.lease import EventKind, LeaseEvent
from queue_engine.message import SEQUENCE_BITS
from queue_engine.registry import ChannelInfo, Registry, TopicInfo
from queue_engine.settings import RetentionMode
from queue_engine.store.delta import (
    LocalAppender,
    RemovalConflict,
    conform,
    open_or_create,
    remove_files,
)
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    LEDGER_SCHEMA,
    STATE_SCHEMA,
    TOPIC_SCHEMA,
    DeadLetterStore,
    StateMeta,
    Warehouse,
    events_to_arrow,
    meta_as_of,
    read_meta,
    write_state,
)
from queue_engine.store.tables.batch_notes import batch_note
from queue_engine.store.upkeep import RetentionPolicy, apply_retention

HOUR = 3_600_000_000
NOW = 1_790_000_000_000_000 + 10 * HOUR
_TS = pa.timestamp("us", tz="UTC")


def _ids(at_us: int, n: int, first: int = 0) -> list[str]:
    """Message ids as the API makes them: publish time (ms) in the high bits."""
    return [f"{((at_us // 1000) << SEQUENCE_BITS) | (first + i):016x}" for i in range(n)]


def _topic_rows(ids: list[str]) -> pa.Table:
    n = len(ids)
    return conform(
        pa.table(
            {
                "id": ids,
                "body": [b"m"] * n,
                "published_at": pa.array([NOW] * n, pa.int64()).cast(_TS),
                "deliver_at": pa.nulls(n, _TS),
            }
        ),
        TOPIC_SCHEMA,
    )


def _channel_rows(ids: list[str], topic_version: int) -> pa.Table:
    rows = _topic_rows(ids)
    return conform(
        rows.append_column("topic_version", pa.array([topic_version] * len(ids), pa.int64())),
        CHANNEL_MESSAGES_SCHEMA,
    )


def _events(ids: list[str], at_us: int, *kinds: EventKind) -> pa.Table:
    events = [
        LeaseEvent(i, kind, 1, at_us + n, lease="1-aaaaaaaaaaaa")
        for i in ids
        for n, kind in enumerate(kinds)
    ]
    return events_to_arrow(events).cast(LEDGER_SCHEMA)


def _state(
    path: str,
    live: list[str],
    meta: StateMeta,
    row_topic_version: int = 0,
    dead: frozenset[str] = frozenset(),
) -> None:
    """A sweep's state: ``live`` messages, ready and never delivered (or dead), from one topic
    version."""
    n = len(live)
    columns: dict[str, pa.Array] = {
        "id": pa.array(live, pa.string()),
        "status": pa.array(["dead" if m in dead else "ready" for m in live], pa.string()),
        "attempts": pa.array([0] * n, pa.int32()),
        "lease_duration_us": pa.array([0] * n, pa.int64()),
        "timed_out": pa.array([False] * n, pa.bool_()),
        "requeues": pa.array([0] * n, pa.int32()),
        "timeouts": pa.array([0] * n, pa.int32()),
        "topic_version": pa.array([row_topic_version] * n, pa.int64()),
        "ledger_version": pa.array([meta.ledger_version] * n, pa.int64()),
        "swept_at": pa.array([meta.swept_at_us] * n, pa.int64()).cast(_TS),
    }
    rows = pa.table({f.name: columns.get(f.name, pa.nulls(n, f.type)) for f in STATE_SCHEMA})
    write_state(path, rows, meta)


def _meta(ledger: int, messages: int, topic: int, swept_at: int) -> StateMeta:
    return StateMeta(ledger, messages, topic, 0, 0, None, swept_at)


def _registry(*topics: TopicInfo) -> Registry:
    registry = Registry()
    for topic in topics:
        registry.topics[topic.name] = topic
    return registry


def _topic(name: str, *channels: str, **options: object) -> TopicInfo:
    info = TopicInfo(name, 0, channels={c: ChannelInfo(c, 0, start_version=-1) for c in channels})
    for key, value in options.items():
        setattr(info, key, value)
    return info


def _appender(path: str, schema: pa.Schema) -> LocalAppender:
    open_or_create(path, schema)
    return LocalAppender(path)


def _channel_paths(wh: Warehouse) -> tuple[str, str, str]:
    """Channel t/c's messages, ledger and state tables."""
    return (
        wh.channel_messages_path("t", "c"),
        wh.channel_ledger_path("t", "c"),
        wh.channel_state_path("t", "c"),
    )


def _ids_in(path: str, version: int | None = None) -> set[str]:
    return set(DeltaTable(path, version=version).to_pyarrow_table(columns=["id"])["id"].to_pylist())


TOPIC_ONLY = RetentionPolicy(2.0, RetentionMode.TAKEN, 0.0)


def test_topic_rows_go_once_old_and_taken_by_every_channel(tmp_path: Path) -> None:
    wh = Warehouse(str(tmp_path))
    topic = _appender(wh.topic_path("t"), TOPIC_SCHEMA)
    old_a, old_b = _ids(NOW - 5 * HOUR, 3), _ids(NOW - 5 * HOUR, 3, 3)
    recent = _ids(NOW - 60_000_000, 2)
    assert [topic.append(_topic_rows(ids)) for ids in (old_a, old_b, recent)] == [1, 2, 3]
    fast = _appender(wh.channel_messages_path("t", "fast"), CHANNEL_MESSAGES_SCHEMA)
    for version, ids in ((1, old_a), (2, old_b), (3, recent)):
        fast.append(_channel_rows(ids, version))
    slow = _appender(wh.channel_messages_path("t", "slow"), CHANNEL_MESSAGES_SCHEMA)
    slow.append(_channel_rows(old_a, 1))
    registry = _registry(_topic("t", "fast", "slow"))

    report = apply_retention(wh, registry, TOPIC_ONLY, NOW)
    # old_b is old enough, but "slow" has not taken it yet; recent is too young.
    assert (report.files_removed, report.rows_removed) == (1, 3)
    assert _ids_in(wh.topic_path("t")) == set(old_b + recent)

    slow.append(_channel_rows(old_b, 2))
    assert apply_retention(wh, registry, TOPIC_ONLY, NOW).rows_removed == 3
    assert _ids_in(wh.topic_path("t")) == set(recent)
    # The publisher's appender goes on; time travel still sees what was removed.
    more = _ids(NOW, 1)
    assert topic.append(_topic_rows(more)) == 6
    assert _ids_in(wh.topic_path("t")) == set(recent + more)
    assert _ids_in(wh.topic_path("t"), version=3) == set(old_a + old_b + recent)
    # Channel tables are untouched by topic retention (finished_hours 0: kept for ever).
    assert len(_ids_in(wh.channel_messages_path("t", "fast"))) == 8


def test_a_filtered_channel_that_kept_everything_out_has_taken_what_its_fanout_noted(
    tmp_path: Path,
) -> None:
    wh = Warehouse(str(tmp_path))
    topic = _appender(wh.topic_path("t"), TOPIC_SCHEMA)
    old_a, old_b = _ids(NOW - 5 * HOUR, 3), _ids(NOW - 5 * HOUR, 3, 3)
    assert [topic.append(_topic_rows(ids)) for ids in (old_a, old_b)] == [1, 2]
    picky = _appender(wh.channel_messages_path("t", "picky"), CHANNEL_MESSAGES_SCHEMA)
    registry = _registry(_topic("t", "picky"))
    registry.topics["t"].channels["picky"].filters = ((-1, "id = 'none of them'"),)
    # Its fanout commits noted version 1, then its filter kept version 2 wholly out: a commit
    # of no rows noting the version reached.
    picky.append(_channel_rows([], 1), user_metadata=batch_note(3, 1))
    assert apply_retention(wh, registry, TOPIC_ONLY, NOW).rows_removed == 3
    assert _ids_in(wh.topic_path("t")) == set(old_b)
    empty = pa.Table.from_batches([], schema=CHANNEL_MESSAGES_SCHEMA)
    picky.append(empty, user_metadata=batch_note(3, 2))
    assert apply_retention(wh, registry, TOPIC_ONLY, NOW).rows_removed == 3
    assert _ids_in(wh.topic_path("t")) == set()
    # An unfiltered channel's progress is its rows': a note there is not read.
    registry.topics["t"].channels["picky"].filters = ()
    latest = topic.append(_topic_rows(_ids(NOW - 5 * HOUR, 2, 6)))
    picky.append(empty, user_metadata=batch_note(2, latest))
    assert apply_retention(wh, registry, TOPIC_ONLY, NOW).rows_removed == 0


def test_fixed_retention_ignores_channels_and_a_topic_without_channels_keeps_its_buffer(
    tmp_path: Path,
) -> None:
    wh = Warehouse(str(tmp_path))
    old = _ids(NOW - 5 * HOUR, 2)
    for name in ("fixed", "buffered", "forever"):
        _appender(wh.topic_path(name), TOPIC_SCHEMA).append(_topic_rows(old))
    _appender(wh.channel_messages_path("fixed", "idle"), CHANNEL_MESSAGES_SCHEMA)
    registry = _registry(
        _topic("fixed", "idle", retention="fixed"),
        _topic("buffered"),
        _topic("forever", retention="fixed", retention_hours=0.0),
    )
    report = apply_retention(wh, registry, TOPIC_ONLY, NOW)
    assert report.rows_removed == 2
    assert _ids_in(wh.topic_path("fixed")) == set()
    # nsqd keeps what a topic without channels holds for its first channel.
    assert _ids_in(wh.topic_path("buffered")) == set(old)
    assert _ids_in(wh.topic_path("forever")) == set(old)
    # Once emptied (or drained to a channel since deleted), that buffer may go too.
    registry.topics["buffered"].empty_version = 1
    assert apply_retention(wh, registry, TOPIC_ONLY, NOW).rows_removed == 2


def test_a_channel_keeps_rows_of_live_messages_and_loses_those_finished_long_enough(
    tmp_path: Path,
) -> None:
    wh = Warehouse(str(tmp_path))
    messages_path, ledger_path, state_path = _channel_paths(wh)
    messages = _appender(messages_path, CHANNEL_MESSAGES_SCHEMA)
    ledger = _appender(ledger_path, LEDGER_SCHEMA)
    done, still, later = _ids(NOW - 6 * HOUR, 2), _ids(NOW - 6 * HOUR, 1, 2), _ids(NOW - HOUR, 1)
    assert messages.append(_channel_rows(done, 1)) == 1
    assert messages.append(_channel_rows(still, 2)) == 2
    ledger.append(_events(done, NOW - 5 * HOUR, EventKind.DELIVER, EventKind.FIN))
    assert ledger.append(_events(still, NOW - 5 * HOUR, EventKind.DELIVER)) == 2
    # A sweep 4 hours ago: "still" was live, "done" had been FIN'd.
    _state(state_path, still, _meta(2, 2, 2, NOW - 4 * HOUR), 2)
    # Hourly sweeps since, each seeing the same; then a new message.
    for hours in (3, 2):
        _state(state_path, still, _meta(2, 2, 2, NOW - hours * HOUR), 2)
    assert messages.append(_channel_rows(later, 3)) == 3
    assert ledger.append(_events(later, NOW - HOUR, EventKind.DELIVER, EventKind.FIN)) == 3
    _state(state_path, still, _meta(3, 3, 3, NOW - HOUR + 10), 2)
    policy = RetentionPolicy(0.0, RetentionMode.TAKEN, 2.5)

    # Finished 2.5 hours ago is judged by the sweep of 3 hours ago.
    report = apply_retention(wh, _registry(_topic("t", "c")), policy, NOW)
    assert (report.files_removed, report.rows_removed) == (2, 6)  # done: its rows, its events
    assert _ids_in(messages_path) == set(still + later)
    assert _ids_in(ledger_path) == set(still + later)
    # Nothing else can be proved yet: a second pass removes nothing.
    assert apply_retention(wh, _registry(_topic("t", "c")), policy, NOW).files_removed == 0
    # Much later, "later" (FIN'd before the newest sweep) goes too; "still" stays while live.
    report = apply_retention(wh, _registry(_topic("t", "c")), policy, NOW + 10 * HOUR)
    assert report.rows_removed == 3
    assert _ids_in(messages_path) == _ids_in(ledger_path) == set(still)

    # A restart from the newest state finds what it needs, and the fanout's position.
    restored = restore_channel("t/c", messages_path, ledger_path, state_path, NOW)
    assert restored.queue.unstarted_count == 1
    assert restored.reader.max_topic_version == 3
    assert restored.reader.paths == DeltaTable(messages_path).file_uris()
    assert restored.reader.unread_rows == 1


def test_a_message_dead_long_enough_loses_its_channel_row_but_not_its_events(
    tmp_path: Path,
) -> None:
    wh = Warehouse(str(tmp_path))
    messages_path, ledger_path, state_path = _channel_paths(wh)
    messages = _appender(messages_path, CHANNEL_MESSAGES_SCHEMA)
    ledger = _appender(ledger_path, LEDGER_SCHEMA)
    dead, redriven = _ids(NOW - 6 * HOUR, 2), _ids(NOW - 6 * HOUR, 1, 2)
    assert messages.append(_channel_rows(dead, 1)) == 1
    assert messages.append(_channel_rows(redriven, 2)) == 2
    assert ledger.append(_events(dead + redriven, NOW - 5 * HOUR, EventKind.DEAD)) == 1
    everything = dead + redriven
    # Both dead at a sweep 4 hours ago; since then one was redriven (ready in the newest).
    _state(state_path, everything, _meta(1, 2, 2, NOW - 4 * HOUR), 2, frozenset(everything))
    _state(state_path, everything, _meta(1, 2, 2, NOW - HOUR), 2, frozenset(dead))
    policy = RetentionPolicy(0.0, RetentionMode.TAKEN, 2.5)

    report = apply_retention(wh, _registry(_topic("t", "c")), policy, NOW)
    assert (report.files_removed, report.rows_removed) == (1, 2)
    # The redriven message keeps its row (it will be delivered); the dead ones' bodies are in
    # the dead-letter table. Every DEAD event stays for the dead_letters view.
    assert _ids_in(messages_path) == set(redriven)
    assert _ids_in(ledger_path) == set(everything)


def test_dead_letter_rows_go_once_redriven_long_enough(tmp_path: Path) -> None:
    wh = Warehouse(str(tmp_path))
    state_path = wh.channel_state_path("t", "c")
    start = time.time_ns() // 1000
    redriven, dead, finished = (_ids(start, 1, n) for n in (1, 2, 3))
    messages = _appender(wh.channel_messages_path("t", "c"), CHANNEL_MESSAGES_SCHEMA)
    messages.append(_channel_rows(redriven + dead + finished, 1))
    letters = DeadLetterStore(wh.channel_dead_path("t", "c"))
    for ids in (redriven, dead, finished):
        letters.append([DeadLetter(i, b"x", start, 1, "c", "REQ", start) for i in ids])
    letters.close()
    # Sweeps (their clocks ahead of the rows' writing): all three dead at the first; by the
    # newest, one redriven and ready, one still dead, one redriven and FIN'd (gone).
    swept = start + 2 * 60_000_000
    everything = redriven + dead + finished
    _state(state_path, everything, _meta(1, 1, 1, swept), 1, frozenset(everything))
    _state(state_path, everything, _meta(1, 1, 1, swept + HOUR), 1, frozenset(everything))
    _state(state_path, redriven + dead, _meta(2, 1, 1, swept + 2 * HOUR), 1, frozenset(dead))
    policy = RetentionPolicy(0.0, RetentionMode.TAKEN, 2.5)

    # Judged by the sweep at swept + 1 h: all three dead then, so every row stays.
    report = apply_retention(wh, _registry(_topic("t", "c")), policy, swept + 3.5 * HOUR)
    assert report.files_removed == 0
    assert _ids_in(wh.channel_dead_path("t", "c")) == set(everything)
    # Judged by the newest: the redriven ones' dead-letter files go, the dead one's stays,
    # and so does the channel's file (the redriven message is ready in it).
    report = apply_retention(wh, _registry(_topic("t", "c")), policy, swept + 5 * HOUR)
    assert report.files_removed == 2
    assert _ids_in(wh.channel_dead_path("t", "c")) == set(dead)
    assert _ids_in(wh.channel_messages_path("t", "c")) == set(everything)


def test_the_old_state_is_found_among_many_sweeps(tmp_path: Path) -> None:
    path = str(tmp_path / "state")
    for k in range(40):
        _state(path, [], _meta(k, k, k, NOW + k * HOUR))
    latest = read_meta(path)
    assert latest is not None and latest.state_version == 39
    for k in (0, 1, 17, 38, 39):
        found = meta_as_of(path, latest, NOW + k * HOUR + HOUR // 2)
        assert found is not None and (found.ledger_version, found.state_version) == (k, k)
    assert meta_as_of(path, latest, NOW - 1) is None


def test_a_removal_racing_another_over_the_same_file_commits_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    appender = _appender(path, TOPIC_SCHEMA)
    for k in range(3):
        appender.append(_topic_rows(_ids(NOW, 1, k)))
    stale = DeltaTable(path)
    files = pa.table(stale.get_add_actions(flatten=True)).to_pylist()
    first = [(files[0]["path"], files[0]["size_bytes"])]
    assert remove_files(path, DeltaTable(path), first, "test") == 4
    # A writer that loaded the table before that commit and removes the same file loses.
    with pytest.raises(RemovalConflict):
        remove_files(path, stale, [*first, (files[1]["path"], files[1]["size_bytes"])], "test")
    assert DeltaTable(path).version() == 4
    assert len(_ids_in(path)) == 2
    # One removing another file follows the first commit.
    other = [(files[2]["path"], files[2]["size_bytes"])]
    assert remove_files(path, stale, other, "test") == 5
    assert len(_ids_in(path)) == 1
