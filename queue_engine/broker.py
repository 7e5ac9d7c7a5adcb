"""The broker: one process's topics, channels and publish path (nsqd's ``NSQD`` struct).

It owns the registry (folded from its Delta table), one group-commit writer per topic and the
maintenance thread. It is asyncio-facing: publishes await the commit that carries them; the
blocking Delta work runs in the writer threads or in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from queue_engine.channel import ChannelRuntime
from queue_engine.channel_queue import Answer, Delivery
from queue_engine.errors import ChannelElsewhereError, ErrorCode, QueueError
from queue_engine.lease import EventKind
from queue_engine.metrics import PUBLISH_SECONDS
from queue_engine.names import path_segment
from queue_engine.registry import Action, Registry, RegistryEvent, TopicInfo
from queue_engine.replay import Bound, ReplayResult, run_replay
from queue_engine.settings import AckMode, Settings
from queue_engine.stats import ChannelStats, TopicStats, percentile_ms
from queue_engine.store.append import ConstraintViolation
from queue_engine.store.commit_log import latest_version
from queue_engine.store.maintenance import Maintenance, MaintenancePolicy
from queue_engine.store.nodes import Node, NodeDirectory, NodeRecord
from queue_engine.store.notices import NoticeReader, NoticeWriter, topic_writer
from queue_engine.store.object_store import is_remote
from queue_engine.store.ownership import Ownership
from queue_engine.store.registry_store import RegistryMovedError, RegistryStore
from queue_engine.store.table_features import TableRefusedError
from queue_engine.store.tables import Warehouse, delete_tree, list_dirs
from queue_engine.store.writer import CommitStats, TopicWriter, WriterClosedError

log = logging.getLogger(__name__)

# The consumer pump's period, and how many periods apart channels nobody waits on are visited.
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
# How often a node posts the topics it committed to (while it commits), and how much of that
# a notice keeps: ~5 s of posts, so a fanout trigger slower than that probes every topic.
TOPIC_NOTICE_S = 0.1
TOPIC_NOTICE_BATCHES = 50
TOPIC_NOTICE_TOPICS = 10_000
# With several nodes: how often a node looks for registry events other nodes committed, and
# for nodes that died (whose channels it then takes over).
WATCH_INTERVAL_S = 1.0
# A registry event or a channel claim that raced another node's is decided again this many
# times.
_RACE_RETRIES = 20


class Broker:
    """Topics, channels and publishing for one deltaq process.

    With a ``node`` (every ``deltaq api``), it is one of the warehouse's nodes: it publishes to
    any topic, serves the channels it owns (queue_engine.store.ownership), answers
    ``ChannelElsewhereError`` for channels another live node owns, follows the registry events
    other nodes commit, and takes over the channels of nodes that die. Without one it serves
    every channel of the warehouse alone (tests, embedded use).
    """

    def __init__(self, settings: Settings, node: Node | None = None) -> None:
        self.settings = settings
        self.warehouse = Warehouse(settings.warehouse)
        self.node = node
        self._directory = NodeDirectory(settings.warehouse) if node is not None else None
        self._ownership = Ownership(settings.warehouse) if node is not None else None
        # Live nodes (lane -> token) as last seen by the watch, to notice one dying.
        self._seen_nodes: dict[int, str] = {}
        # Channels other nodes own, and where (for /stats): refreshed by the watch.
        self._elsewhere: dict[tuple[str, str], str] = {}
        # Channels re-claimed from this lane's earlier process (counted, not logged one by one).
        self._taken_back = 0
        self._watch: asyncio.Task[None] | None = None
        self.started_at = time.time()
        self._registry_store: RegistryStore | None = None
        self.registry = Registry()
        self._writers: dict[str, TopicWriter] = {}
        # HTTP /sub requests in progress (the API caps them: max_sub_waiters).
        self.sub_waiters = 0
        self._channels: dict[tuple[str, str], ChannelRuntime] = {}
        # The pump's work: channels with a waiting consumer (ticked every PUMP_INTERVAL_S),
        # and a schedule of when every channel is next due otherwise.
        self._hot: set[ChannelRuntime] = set()
        self._schedule: list[tuple[float, int, ChannelRuntime]] = []
        self._scheduled = itertools.count()
        # When each channel is next due: a schedule entry at another time is stale.
        self._next_due: dict[ChannelRuntime, float] = {}
        self._notices = NoticeReader(settings.warehouse)
        self._notice_task: asyncio.Task[None] | None = None
        # Topics committed to since the last topic notice (writer threads add, the loop posts).
        self._written_topics: set[str] = set()
        self._written_lock = threading.Lock()
        self._topic_notices: NoticeWriter | None = None
        self._topic_notice_task: asyncio.Task[None] | None = None
        # Opening what the start's budget left (None: nothing was left).
        self._opening: asyncio.Task[None] | None = None
        # Set when a channel turns hot: the pump, asleep until the next due channel, wakes.
        self._heated = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._admin = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.maintenance = Maintenance(
            MaintenancePolicy.from_settings(settings),
            on_checkpoint=self._checkpointed,
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Fold the registry, finish interrupted deletes, open every topic's writer and the
        channels this node serves: for ``startup_open_budget_s``, then in the background while
        requests are served (ten thousand topics take minutes to open)."""
        self._loop = asyncio.get_running_loop()
        nodes = await asyncio.to_thread(self._start_blocking)
        deadline = time.monotonic() + self.settings.startup_open_budget_s
        topics = collections.deque(self.registry.topics)
        channels = collections.deque(
            (topic.name, channel)
            for topic in list(self.registry.topics.values())
            for channel in list(topic.channels)
        )
        while (topics or channels) and time.monotonic() < deadline:
            await self._open_next(topics, channels, nodes)
        if topics or channels:
            log.info(
                "serving while %d topics and %d channels are still being opened",
                len(topics),
                len(channels),
            )
            self._opening = asyncio.get_running_loop().create_task(
                self._open_rest(topics, channels, nodes)
            )
        else:
            self._log_taken_back()
        self._seen_nodes = {lane: n.token for lane, n in nodes.items()}
        self.maintenance.start()
        self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        self._notice_task = asyncio.get_running_loop().create_task(self._follow_notices())
        self._topic_notice_task = asyncio.get_running_loop().create_task(self._post_topic_notices())
        if self.node is not None:
            self._watch = asyncio.get_running_loop().create_task(self._run_watch())
        log.info(
            "warehouse %s: %d topics, %d channels",
            self.warehouse.root,
            len(self.registry.topics),
            sum(len(t.channels) for t in self.registry.topics.values()),
        )

    def _start_blocking(self) -> dict[int, NodeRecord]:
        """Returns the live nodes as read at start."""
        self._registry_store = RegistryStore(self.warehouse.registry_path)
        self.maintenance.watch(self.warehouse.registry_path)
        self.registry = Registry.fold(self._registry_store.load())
        nodes = self.live_nodes()
        if self.node is None or set(nodes) == {self.node.lane}:
            self._remove_orphan_directories()
        return nodes

    def _remove_orphan_directories(self) -> None:
        """A delete is committed to the registry before its directories are removed; a crash
        in between leaves directories that no registered topic or channel owns. (Only while
        no other node runs: another's create may be between its event and its table.)"""
        live = {path_segment(name): info for name, info in self.registry.topics.items()}
        for segment in list_dirs(self.warehouse.topics_root):
            if segment not in live:
                delete_tree(f"{self.warehouse.topics_root}/{segment}")
        for segment in list_dirs(self.warehouse.channels_root_all):
            topic = live.get(segment)
            if topic is None:
                delete_tree(f"{self.warehouse.channels_root_all}/{segment}")
                continue
            owned = {path_segment(c) for c in topic.channels}
            for channel_segment in list_dirs(f"{self.warehouse.channels_root_all}/{segment}"):
                if channel_segment not in owned:
                    delete_tree(f"{self.warehouse.channels_root_all}/{segment}/{channel_segment}")

    async def _open_rest(
        self,
        topics: collections.deque[str],
        channels: collections.deque[tuple[str, str]],
        nodes: dict[int, NodeRecord],
    ) -> None:
        """Open what the start left (one at a time under ``_admin``: a delete or a request
        that opened it meanwhile wins)."""
        started = time.monotonic()
        opened = 0
        while (topics or channels) and not self._closing:
            async with self._admin:
                try:
                    opened += await self._open_next(topics, channels, nodes)
                except Exception:
                    # Left to the watch's next look (or the first request for it).
                    log.exception("opening a topic or channel after the start failed")
        log.info(
            "opened %d topics and channels after the start in %.1f s",
            opened,
            time.monotonic() - started,
        )
        self._log_taken_back()

    async def _open_next(
        self,
        topics: collections.deque[str],
        channels: collections.deque[tuple[str, str]],
        nodes: dict[int, NodeRecord],
    ) -> bool:
        """Open the next of the start's topic writers, then of its channels that no other live
        node serves; what was deleted or opened meanwhile is skipped. True if one was opened."""
        if topics:
            name = topics.popleft()
            if name not in self.registry.topics or name in self._writers:
                return False
            await asyncio.to_thread(self._open_writer, name)
            return True
        topic, channel = channels.popleft()
        info = self.registry.topics.get(topic)
        if info is None or channel not in info.channels or self._closing:
            return False
        if (topic, channel) in self._channels:
            return False
        return await self._open_if_ours(topic, channel, nodes)

    def _log_taken_back(self) -> None:
        if self._taken_back:
            log.info("took back %d channels this node's lane served before", self._taken_back)
            self._taken_back = 0

    async def close(self) -> None:
        """Commit everything pending, then stop the writers and the maintenance thread."""
        self._closing = True
        if self._opening is not None:
            self._opening.cancel()
        if self._pump is not None:
            self._pump.cancel()
        if self._notice_task is not None:
            self._notice_task.cancel()
        if self._topic_notice_task is not None:
            self._topic_notice_task.cancel()
        if self._watch is not None:
            self._watch.cancel()
        for runtime in list(self._channels.values()):
            await runtime.close()
        self._channels.clear()
        writers = list(self._writers.values())
        self._writers.clear()
        await asyncio.to_thread(_close_all, writers)
        await asyncio.to_thread(self.maintenance.stop)
        if self._registry_store is not None:
            self._registry_store.close()

    # -- publishing -----------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        bodies: list[bytes],
        defer_ms: int | None = None,
        ttl_ms: int | None = None,
    ) -> None:
        """Append ``bodies`` to ``topic`` (created if needed); return once acknowledged.

        ``ttl_ms``: the messages are not delivered that long after publishing (it replaces the
        topic's TTL for them).

        With ``ack = "commit"`` that is after the Delta commit holding them succeeded; with
        ``ack = "buffer"`` once they are queued for the next commit (unless the buffer is full,
        then the publisher waits for the commit: backpressure).
        """
        if self._closing:
            raise QueueError(ErrorCode.EXITING)
        started = time.perf_counter()
        writer = self._writers.get(topic) or await self._create_topic(topic)
        refusal = writer.refusal()
        if refusal is not None:
            raise QueueError(ErrorCode.E_TABLE_REFUSED, refusal.reason)
        published_at_us = time.time_ns() // 1000
        deliver_at_us = published_at_us + defer_ms * 1000 if defer_ms else None
        expires_at_us = published_at_us + ttl_ms * 1000 if ttl_ms else None
        wait = (
            self.settings.ack is AckMode.COMMIT
            or writer.pending_bytes >= self.settings.buffer_max_bytes
        )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] | None = loop.create_future() if wait else None
        try:
            writer.submit_publish(bodies, published_at_us, deliver_at_us, future, expires_at_us)
        except WriterClosedError as exc:
            raise QueueError(ErrorCode.EXITING, str(exc)) from exc
        if future is not None:
            await future
        PUBLISH_SECONDS.labels(topic).observe(time.perf_counter() - started)

    def _committed(self, tokens: list[Any], error: BaseException | None) -> None:
        """Writer thread -> event loop: resolve the futures of one commit in one hop."""
        waiting = [t for t in tokens if t is not None]
        if error is not None and len(waiting) < len(tokens):
            log.error("lost %d buffered publishes: %s", len(tokens) - len(waiting), error)
        if waiting and self._loop is not None:
            self._loop.call_soon_threadsafe(_resolve, waiting, error)

    def _topic_committed(self, name: str, tokens: list[Any], error: BaseException | None) -> None:
        if error is None:
            with self._written_lock:
                self._written_topics.add(name)
        self._committed(tokens, error)

    async def _post_topic_notices(self) -> None:
        """Tell the fanout which topics got commits, every TOPIC_NOTICE_S while any do: over
        many topics it probes those instead of every topic's log."""
        lane = self.node.lane if self.node is not None else None
        self._topic_notices = await asyncio.to_thread(
            NoticeWriter,
            self.settings.warehouse,
            topic_writer(lane),
            keep_batches=TOPIC_NOTICE_BATCHES,
            keep_channels=TOPIC_NOTICE_TOPICS,
        )
        while True:
            await asyncio.sleep(TOPIC_NOTICE_S)
            with self._written_lock:
                written, self._written_topics = self._written_topics, set()
            if written:
                # post() never raises: a lost notice costs the fanout latency, not messages.
                await asyncio.to_thread(self._topic_notices.post, [(t, "") for t in written])

    def _checkpointed(self, path: str) -> None:
        for writer in list(self._writers.values()):
            if writer.path == path:
                writer.request_reopen()
        for runtime in list(self._channels.values()):
            if runtime.ledger_path == path:
                runtime.request_reopen()

    # -- topics ---------------------------------------------------------------------------

    async def _create_topic(self, name: str) -> TopicWriter:
        async with self._admin:
            writer = self._writers.get(name)
            if writer is not None:
                return writer
            await self._refresh_if_moved(name not in self.registry.topics)
            if name not in self.registry.topics:
                cap = self.settings.max_topics
                if cap and len(self.registry.topics) >= cap:
                    raise QueueError(ErrorCode.E_TOO_MANY_TOPICS, f"{cap} topics (max_topics)")
                await self._record(Action.TOPIC_CREATE, name)
            return await asyncio.to_thread(self._open_writer, name)

    async def create_topic(self, name: str) -> None:
        """Create ``name`` if it does not exist (nsqd's GetTopic)."""
        if name not in self._writers:
            await self._create_topic(name)

    async def delete_topic(self, name: str) -> None:
        async with self._admin:
            await self._refresh_if_moved(name not in self.registry.topics)
            self.registry.existing_topic(name)
            await self._record(Action.TOPIC_DELETE, name)
            for key in [k for k in self._channels if k[0] == name]:
                await self._close_channel(*key)
            writer = self._writers.pop(name, None)
            if writer is not None:
                self.maintenance.unwatch(writer.path)
                await asyncio.to_thread(writer.close)
            await asyncio.to_thread(delete_tree, self.warehouse.topic_path(name))
            await asyncio.to_thread(delete_tree, self.warehouse.channels_root(name))
            if self._ownership is not None:
                await asyncio.to_thread(self._ownership.forget, name)

    async def pause_topic(self, name: str, paused: bool) -> None:
        async with self._admin:
            await self._refresh_if_moved(name not in self.registry.topics)
            self.registry.existing_topic(name)
            await self._record(Action.TOPIC_PAUSE if paused else Action.TOPIC_UNPAUSE, name)

    async def empty_topic(self, name: str) -> None:
        async with self._admin:
            await self._refresh_if_moved(name not in self.registry.topics)
            self.registry.existing_topic(name)
            writer = await self._writer(name)
            stats = writer.stats()
            version = stats.version
            if self.node is not None:
                # Other nodes commit to the topic too: empty up to the newest version.
                version = await asyncio.to_thread(latest_version, writer.path, version)
            await self._record(
                Action.TOPIC_EMPTY,
                name,
                topic_version=version,
                topic_messages=stats.message_count,
            )

    # -- channels -------------------------------------------------------------------------

    async def create_channel(self, topic: str, channel: str) -> None:
        """Create ``channel``: it receives every message committed to ``topic`` from now on
        (and, if it is the topic's only channel, what the topic buffered before it)."""
        async with self._admin:
            known = self.registry.topics.get(topic)
            await self._refresh_if_moved(known is None or channel not in known.channels)
            info = self.registry.existing_topic(topic)
            if channel in info.channels:
                return
            cap = self.settings.max_channels_per_topic
            if cap and len(info.channels) >= cap:
                raise QueueError(
                    ErrorCode.E_TOO_MANY_CHANNELS, f"{cap} channels (max_channels_per_topic)"
                )
            await self._record_at_topic_version(Action.CHANNEL_CREATE, topic, channel)
            await self._open_if_ours(topic, channel)

    async def delete_channel(self, topic: str, channel: str) -> None:
        # On the channel's node: only its owner may stop it and remove its tables.
        await self._runtime(topic, channel)
        async with self._admin:
            self.registry.existing_channel(topic, channel)
            await self._record_at_topic_version(Action.CHANNEL_DELETE, topic, channel)
            await self._close_channel(topic, channel)
            await asyncio.to_thread(delete_tree, self.warehouse.channel_root(topic, channel))
            if self._ownership is not None:
                await asyncio.to_thread(self._ownership.forget, topic, channel)

    async def _record_at_topic_version(self, action: Action, topic: str, channel: str) -> None:
        """Record a channel event stamped with the topic version, with no topic commit between
        reading that version and committing the event.

        The fanout decides from the registry which channels get a topic version; if a message
        could be committed after the version was read but before the event, a fanout batch could
        see the message without the channel, and the channel would miss it.
        """
        writer = await self._writer(topic)

        def record() -> RegistryEvent:
            info = self.registry.existing_topic(topic)
            with writer.exclusive():
                version = writer.stats().version
                if self.node is not None:
                    # Other nodes commit to the topic too: from the newest version on.
                    version = latest_version(writer.path, version)
                start = version
                if action is Action.CHANNEL_CREATE:
                    start = self.registry.first_channel_start(info, version)
                event = self._event(
                    action,
                    info.name,
                    channel,
                    topic_version=start,
                    topic_messages=writer.stats().message_count,
                )
                assert self._registry_store is not None
                self._registry_store.append(event)
                return event

        await self._commit_event(record)

    async def pause_channel(self, topic: str, channel: str, paused: bool) -> None:
        await self._runtime(topic, channel)
        async with self._admin:
            self.registry.existing_channel(topic, channel)
            action = Action.CHANNEL_PAUSE if paused else Action.CHANNEL_UNPAUSE
            await self._record(action, topic, channel)
        runtime = self._channels.get((topic, channel))
        if runtime is not None and not paused:
            await runtime.wake()

    async def configure_channel(
        self, topic: str, channel: str, *, max_attempts: int | None
    ) -> None:
        """Set the channel's max_attempts (None: back to the settings' default)."""
        await self._runtime(topic, channel)
        async with self._admin:
            info = self.registry.existing_channel(topic, channel)
            if info.max_attempts != max_attempts:
                await self._record(
                    Action.CHANNEL_CONFIGURE,
                    topic,
                    channel,
                    options={"max_attempts": max_attempts},
                )
        runtime = self._channels.get((topic, channel))
        if runtime is not None:
            runtime.set_max_attempts(self._max_attempts(topic, channel))

    async def configure_topic(self, topic: str, options: dict[str, Any]) -> None:
        """Change the topic's settings named in ``options`` (``ttl_ms``, ``retention_hours``,
        ``retention``; a None value: back to the settings' default). Recorded only if
        something changes."""
        async with self._admin:
            await self._refresh_if_moved(topic not in self.registry.topics)
            info = self.registry.existing_topic(topic)
            changed = {k: v for k, v in options.items() if getattr(info, k) != v}
            if changed:
                await self._record(Action.TOPIC_CONFIGURE, topic, options=changed)
        for (name, _), runtime in list(self._channels.items()):
            if name == topic:
                runtime.set_ttl(self._ttl_ms(topic))

    def _ttl_ms(self, topic: str) -> int:
        info = self.registry.existing_topic(topic)
        return self.settings.message_ttl_ms if info.ttl_ms is None else info.ttl_ms

    def _max_attempts(self, topic: str, channel: str) -> int:
        info = self.registry.existing_channel(topic, channel)
        return self.settings.max_attempts if info.max_attempts is None else info.max_attempts

    async def redrive(self, topic: str, channel: str, ids: list[str] | None) -> int:
        """Dead letters of the channel (``ids``, or all) become ready with attempts reset."""
        return await (await self._runtime(topic, channel)).redrive(ids)

    async def replay(
        self, topic: str, channel: str, start: Bound, end: Bound | None, replay_id: str
    ) -> ReplayResult:
        """Copies of the topic's messages of a range of versions, for ``channel`` only
        (queue_engine.replay); returns once they are committed to the topic."""
        await self._known_channel(topic, channel)
        writer = self._writers.get(topic) or await self._create_topic(topic)
        limit = self.settings.max_replay_messages
        return await asyncio.to_thread(run_replay, writer, channel, start, end, replay_id, limit)

    async def empty_channel(self, topic: str, channel: str) -> int:
        """Drop every message the channel holds (on its owner); returns how many."""
        runtime = await self._runtime(topic, channel)
        async with self._admin:
            self.registry.existing_channel(topic, channel)
            await self._record(Action.CHANNEL_EMPTY, topic, channel)
        return await runtime.empty()

    async def move_channel(self, topic: str, channel: str, lane: int) -> str:
        """Hand the channel to the live node in ``lane``; returns that node's URL.

        Only the owner may move a channel (elsewhere: ChannelElsewhereError, so the call is
        redirected to it). The owner stops the channel first, so its last ledger commits land
        before the claim naming the new owner does; that node then restores the channel from
        the tables as a restart would. Waiting SUBs answer empty and TCP consumers of the
        channel are disconnected (as nsqd does when a channel goes); their leases stay in the
        ledger, so what they hold is FIN'd at the new owner or times out there."""
        if self.node is None or self._ownership is None or self._directory is None:
            await self._runtime(topic, channel)
            raise QueueError(ErrorCode.INVALID_NODE, "this node is alone on its warehouse")
        me = self.node.record
        assert me is not None
        target = (await asyncio.to_thread(self._directory.fresh)).get(lane)
        if target is None:
            raise QueueError(ErrorCode.INVALID_NODE, f"no live node in lane {lane}", param="node")
        if target.lane == me.lane:
            await self._runtime(topic, channel)
            return me.http_url
        for _ in range(_RACE_RETRIES):
            await self._runtime(topic, channel)  # elsewhere: redirected to the owner
            async with self._admin:
                self.registry.existing_channel(topic, channel)
                if (topic, channel) not in self._channels:
                    continue  # moved or deleted while this call waited its turn: ask again
                await self._close_channel(topic, channel)
                if not await asyncio.to_thread(self._hand_over, topic, channel, target):
                    raise QueueError(
                        ErrorCode.INTERNAL_ERROR, f"could not hand over {topic}/{channel}"
                    )
                self._elsewhere[(topic, channel)] = target.http_url
                log.info("node %d moved channel %s/%s to node %d", me.lane, topic, channel, lane)
                try:
                    await self._record(
                        Action.CHANNEL_MOVE,
                        topic,
                        channel,
                        options={"lane": target.lane, "http_url": target.http_url},
                    )
                except Exception:
                    # The claim is the move; the event only hastens it (the new owner's
                    # watch finds the claim within WATCH_INTERVAL_S * 10 otherwise).
                    log.exception("recording the move of %s/%s failed", topic, channel)
                return target.http_url
        raise QueueError(ErrorCode.INTERNAL_ERROR, f"could not move {topic}/{channel}")

    # -- consuming ------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, channel: str, *, limit: int, wait_s: float, lease_us: int, consumer: str
    ) -> list[Delivery]:
        """nsqd's SUB + RDY over HTTP: creates the topic and channel if needed, then waits
        up to ``wait_s`` for messages and leases up to ``limit`` of them to ``consumer``."""
        runtime = await self.open_channel(topic, channel)
        return await runtime.sub(limit, wait_s, lease_us, consumer)

    async def open_channel(self, topic: str, channel: str) -> ChannelRuntime:
        """The live channel (nsqd's GetTopic + GetChannel: both are created if needed)."""
        return await self._runtime(topic, channel, create=True)

    async def channel(self, topic: str, channel: str) -> ChannelRuntime:
        """The live channel (CHANNEL_NOT_FOUND if it does not exist); nothing is created."""
        return await self._runtime(topic, channel)

    async def _runtime(self, topic: str, channel: str, *, create: bool = False) -> ChannelRuntime:
        """The channel's runtime on this node: opened if this node may own it, else
        ``ChannelElsewhereError`` naming the node that does."""
        runtime = self._channels.get((topic, channel))
        if runtime is not None:
            return runtime
        if self._closing:
            raise QueueError(ErrorCode.EXITING)
        if create:
            await self.create_topic(topic)
            await self.create_channel(topic, channel)
        else:
            await self._known_channel(topic, channel)
        return await self._adopt(topic, channel)

    async def _known_channel(self, topic: str, channel: str) -> None:
        """CHANNEL_NOT_FOUND unless the channel exists, after reading the registry again if
        another node may have created it."""
        info = self.registry.topics.get(topic)
        if info is None or channel not in info.channels:
            async with self._admin:
                await self._refresh_if_moved(True)
        self.registry.existing_channel(topic, channel)

    async def _adopt(self, topic: str, channel: str) -> ChannelRuntime:
        async with self._admin:
            runtime = self._channels.get((topic, channel))
            if runtime is not None:
                return runtime
            self.registry.existing_channel(topic, channel)
            owner = await self._owner_if_not_us(topic, channel, None)
            if owner is not None:
                raise ChannelElsewhereError(owner.http_url, owner.tcp_address)
            await self._open_channel(topic, channel)
            return self._channels[(topic, channel)]

    async def _open_if_ours(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None = None
    ) -> bool:
        """Open the channel if no other live node owns it (taking it); False if one does."""
        if await self._owner_if_not_us(topic, channel, nodes) is not None:
            return False
        await self._open_channel(topic, channel)
        return True

    async def _owner_if_not_us(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None
    ) -> NodeRecord | None:
        """The live node that owns the channel if not this one (noted for /stats); else
        this node owns it now (taking it if nobody live did)."""
        if self.node is None:
            return None  # alone on the warehouse: every channel is this process's
        owner = await asyncio.to_thread(self._take_ownership, topic, channel, nodes)
        if owner is not None:
            self._elsewhere[(topic, channel)] = owner.http_url
        return owner

    def _take_ownership(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None
    ) -> NodeRecord | None:
        """Own the channel unless another live node does (returned then). ``nodes``: a view of
        the live nodes to start from (refreshed when the claim names a node it lacks)."""
        assert self.node is not None and self._ownership is not None
        assert self._directory is not None
        me = self.node.record
        assert me is not None
        for _ in range(_RACE_RETRIES):
            claim = self._ownership.current(topic, channel)
            if claim is not None and claim.lane is not None:
                if claim.lane == me.lane and claim.token == me.token:
                    self._elsewhere.pop((topic, channel), None)
                    return None
                # The live nodes are read after the claim: a node that made the claim joined
                # before it, so a fresh view names it if it still lives.
                holder = claim.held_by(nodes if nodes is not None else self._directory.current())
                if holder is None:
                    holder = claim.held_by(self._directory.fresh())
                if holder is not None:
                    return holder
            if self._ownership.claim(topic, channel, claim, me):
                if claim is not None and claim.lane == me.lane:
                    # This lane's earlier process served it: a restart, summed up once.
                    self._taken_back += 1
                    log.debug("node %d took back channel %s/%s", me.lane, topic, channel)
                else:
                    log.info("node %d took channel %s/%s", me.lane, topic, channel)
                self._elsewhere.pop((topic, channel), None)
                return None
        raise QueueError(ErrorCode.INTERNAL_ERROR, f"could not take {topic}/{channel}")

    def _hand_over(self, topic: str, channel: str, target: NodeRecord) -> bool:
        """Claim the channel for ``target`` (this node owns it: no other claim comes first)."""
        assert self._ownership is not None
        claim = self._ownership.current(topic, channel)
        return self._ownership.claim(topic, channel, claim, target)

    def live_nodes(self) -> dict[int, NodeRecord]:
        """The warehouse's live nodes, read now."""
        return self._directory.fresh() if self._directory is not None else {}

    @property
    def closing(self) -> bool:
        return self._closing

    async def settle(
        self,
        topic: str,
        channel: str,
        kind: EventKind,
        answers: list[Answer],
        *,
        delay_us: int = 0,
        lease_us: int | None = None,
    ) -> None:
        """FIN, REQ or TOUCH the given leases, all or none; durable when this returns."""
        runtime = await self._runtime(topic, channel)
        await runtime.settle(
            kind,
            answers,
            delay_us=delay_us,
            lease_us=lease_us,
            max_lease_us=self.settings.max_msg_timeout_ms * 1000,
        )

    def stop_waiting(self) -> None:
        """The server is stopping: waiting SUBs answer now (with what they have: nothing).

        Safe to call from a signal handler or another thread.
        """
        self._closing = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_all_closed)

    def _wake_all_closed(self) -> None:
        for runtime in self._channels.values():
            runtime.closed = True
            asyncio.get_running_loop().create_task(runtime.wake())

    async def _open_channel(self, topic: str, channel: str) -> None:
        key = (topic, channel)
        if key in self._channels:
            return
        runtime = ChannelRuntime(
            topic,
            channel,
            self.warehouse.channel_messages_path(topic, channel),
            self.warehouse.channel_ledger_path(topic, channel),
            self.warehouse.channel_dead_path(topic, channel),
            state_path=self.warehouse.channel_state_path(topic, channel),
            max_attempts=self._max_attempts(topic, channel),
            ttl_ms=self._ttl_ms(topic),
            expired_dead=self.settings.expired_to_dead_letters,
            scan_leases=self.settings.scan_leases,
            mem_queue_size=self.settings.mem_queue_size,
            is_paused=lambda: self._channel_paused(topic, channel),
            notify=self._committed,
            on_waiting=self._heat,
        )
        await runtime.start()
        self._channels[key] = runtime
        # Spread over the first interval, so channels opened together are not all due at once.
        self._due(runtime, random.uniform(0, BUSY_TICK_S))
        self.maintenance.watch(runtime.ledger_path)

    async def _close_channel(self, topic: str, channel: str) -> None:
        runtime = self._channels.pop((topic, channel), None)
        if runtime is not None:
            self._next_due.pop(runtime, None)
            self.maintenance.unwatch(runtime.ledger_path)
            await runtime.close()

    def _channel_paused(self, topic: str, channel: str) -> bool:
        info = self.registry.topics.get(topic)
        state = info.channels.get(channel) if info is not None else None
        return state is None or state.paused

    def _heat(self, runtime: ChannelRuntime) -> None:
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

    def _tick_interval(self, runtime: ChannelRuntime) -> float:
        if runtime.busy:
            return BUSY_TICK_S
        return EXPIRING_TICK_S if runtime.expiring else QUIET_TICK_S

    async def _follow_notices(self) -> None:
        """Tick at once the channels the fanout or the sweep say they wrote to: an idle
        channel is otherwise visited only every QUIET_TICK_S."""
        remote = is_remote(self.settings.warehouse)
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

    async def _run_pump(self) -> None:
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

    async def _tick(self, runtime: ChannelRuntime) -> None:
        try:
            await runtime.tick()
        except Exception:
            log.exception("pump of %s/%s failed", runtime.topic, runtime.channel)

    # -- stats ----------------------------------------------------------------------------

    def stats(self, topic: str | None = None, channel: str | None = None) -> list[TopicStats]:
        """nsqd's /stats figures; ``topic``/``channel`` filter as nsqd filters them."""
        names = [topic] if topic else sorted(self.registry.topics)
        return self.topic_stats(names, channel)

    def topic_stats(self, names: Iterable[str], channel: str | None = None) -> list[TopicStats]:
        """The figures of the named topics that exist, in the order named."""
        topics = self.registry.topics
        return [
            self._topic_stats(topics[n], channel)
            for n in names
            # As nsqd: a channel filter leaves out the topics without that channel.
            if n in topics and (not channel or channel in topics[n].channels)
        ]

    def _topic_stats(self, info: TopicInfo, channel: str | None) -> TopicStats:
        stats = self._writer_stats(info.name)
        channels = [
            self._channel_stats(info.name, c.name, c.paused)
            for c in sorted(info.channels.values(), key=lambda c: c.name)
            if not channel or c.name == channel
        ]
        durations = (
            sorted(self._writers[info.name].commit_seconds) if info.name in self._writers else []
        )
        depth = self._topic_depth(info, stats)
        return TopicStats(
            name=info.name,
            paused=info.paused,
            depth=depth,
            message_count=stats.message_count,
            message_bytes=stats.committed_bytes,
            commits=stats.commits,
            version=stats.version,
            channels=channels,
            commit_p50_ms=percentile_ms(durations, 0.50),
            commit_p99_ms=percentile_ms(durations, 0.99),
            refused=_refused(self._writers.get(info.name)),
            data_version=stats.data_version,
        )

    def _topic_depth(self, info: TopicInfo, stats: CommitStats) -> int:
        """Messages no channel has taken yet (nsqd's topic depth): those committed after the
        newest topic version the fanout has put in any of the topic's channels, and after the
        last /topic/empty. A topic without channels keeps everything (nsqd buffers them)."""
        writer = self._writers.get(info.name)
        if writer is None:
            return 0
        # Looked up through the topic's own channels: /stats over many topics stays linear.
        fanned = max(
            (
                runtime.fanned_topic_version
                for name in info.channels
                if (runtime := self._channels.get((info.name, name))) is not None
            ),
            default=-1,
        )
        taken = writer.messages_through(fanned) if fanned >= 0 else 0
        return max(0, stats.message_count - max(taken, info.empty_message_count))

    def _channel_stats(self, topic: str, channel: str, paused: bool) -> ChannelStats:
        runtime = self._channels.get((topic, channel))
        if runtime is None:
            return ChannelStats(
                name=channel, paused=paused, node=self._elsewhere.get((topic, channel))
            )
        counts = runtime.counts()
        return ChannelStats(
            name=channel,
            paused=paused,
            depth=counts.depth,
            in_flight_count=counts.in_flight_count,
            deferred_count=counts.deferred_count,
            message_count=counts.message_count,
            requeue_count=counts.requeue_count,
            timeout_count=counts.timeout_count,
            clients=tuple(counts.clients),
            fanned_topic_version=runtime.fanned_topic_version,
            finish_count=counts.finish_count,
            dead_count=counts.dead_count,
            expired_count=counts.expired_count,
            max_attempts=runtime.max_attempts,
            table_version=counts.table_version,
            ledger_version=counts.ledger_version,
            node=self.node.record.http_url if self.node and self.node.record else None,
        )

    # -- internals ------------------------------------------------------------------------

    def _open_writer(self, name: str) -> TopicWriter:
        writer = TopicWriter(
            self.warehouse.topic_path(name),
            functools.partial(self._topic_committed, name),
            commit_max_bytes=self.settings.commit_max_bytes,
            name=name,
            id_lane=self.node.lane if self.node is not None else 0,
        )
        self._writers[name] = writer
        self.maintenance.watch(writer.path)
        return writer

    def _writer_stats(self, name: str) -> CommitStats:
        writer = self._writers.get(name)
        if writer is None:
            return CommitStats(
                version=-1, message_count=0, commits=0, committed_messages=0, committed_bytes=0
            )
        return writer.stats()

    async def _record(
        self,
        action: Action,
        topic: str,
        channel: str | None = None,
        *,
        topic_version: int | None = None,
        topic_messages: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Commit a registry event, then apply it: memory never runs ahead of the table.
        With ``_admin`` held."""
        store = self._registry_store
        assert store is not None, "broker not started"

        def record() -> RegistryEvent:
            event = self._event(
                action,
                topic,
                channel,
                topic_version=topic_version,
                topic_messages=topic_messages,
                options=options,
            )
            store.append(event)
            return event

        await self._commit_event(record)

    async def _commit_event(self, record: Callable[[], RegistryEvent]) -> None:
        """Run ``record`` (make an event from the registry as folded and commit it; in a
        thread), then apply the event. With ``_admin`` held. When another node's event took the
        version first, read the registry again and make the event anew (a stale event is
        harmless: the fold ignores it)."""
        for _ in range(_RACE_RETRIES):
            try:
                event = await asyncio.to_thread(record)
            except RegistryMovedError:
                await self._refresh_registry()
                continue
            self.registry.apply(event)
            return
        raise QueueError(ErrorCode.E_COMMIT_FAILED, "the registry kept changing; try again")

    async def _writer(self, name: str) -> TopicWriter:
        """The topic's writer, opened if this node has none yet (a topic another node created
        has none here until this node uses it). With ``_admin`` held."""
        writer = self._writers.get(name)
        if writer is None:
            writer = await asyncio.to_thread(self._open_writer, name)
        return writer

    async def _refresh_if_moved(self, missing: bool) -> None:
        """With ``_admin`` held, before creating something ``missing`` from the registry:
        another node may have created it since this one last read the registry."""
        store = self._registry_store
        if (
            missing
            and self.node is not None
            and store is not None
            and await asyncio.to_thread(store.moved)
        ):
            await self._refresh_registry()

    async def refresh_registry(self) -> None:
        """Read the registry events other nodes committed, and follow them."""
        async with self._admin:
            await self._refresh_registry()

    async def _refresh_registry(self) -> None:
        """With ``_admin`` held: fold the registry again and follow what changed."""
        assert self._registry_store is not None, "broker not started"
        before = self.registry
        self.registry = Registry.fold(await asyncio.to_thread(self._registry_store.load))
        await self._follow(before, self.registry)

    async def _follow(self, before: Registry, after: Registry) -> None:
        """Another node deleted (or re-created) topics or channels, or changed settings: stop
        what this node runs of them, and apply the settings to the channels it serves."""

        def replaced(name: str) -> bool:
            """Deleted, or deleted and created again, since ``before``."""
            info, old = after.topics.get(name), before.topics.get(name)
            return info is None or (old is not None and info.created_seq != old.created_seq)

        for name in [n for n in self._writers if replaced(n)]:
            writer = self._writers.pop(name)
            self.maintenance.unwatch(writer.path)
            await asyncio.to_thread(writer.close)
        for (topic, channel), runtime in list(self._channels.items()):
            info = after.topics.get(topic)
            if info is None or replaced(topic) or channel not in info.channels:
                await self._close_channel(topic, channel)
                await asyncio.to_thread(delete_tree, self.warehouse.channel_root(topic, channel))
                continue
            runtime.set_ttl(self._ttl_ms(topic))
            runtime.set_max_attempts(self._max_attempts(topic, channel))
            old_topic = before.topics.get(topic)
            was = old_topic.channels.get(channel) if old_topic is not None else None
            if was is not None and was.paused and not info.channels[channel].paused:
                await runtime.wake()
        await self._follow_moves(before, after)

    async def _follow_moves(self, before: Registry, after: Registry) -> None:
        """Channels an admin moved since ``before``: open those moved here, note where the
        others went (for /stats)."""
        me = self.node.record if self.node is not None else None
        if me is None:
            return
        for name, info in after.topics.items():
            old = before.topics.get(name)
            for channel, state in info.channels.items():
                was = old.channels.get(channel) if old is not None else None
                if state.moved_to is None or (was is not None and was.moved_seq == state.moved_seq):
                    continue
                if state.moved_to != me.lane:
                    if (name, channel) not in self._channels:
                        self._elsewhere[(name, channel)] = str(state.moved_to_url)
                elif (name, channel) not in self._channels and not self._closing:
                    await self._open_if_ours(name, channel)

    async def _run_watch(self) -> None:
        """Every WATCH_INTERVAL_S: follow registry events of other nodes; when a node died
        (and every few passes, for /stats), look at who owns the channels this node does not
        serve and take those whose owner is gone."""
        assert self._registry_store is not None and self._directory is not None
        passes = 0
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            passes += 1
            try:
                if await asyncio.to_thread(self._registry_store.moved):
                    await self.refresh_registry()
                nodes = await asyncio.to_thread(self._directory.fresh)
                seen = {lane: n.token for lane, n in nodes.items()}
                died = any(seen.get(lane) != token for lane, token in self._seen_nodes.items())
                self._seen_nodes = seen
                if died or passes % 10 == 0:
                    await self._take_over(nodes)
            except Exception:
                log.exception("watching the warehouse's nodes failed (retrying)")

    async def _take_over(self, nodes: dict[int, NodeRecord]) -> None:
        """Open the channels no live node owns; note where the others are served."""
        for name, info in list(self.registry.topics.items()):
            for channel in list(info.channels):
                if (name, channel) in self._channels or self._closing:
                    continue
                async with self._admin:
                    if name in self.registry.topics and channel in info.channels:
                        await self._open_if_ours(name, channel, nodes)
        if self._opening is None or self._opening.done():
            self._log_taken_back()  # else the background opening sums them up at its end

    def _event(
        self,
        action: Action,
        topic: str,
        channel: str | None,
        *,
        topic_version: int | None,
        topic_messages: int | None,
        options: dict[str, Any] | None = None,
    ) -> RegistryEvent:
        return RegistryEvent(
            seq=self.registry.next_seq(),
            at_us=time.time_ns() // 1000,
            action=action,
            topic=topic,
            channel=channel,
            topic_version=topic_version,
            topic_messages=topic_messages,
            options=options,
        )


def _refused(writer: TopicWriter | None) -> str | None:
    refusal = writer.refusal() if writer is not None else None
    return refusal.reason if refusal is not None else None


def commit_error(error: BaseException) -> QueueError:
    """What a publisher is answered when the commit carrying its messages failed."""
    if isinstance(error, QueueError):
        return error
    if isinstance(error, TableRefusedError):
        return QueueError(ErrorCode.E_TABLE_REFUSED, error.reason)
    if isinstance(error, ConstraintViolation):
        return QueueError(ErrorCode.E_CONSTRAINT_VIOLATED, error.reason)
    return QueueError(ErrorCode.E_COMMIT_FAILED, str(error))


def _resolve(futures: Iterable[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(commit_error(error))


def _close_all(writers: list[TopicWriter]) -> None:
    for writer in writers:
        writer.close()
