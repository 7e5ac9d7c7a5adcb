"""Serving one channel to consumers: long-poll SUB, FIN/REQ/TOUCH, timeouts (asyncio side).

``ChannelRuntime`` joins the pure queue (``ChannelQueue``, the fold of the ledger) with the
tables: it rebuilds the queue from the ledger and the messages table when it starts, reads the
messages table a window at a time, follows its tail, and writes every lease event to the
ledger before the request that caused it is answered. All queue changes happen on the event
loop thread, in event-time order, so memory is always the fold of the ledger it has written.

If a ledger commit fails, the requests it carried get E_COMMIT_FAILED and the runtime rebuilds
its queue from the tables: memory never keeps a change the ledger does not have.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass

import pyarrow as pa

from queue_engine.channel_queue import ChannelQueue, Delivery
from queue_engine.channel_restore import add_rows, expires_at, headers_of, restore_channel
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.headers import Headers
from queue_engine.lease import EventKind, LeaseEvent
from queue_engine.shares import lane_of
from queue_engine.store.delta import WriterClosedError, commit_file, conform
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    ChannelReader,
    DeadLetterStore,
    LedgerWriter,
    LoopLedgerWriter,
    is_sweep_commit,
    open_ledger_writer,
    read_versions,
)
from queue_engine.topic_schema import TopicSchema

# What a body lookup needs of a row (the channel table's and the dead-letter table's).
_BODY_SCHEMA = pa.schema(
    [
        CHANNEL_MESSAGES_SCHEMA.field(c)
        for c in ("id", "body", "published_at", "expires_at", "headers")
    ]
)

log = logging.getLogger(__name__)

# How often a consumer still waiting says so again (see ``sub``): well within the 5 s for
# which the drain counts a topic as one whose consumers wait (DrainPacer.WAITED_S).
WAITING_SAID_S = 2.0

# How long a consumer counts as connected (client_count) after its last SUB.
CLIENT_IDLE_S = 60.0
# On an object store, how often a channel looks at its table without a notice of a write.
REMOTE_LOOK_S = 1.0
# A TCP connection's deliveries do not wait for their DELIVER commit unless the ledger is this
# far behind (~87,000 events: a store slower than the consumers); then they wait, as HTTP's do.
LEDGER_BEHIND_MAX_BYTES = 8 * 1024 * 1024


class _Done:
    """An awaitable that is already over (nothing to commit)."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield


_DONE = _Done()


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass
class ConsumerSeen:
    """An HTTP consumer of a channel, as nsqd lists a client: who, since when, how much."""

    name: str
    first_seen: float  # wall clock, s
    last_seen: float  # monotonic, s
    delivered: int = 0
    in_flight: int = 0
    finished: int = 0
    requeued: int = 0


@dataclass(frozen=True)
class ChannelCounts:
    """nsqd's per-channel figures."""

    depth: int
    in_flight_count: int
    deferred_count: int
    message_count: int
    requeue_count: int
    timeout_count: int
    clients: list[ConsumerSeen]
    finish_count: int = 0
    dead_count: int = 0
    expired_count: int = 0
    table_version: int = -1
    ledger_version: int = -1
    filtered_count: int = 0

    @property
    def client_count(self) -> int:
        return len(self.clients)


class ChannelRuntime:
    """One channel's live queue, its ledger writer and its reader."""

    def __init__(
        self,
        topic: str,
        channel: str,
        messages_path: str,
        ledger_path: str,
        dead_path: str,
        *,
        state_path: str | None = None,
        max_attempts: int = 0,
        ttl_ms: int = 0,
        expired_dead: bool = False,
        scan_leases: bool = True,
        mem_queue_size: int,
        ledger_linger_ms: int = 0,
        max_lease_us: int = 0,
        is_paused: Callable[[], bool],
        notify: Callable[[list[object], BaseException | None], None],
        on_waiting: Callable[[ChannelRuntime], None] | None = None,
        on_leased: Callable[[ChannelRuntime], None] | None = None,
        lanes: frozenset[int] | None = None,
        schema_of: Callable[[], TopicSchema | None] = lambda: None,
    ) -> None:
        self.topic = topic
        self.channel = channel
        # The longest lease a TOUCH or a consumer's timeout may ask for (0: no limit).
        self.max_lease_us = max_lease_us
        # The shares of the channel served here (queue_engine.shares; None: all of it).
        self.lanes = lanes
        # Set when this runtime closes because another (other shares) serves the channel on
        # from here: its consumers carry on there (None: the channel stopped here).
        self.handed_on: asyncio.Future[ChannelRuntime | None] = (
            asyncio.get_running_loop().create_future()
        )
        self.messages_path = messages_path
        self.ledger_path = ledger_path
        self.state_path = state_path
        # nsqd's queueScanLoop: time out expired leases here (False: only the sweep does).
        self._scan_leases = scan_leases
        # The ledger version up to which foreign commits (the sweep's) have been applied.
        self._ledger_seen = -1
        self._mem_queue_size = max(2, mem_queue_size)
        self._ledger_linger_s = ledger_linger_ms / 1000
        self._is_paused = is_paused
        self._notify = notify
        # Told when a consumer starts waiting here: the broker then ticks this channel often.
        self._on_waiting = on_waiting
        self._on_leased = on_leased
        self.max_attempts = max_attempts
        self.ttl_ms = ttl_ms
        self.expired_dead = expired_dead
        self.queue = self._configured(ChannelQueue())
        self._dead = DeadLetterStore(dead_path, schema_of)
        # Held from taking dead letters until their DEAD events are submitted, and by a
        # redrive: a REDRIVE never reaches the ledger before the DEAD it undoes.
        self._burying = asyncio.Lock()
        self._reader = ChannelReader(messages_path, lanes)
        # Unread rows of messages the ledger already knew (they are not depth).
        self._known_unread = 0
        self._writer: LoopLedgerWriter | LedgerWriter | None = None
        self._changed = asyncio.Condition()
        self._load_lock = asyncio.Lock()
        self._clients: dict[str, ConsumerSeen] = {}
        self._fetching = False
        self.waiting = 0
        self.closed = False
        self._broken = False
        # A notice said the fanout or the sweep wrote here (store.tables.notices); on an object
        # store, where a look is a request, the table is otherwise looked at only every
        # REMOTE_LOOK_S.
        self._noticed = True
        self._looked_at = float("-inf")

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._writer = await asyncio.to_thread(
            open_ledger_writer,
            self.ledger_path,
            asyncio.get_running_loop(),
            self._notify,
            name=f"{self.topic}/{self.channel}",
            linger_s=self._ledger_linger_s,
        )
        await self._rebuild()

    async def _rebuild(self) -> None:
        """The queue as the fold of the ledger plus the rows of the messages table."""
        async with self._load_lock:
            restored = await asyncio.to_thread(
                restore_channel,
                f"{self.topic}/{self.channel}",
                self.messages_path,
                self.ledger_path,
                self.state_path,
                now_us(),
                self.lanes,
            )
            self.queue, self._reader = self._configured(restored.queue), restored.reader
            self._known_unread = restored.known_unread
            self._ledger_seen = restored.ledger_version
            self._broken = False
        await self.refill()

    async def close(self) -> None:
        """Wake every waiting SUB (they answer with no messages) and stop the ledger writer:
        what it had taken is committed when this returns."""
        self.closed = True
        await self.wake()
        if self._writer is not None:
            await self._writer.aclose()
        await asyncio.to_thread(self._dead.close)

    def hand_on(self, successor: ChannelRuntime | None) -> None:
        """Tell this closed runtime's consumers where the channel is served on (None: not
        here)."""
        if not self.handed_on.done():
            self.handed_on.set_result(successor)

    def holds(self, message_id: str, lease: str) -> bool:
        """Whether ``message_id`` is in flight under ``lease``."""
        state = self.queue.states.get(message_id)
        return state is not None and state.in_flight and state.lease == lease

    def ended_leases(self, leases: dict[str, str]) -> list[str]:
        """The ids of ``leases`` (id -> lease) that ended without their client: no longer in
        flight under that lease, nor timed out and waiting to be delivered again. One pass
        over a client's in-flight messages each time its RDY frees up."""
        states = self.queue.states
        ended = []
        for message_id, lease in leases.items():
            state = states.get(message_id)
            if state is None or state.lease != lease or not (state.in_flight or state.timed_out):
                ended.append(message_id)
        return ended

    def why_not_held(self, message_id: str) -> str:
        """nsqd's reason a FIN, REQ or TOUCH of ``message_id`` by a client without its lease
        fails."""
        state = self.queue.states.get(message_id)
        if state is not None and state.in_flight:
            return "client does not own message"
        return "ID not in flight"

    def serves(self, message_id: str) -> bool:
        """Whether ``message_id`` is of a share served here."""
        if self.lanes is None:
            return True
        try:
            return lane_of(message_id) in self.lanes
        except ValueError:
            return True  # not an id: the queue answers it as unknown

    def set_max_attempts(self, max_attempts: int) -> None:
        """Deliveries a message may have from now on (0: no limit); dead letters stay dead."""
        self.max_attempts = max_attempts
        self.queue.max_attempts = max_attempts

    def set_ttl(self, ttl_ms: int) -> None:
        """Message TTL from now on (0: none); it applies to messages already waiting too."""
        self.ttl_ms = ttl_ms
        self.queue.ttl_us = ttl_ms * 1000

    def _configured(self, queue: ChannelQueue) -> ChannelQueue:
        """``queue`` with this channel's delivery limit, TTL and what expiry does."""
        queue.max_attempts = self.max_attempts
        queue.ttl_us = self.ttl_ms * 1000
        queue.expired_dead = self.expired_dead
        return queue

    def request_reopen(self) -> None:
        if self._writer is not None:
            self._writer.request_reopen()

    # -- consumers --------------------------------------------------------------------------

    async def sub(
        self,
        limit: int | Callable[[], int],
        wait_s: float,
        lease_us: int,
        consumer: str,
        *,
        durable: bool = True,
    ) -> list[Delivery]:
        """Lease up to ``limit`` messages, waiting up to ``wait_s`` for the first one.

        ``limit`` may be a function, asked again after each wait (a TCP client's RDY less its
        messages in flight changes while it waits); at 0 nothing more is awaited.

        ``durable``: the deliveries' DELIVER events are in the ledger on return. Without it
        they are submitted (lazily, with the next commit) and the deliveries return at once:
        for a TCP connection, whose leases end with it as nsqd's do, so a crash before that
        commit only makes them ready again, as a closed connection would."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        client = self._clients.get(consumer)
        if client is None:
            client = self._clients[consumer] = ConsumerSeen(consumer, time.time(), 0.0)
        client.last_seen = time.monotonic()
        while not self.closed:
            wanted = limit() if callable(limit) else limit
            if wanted <= 0:
                break
            if not self._is_paused() and not self._broken:
                if not self.queue.has_ready():
                    # An idle channel is polled every few seconds only: look for rows the
                    # fanout committed since, rather than wait for the pump.
                    await self.poll()
                await self.refill()
                deliveries, events = self.queue.take(wanted, now_us(), lease_us, consumer)
                if self.queue.body_wanted:
                    self._fetch_bodies()
                if self.queue.dying:
                    await self._bury(events)
                elif events:
                    assert self._writer is not None
                    if durable or self._writer.pending_bytes >= LEDGER_BEHIND_MAX_BYTES:
                        await self._write(events)
                    else:
                        self._submit(events, lazy=True)
                if deliveries:
                    client.delivered += len(deliveries)
                    client.last_seen = time.monotonic()
                    if self._on_leased is not None:
                        self._on_leased(self)
                    return deliveries
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self.waiting += 1
            if self._on_waiting is not None:
                self._on_waiting(self)
            try:
                async with self._changed:
                    # In slices: a consumer that waits longer says so again, so that its
                    # topic commits as one whose consumers wait for as long as it waits.
                    await asyncio.wait_for(self._changed.wait(), min(remaining, WAITING_SAID_S))
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1
        return []

    def answer(
        self,
        kind: EventKind,
        answers: Iterable[tuple[str, str]],
        *,
        delay_us: int = 0,
        lease_us: int | None = None,
        lazy: bool = False,
    ) -> Awaitable[None]:
        """FIN, REQ or TOUCH of (id, lease) pairs, as nsqd's channel FinishMessage,
        RequeueMessage and TouchMessage: HTTP and TCP both answer through here.

        Applied to the queue now, all or none (``SettleError`` names the ids not in flight
        under their lease); the returned awaitable ends when the ledger has it. The TCP
        protocol answers FIN with nothing, so its FINs are applied in command order without
        waiting for each commit (``lazy``: and commit with the ledger's next lingering
        commit)."""
        if self._broken:
            raise QueueError(ErrorCode.E_COMMIT_FAILED, "channel is reloading")
        events = self.queue.settle(
            kind,
            answers,
            now_us(),
            delay_us=delay_us,
            lease_us=lease_us,
            max_lease_us=self.max_lease_us,
        )
        if kind is EventKind.REQ and any(e.deliver_at_us is None for e in events):
            self._wake_soon()
        return self._submit(events, lazy=lazy)

    async def redrive(self, ids: list[str] | None) -> int:
        """Make the dead messages named (None: all) ready again with their attempts reset, in
        one ledger commit (all or none: ``SettleError``); returns how many."""
        if self._broken:
            raise QueueError(ErrorCode.E_COMMIT_FAILED, "channel is reloading")
        async with self._burying:
            wanted = sorted(self.queue.dead) if ids is None else ids
            if not wanted:
                return 0
            bodies = await asyncio.to_thread(self._dead.latest, wanted)
            if self._broken:
                raise QueueError(ErrorCode.E_COMMIT_FAILED, "channel is reloading")
            events = self.queue.redrive(wanted, now_us())
            # Bodies come back from the dead-letter table (the queue dropped them); any not
            # found there are read from the channel table on demand.
            self.queue.attach_bodies(
                bodies["id"].to_pylist(),
                bodies["body"].to_pylist(),
                bodies["published_at"].cast(pa.int64()).to_pylist(),
                expires_at(bodies),
                headers_of(bodies),
            )
            done = self._submit(events)
        await done
        if self.waiting:
            await self.wake()
        return len(events)

    async def empty(self) -> int:
        """nsqd's channel empty: every message the channel holds now is dropped (an EMPTY
        ledger event each), including rows not read into memory yet; dead letters stay.
        Returns how many; durable when this returns."""
        if self._broken:
            raise QueueError(ErrorCode.E_COMMIT_FAILED, "channel is reloading")
        dropped = 0
        async with self._load_lock:
            while True:
                events = self.queue.empty(now_us())
                if events:
                    await self._write(events)
                    dropped += len(events)
                table = await asyncio.to_thread(self._reader.read, self._mem_queue_size // 2)
                if table is None:
                    break
                add_rows(self.queue, table, now_us())
                if self._reader.snapshot_read:
                    self.queue.forget_finished()
            self._known_unread = 0
        log.info("%s/%s: emptied, %d messages dropped", self.topic, self.channel, dropped)
        return dropped

    async def dead_letters(self, limit: int) -> pa.Table:
        """The channel's current dead letters (at most ``limit``, longest dead first)."""
        table = await asyncio.to_thread(self._dead.latest, sorted(self.queue.dead))
        return table.slice(0, limit)

    # -- background work (called by the broker's pump) ---------------------------------------

    async def tick(self) -> None:
        """Time out expired leases, release due deferrals, pick up new rows of the table."""
        if self.closed or self._broken:
            return
        if self._scan_leases:
            events = self.queue.expire(now_us())
            if events:
                asyncio.get_running_loop().create_task(self._write_quietly(events))
        else:
            self.queue.promote(now_us())
        await self.follow_ledger()
        await self.poll()
        await self._expire_ready()
        if self.queue.body_wanted:
            self._fetch_bodies()
        if self.queue.has_ready() and self.waiting:
            await self.wake()

    def _fetch_bodies(self) -> None:
        """Load, in the background, the bodies ``take`` found missing (leases that ended
        after a restart, before the reader reached their rows); wake the waiting SUBs."""
        if self._fetching or self._broken:
            return
        self._fetching = True
        wanted = list(self.queue.body_wanted)
        paths = list(self._reader.paths)

        async def fetch() -> None:
            try:
                table = await asyncio.to_thread(ChannelReader.read_ids, paths, wanted)
                missing = set(wanted) - set(table["id"].to_pylist())
                if missing:
                    # A message redriven since the last sweep, whose channel row retention
                    # removed while it was dead: its body is in the dead-letter table.
                    dead = await asyncio.to_thread(self._dead.latest, sorted(missing))
                    table = pa.concat_tables(
                        [conform(table, _BODY_SCHEMA), conform(dead, _BODY_SCHEMA)]
                    )
                if not self._broken:
                    self.queue.attach_bodies(
                        table["id"].to_pylist(),
                        table["body"].to_pylist(),
                        table["published_at"].cast(pa.int64()).to_pylist(),
                        expires_at(table),
                        headers_of(table),
                    )
                    await self.wake()
                # Rows not found are not asked for again until a SUB passes over them anew.
                self.queue.body_wanted.difference_update(wanted)
            except Exception:
                log.exception(
                    "%s/%s: could not read %d bodies", self.topic, self.channel, len(wanted)
                )
            finally:
                self._fetching = False

        asyncio.get_running_loop().create_task(fetch())

    def notice(self) -> None:
        """The fanout or the sweep wrote to this channel's tables: look at them next tick."""
        self._noticed = True

    def _look(self) -> bool:
        """Whether this tick looks at the channel's table for new versions."""
        if "://" not in self.messages_path:
            return True  # one file-existence check: cheap enough for every tick
        now = time.monotonic()
        if not self._noticed and now - self._looked_at < REMOTE_LOOK_S:
            return False
        self._noticed = False
        self._looked_at = now
        return True

    async def follow_ledger(self) -> None:
        """Apply what the sweep appended to the ledger (TIMEOUTs of leases that ended)."""
        if self._load_lock.locked() or self._writer is None or "://" in self.ledger_path:
            return
        base = self.ledger_path
        seen = self._ledger_seen
        while os.path.exists(f"{base}/{commit_file(self._ledger_seen + 1)}"):
            version = self._ledger_seen + 1
            if version not in self._writer.own and is_sweep_commit(base, version):
                events = await asyncio.to_thread(read_versions, base, version - 1, version)
                if self._broken or self.closed:
                    return
                changed = self.queue.apply_foreign(events, now_us())
                log.info(
                    "%s/%s: sweep commit v%d: %d of %d events applied",
                    self.topic,
                    self.channel,
                    version,
                    changed,
                    len(events),
                )
                if changed and self.waiting:
                    await self.wake()
            self._ledger_seen = version
        if self._ledger_seen != seen:
            self._writer.own.forget_through(self._ledger_seen)

    async def poll(self) -> None:
        """Read the versions the fanout committed since the last poll."""
        if self._load_lock.locked() or not self._look() or not self._reader.probe():
            return
        async with self._load_lock:
            rows = await asyncio.to_thread(self._reader.poll)
        if rows:
            await self.refill()

    async def refill(self) -> None:
        """Read more rows while fewer than half a window of messages is ready in memory."""
        if self.queue.ready_count * 2 >= self._mem_queue_size or not self._reader.has_unread:
            return
        if self._load_lock.locked():
            return
        added = 0
        rows_read = 0
        async with self._load_lock:
            # Bounded per call: rows of messages already leased (after a restart) do not fill
            # the window, and reading them all here would hold up the first SUB.
            while (
                self.queue.ready_count * 2 < self._mem_queue_size
                and rows_read < 2 * self._mem_queue_size
            ):
                table = await asyncio.to_thread(self._reader.read, self._mem_queue_size // 2)
                if table is None:
                    break
                rows_read += table.num_rows
                fresh = add_rows(self.queue, table, now_us())
                added += fresh
                self._known_unread = max(0, self._known_unread - (table.num_rows - fresh))
                if self._reader.snapshot_read:
                    self.queue.forget_finished()
                    self._known_unread = 0
        if added and self.waiting:
            await self.wake()

    async def wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @property
    def busy(self) -> bool:
        """Leases to time out or deferrals to release: worth ticking often."""
        return bool(self.queue.in_flight or self.queue.deferred)

    @property
    def expiring(self) -> bool:
        """Messages here may outlive their TTL: worth ticking though nothing else happens."""
        return bool(self.queue.ttl_us or self.queue.has_own_expiries)

    # -- figures ----------------------------------------------------------------------------

    @property
    def fanned_topic_version(self) -> int:
        """The newest topic version the fanout has put in this channel's table (-1: none)."""
        return self._reader.max_topic_version

    def counts(self) -> ChannelCounts:
        cutoff = time.monotonic() - CLIENT_IDLE_S
        self._clients = {n: c for n, c in self._clients.items() if c.last_seen >= cutoff}
        owners: dict[str | None, int] = {}
        for message_id in self.queue.in_flight:
            owner = self.queue.states[message_id].lease_owner
            owners[owner] = owners.get(owner, 0) + 1
        queue = self.queue
        # Answer counts of consumers no longer listed go with them.
        queue.finished_by = {n: k for n, k in queue.finished_by.items() if n in self._clients}
        queue.requeued_by = {n: k for n, k in queue.requeued_by.items() if n in self._clients}
        for client in self._clients.values():
            client.in_flight = owners.get(client.name, 0)
            client.finished = queue.finished_by.get(client.name, 0)
            client.requeued = queue.requeued_by.get(client.name, 0)
        return ChannelCounts(
            depth=self.queue.ready_count + max(0, self._reader.unread_rows - self._known_unread),
            in_flight_count=len(self.queue.in_flight),
            deferred_count=len(self.queue.deferred),
            message_count=self._reader.message_count,
            requeue_count=self.queue.requeue_count,
            timeout_count=self.queue.timeout_count,
            clients=sorted(self._clients.values(), key=lambda c: c.name),
            finish_count=self.queue.finish_count,
            dead_count=len(self.queue.dead),
            expired_count=self.queue.expired_count,
            filtered_count=self._reader.kept_out,
            table_version=self._reader.version,
            ledger_version=self._writer.version if self._writer is not None else -1,
        )

    def peek(self, limit: int) -> list[tuple[str, int, bytes, Headers | None]]:
        """The next ready messages, in the order SUB would lease them (nothing is leased)."""
        return self.queue.peek(limit, now_us())

    # -- internals --------------------------------------------------------------------------

    async def _write(self, events: list[LeaseEvent]) -> None:
        await self._submit(events)

    async def _bury(self, events: list[LeaseEvent]) -> None:
        """Commit what ``take`` dead-lettered to the dead-letter table, then ``events`` (its
        DEAD events and any deliveries) to the ledger. If the dead letters cannot be written,
        the queue is rebuilt from the tables (where those messages are not dead)."""
        dying, self.queue.dying = self.queue.dying, []
        async with self._burying:
            try:
                await asyncio.to_thread(self._dead.append, dying)
            except Exception as exc:
                log.error("%s/%s: dead letters not written: %s", self.topic, self.channel, exc)
                self._fail()
                raise QueueError(ErrorCode.E_COMMIT_FAILED, str(exc)) from exc
            if self._broken:
                raise QueueError(ErrorCode.E_COMMIT_FAILED, "channel is reloading")
            done = self._submit(events)
        log.info("%s/%s: %d messages dead-lettered", self.topic, self.channel, len(dying))
        await done

    def _submit(self, events: list[LeaseEvent], *, lazy: bool = False) -> Awaitable[None]:
        """Hand ``events`` to the ledger writer now; the awaitable ends with their commit
        (``lazy``: nobody waits for it, so it may linger)."""
        if not events:
            return _DONE
        assert self._writer is not None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._writer.submit_events(events, future, lazy=lazy)
        except WriterClosedError as exc:
            raise QueueError(ErrorCode.EXITING, str(exc)) from exc
        future.add_done_callback(self._check_commit)
        return future

    def _check_commit(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and isinstance(future.exception(), QueueError):
            self._fail()

    def _wake_soon(self) -> None:
        asyncio.get_running_loop().create_task(self.wake())

    async def _expire_ready(self) -> None:
        """Messages past their TTL are expired (or dead-lettered) though no consumer comes:
        with a TTL in play, rows are read into the window (as a SUB would) so that expiry
        reaches them, and the head of the ready queue is expired."""
        if not (self.queue.ttl_us or self.queue.has_own_expiries) or self._is_paused():
            return
        await self.refill()
        events = self.queue.expire_ready(now_us())
        if self.queue.dying:
            task = self._bury(events)
        elif events:
            task = self._write(events)
        else:
            return
        try:
            await task
        except QueueError:
            log.error("%s/%s: could not record %d expiries", self.topic, self.channel, len(events))

    async def _write_quietly(self, events: list[LeaseEvent]) -> None:
        try:
            await self._write(events)
        except QueueError:
            log.error("%s/%s: could not record %d timeouts", self.topic, self.channel, len(events))

    def _fail(self) -> None:
        """A ledger commit failed: memory is ahead of the ledger, so rebuild from the tables."""
        if self._broken or self.closed:
            return
        self._broken = True
        log.error(
            "%s/%s: ledger commit failed, rebuilding from the tables", self.topic, self.channel
        )
        asyncio.get_running_loop().create_task(self._rebuild())
