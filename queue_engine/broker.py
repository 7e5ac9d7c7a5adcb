"""The broker: one deltaq node (nsqd's ``NSQD`` struct).

Its parts each have a home: the registry as this node follows it (queue_engine.node_registry),
the topics and the publish path (queue_engine.topics), the channels it serves and their pump
(queue_engine.channels, queue_engine.pump), and its place among the warehouse's nodes
(queue_engine.cluster). The broker starts and stops them, follows what other nodes change,
and is the one interface the HTTP and TCP servers use. It is asyncio-facing: the blocking Delta
work runs in writer threads or in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from queue_engine.acks import Acks
from queue_engine.channel import ChannelRuntime
from queue_engine.channel_queue import Answer, Delivery
from queue_engine.channels import Channels
from queue_engine.cluster import Membership
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.headers import Headers
from queue_engine.names import path_segment
from queue_engine.node_registry import NodeRegistry
from queue_engine.registry import Action, Registry
from queue_engine.replay import Bound, ReplayResult
from queue_engine.settings import AckMode, Settings
from queue_engine.stats import TopicStats
from queue_engine.store.coordination import Node, NodeRecord
from queue_engine.store.delta import TableRefusedError
from queue_engine.store.journal import journal_tokens
from queue_engine.store.storage import delete_tree, list_dirs
from queue_engine.store.tables import Warehouse
from queue_engine.store.upkeep import Maintenance, MaintenancePolicy
from queue_engine.topics import Topics

log = logging.getLogger(__name__)

# With several nodes: how often a node looks for registry events other nodes committed, and
# for nodes that died (whose channels it then takes over).
WATCH_INTERVAL_S = 1.0


class Broker:
    """Topics, channels and publishing for one deltaq process.

    With a ``node`` (every ``deltaq api``), it is one of the warehouse's nodes: it publishes to
    any topic, serves its shares of every channel (queue_engine.shares), answers
    ``ChannelElsewhereError`` for answers to messages of shares another live node holds,
    follows the registry events other nodes commit, and takes over the shares of nodes that
    die. Without one it serves every channel of the warehouse alone (tests, embedded use).
    """

    def __init__(self, settings: Settings, node: Node | None = None) -> None:
        self.settings = settings
        self.warehouse = Warehouse(settings.warehouse)
        self.node = node
        self.started_at = time.time()
        # HTTP /sub requests in progress (``subscribe`` caps them: max_sub_waiters).
        self.sub_waiters = 0
        self.cluster = Membership(settings.warehouse, node)
        self._registry = NodeRegistry(self.warehouse.registry_path, shared=node is not None)
        self._registry.on_reload = self._follow
        self.maintenance = Maintenance(
            MaintenancePolicy.from_settings(settings),
            on_checkpoint=self._checkpointed,
            in_process=not settings.maintenance_process,
        )
        self._acks = Acks()
        self.topics = Topics(
            settings,
            self.warehouse,
            self._registry,
            self.maintenance,
            self._acks,
            lane=node.lane if node is not None else None,
        )
        self.channels = Channels(
            settings,
            self.warehouse,
            self._registry,
            self.topics,
            self.cluster,
            self.maintenance,
            self._acks,
        )
        self._watch: asyncio.Task[None] | None = None
        # Opening what the start's budget left (None: nothing was left).
        self._opening: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    @property
    def registry(self) -> Registry:
        return self._registry.registry

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Fold the registry, finish interrupted deletes, open every topic's writer and the
        channels this node serves: for ``startup_open_budget_s``, then in the background while
        requests are served (ten thousand topics take minutes to open)."""
        self._loop = asyncio.get_running_loop()
        self._acks.loop = self._loop
        nodes = await asyncio.to_thread(self._start_blocking)
        if self.settings.ack is AckMode.JOURNAL:
            me = self.cluster.me
            self.topics.start_journal(me.token if me is not None else uuid.uuid4().hex)
        deadline = time.monotonic() + self.settings.startup_open_budget_s
        topics = collections.deque(self.registry.topics)
        channels = collections.deque(
            (topic.name, channel)
            for topic in list(self.registry.topics.values())
            for channel in list(topic.channels)
        )
        while (topics or channels) and time.monotonic() < deadline:
            try:
                await self._open_next(topics, channels, nodes)
            except TableRefusedError as exc:
                # A table damaged beyond what a power cut leaves: refused by name, the
                # others serve (its requests answer E_TABLE_REFUSED).
                log.error("not serving a table: %s", exc)
        if topics or channels:
            log.info(
                "serving while %d topics and %d channels are still being opened",
                len(topics),
                len(channels),
            )
            self._opening = self._loop.create_task(self._open_rest(topics, channels, nodes))
        else:
            self.cluster.log_taken_back()
        self.cluster.seen(nodes)
        self.maintenance.start()
        self.channels.pump.start()
        self.topics.start_notices()
        if self.node is not None:
            self._watch = self._loop.create_task(self._run_watch())
        log.info(
            "warehouse %s: %d topics, %d channels",
            self.warehouse.root,
            len(self.registry.topics),
            sum(len(t.channels) for t in self.registry.topics.values()),
        )

    def _start_blocking(self) -> dict[int, NodeRecord]:
        """Returns the live nodes as read at start."""
        self.maintenance.watch(self.warehouse.registry_path)
        self._registry.load()
        journals = journal_tokens(self.settings.warehouse)
        nodes = self.cluster.live()
        if self.node is None or set(nodes) == {self.node.lane}:
            self._remove_orphan_directories()
        self._recover_journals(journals, nodes)
        return nodes

    def _recover_journals(self, tokens: list[str], nodes: dict[int, NodeRecord]) -> None:
        """Commit what the journals of processes that are gone hold (blocking): at start
        before any publish is taken, and when the watch sees a node die."""
        for token in self.cluster.dead_journals(tokens, nodes):
            try:
                self.topics.recover(token)
            except Exception:
                log.exception("recovering journal %s failed (tried again later)", token)
                continue
            self.cluster.journal_recovered(token)

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
        """Open what the start left (one at a time under ``admin``: a delete or a request
        that opened it meanwhile wins)."""
        started = time.monotonic()
        opened = 0
        while (topics or channels) and not self._closing:
            async with self._registry.admin:
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
        self.cluster.log_taken_back()

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
            if name not in self.registry.topics or name in self.topics:
                return False
            await asyncio.to_thread(self.topics.open, name)
            return True
        topic, channel = channels.popleft()
        info = self.registry.topics.get(topic)
        if info is None or channel not in info.channels or self._closing:
            return False
        if (topic, channel) in self.channels:
            return False
        return await self.channels.open_if_ours(topic, channel, nodes)

    async def close(self) -> None:
        """Commit everything pending, then stop the writers and the maintenance thread."""
        self._closing = True
        self.topics.closing = True
        for task in (self._opening, self._watch):
            if task is not None:
                task.cancel()
        await self.channels.close()
        await self.topics.close()
        await asyncio.to_thread(self.maintenance.stop)
        self._registry.close()

    @property
    def closing(self) -> bool:
        return self._closing

    def stop_waiting(self) -> None:
        """The server is stopping: waiting SUBs answer now (with what they have: nothing).

        Safe to call from a signal handler or another thread.
        """
        self._closing = True
        self.topics.closing = True
        self.channels.closing = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.channels.wake_all_closed)

    def _checkpointed(self, path: str) -> None:
        self.topics.checkpointed(path)
        self.channels.checkpointed(path)

    def live_nodes(self) -> dict[int, NodeRecord]:
        """The warehouse's live nodes, read now."""
        return self.cluster.live()

    # -- publishing -----------------------------------------------------------------------

    async def publish(
        self,
        topic: str,
        bodies: list[bytes],
        defer_ms: int | None = None,
        ttl_ms: int | None = None,
        headers: list[Headers | None] | None = None,
    ) -> None:
        """Append ``bodies`` to ``topic`` (created if needed); return once acknowledged
        (queue_engine.topics.Topics.start_publish). ``headers``: one entry per body."""
        await (await self.topics.start_publish(topic, bodies, defer_ms, ttl_ms, headers))

    async def start_publish(
        self, topic: str, bodies: list[bytes], defer_ms: int | None = None
    ) -> asyncio.Future[None]:
        """Start a publish; the future is done once it is acknowledged. Publishes started one
        after the other are taken in that order (queue_engine.topics.Topics.start_publish)."""
        return await self.topics.start_publish(topic, bodies, defer_ms)

    # -- topics ---------------------------------------------------------------------------

    async def create_topic(self, name: str) -> None:
        """Create ``name`` if it does not exist (nsqd's GetTopic)."""
        if name not in self.topics:
            await self.topics.create(name)

    async def declare_topic_schema(self, name: str, text: str) -> None:
        """Type the topic, or evolve its schema (queue_engine.topic_schema)."""
        await self.topics.declare_schema(name, text)

    async def delete_topic(self, name: str) -> None:
        nr = self._registry
        async with nr.admin:
            await nr.reload_if_moved(name not in self.registry.topics)
            self.registry.existing_topic(name)
            await nr.record(Action.TOPIC_DELETE, name)
            await self.channels.stop_topic(name)
            await self.topics.remove(name)
            await asyncio.to_thread(self.cluster.forget, name)

    async def pause_topic(self, name: str, paused: bool) -> None:
        await self.topics.pause(name, paused)

    async def empty_topic(self, name: str) -> None:
        await self.topics.empty(name, shared=self.node is not None)

    async def configure_topic(self, topic: str, options: dict[str, Any]) -> None:
        await self.topics.configure(topic, options)
        self.channels.apply_settings(topic)

    # -- channels -------------------------------------------------------------------------

    async def create_channel(
        self, topic: str, channel: str, filter_text: str | None = None
    ) -> bool:
        """Create the channel (with its filter); False if it existed (nothing changed)."""
        return await self.channels.create(topic, channel, filter_text)

    async def set_channel_filter(self, topic: str, channel: str, filter_text: str | None) -> None:
        await self.channels.set_filter(topic, channel, filter_text)

    async def delete_channel(self, topic: str, channel: str) -> None:
        await self.channels.delete(topic, channel)

    async def pause_channel(self, topic: str, channel: str, paused: bool) -> None:
        await self.channels.pause(topic, channel, paused)

    async def configure_channel(
        self, topic: str, channel: str, *, max_attempts: int | None
    ) -> None:
        await self.channels.configure(topic, channel, max_attempts=max_attempts)

    async def redrive(self, topic: str, channel: str, ids: list[str] | None) -> int:
        return await self.channels.redrive(topic, channel, ids)

    async def replay(
        self, topic: str, channel: str, start: Bound, end: Bound | None, replay_id: str
    ) -> ReplayResult:
        return await self.channels.replay(topic, channel, start, end, replay_id)

    async def empty_channel(self, topic: str, channel: str) -> int:
        return await self.channels.empty(topic, channel)

    async def move_channel(self, topic: str, channel: str, lane: int) -> str:
        return await self.channels.move(topic, channel, lane)

    # -- consuming ------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, channel: str, *, limit: int, wait_s: float, lease_us: int, consumer: str
    ) -> list[Delivery]:
        """nsqd's SUB + RDY over HTTP: creates the topic and channel if needed, then waits
        up to ``wait_s`` for messages and leases up to ``limit`` of them to ``consumer``. At
        most ``max_sub_waiters`` wait at once (E_TOO_MANY_WAITERS)."""
        cap = self.settings.max_sub_waiters
        if wait_s > 0 and cap and self.sub_waiters >= cap:
            raise QueueError(ErrorCode.E_TOO_MANY_WAITERS, f"{cap} waiting (max_sub_waiters)")
        self.sub_waiters += 1
        try:
            return await self.channels.subscribe(
                topic, channel, limit=limit, wait_s=wait_s, lease_us=lease_us, consumer=consumer
            )
        finally:
            self.sub_waiters -= 1

    async def open_channel(self, topic: str, channel: str) -> ChannelRuntime:
        """The live channel (nsqd's GetTopic + GetChannel: both are created if needed)."""
        return await self.channels.runtime(topic, channel, create=True)

    async def channel(self, topic: str, channel: str) -> ChannelRuntime:
        """The live channel (CHANNEL_NOT_FOUND if it does not exist); nothing is created."""
        return await self.channels.runtime(topic, channel)

    async def answering(self, topic: str, channel: str, answers: list[Answer]) -> ChannelRuntime:
        """The live channel that answers FIN, REQ or TOUCH of ``answers`` (its ``answer``);
        ``ChannelElsewhereError`` when another node serves them."""
        return await self.channels.answering(topic, channel, answers)

    # -- stats ----------------------------------------------------------------------------

    def stats(self, topic: str | None = None, channel: str | None = None) -> list[TopicStats]:
        """nsqd's /stats figures; ``topic``/``channel`` filter as nsqd filters them."""
        names = [topic] if topic else sorted(self.registry.topics)
        return self.topic_stats(names, channel)

    def topic_stats(
        self, names: Iterable[str], channel: str | None = None, *, latencies: bool = True
    ) -> list[TopicStats]:
        """The figures of the named topics that exist, in the order named (``latencies``:
        with commit percentiles, a sort of up to 1,000 durations per topic)."""
        topics = self.registry.topics
        out = []
        for name in names:
            info = topics.get(name)
            # As nsqd: a channel filter leaves out the topics without that channel.
            if info is None or (channel and channel not in info.channels):
                continue
            channels = [
                self.channels.stats(name, c.name, c.paused)
                for c in sorted(info.channels.values(), key=lambda c: c.name)
                if not channel or c.name == channel
            ]
            # Looked up through the topic's own channels: /stats over many topics stays linear.
            fanned = self.channels.fanned(name, info.channels)
            out.append(self.topics.stats(info, channels, fanned, latencies=latencies))
        return out

    # -- other nodes ----------------------------------------------------------------------

    async def refresh_registry(self) -> None:
        """Read the registry events other nodes committed, and follow them."""
        async with self._registry.admin:
            await self._registry.reload()

    async def _follow(self, before: Registry, after: Registry) -> None:
        """Another node deleted (or re-created) topics or channels, or changed settings: stop
        what this node runs of them, and apply the settings to the channels it serves."""

        def replaced(name: str) -> bool:
            """Deleted, or deleted and created again, since ``before``."""
            info, old = after.topics.get(name), before.topics.get(name)
            return info is None or (old is not None and info.created_seq != old.created_seq)

        for name in [n for n in self.topics if replaced(n)]:
            await self.topics.drop(name)
        for (topic, channel), runtime in self.channels.items():
            info = after.topics.get(topic)
            if info is None or replaced(topic) or channel not in info.channels:
                await self.channels.stop(topic, channel)
                await asyncio.to_thread(delete_tree, self.warehouse.channel_root(topic, channel))
                continue
            runtime.set_ttl(self.topics.ttl_ms(topic))
            runtime.set_max_attempts(self.channels.max_attempts(topic, channel))
            old_topic = before.topics.get(topic)
            was = old_topic.channels.get(channel) if old_topic is not None else None
            if was is not None and was.paused and not info.channels[channel].paused:
                await runtime.wake()
        await self._follow_channels(before, after)

    async def _follow_channels(self, before: Registry, after: Registry) -> None:
        """Channels other nodes created, moved or emptied since ``before``: serve this node's
        shares of the new ones, claim again where shares moved, empty the shares served
        here (the node asked emptied its own)."""
        for name, info in after.topics.items():
            old = before.topics.get(name)
            for channel, state in info.channels.items():
                if self._closing:
                    return
                was = old.channels.get(channel) if old is not None else None
                if was is None or was.moved_seq != state.moved_seq:
                    await self.channels.open_if_ours(name, channel)
                runtime = self.channels.get(name, channel)
                if (
                    was is not None
                    and state.emptied_at_us != was.emptied_at_us
                    and runtime is not None
                    and runtime.lanes is not None
                ):
                    await runtime.empty()

    async def _run_watch(self) -> None:
        """Every WATCH_INTERVAL_S: follow registry events of other nodes; when nodes joined
        or died, claim every channel's shares again (take a dead node's, hand back a returning
        node's); each pass, look at the claims of the channels this node serves without its
        own share (one handed back is served from then on)."""
        passes = 0
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            passes += 1
            try:
                if await self._registry.moved():
                    await self.refresh_registry()
                nodes = await asyncio.to_thread(self.cluster.live)
                changed = self.cluster.seen(nodes)
                if changed or passes % 10 == 0:
                    await self._recover_dead_journals()
                await self._take_over(nodes, every=changed)
            except Exception:
                log.exception("watching the warehouse's nodes failed (retrying)")

    async def _recover_dead_journals(self) -> None:
        """Journals of processes that died while other nodes ran (under ``admin``: a topic's
        writer is opened once)."""
        journals = await asyncio.to_thread(journal_tokens, self.settings.warehouse)
        nodes = await asyncio.to_thread(self.cluster.live)  # read after the journals
        async with self._registry.admin:
            await asyncio.to_thread(self._recover_journals, journals, nodes)

    async def _take_over(self, nodes: dict[int, NodeRecord], *, every: bool) -> None:
        """Claim again the shares of the channels (``every``: all of them, as nodes joined
        or died; else, each watch pass, those not served here yet or without this node's
        own share: a share handed back to it is served within a pass): take the shares of
        dead nodes, hand back those of nodes that came back."""
        me = self.cluster.me
        # The start's background opening takes the channels not open yet.
        opening = self._opening is not None and not self._opening.done()
        for name, info in list(self.registry.topics.items()):
            for channel in list(info.channels):
                if self._closing:
                    return
                runtime = self.channels.get(name, channel)
                if not every and (
                    (runtime is None and opening)
                    or (
                        runtime is not None
                        and (runtime.lanes is None or me is None or me.lane in runtime.lanes)
                    )
                ):
                    continue
                async with self._registry.admin:
                    if name in self.registry.topics and channel in info.channels:
                        await self.channels.open_if_ours(name, channel, nodes)
        if self._opening is None or self._opening.done():
            self.cluster.log_taken_back()  # else the background opening sums them up at its end
