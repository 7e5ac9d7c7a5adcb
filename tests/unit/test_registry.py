from __future__ import annotations

import pytest

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.registry import Action, Registry, RegistryEvent


def ev(
    seq: int, action: Action, topic: str = "t", channel: str | None = None, **kw: int
) -> RegistryEvent:
    return RegistryEvent(seq=seq, at_us=seq * 10, action=action, topic=topic, channel=channel, **kw)


def test_fold_orders_by_seq_and_applies_everything() -> None:
    events = [
        ev(3, Action.CHANNEL_PAUSE, channel="c"),
        ev(0, Action.TOPIC_CREATE),
        ev(1, Action.CHANNEL_CREATE, channel="c", topic_version=4),
        ev(2, Action.CHANNEL_CREATE, channel="d", topic_version=6),
        ev(4, Action.CHANNEL_DELETE, channel="d"),
        ev(5, Action.TOPIC_PAUSE),
        ev(6, Action.TOPIC_EMPTY, topic_version=9, topic_messages=12),
    ]
    r = Registry.fold(events)
    t = r.topics["t"]
    assert t.paused and t.empty_version == 9 and t.empty_message_count == 12
    assert list(t.channels) == ["c"]
    assert t.channels["c"].paused and t.channels["c"].start_version == 4
    assert r.next_seq() == 7


def test_delete_then_recreate_starts_fresh() -> None:
    r = Registry.fold(
        [
            ev(0, Action.TOPIC_CREATE),
            ev(1, Action.CHANNEL_CREATE, channel="c"),
            ev(2, Action.TOPIC_DELETE),
            ev(3, Action.TOPIC_CREATE),
        ]
    )
    assert r.topics["t"].channels == {}


def test_events_for_unknown_things_are_ignored() -> None:
    r = Registry.fold([ev(0, Action.CHANNEL_CREATE, channel="c"), ev(1, Action.TOPIC_PAUSE)])
    assert r.topics == {}


def test_lookups_raise_nsq_codes() -> None:
    r = Registry.fold([ev(0, Action.TOPIC_CREATE)])
    with pytest.raises(QueueError) as e:
        r.existing_topic("nope")
    assert e.value.code is ErrorCode.TOPIC_NOT_FOUND
    with pytest.raises(QueueError) as e:
        r.existing_channel("t", "nope")
    assert e.value.code is ErrorCode.CHANNEL_NOT_FOUND


def test_a_channel_keeps_each_filter_with_the_version_it_starts_after() -> None:
    eu, us = "headers['region'] = 'eu'", "headers['region'] = 'us'"
    events = [
        ev(0, Action.TOPIC_CREATE),
        RegistryEvent(1, 10, Action.CHANNEL_CREATE, "t", "c", 4, options={"filter": eu}),
        RegistryEvent(2, 20, Action.CHANNEL_CREATE, "t", "d", 4),
        RegistryEvent(3, 30, Action.CHANNEL_CONFIGURE, "t", "c", 7, options={"filter": us}),
        RegistryEvent(4, 40, Action.CHANNEL_CONFIGURE, "t", "c", 9, options={"filter": None}),
        # A max_attempts change leaves the filters as they are.
        RegistryEvent(5, 50, Action.CHANNEL_CONFIGURE, "t", "c", None, options={"max_attempts": 3}),
    ]
    channels = Registry.fold(events).topics["t"].channels
    assert channels["c"].filters == ((4, eu), (7, us), (9, None))
    assert channels["c"].filter is None and channels["c"].max_attempts == 3
    assert (channels["d"].filters, channels["d"].filter) == ((), None)
