"""The channels of one node (nsqd's ``Channel``s): the ones it serves, and their admin.

Every node serves every channel: its shares of it (queue_engine.shares), as one
``ChannelRuntime`` (queue_engine.channel) ticked by the pump (queue_engine.pump). Which node
holds which share is decided by the channel's claims (queue_engine.cluster); a FIN, REQ or
TOUCH of messages of a share another live node holds answers ``ChannelElsewhereError``
(redirected there).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from queue_engine.acks import Acks
from queue_engine.channel import ChannelRuntime
from queue_engine.channel_filter import compile_filter
from queue_engine.channel_queue import Answer, Delivery
from queue_engine.cluster import Membership
from queue_engine.errors import ChannelElsewhereError, ErrorCode, QueueError
from queue_engine.fanout import fields_of, topic_schema
from queue_engine.node_registry import NodeRegistry
from queue_engine.pump import Pump
from queue_engine.registry import Action, RegistryEvent
from queue_engine.replay import Bound, ReplayResult, run_replay
from queue_engine.settings import Settings
from queue_engine.shares import Holder, changed, lane_of, served_by
from queue_engine.stats import ChannelStats
from queue_engine.store.coordination import NodeRecord
from queue_engine.store.delta import latest_version
from queue_engine.store.storage import delete_tree
from queue_engine.store.tables import Warehouse
from queue_engine.store.upkeep import Maintenance
from queue_engine.topics import Topics

log = logging.getLogger(__name__)

# A move that raced a delete or another move is decided again this many times.
_RACE_RETRIES = 20


class Channels:
    def __init__(
        self,
        settings: Settings,
        warehouse: Warehouse,
        registry: NodeRegistry,
        topics: Topics,
        cluster: Membership,
        maintenance: Maintenance,
        acks: Acks,
    ) -> None:
        self.settings = settings
        self.warehouse = warehouse
        self._registry = registry
        self._topics = topics
        self._cluster = cluster
        self._maintenance = maintenance
        self._acks = acks
        self._open: dict[tuple[str, str], ChannelRuntime] = {}
        self.pump = Pump(settings.warehouse, self._open)
        self.closing = False

    def get(self, topic: str, channel: str) -> ChannelRuntime | None:
        return self._open.get((topic, channel))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._open

    def items(self) -> Iterator[tuple[tuple[str, str], ChannelRuntime]]:
        return iter(list(self._open.items()))

    # -- serving --------------------------------------------------------------------------

    async def runtime(self, topic: str, channel: str, *, create: bool = False) -> ChannelRuntime:
        """The channel's runtime on this node, serving the shares it holds (opened if needed).
        ``create``: the topic and the channel are created if needed (nsqd's GetTopic +
        GetChannel)."""
        runtime = self._open.get((topic, channel))
        if runtime is not None:
            return runtime
        if self.closing:
            raise QueueError(ErrorCode.EXITING)
        if create:
            if topic not in self._topics:
                await self._topics.create(topic)
            await self.create(topic, channel)
        else:
            await self.known(topic, channel)
        return await self._adopt(topic, channel)

    async def known(self, topic: str, channel: str) -> None:
        """CHANNEL_NOT_FOUND unless the channel exists, after reading the registry again if
        another node may have created it."""
        nr = self._registry
        info = nr.registry.topics.get(topic)
        if info is None or channel not in info.channels:
            async with nr.admin:
                await nr.reload_if_moved(True)
        nr.registry.existing_channel(topic, channel)

    async def _adopt(self, topic: str, channel: str) -> ChannelRuntime:
        async with self._registry.admin:
            runtime = self._open.get((topic, channel))
            if runtime is not None:
                return runtime
            self._registry.registry.existing_channel(topic, channel)
            return await self.serve_shares(topic, channel)

    async def open_if_ours(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None = None
    ) -> bool:
        """Serve the channel's shares this node should hold (under ``admin``); False if it
        holds none."""
        runtime = await self.serve_shares(topic, channel, nodes)
        return runtime.lanes is None or bool(runtime.lanes)

    async def serve_shares(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None = None
    ) -> ChannelRuntime:
        """Claim the channel's shares as queue_engine.shares.plan says, and serve what the
        claim names this node for (under ``admin``). Shares handed away stop being served
        here before the claim naming their new holder is written; shares taken are served
        only after the claim naming this node is. ``nodes``: the live nodes, if just read."""
        me = self._cluster.me
        if me is None:
            return await self._serve(topic, channel, None)
        for _ in range(_RACE_RETRIES):
            claim, after = await asyncio.to_thread(self._cluster.plan, topic, channel, nodes)
            before = claim.shares if claim is not None else {}
            mine = served_by(after, me)
            if not changed(before, after):
                return await self._serve(topic, channel, mine)
            runtime = self._open.get((topic, channel))
            if runtime is not None and runtime.lanes is not None and runtime.lanes - mine:
                await self._serve(topic, channel, runtime.lanes & mine)
            if await asyncio.to_thread(self._cluster.write, topic, channel, claim, after):
                # A share handed back is served by its node at its next watch pass, which
                # looks at the claims of every channel it serves without its own share.
                return await self._serve(topic, channel, mine)
            nodes = None  # another node claimed first: decide again on a fresh view
        raise QueueError(ErrorCode.INTERNAL_ERROR, f"could not claim {topic}/{channel}")

    async def _serve(
        self, topic: str, channel: str, lanes: frozenset[int] | None
    ) -> ChannelRuntime:
        """The channel served here for ``lanes``: the runtime serving them, else a new one
        that the old one (other lanes) hands its consumers on to. The old one closes first,
        so its last ledger commits are in the tables the new one restores from."""
        key = (topic, channel)
        old = self._open.get(key)
        if old is not None and old.lanes == lanes:
            return old
        if old is not None:
            await self.stop(topic, channel, handing_on=True)
        runtime = ChannelRuntime(
            topic,
            channel,
            self.warehouse.channel_messages_path(topic, channel),
            self.warehouse.channel_ledger_path(topic, channel),
            self.warehouse.channel_dead_path(topic, channel),
            state_path=self.warehouse.channel_state_path(topic, channel),
            max_attempts=self.max_attempts(topic, channel),
            ttl_ms=self._topics.ttl_ms(topic),
            expired_dead=self.settings.expired_to_dead_letters,
            scan_leases=self.settings.scan_leases,
            mem_queue_size=self.settings.mem_queue_size,
            ledger_linger_ms=self.settings.ledger_linger_ms,
            max_lease_us=self.settings.max_msg_timeout_ms * 1000,
            is_paused=lambda: self._paused(topic, channel),
            notify=self._acks.committed,
            on_waiting=self._waiting,
            on_leased=self.pump.leased,
            lanes=lanes,
            schema_of=functools.partial(self._topics.schema, topic),
        )
        try:
            await runtime.start()
        except BaseException:
            if old is not None:
                old.hand_on(None)
            raise
        self._open[key] = runtime
        self.pump.add(runtime)
        self._maintenance.watch(runtime.ledger_path)
        if old is not None:
            old.hand_on(runtime)
            log.info(
                "%s/%s: now serving lanes %s here",
                topic,
                channel,
                "all" if lanes is None else sorted(lanes),
            )
        return runtime

    async def stop(self, topic: str, channel: str, *, handing_on: bool = False) -> None:
        """Stop serving the channel here (its tables stay). ``handing_on``: another runtime
        takes over (its consumers wait for it), else they are told the channel stopped."""
        runtime = self._open.pop((topic, channel), None)
        if runtime is not None:
            self.pump.forget(runtime)
            self._maintenance.unwatch(runtime.ledger_path)
            try:
                await runtime.close()
            finally:
                if not handing_on:
                    runtime.hand_on(None)

    async def stop_topic(self, topic: str) -> None:
        for key in [k for k in self._open if k[0] == topic]:
            await self.stop(*key)

    async def close(self) -> None:
        self.closing = True
        self.pump.stop()
        for runtime in list(self._open.values()):
            await runtime.close()
            runtime.hand_on(None)
        self._open.clear()

    def wake_all_closed(self) -> None:
        """The server stops: waiting consumers answer now."""
        for runtime in self._open.values():
            runtime.closed = True
            asyncio.get_running_loop().create_task(runtime.wake())

    def checkpointed(self, path: str) -> None:
        for runtime in list(self._open.values()):
            if runtime.ledger_path == path:
                runtime.request_reopen()

    def _waiting(self, runtime: ChannelRuntime) -> None:
        """A consumer waits on ``runtime``: tick it often, and commit its topic soon."""
        self.pump.heat(runtime)
        self._topics.consumer_waiting(runtime.topic)

    def _paused(self, topic: str, channel: str) -> bool:
        info = self._registry.registry.topics.get(topic)
        state = info.channels.get(channel) if info is not None else None
        return state is None or state.paused

    def max_attempts(self, topic: str, channel: str) -> int:
        info = self._registry.registry.existing_channel(topic, channel)
        return self.settings.max_attempts if info.max_attempts is None else info.max_attempts

    async def answering(self, topic: str, channel: str, answers: list[Answer]) -> ChannelRuntime:
        """The runtime that answers FIN, REQ or TOUCH of ``answers``. Leases of messages of a
        share held by another live node, none of them served here, are answered there
        (``ChannelElsewhereError``)."""
        runtime = await self.runtime(topic, channel)
        if answers and not any(runtime.serves(a.id) for a in answers):
            holder = self._cluster.elsewhere(topic, channel, lane_of(answers[0].id))
            if holder is not None:
                raise ChannelElsewhereError(holder.http_url, holder.tcp_address)
        return runtime

    async def subscribe(
        self, topic: str, channel: str, *, limit: int, wait_s: float, lease_us: int, consumer: str
    ) -> list[Delivery]:
        runtime = await self.runtime(topic, channel, create=True)
        return await runtime.sub(limit, wait_s, lease_us, consumer)

    # -- admin ----------------------------------------------------------------------------

    async def create(self, topic: str, channel: str, filter_text: str | None = None) -> bool:
        """Create ``channel``: it receives every message committed to ``topic`` from now on
        (and, if it is the topic's only channel, what the topic buffered before it); with
        ``filter_text``, only those it matches (queue_engine.channel_filter), from its first
        message on. False if the channel existed (nothing changed)."""
        nr = self._registry
        async with nr.admin:
            known = nr.registry.topics.get(topic)
            await nr.reload_if_moved(known is None or channel not in known.channels)
            info = nr.registry.existing_topic(topic)
            if channel in info.channels:
                return False
            if filter_text is not None:
                # A typed field it names must be the topic's (checked again under the lock).
                compile_filter(filter_text, fields_of(topic_schema(nr.registry, topic)))
            cap = self.settings.max_channels_per_topic
            if cap and len(info.channels) >= cap:
                raise QueueError(
                    ErrorCode.E_TOO_MANY_CHANNELS, f"{cap} channels (max_channels_per_topic)"
                )
            await self._record_at_topic_version(
                Action.CHANNEL_CREATE,
                topic,
                channel,
                None if filter_text is None else {"filter": filter_text},
            )
            # Another node may have created it first (its creation won; ours was ignored):
            # the filter asked for is set from now on.
            made = nr.registry.existing_channel(topic, channel)
            if made.filter != filter_text and filter_text is not None:
                await self._record_at_topic_version(
                    Action.CHANNEL_CONFIGURE, topic, channel, {"filter": filter_text}
                )
            await self.open_if_ours(topic, channel)
        return True

    async def delete(self, topic: str, channel: str) -> None:
        # On the channel's node: only its owner may stop it and remove its tables.
        await self.runtime(topic, channel)
        async with self._registry.admin:
            self._registry.registry.existing_channel(topic, channel)
            await self._record_at_topic_version(Action.CHANNEL_DELETE, topic, channel)
            await self.stop(topic, channel)
            await asyncio.to_thread(delete_tree, self.warehouse.channel_root(topic, channel))
            await asyncio.to_thread(self._cluster.forget, topic, channel)

    async def _record_at_topic_version(
        self, action: Action, topic: str, channel: str, options: dict[str, Any] | None = None
    ) -> None:
        """Record a channel event stamped with the topic version, with no topic commit between
        reading that version and committing the event.

        The fanout decides from the registry which channels get a topic version; if a message
        could be committed after the version was read but before the event, a fanout batch could
        see the message without the channel, and the channel would miss it.
        """
        nr = self._registry
        writer = await self._topics.writer(topic)
        shared = not self._cluster.alone

        def record() -> RegistryEvent:
            info = nr.registry.existing_topic(topic)
            # Publishes acknowledged before this call (journaled, not yet committed) are in
            # the topic before the channel's start: a channel gets what is published after it.
            self._topics.settle(writer)
            with writer.exclusive():
                version = writer.stats().version
                if shared:
                    # Other nodes commit to the topic too: from the newest version on.
                    version = latest_version(writer.path, version)
                start = version
                if action is Action.CHANNEL_CREATE:
                    start = nr.registry.first_channel_start(info, version)
                event = nr.event(
                    action,
                    info.name,
                    channel,
                    topic_version=start,
                    topic_messages=writer.stats().message_count,
                    options=options,
                )
                nr.store.append(event)
                return event

        await nr.commit(record)

    async def pause(self, topic: str, channel: str, paused: bool) -> None:
        await self.runtime(topic, channel)
        async with self._registry.admin:
            self._registry.registry.existing_channel(topic, channel)
            action = Action.CHANNEL_PAUSE if paused else Action.CHANNEL_UNPAUSE
            await self._registry.record(action, topic, channel)
        runtime = self._open.get((topic, channel))
        if runtime is not None and not paused:
            await runtime.wake()

    async def configure(self, topic: str, channel: str, *, max_attempts: int | None) -> None:
        """Set the channel's max_attempts (None: back to the settings' default)."""
        await self.runtime(topic, channel)
        async with self._registry.admin:
            info = self._registry.registry.existing_channel(topic, channel)
            if info.max_attempts != max_attempts:
                await self._registry.record(
                    Action.CHANNEL_CONFIGURE,
                    topic,
                    channel,
                    options={"max_attempts": max_attempts},
                )
        runtime = self._open.get((topic, channel))
        if runtime is not None:
            runtime.set_max_attempts(self.max_attempts(topic, channel))

    async def set_filter(self, topic: str, channel: str, filter_text: str | None) -> None:
        """The channel's filter for the messages committed from now on (None: every message).
        Recorded at the topic's version, as a channel's creation: the fanout routes each row
        by the filter of its version, whenever it gets to it (a replayed batch as the first)."""
        await self.runtime(topic, channel)
        async with self._registry.admin:
            info = self._registry.registry.existing_channel(topic, channel)
            if filter_text is not None:
                registry = self._registry.registry
                compile_filter(filter_text, fields_of(topic_schema(registry, topic)))
            if info.filter != filter_text:
                await self._record_at_topic_version(
                    Action.CHANNEL_CONFIGURE, topic, channel, {"filter": filter_text}
                )

    def apply_settings(self, topic: str) -> None:
        """The topic's settings changed: its channels here follow."""
        for (name, channel), runtime in self.items():
            if name == topic:
                runtime.set_ttl(self._topics.ttl_ms(topic))
                runtime.set_max_attempts(self.max_attempts(topic, channel))

    async def redrive(self, topic: str, channel: str, ids: list[str] | None) -> int:
        """Dead letters of the channel (``ids``, or all) become ready with attempts reset."""
        return await (await self.runtime(topic, channel)).redrive(ids)

    async def replay(
        self, topic: str, channel: str, start: Bound, end: Bound | None, replay_id: str
    ) -> ReplayResult:
        """Copies of the topic's messages of a range of versions, for ``channel`` only
        (queue_engine.replay); returns once they are committed to the topic."""
        await self.known(topic, channel)
        writer = self._topics.get(topic) or await self._topics.create(topic)
        limit = self.settings.max_replay_messages
        return await asyncio.to_thread(run_replay, writer, channel, start, end, replay_id, limit)

    async def empty(self, topic: str, channel: str) -> int:
        """Drop every message the channel holds: the shares served here now, the others' on
        their nodes as they follow the registry event; returns how many were dropped here."""
        runtime = await self.runtime(topic, channel)
        async with self._registry.admin:
            self._registry.registry.existing_channel(topic, channel)
            await self._registry.record(Action.CHANNEL_EMPTY, topic, channel)
        return await runtime.empty()

    async def move(self, topic: str, channel: str, lane: int) -> str:
        """Hand the shares of the channel this node holds to the live node in ``lane``,
        pinned there (not handed back to their own lanes' nodes); returns that node's URL.

        This node stops serving them first, so its last ledger commits land before the claim
        naming the new holder does; that node then restores them from the tables as a restart
        would. Waiting SUBs answer empty and TCP consumers here carry on with what is left
        (nothing, until a share comes back); the leases stay in the ledger, so what they hold
        is FIN'd at the new holder (HTTP: redirected there) or times out there."""
        me = self._cluster.me
        await self.known(topic, channel)
        target = await asyncio.to_thread(self._cluster.target, lane)
        assert me is not None
        if target.lane == me.lane:
            await self.runtime(topic, channel)
            return me.http_url
        for _ in range(_RACE_RETRIES):
            async with self._registry.admin:
                self._registry.registry.existing_channel(topic, channel)
                claim = await asyncio.to_thread(self._cluster.claim_of, topic, channel)
                before = claim.shares if claim is not None else {}
                mine = served_by(before, me)
                after = {
                    share: Holder.of(target, pinned=True) if share in mine else holder
                    for share, holder in before.items()
                }
                await self._serve(topic, channel, frozenset())
                if not await asyncio.to_thread(self._cluster.write, topic, channel, claim, after):
                    await self.serve_shares(topic, channel)
                    continue  # another claim came first: decide again
                log.info(
                    "node %d moved channel %s/%s lanes %s to node %d",
                    me.lane,
                    topic,
                    channel,
                    sorted(mine),
                    lane,
                )
                try:
                    await self._registry.record(
                        Action.CHANNEL_MOVE,
                        topic,
                        channel,
                        options={"lane": target.lane, "http_url": target.http_url},
                    )
                except Exception:
                    # The claim is the move; the event only hastens it (the new holder's
                    # watch finds the claim within ten watch passes otherwise).
                    log.exception("recording the move of %s/%s failed", topic, channel)
                return target.http_url
        raise QueueError(ErrorCode.INTERNAL_ERROR, f"could not move {topic}/{channel}")

    # -- stats ----------------------------------------------------------------------------

    def fanned(self, topic: str, channels: Iterable[str]) -> int:
        """The newest topic version the fanout put in any of ``channels`` served here."""
        return max(
            (
                runtime.fanned_topic_version
                for name in channels
                if (runtime := self._open.get((topic, name))) is not None
            ),
            default=-1,
        )

    def stats(self, topic: str, channel: str, paused: bool) -> ChannelStats:
        runtime = self._open.get((topic, channel))
        known = self._registry.registry.topics.get(topic)
        info = None if known is None else known.channels.get(channel)
        filter_text = None if info is None else info.filter
        if runtime is None:
            return ChannelStats(
                name=channel,
                paused=paused,
                node=self._cluster.served_elsewhere(topic, channel),
                filter=filter_text,
            )
        counts = runtime.counts()
        return ChannelStats(
            name=channel,
            paused=paused,
            filter=filter_text,
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
            filtered_count=counts.filtered_count,
            max_attempts=runtime.max_attempts,
            table_version=counts.table_version,
            ledger_version=counts.ledger_version,
            node=self._cluster.url
            if runtime.lanes is None or runtime.lanes
            else self._cluster.served_elsewhere(topic, channel),
            lanes=None if runtime.lanes is None else tuple(sorted(runtime.lanes)),
        )
