"""The topics of one node (nsqd's ``Topic``s): a group-commit writer each, and publishing.

A topic is a Delta table; this node appends to it through one ``TopicWriter`` (queue_engine.store
.writer), opened when the node starts or first uses the topic. Admin changes are registry events
(queue_engine.node_registry), committed before they are applied.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from queue_engine.acks import Acks
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.fanout import topic_schema
from queue_engine.headers import Headers
from queue_engine.metrics import PUBLISH_SECONDS
from queue_engine.node_registry import NodeRegistry
from queue_engine.registry import Action, TopicInfo
from queue_engine.settings import AckMode, Settings
from queue_engine.stats import ChannelStats, TopicStats, percentile_ms
from queue_engine.store.delta import (
    ConstraintViolation,
    TableRefusedError,
    WriterClosedError,
    latest_version,
)
from queue_engine.store.journal import (
    Journal,
    JournalClosedError,
    Record,
    app_id,
    read_journal,
    remove_journal,
)
from queue_engine.store.storage import delete_tree, is_remote
from queue_engine.store.tables import (
    CommitStats,
    NoticeWriter,
    TopicWriter,
    Warehouse,
    topic_notice_writer,
)
from queue_engine.store.upkeep import Maintenance
from queue_engine.topic_schema import TopicSchema, evolve, parse_schema

log = logging.getLogger(__name__)

# How long an admin change waits for the publishes acknowledged before it to be committed
# (Topics.settle) before it goes on without them.
SETTLE_TIMEOUT_S = 30.0

# How often a node posts the topics it committed to (while it commits), and how much of that
# a notice keeps: ~5 s of posts, so a fanout trigger slower than that probes every topic.
TOPIC_NOTICE_S = 0.1
TOPIC_NOTICE_BATCHES = 50
TOPIC_NOTICE_TOPICS = 10_000


def drain_linger_s(settings: Settings, warehouse_root: str) -> float:
    """A busy topic's shortest time between commits while its consumers wait, by where its
    table lives."""
    if is_remote(warehouse_root):
        return settings.object_store_drain_linger_ms / 1000
    return settings.drain_linger_ms / 1000


def drain_unwatched_linger_s(settings: Settings, warehouse_root: str) -> float:
    """The same for a topic no consumer waits for: never shorter."""
    return max(drain_linger_s(settings, warehouse_root), settings.drain_unwatched_linger_ms / 1000)


class DrainPacer:
    """How long a topic's journaled publishes may wait before their commit: at least
    ``unwatched_s`` after the topic's previous commit began (or, where the topic was idle,
    after the first of them), and longer the more topics commit, so that the node makes
    about ``commits_per_s`` topic commits a second at most among them (each costs the same
    few ms of CPU however few messages it carries: 1,000 busy topics would otherwise spend the
    node's CPU on commits of one message each; and its file syncs slow the journal's beside
    it).

    A topic for which a consumer began waiting within ``WAITED_S`` (one still waiting says so
    again every few seconds) is not paced: it commits every ``base_s``, and at once after an
    idle spell, ahead of the others; it counts as one busy topic in their pace. After a burst
    to many topics, one whose consumers wait would otherwise see its messages only after
    every busy topic had its turn (10 s at 1,000 topics and 100 commits a second)."""

    WINDOW_S = 2.0
    WAITED_S = 5.0

    def __init__(
        self,
        base_s: float,
        commits_per_s: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        unwatched_s: float,
    ) -> None:
        self.base_s = base_s
        self.unwatched_s = unwatched_s  # drain_unwatched_linger_s: never shorter than base_s
        self.commits_per_s = max(1, commits_per_s)
        self._clock = clock
        self._last: dict[str, float] = {}
        self._counted_at = 0.0
        self._active = 0
        # Topic -> when a consumer last began waiting for its messages (monotonic s).
        self._waited: dict[str, float] = {}
        self._lock = threading.Lock()  # writers' threads ask at once

    def waited(self, topic: str) -> bool:
        """Note that a consumer of ``topic`` waits; True if the topic was paced until now."""
        now = self._clock()
        with self._lock:
            before = self._waited.get(topic)
            self._waited[topic] = now
            return before is None or now - before > self.WAITED_S

    def linger(self, topic: str, idle: bool = False) -> float:
        """How long ``topic``'s publishes wait for their commit: from the previous commit's
        start, or with ``idle`` (the topic was idle until they came) from the first of them.
        An idle topic whose consumers wait commits at once (they see the message at once);
        the others wait as after a commit: 1,000 idle topics that turn busy together would
        else each commit at once, ~1,000 commits in a few seconds that took the CPU
        publishing needed (measured under ``deltaq up``: ~6 ms of CPU a commit)."""
        now = self._clock()
        with self._lock:
            self._last[topic] = now
            # Topics that turn busy together are counted as they come, not only at the next
            # count: otherwise each would linger as if it were one of a few.
            if now - self._counted_at > 0.5 or len(self._last) > self._active * 3 // 2 + 16:
                # Topics that committed lately (counted twice a second, not at every commit).
                window = max(self.WINDOW_S, 2 * self._active / self.commits_per_s)
                self._last = {t: at for t, at in self._last.items() if now - at <= window}
                self._active = len(self._last)
                self._waited = {
                    t: at for t, at in self._waited.items() if now - at <= self.WAITED_S
                }
                self._counted_at = now
            waited = self._waited.get(topic)
            if waited is not None and now - waited <= self.WAITED_S:
                return 0.0 if idle else self.base_s
            return max(self.unwatched_s, self._active / self.commits_per_s)


@dataclass(frozen=True)
class _Journaled:
    """The token of a journaled publish in its topic writer: its journal position."""

    position: int


class Topics:
    def __init__(
        self,
        settings: Settings,
        warehouse: Warehouse,
        registry: NodeRegistry,
        maintenance: Maintenance,
        acks: Acks,
        *,
        lane: int | None,
    ) -> None:
        self.settings = settings
        self.warehouse = warehouse
        self._registry = registry
        self._maintenance = maintenance
        self._acks = acks
        self._lane = lane
        self._writers: dict[str, TopicWriter] = {}
        # Each topic's publish-duration histogram (looking a label up costs more than observing).
        self._histograms: dict[str, Any] = {}
        # Topics committed to since the last topic notice (writer threads add, the loop posts).
        self._written: set[str] = set()
        self._written_lock = threading.Lock()
        self._notices: NoticeWriter | None = None
        self._notice_task: asyncio.Task[None] | None = None
        # The node journal (ack = "journal"), once started.
        self.journal: Journal | None = None
        self._pacer = DrainPacer(
            drain_linger_s(settings, warehouse.root),
            settings.drain_max_commits_per_s,
            unwatched_s=drain_unwatched_linger_s(settings, warehouse.root),
        )
        self.closing = False

    # -- writers --------------------------------------------------------------------------

    def get(self, name: str) -> TopicWriter | None:
        return self._writers.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._writers

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._writers))

    def open(self, name: str) -> TopicWriter:
        """Open the topic's writer (blocking)."""
        writer = TopicWriter(
            self.warehouse.topic_path(name),
            functools.partial(self._committed, name),
            commit_max_bytes=self.settings.commit_max_bytes,
            name=name,
            id_lane=self._lane or 0,
            schema_of=functools.partial(self.schema, name),
        )
        self._journaled(name, writer)
        self._writers[name] = writer
        self._maintenance.watch(writer.path)
        return writer

    async def writer(self, name: str) -> TopicWriter:
        """The topic's writer, opened if this node has none yet (a topic another node created
        has none here until this node uses it). With ``admin`` held."""
        writer = self._writers.get(name)
        if writer is None:
            writer = await asyncio.to_thread(self.open, name)
        return writer

    async def drop(self, name: str) -> None:
        """Stop the topic's writer (deleted, or replaced by another node)."""
        writer = self._writers.pop(name, None)
        if writer is not None:
            self._maintenance.unwatch(writer.path)
            await asyncio.to_thread(writer.close)

    async def close(self) -> None:
        """Commit everything pending, then stop every writer."""
        self.closing = True
        if self._notice_task is not None:
            self._notice_task.cancel()
        await asyncio.to_thread(self.stop_journal)
        writers = list(self._writers.values())
        self._writers.clear()
        await asyncio.to_thread(_close_all, writers)
        if self.journal is not None:
            # Everything journaled is committed now, unless a commit kept failing.
            await asyncio.to_thread(self.journal.remove_if_drained)

    def checkpointed(self, path: str) -> None:
        for writer in list(self._writers.values()):
            if writer.path == path:
                writer.request_reopen()

    # -- publishing -----------------------------------------------------------------------

    async def start_publish(
        self,
        topic: str,
        bodies: list[bytes],
        defer_ms: int | None = None,
        ttl_ms: int | None = None,
        headers: list[Headers | None] | None = None,
    ) -> asyncio.Future[None]:
        """Start appending ``bodies`` to ``topic`` (created if needed); the future is done
        once they are acknowledged. Only creating the topic waits: publishes started one after
        the other reach the journal (and their topic) in that order.

        ``ttl_ms``: the messages are not delivered that long after publishing (it replaces the
        topic's TTL for them). ``headers``: one entry per body (None: no message has any).

        With ``ack = "journal"`` acknowledged means in the node journal; with ``"commit"``,
        in the topic's Delta commit; with ``"buffer"``, queued for the next commit (unless the
        buffer is full: then the publisher waits for the commit, backpressure).
        """
        if self.closing:
            raise QueueError(ErrorCode.EXITING)
        started = time.perf_counter()
        writer = self._writers.get(topic) or await self.create(topic)
        schema = self.schema(topic)
        if schema is not None:
            # INVALID_BODY names the first body that does not fit. The writer makes the
            # columns of a whole commit at once from the bodies, off this loop; the schema
            # goes with them, saying that they fit it.
            schema.check(bodies)
        refusal = writer.refusal()
        if refusal is not None:
            raise QueueError(ErrorCode.E_TABLE_REFUSED, refusal.reason)
        published_at_us = time.time_ns() // 1000
        deliver_at_us = published_at_us + defer_ms * 1000 if defer_ms else None
        expires_at_us = published_at_us + ttl_ms * 1000 if ttl_ms else None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(functools.partial(self._observe, topic, started))
        mode = self.settings.ack
        backlog = writer.pending_bytes >= self.settings.buffer_max_bytes
        journal = self.journal
        if mode is AckMode.JOURNAL and journal is not None and not backlog and not writer.validates:
            try:
                journal.append(
                    topic,
                    bodies,
                    published_at_us,
                    deliver_at_us,
                    expires_at_us,
                    done,
                    headers,
                    schema,
                )
            except JournalClosedError as exc:
                raise QueueError(ErrorCode.EXITING, str(exc)) from exc
            return done
        # ack = "commit"; or the topic's writer is behind by buffer_max_bytes (backpressure);
        # or only the commit can tell whether the table takes the rows (``validates``).
        wait = mode is not AckMode.BUFFER or backlog
        try:
            writer.submit_publish(
                bodies,
                published_at_us,
                deliver_at_us,
                done if wait else None,
                expires_at_us,
                headers=headers,
                checked=schema,
            )
        except WriterClosedError as exc:
            raise QueueError(ErrorCode.EXITING, str(exc)) from exc
        if writer.validates and not backlog and writer.linger is not None:
            # A publisher waits for this commit: the topic commits as one its consumers wait
            # for does (drain_linger_ms), not as an unwatched one.
            self.consumer_waiting(topic)
        if not wait:
            done.set_result(None)
        return done

    def _observe(self, topic: str, started: float, _: object) -> None:
        histogram = self._histograms.get(topic)
        if histogram is None:
            histogram = self._histograms[topic] = PUBLISH_SECONDS.labels(topic)
        histogram.observe(time.perf_counter() - started)

    def _committed(self, name: str, tokens: list[Any], error: BaseException | None) -> None:
        if error is None:
            with self._written_lock:
                self._written.add(name)
        journaled = [t.position for t in tokens if isinstance(t, _Journaled)]
        if journaled:
            tokens = [t for t in tokens if not isinstance(t, _Journaled)]
            if isinstance(error, ConstraintViolation):
                # Acknowledged before a constraint that refuses them was added to the table.
                log.error("dropped %d journaled publishes to %s: %s", len(journaled), name, error)
            if (error is None or isinstance(error, ConstraintViolation)) and self.journal:
                self.journal.drained(journaled)
            # Else the node stops with them uncommitted: the journal keeps them.
        if tokens:
            self._acks.committed(tokens, error)

    def consumer_waiting(self, topic: str) -> None:
        """A consumer on this node waits for ``topic``'s messages: its commits go first (see
        DrainPacer), including one already waiting out a longer linger."""
        if self._pacer.waited(topic):
            writer = self._writers.get(topic)
            if writer is not None:
                writer.hurry()

    # -- the node journal -------------------------------------------------------------------

    def settle(self, writer: TopicWriter) -> None:
        """Wait until every publish acknowledged before this call is committed to its table
        (blocking). A journaled publish is answered before the journal's thread hands it to
        its writer, so the hand-off is waited for first."""
        if self.journal is not None and not self.journal.wait_handed_on(SETTLE_TIMEOUT_S):
            log.warning(
                "the journal has not handed its publishes on in %.0f s; going on", SETTLE_TIMEOUT_S
            )
        if not writer.wait_settled(SETTLE_TIMEOUT_S):
            log.warning(
                "%s: its acknowledged publishes are not committed after %.0f s; going on",
                writer.path,
                SETTLE_TIMEOUT_S,
            )

    def _journaled(self, name: str, writer: TopicWriter) -> None:
        """Once the journal runs: the writer's commits record the journal's app transaction,
        and linger (its publishes are durable before they reach it)."""
        if self.journal is not None:
            writer.journal_app_id = self.journal.app_id
            writer.linger = functools.partial(self._pacer.linger, name)

    def start_journal(self, token: str) -> None:
        """Journal publishes from now on (ack = "journal")."""
        self.journal = Journal(
            self.settings.warehouse,
            token,
            self._durable,
            segment_bytes=self.settings.journal_segment_bytes,
        )
        for name, writer in list(self._writers.items()):
            # Opened before (recovering a dead process's journal at start).
            self._journaled(name, writer)

    def _durable(
        self, records: list[Record], tokens: list[Any], error: BaseException | None
    ) -> None:
        """The journal's thread: a write is durable (or failed). Acknowledge its publishes and
        hand them to their topics' writers."""
        journal = self.journal
        assert journal is not None
        # The answers first: the journal holds the publishes whatever happens to their hand-off,
        # and each publisher's round trip is what bounds a connection that waits for its OK.
        self._acks.committed(tokens, error)
        if error is None:
            gone = []
            for record in records:
                writer = self._writers.get(record.topic)
                try:
                    if writer is None:
                        raise WriterClosedError(record.topic)
                    writer.submit_publish(
                        record.bodies,
                        record.published_at_us,
                        record.deliver_at_us,
                        _Journaled(record.position),
                        record.expires_at_us,
                        position=record.position,
                        headers=record.headers,
                        checked=record.checked,
                    )
                except WriterClosedError:
                    # Deleted since (dropped with its topic, as nsqd drops them); or the node
                    # stops (kept: the next start commits it).
                    if record.topic not in self._registry.registry.topics:
                        gone.append(record.position)
            if gone:
                journal.drained(gone)

    def recover(self, token: str) -> int:
        """Commit what the journal of a stopped process (``token``) holds and its topics' tables
        do not, then remove the journal (blocking). Returns how many messages were committed."""
        recovered = read_journal(self.settings.warehouse, token)
        for line in recovered.torn:
            log.warning("journal: %s (every publish before it is kept)", line)
        by_topic: dict[str, list[Record]] = collections.defaultdict(list)
        for record in recovered.records:
            by_topic[record.topic].append(record)
        committed = dropped = 0
        for topic, records in by_topic.items():
            if topic not in self._registry.registry.topics:
                dropped += len(records)
                continue
            writer = self._writers.get(topic) or self.open(topic)
            committed += writer.commit_recovered(records, app_id(token))
        remove_journal(self.settings.warehouse, token)
        if recovered.records:
            log.info(
                "journal %s recovered: %d publishes, %d messages committed, %d of deleted topics",
                token,
                len(recovered.records),
                committed,
                dropped,
            )
        return committed

    def stop_journal(self) -> None:
        """Write what the journal has queued and stop it (blocking)."""
        if self.journal is not None:
            self.journal.close()

    def start_notices(self) -> None:
        self._notice_task = asyncio.get_running_loop().create_task(self._post_notices())

    async def _post_notices(self) -> None:
        """Tell the fanout which topics got commits, every TOPIC_NOTICE_S while any do: over
        many topics it probes those instead of every topic's log."""
        self._notices = await asyncio.to_thread(
            NoticeWriter,
            self.settings.warehouse,
            topic_notice_writer(self._lane),
            keep_batches=TOPIC_NOTICE_BATCHES,
            keep_channels=TOPIC_NOTICE_TOPICS,
        )
        while True:
            await asyncio.sleep(TOPIC_NOTICE_S)
            with self._written_lock:
                written, self._written = self._written, set()
            if written:
                # post() never raises: a lost notice costs the fanout latency, not messages.
                await asyncio.to_thread(self._notices.post, [(t, "") for t in written])

    # -- admin ----------------------------------------------------------------------------

    async def create(self, name: str) -> TopicWriter:
        """The topic's writer; the topic is created if it does not exist (nsqd's GetTopic)."""
        nr = self._registry
        async with nr.admin:
            writer = self._writers.get(name)
            if writer is not None:
                return writer
            await nr.reload_if_moved(name not in nr.registry.topics)
            if name not in nr.registry.topics:
                cap = self.settings.max_topics
                if cap and len(nr.registry.topics) >= cap:
                    raise QueueError(ErrorCode.E_TOO_MANY_TOPICS, f"{cap} topics (max_topics)")
                await nr.record(Action.TOPIC_CREATE, name)
            try:
                return await asyncio.to_thread(self.open, name)
            except TableRefusedError as exc:  # a damaged log (TableDamagedError)
                raise QueueError(ErrorCode.E_TABLE_REFUSED, exc.reason) from exc

    async def remove(self, name: str) -> None:
        """After its delete is recorded and its channels here are stopped: stop the topic's
        writer and remove its tables."""
        await self.drop(name)
        await asyncio.to_thread(delete_tree, self.warehouse.topic_path(name))
        await asyncio.to_thread(delete_tree, self.warehouse.channels_root(name))

    async def pause(self, name: str, paused: bool) -> None:
        nr = self._registry
        async with nr.admin:
            await nr.reload_if_moved(name not in nr.registry.topics)
            nr.registry.existing_topic(name)
            await nr.record(Action.TOPIC_PAUSE if paused else Action.TOPIC_UNPAUSE, name)

    async def empty(self, name: str, *, shared: bool) -> None:
        """nsqd's /topic/empty: what no channel took yet is dropped (``shared``: other nodes
        commit to the topic too)."""
        nr = self._registry
        async with nr.admin:
            await nr.reload_if_moved(name not in nr.registry.topics)
            nr.registry.existing_topic(name)
            writer = await self.writer(name)
            # What was acknowledged before the empty (journaled, not committed yet) goes too.
            await asyncio.to_thread(self.settle, writer)
            stats = writer.stats()
            version = stats.version
            if shared:
                # Other nodes commit to the topic too: empty up to the newest version.
                version = await asyncio.to_thread(latest_version, writer.path, version)
            await nr.record(
                Action.TOPIC_EMPTY,
                name,
                topic_version=version,
                topic_messages=stats.message_count,
            )

    async def configure(self, name: str, options: dict[str, Any]) -> None:
        """Change the topic's settings named in ``options`` (``ttl_ms``, ``retention_hours``,
        ``retention``; a None value: back to the settings' default). Recorded only if
        something changes."""
        nr = self._registry
        async with nr.admin:
            await nr.reload_if_moved(name not in nr.registry.topics)
            info = nr.registry.existing_topic(name)
            changed = {k: v for k, v in options.items() if getattr(info, k) != v}
            if changed:
                await nr.record(Action.TOPIC_CONFIGURE, name, options=changed)

    def schema(self, name: str) -> TopicSchema | None:
        """The topic's declared schema (None: untyped, or no such topic)."""
        return topic_schema(self._registry.registry, name)

    async def declare_schema(self, name: str, text: str) -> None:
        """Give the topic a schema, or evolve the one it has (SCHEMA_CHANGE_REFUSED if its
        rows could not follow). The table gains the columns before the schema is recorded:
        a crash in between leaves columns no row fills, never rows without their columns."""
        schema = parse_schema(text)
        nr = self._registry
        async with nr.admin:
            await nr.reload_if_moved(name not in nr.registry.topics)
            info = nr.registry.existing_topic(name)
            old = None if info.schema is None else parse_schema(info.schema)
            evolve(old, schema)
            if old is not None and old.ddl == schema.ddl:
                return
            writer = await self.writer(name)
            await asyncio.to_thread(writer.declare, schema)
            await nr.record(Action.TOPIC_CONFIGURE, name, options={"schema": schema.ddl})

    def ttl_ms(self, name: str) -> int:
        info = self._registry.registry.existing_topic(name)
        return self.settings.message_ttl_ms if info.ttl_ms is None else info.ttl_ms

    # -- stats ----------------------------------------------------------------------------

    def writer_stats(self, name: str) -> CommitStats:
        writer = self._writers.get(name)
        if writer is None:
            return CommitStats(
                version=-1, message_count=0, commits=0, committed_messages=0, committed_bytes=0
            )
        return writer.stats()

    def stats(
        self,
        info: TopicInfo,
        channels: list[ChannelStats],
        fanned: int,
        *,
        latencies: bool = True,
    ) -> TopicStats:
        """nsqd's figures of one topic. ``fanned``: the newest topic version the fanout put in
        any of its channels (-1: none); without ``latencies`` the commit percentiles are 0."""
        stats = self.writer_stats(info.name)
        writer = self._writers.get(info.name)
        durations = sorted(writer.commit_seconds) if writer is not None and latencies else []
        refusal = writer.refusal() if writer is not None else None
        return TopicStats(
            name=info.name,
            paused=info.paused,
            depth=self._depth(info, stats, fanned) + stats.queued,
            message_count=stats.message_count + stats.queued,
            message_bytes=stats.committed_bytes,
            commits=stats.commits,
            version=stats.version,
            channels=channels,
            commit_p50_ms=percentile_ms(durations, 0.50),
            commit_p99_ms=percentile_ms(durations, 0.99),
            refused=refusal.reason if refusal is not None else None,
            data_version=stats.data_version,
            schema=info.schema,
        )

    def _depth(self, info: TopicInfo, stats: CommitStats, fanned: int) -> int:
        """Messages no channel has taken yet (nsqd's topic depth): those committed after the
        newest topic version the fanout has put in any of the topic's channels, and after the
        last /topic/empty. A topic without channels keeps everything (nsqd buffers them)."""
        writer = self._writers.get(info.name)
        if writer is None:
            return 0
        taken = writer.messages_through(fanned) if fanned >= 0 else 0
        return max(0, stats.message_count - max(taken, info.empty_message_count))


def _close_all(writers: list[TopicWriter]) -> None:
    for writer in writers:
        writer.close()
