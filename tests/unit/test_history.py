"""The console's hour of figures: rates from counters, trimming, rebuilding from commits."""

from __future__ import annotations

import itertools
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


def test_unchanged_samples_are_not_stored_and_rates_stay_exact() -> None:
    h = History()
    h.record([topic(10, 0, 1)], 0.0)
    for t in range(2, 100, 2):
        h.record([topic(10, 0, 1)], float(t))
    assert len(h.topics["t"]) == 1 and len(h.channels[("t", "c")]) == 1
    # The newest unchanged sample still ends the series.
    assert h.topic_series("t")["t"] == [0.0, 98.0]
    h.record([topic(30, 0, 2)], 100.0)
    series = h.topic_series("t")
    # The held sample is stored before the change: the rate is over the last 2 s, not 100 s.
    assert series["t"] == [0.0, 98.0, 100.0]
    assert series["publish_rate"] == [None, 0.0, 10.0]


def test_an_unchanged_figure_is_stored_every_few_minutes() -> None:
    h = History()
    for t in range(0, 901, 2):
        h.record([topic(10, 0, 1)], float(t))
    assert [p.t for p in h.topics["t"]] == [0.0, 300.0, 600.0, 900.0]


def test_a_topic_that_stopped_changing_is_sampled_less_and_less_often() -> None:
    h = History(period_s=2.0)
    sampled = []
    messages = 0
    for t in range(0, 400, 2):
        now = float(t)
        if t < 20:
            messages += 1  # busy for the first 20 s
        if h.due(["t"], now):
            sampled.append(t)
            h.record([topic(messages, 0, messages)], now, ["t"])
    busy = [t for t in sampled if t < 20]
    assert busy == list(range(0, 20, 2))  # every period while it changes
    gaps = [b - a for a, b in itertools.pairwise(sampled[len(busy) :])]
    assert gaps == sorted(gaps) and gaps[-1] == 60  # then backing off to 30 periods
    assert len(sampled) < 30


def test_a_partial_sample_keeps_the_history_of_topics_not_sampled() -> None:
    h = History()
    h.record([topic(1, 0, 0)], 1.0)
    h.record([], 2.0, ["t"])
    assert len(h.topics["t"]) == 1 and ("t", "c") in h.channels
    h.record([], 3.0, [])
    assert "t" not in h.topics and ("t", "c") not in h.channels


def test_a_rate_falls_to_zero_once_its_channel_goes_quiet() -> None:
    h = History()
    h.record([topic(10, 0, 1, finished=0)], 0.0)
    h.record([topic(10, 0, 2, finished=10)], 2.0)
    assert h.latest_rates("t", "c")["fin_rate"] == 5.0
    h.record([topic(10, 0, 2, finished=10)], 4.0)
    assert h.latest_rates("t", "c")["fin_rate"] == 0.0
    # Sampled again within one period of the last change, so the console shows the 0 then.
    assert h.due(["t"], 4.0 + h.period_s) == ["t"]
