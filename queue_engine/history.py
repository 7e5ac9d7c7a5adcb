"""The last hour of each topic's and channel's figures, for the console's charts (pure).

The API samples its own figures every few seconds (``record``); rates are the differences of
counters between samples. After a restart the topic's publish history is rebuilt from its
Delta commit log (``topic_commits``: every commit's time and row count), so the chart of the
hour before the restart is not empty; channel figures start again from the restart.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from queue_engine.stats import TopicStats

KEEP_S = 3600.0


class TopicPoint(NamedTuple):
    t: float  # wall clock, s
    messages: int
    depth: float  # nan where unknown (rebuilt from the commit log)
    version: int


class ChannelPoint(NamedTuple):
    t: float
    depth: int
    in_flight: int
    deferred: int
    finished: int
    requeued: int
    timed_out: int
    table_version: int
    ledger_version: int


def _rate(points: list[Any], field: str) -> list[float | None]:
    """Per-second change of ``field`` between consecutive points (None for the first, and
    where the counter went backwards: the process restarted)."""
    if not points:
        return []
    rates: list[float | None] = [None]
    for before, after in itertools.pairwise(points):
        dt = after.t - before.t
        change = getattr(after, field) - getattr(before, field)
        rates.append(change / dt if dt > 0 and change >= 0 else None)
    return rates


def _clean(values: Iterable[float]) -> list[float | None]:
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values]


class History:
    """Points per topic and channel over the last ``keep_s`` seconds."""

    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep_s = keep_s
        self.topics: dict[str, deque[TopicPoint]] = {}
        self.channels: dict[tuple[str, str], deque[ChannelPoint]] = {}

    def record(self, stats: list[TopicStats], now: float) -> None:
        live_topics = set()
        live_channels = set()
        for topic in stats:
            live_topics.add(topic.name)
            self._add(
                self.topics.setdefault(topic.name, deque()),
                TopicPoint(now, topic.message_count, topic.depth, topic.version),
                now,
            )
            for c in topic.channels:
                key = (topic.name, c.name)
                live_channels.add(key)
                point = ChannelPoint(
                    now,
                    c.depth,
                    c.in_flight_count,
                    c.deferred_count,
                    c.finish_count,
                    c.requeue_count,
                    c.timeout_count,
                    c.table_version,
                    c.ledger_version,
                )
                self._add(self.channels.setdefault(key, deque()), point, now)
        # Deleted topics and channels go with their history.
        for name in set(self.topics) - live_topics:
            del self.topics[name]
        for key in set(self.channels) - live_channels:
            del self.channels[key]

    def backfill_topic(self, topic: str, commits: list[tuple[float, int]], messages: int) -> None:
        """Points for ``topic`` before the first sample, from its commits in the last hour:
        (commit time s, rows added), oldest first; ``messages``: the count after them all."""
        points = self.topics.setdefault(topic, deque())
        first = points[0].t if points else math.inf
        count = messages - sum(rows for _, rows in commits)
        rebuilt = []
        for at, rows in commits:
            count += rows
            if at < first:
                rebuilt.append(TopicPoint(at, count, math.nan, -1))
        points.extendleft(reversed(rebuilt))

    def _add(self, points: deque[Any], point: Any, now: float) -> None:
        points.append(point)
        while points and points[0].t < now - self.keep_s:
            points.popleft()

    def topic_series(self, topic: str) -> dict[str, list[Any]]:
        points = list(self.topics.get(topic, ()))
        return {
            "t": [p.t for p in points],
            "depth": _clean(p.depth for p in points),
            "publish_rate": _rate(points, "messages"),
            "commit_rate": [
                r if p.version >= 0 else None
                for p, r in zip(points, _rate(points, "version"), strict=True)
            ],
        }

    def channel_series(self, topic: str, channel: str) -> dict[str, list[Any]]:
        points = list(self.channels.get((topic, channel), ()))
        return {
            "t": [p.t for p in points],
            "depth": [p.depth for p in points],
            "in_flight": [p.in_flight for p in points],
            "deferred": [p.deferred for p in points],
            "fin_rate": _rate(points, "finished"),
            "requeue_rate": _rate(points, "requeued"),
            "timeout_rate": _rate(points, "timed_out"),
            "ledger_commit_rate": _rate(points, "ledger_version"),
        }

    def latest_rates(self, topic: str, channel: str | None = None) -> dict[str, float | None]:
        """The rates between the last two points (None before there are two)."""
        series = self.channel_series(topic, channel) if channel else self.topic_series(topic)
        return {k: v[-1] if v else None for k, v in series.items() if k.endswith("_rate")}
