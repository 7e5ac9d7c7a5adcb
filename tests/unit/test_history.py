"""The console's hour of figures: rates from counters, trimming, rebuilding from commits."""

from __future__ import annotations

import math

from queue_engine.history import History
from queue_engine.stats import ChannelStats, TopicStats


def topic(messages: int, depth: int, version: int, finished: int = 0) -> TopicStats:
    channel = ChannelStats("c", False, depth=depth, finish_count=finished, ledger_version=version)
    return TopicStats("t", False, depth, messages, 0, 0, version, [channel])


def test_rates_are_counter_differences_per_second() -> None:
    h = History()
    h.record([topic(0, 0, 0)], 100.0)
    h.record([topic(20, 5, 2, finished=4)], 102.0)
    h.record([topic(30, 3, 3, finished=10)], 104.0)
    series = h.topic_series("t")
    assert series["publish_rate"] == [None, 10.0, 5.0]
    assert series["commit_rate"] == [None, 1.0, 0.5]
    assert h.channel_series("t", "c")["fin_rate"] == [None, 2.0, 3.0]
    assert h.latest_rates("t", "c")["fin_rate"] == 3.0


def test_a_counter_that_went_back_is_no_rate_and_old_points_go() -> None:
    h = History(keep_s=10)
    h.record([topic(50, 0, 5)], 0.0)
    h.record([topic(10, 0, 6)], 5.0)  # restarted: counters began again
    assert h.topic_series("t")["publish_rate"] == [None, None]
    h.record([topic(24, 0, 7)], 12.0)
    series = h.topic_series("t")
    assert series["t"] == [5.0, 12.0]  # the point at 0 is over 10 s old
    assert series["publish_rate"] == [None, 2.0]


def test_deleted_topics_lose_their_history() -> None:
    h = History()
    h.record([topic(1, 0, 0)], 1.0)
    h.record([], 2.0)
    assert h.topic_series("t")["t"] == [] and h.channel_series("t", "c")["t"] == []


def test_backfill_rebuilds_the_hour_before_a_restart_from_commits() -> None:
    h = History()
    h.backfill_topic("t", [(10.0, 5), (20.0, 5), (30.0, 10)], messages=120)
    h.record([topic(120, 7, 9)], 40.0)
    series = h.topic_series("t")
    assert series["t"] == [10.0, 20.0, 30.0, 40.0]
    assert series["publish_rate"] == [None, 0.5, 1.0, 0.0]
    assert series["depth"][:3] == [None, None, None] and series["depth"][3] == 7
    assert not any(isinstance(v, float) and math.isnan(v) for v in series["depth"])
