"""The consumer pump: when each channel this node serves is ticked.

A channel's tick delivers new rows to waiting consumers, times out leases and releases due
deferrals. Channels with a waiting consumer are ticked every few ms; the rest on a schedule
that follows their activity, and at once when the fanout or the sweep say they wrote to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
import time
from collections.abc import Mapping

from queue_engine.channel import ChannelRuntime
from queue_engine.store.storage import is_remote
from queue_engine.store.tables import NoticeReader

log = logging.getLogger(__name__)

# The pump's period while a consumer waits.
PUMP_INTERVAL_S = 0.005
# How often a channel nobody waits on is ticked: with leases in flight or deferred messages
# (timeouts, releases); with messages that may outlive a TTL; and with none of these, only in
# case a notice of new rows was missed (notices tick a channel the fanout or sweep wrote to).
BUSY_TICK_S = 0.1
EXPIRING_TICK_S = 2.0
QUIET_TICK_S = 60.0
PUMP_IDLE_MAX_S = 1.0
# With no consumer waiting, the pump sleeps at least this long between passes, so channels due
# close together are ticked in one pass (ten thousand quiet channels are ~170 due a second:
# one wake-up each cost more than their ticks).
PUMP_COALESCE_S = 0.05
# How often the notices of the fanout and the sweep are looked at (a stat; a HEAD request on
# an object store).
NOTICE_POLL_S = 0.05
NOTICE_POLL_REMOTE_S = 0.25


class Pump:
    """Ticks the channels of ``channels`` (the node's open channels, shared, not copied)."""

    def __init__(self, warehouse: str, channels: Mapping[tuple[str, str], ChannelRuntime]) -> None:
        self._warehouse = warehouse
        self._channels = channels
        # Channels with a waiting consumer (ticked every PUMP_INTERVAL_S), and a schedule of
        # when every channel is next due otherwise.
        self._hot: set[ChannelRuntime] = set()
        self._schedule: list[tuple[float, int, ChannelRuntime]] = []
        self._scheduled = itertools.count()
        # When each channel is next due: a schedule entry at another time is stale.
        self._next_due: dict[ChannelRuntime, float] = {}
        self._notices = NoticeReader(warehouse)
        # Set when a channel turns hot: the pump, asleep until the next due channel, wakes.
        self._heated = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._follow_notices())]

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    def add(self, runtime: ChannelRuntime) -> None:
        """A channel just opened: spread over the first interval, so channels opened together
        are not all due at once."""
        self._due(runtime, random.uniform(0, BUSY_TICK_S))

    def forget(self, runtime: ChannelRuntime) -> None:
        self._next_due.pop(runtime, None)

    def leased(self, runtime: ChannelRuntime) -> None:
        """Leases were just granted on ``runtime``: tick it within BUSY_TICK_S. It may have
        been due only every QUIET_TICK_S (it had none when last ticked, and a SUB answered at
        once never makes it hot), and its leases must time out when they end, not up to a
        minute later."""
        self._soon(runtime, BUSY_TICK_S)

    def _soon(self, runtime: ChannelRuntime, after_s: float) -> None:
        """Bring ``runtime``'s next tick forward to ``after_s`` from now, if it is due later
        (a channel closed and forgotten stays so)."""
        due = self._next_due.get(runtime)
        if due is not None and due > time.monotonic() + after_s:
            self._due(runtime, after_s)
            self._heated.set()

    def heat(self, runtime: ChannelRuntime) -> None:
        """A consumer waits on ``runtime``: tick it every PUMP_INTERVAL_S from now."""
        if runtime not in self._hot:
            self._hot.add(runtime)
            self._heated.set()

    async def _pause(self) -> None:
        """Until the next pass: PUMP_INTERVAL_S while a channel is hot, else until the next
        channel is due (at least PUMP_COALESCE_S, at most PUMP_IDLE_MAX_S) or one turns hot:
        an idle API sleeps."""
        if self._hot:
            await asyncio.sleep(PUMP_INTERVAL_S)
            return
        due = self._schedule[0][0] - time.monotonic() if self._schedule else PUMP_IDLE_MAX_S
        self._heated.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._heated.wait(), min(max(due, PUMP_COALESCE_S), PUMP_IDLE_MAX_S)
            )

    def _due(self, runtime: ChannelRuntime, after_s: float) -> None:
        at = time.monotonic() + after_s
        self._next_due[runtime] = at
        heapq.heappush(self._schedule, (at, next(self._scheduled), runtime))

    @staticmethod
    def _tick_interval(runtime: ChannelRuntime) -> float:
        if runtime.busy:
            return BUSY_TICK_S
        return EXPIRING_TICK_S if runtime.expiring else QUIET_TICK_S

    async def _follow_notices(self) -> None:
        """Tick at once the channels the fanout or the sweep say they wrote to: an idle
        channel is otherwise visited only every QUIET_TICK_S."""
        remote = is_remote(self._warehouse)
        while True:
            await asyncio.sleep(NOTICE_POLL_REMOTE_S if remote else NOTICE_POLL_S)
            try:
                if remote:
                    changed = await asyncio.to_thread(self._notices.changes)
                else:
                    changed = self._notices.changes()
            except Exception:
                log.exception("reading the fanout's and sweep's notices failed")
                continue
            if changed is None:
                runtimes = list(self._channels.values())
            else:
                runtimes = [r for key in changed if (r := self._channels.get(key)) is not None]
            now = time.monotonic()
            for runtime in runtimes:
                runtime.notice()
                if self._next_due.get(runtime, 0.0) > now:
                    self._due(runtime, 0.0)
            if runtimes:
                self._heated.set()

    async def _run(self) -> None:
        """Timeouts, deferrals and new channel rows: every few ms for channels with waiting
        consumers (so a SUB answers within ms of a fanout commit), every BUSY_TICK_S for
        channels with leases or deferrals, at once for channels a notice names, and rarely
        for the rest (``_tick_interval``). Each pass looks only at the channels due: the cost
        follows activity, not the number of channels."""
        while True:
            await self._pause()
            for runtime in list(self._hot):
                if runtime.closed:
                    self._hot.discard(runtime)
                    continue
                await self._tick(runtime)
                if not runtime.waiting:
                    self._hot.discard(runtime)
                    # Back to its own pace, from a due time set before it turned hot.
                    self._soon(runtime, self._tick_interval(runtime))
            now = time.monotonic()
            while self._schedule and self._schedule[0][0] <= now:
                at, _, runtime = heapq.heappop(self._schedule)
                if runtime.closed:
                    self._next_due.pop(runtime, None)
                    continue
                if self._next_due.get(runtime) != at:
                    continue  # rescheduled since (a notice)
                if runtime not in self._hot:
                    await self._tick(runtime)
                self._due(runtime, self._tick_interval(runtime))

    @staticmethod
    async def _tick(runtime: ChannelRuntime) -> None:
        try:
            await runtime.tick()
        except Exception:
            log.exception("pump of %s/%s failed", runtime.topic, runtime.channel)
