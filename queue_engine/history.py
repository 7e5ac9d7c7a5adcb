"""The last hour of each topic's and channel's figures, for the console's charts (pure).

The API samples its own figures every few seconds (``record``); rates are the differences of
counters between samples. After a restart the topic's publish history is rebuilt from its
Delta commit log (``topic_commits``: every commit's time and row count), so the chart of the
hour before the restart is not empty; channel figures start again from the restart.

A sample equal to the point before it is not stored: only the newest such sample is held
(and stored before the next change, so rates stay exact), and an unchanged figure is stored
every ``UNCHANGED_EVERY_S``. A topic whose figures stopped changing is sampled less and less
often (``due``), up to ``QUIET_MAX_PERIODS`` sample periods apart. Ten thousand idle topics cost
a few points each and a few samples a second, not an hour of samples each.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from queue_engine.stats import TopicStats

KEEP_S = 3600.0
UNCHANGED_EVERY_S = 300.0
QUIET_MAX_PERIODS = 30


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


def _same(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """Equal figures (the time aside; nan equals nan)."""
    return all(a == b or _both_nan(a, b) for a, b in zip(before[1:], after[1:], strict=True))


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def _clean(values: Iterable[float]) -> list[float | None]:
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values]


class History:
    """Points per topic and channel over the last ``keep_s`` seconds."""

    def __init__(self, keep_s: float = KEEP_S, period_s: float = 2.0) -> None:
        self.keep_s = keep_s
        self.period_s = period_s
        # Per topic: sample periods since its figures last changed (capped), next sample time.
        self._quiet: dict[str, int] = {}
        self._next: dict[str, float] = {}
        self.topics: dict[str, deque[TopicPoint]] = {}
        self.channels: dict[tuple[str, str], deque[ChannelPoint]] = {}
        # The newest sample of each series while it equals its last stored point.
        self._held: dict[object, Any] = {}

    def due(self, names: Iterable[str], now: float) -> list[str]:
        """Which of ``names`` to sample now: every period while a topic's figures change."""
        return [n for n in names if self._next.get(n, 0.0) <= now]

    def record(
        self, stats: list[TopicStats], now: float, topics: Iterable[str] | None = None
    ) -> None:
        """Add a sample of ``stats``; ``topics``: every topic there is, when ``stats`` holds
        only some of them (the rest keep their history)."""
        live_topics = set(topics) if topics is not None else set()
        live_channels = set()
        for topic in stats:
            live_topics.add(topic.name)
            changed = self._add(
                topic.name,
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
                changed |= self._add(key, self.channels.setdefault(key, deque()), point, now)
            quiet = min(self._quiet.get(topic.name, 0) * 2 or 1, QUIET_MAX_PERIODS)
            quiet = self._quiet[topic.name] = 0 if changed else quiet
            self._next[topic.name] = now + max(1, quiet) * self.period_s * 0.999
        # Deleted topics and channels go with their history.
        sampled = {topic.name for topic in stats}
        for name in set(self.topics) - live_topics:
            del self.topics[name]
            for kept in (self._held, self._quiet, self._next):
                kept.pop(name, None)
        for key in set(self.channels) - live_channels:
            if key[0] in sampled or key[0] not in live_topics:
                del self.channels[key]
                self._held.pop(key, None)

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

    def _add(self, key: object, points: deque[Any], point: Any, now: float) -> bool:
        """Add a sample; whether the figures changed since the last one."""
        same = bool(points) and _same(points[-1], point)
        if same and point.t - points[-1].t < UNCHANGED_EVERY_S:
            self._held[key] = point
        else:
            held = self._held.pop(key, None)
            if held is not None and not same:
                points.append(held)
            points.append(point)
        while points and points[0].t < now - self.keep_s:
            points.popleft()
        return not same

    def _points(self, key: object, stored: Iterable[Any]) -> list[Any]:
        points = list(stored)
        held = self._held.get(key)
        return points if held is None else [*points, held]

    def topic_series(self, topic: str) -> dict[str, list[Any]]:
        points = self._points(topic, self.topics.get(topic, ()))
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
        points = self._points((topic, channel), self.channels.get((topic, channel), ()))
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
