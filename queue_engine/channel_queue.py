"""One channel's live queue: the fold of its ledger plus the indexes that make SUB fast (pure).

States change only through ``queue_engine.lease.apply``; this class adds what a server needs on
top: a FIFO of ready messages, a heap of deferred ones, a heap of lease expiries, the bodies of
the messages it holds, and nsqd's counters. No I/O and no clock: the caller passes ``now_us``
and writes the returned events to the ledger before answering.

Indexes are lazy: a FIFO or heap entry whose message has since changed state is skipped when
it surfaces, so every transition is O(1) or O(log n).
"""

from __future__ import annotations

import heapq
import random
import re
import secrets
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from queue_engine.headers import Headers
from queue_engine.lease import FRESH, EventKind, LeaseEvent, MessageState, apply, initial

# What the queue holds of a loaded row: body, published_at (µs), its own expiry (µs; None: the
# TTL's), headers.
Loaded = tuple[bytes, int, int | None, Headers | None]


class Delivery(NamedTuple):
    """A message handed to a consumer, with what it needs to answer."""

    id: str
    attempts: int
    published_at_us: int
    body: bytes
    lease: str
    headers: Headers | None = None


class DeadLetter(NamedTuple):
    """A message ``take`` moved to the dead-letter table instead of delivering it."""

    id: str
    body: bytes
    published_at_us: int
    attempts: int
    last_consumer: str | None
    # What ended its last attempt (TIMEOUT or REQ), or EXPIRE: its TTL passed.
    last_event: str
    dead_at_us: int
    # Its own expiry (/pub?ttl_ms=), None: the topic's TTL applies.
    expires_at_us: int | None = None
    headers: Headers | None = None


class Answer(NamedTuple):
    """One FIN/REQ/TOUCH target: a message id and the lease the consumer holds."""

    id: str
    lease: str


class SettleError(Exception):
    """Some targets of a FIN/REQ/TOUCH are not in flight under that lease (nothing applied)."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(", ".join(failed))
        self.failed = failed


# Stale lease-expiry entries tolerated beyond the live ones before the heap is rebuilt.
_EXPIRIES_SLACK = 4096

_LEASE = re.compile(r"^([0-9]{1,9})-[0-9a-f]{12}$")
# Nonces tell one delivery's lease from another's; they guard against mistakes, not attackers
# (anyone who can reach the API can FIN), so a seeded PRNG is enough and much cheaper than
# os.urandom per message.
_NONCES = random.Random(secrets.randbits(64))


def lease_attempt(lease: str) -> int | None:
    """The attempt a lease token names, or None if it is not a lease token."""
    match = _LEASE.match(lease)
    return int(match.group(1)) if match else None


def new_lease(attempt: int, nonce: int) -> str:
    """An opaque lease token: the attempt it leases and a random 48-bit nonce (stale ones
    differ). One ``take`` gives all its deliveries of the same attempt one token: a message's
    deliveries are in different takes, so its leases still differ from each other."""
    return f"{attempt}-{nonce:012x}"


class ChannelQueue:
    """Ready, deferred and in-flight messages of one channel, and its counters."""

    def __init__(self) -> None:
        self.states: dict[str, MessageState] = {}
        # Loaded rows: body, published_at, the message's own expiry (µs; None: the TTL's) and
        # its headers.
        self._bodies: dict[str, Loaded] = {}
        self._ready: deque[str] = deque()
        self._deferred: list[tuple[int, str]] = []
        self._expiries: list[tuple[int, str, int]] = []
        self.in_flight: set[str] = set()
        self.deferred: set[str] = set()
        # Dead-lettered messages (kept, without bodies, until redriven).
        self.dead: set[str] = set()
        # Deliveries a message may have (0: no limit). ``take`` dead-letters a ready message
        # that had them all instead of delivering it again, into ``dying`` (the caller writes
        # them to the dead-letter table, then their DEAD events to the ledger).
        self.max_attempts = 0
        self.dying: list[DeadLetter] = []
        # Message TTL (µs after publishing; 0: none): ``take`` expires a ready message older
        # than that instead of delivering it. A message published with its own TTL has an
        # expiry instead (its row's expires_at), which replaces this.
        self.ttl_us = 0
        # A message past its TTL goes to the dead-letter table (a DEAD event whose dead row
        # says EXPIRE) instead of being ended by an EXPIRE event.
        self.expired_dead = False
        self.expired_count = 0
        # Some loaded message had its own expiry (so expiry is worth looking for without a
        # topic TTL).
        self.has_own_expiries = False
        # Finished messages whose rows may still be read (from the table as it was at restore):
        # skipped when read. Not needed once every row of that snapshot has been read.
        self._finished: set[str] = set()
        self._remember_finished = True
        # Restored from a sweep's state (store/state.py): rows with topic_version at or below
        # ``_covered_through`` are live only if the state had them; ``_unstarted`` are those
        # that were ready and never delivered (they enter the queue when their row is read).
        self._covered_through = -1
        self._unstarted: set[str] = set()
        self._last_at_us = 0
        # Ready messages ``take`` had to pass over because their bodies are not loaded.
        self.body_wanted: set[str] = set()
        self.requeue_count = 0
        self.timeout_count = 0
        # FINs since this queue was built (a rate for the console, not a total).
        self.finish_count = 0
        # The same per lease owner (a consumer's name), for nsqd's per-client figures.
        self.finished_by: dict[str, int] = {}
        self.requeued_by: dict[str, int] = {}

    # -- what the queue holds --------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        return len(self.states) - len(self.in_flight) - len(self.deferred) - len(self.dead)

    def has_ready(self) -> bool:
        return self.ready_count > 0

    def next_due_us(self) -> int | None:
        """The earliest time a lease may expire or a deferral end (None: nothing pending)."""
        times = [t for t in (self._deferred[:1], self._expiries[:1]) if t]
        return min(t[0][0] for t in times) if times else None

    # -- loading ----------------------------------------------------------------------------

    def restore(self, states: dict[str, MessageState], now_us: int) -> None:
        """Start from the fold of the ledger (before any message row is loaded)."""
        for message_id, state in states.items():
            self.requeue_count += state.requeues
            self.timeout_count += state.timeouts
            if state.finished:
                self._finished.add(message_id)
                continue
            self._place(message_id, state, now_us)

    def restore_checkpoint(self, unstarted: set[str], covered_through: int) -> None:
        """Rows up to topic_version ``covered_through`` are the state's: live iff known or in
        ``unstarted`` (FIN'd messages left the state, so no finished set is needed for them)."""
        self._unstarted = unstarted
        self._covered_through = covered_through

    @property
    def unstarted_count(self) -> int:
        return len(self._unstarted)

    @property
    def covered_through(self) -> int:
        """Rows up to this topic_version are the restored state's (``add`` needs their
        versions; -1: none)."""
        return self._covered_through

    def add(
        self,
        ids: Sequence[str],
        bodies: Sequence[bytes],
        published_at_us: Sequence[int],
        deliver_at_us: Sequence[int | None],
        now_us: int,
        topic_versions: Sequence[int] | None = None,
        expires_at_us: Sequence[int | None] | None = None,
        headers: Sequence[Headers | None] | None = None,
    ) -> int:
        """Take message rows read from the channel table; return how many were new.

        Rows of messages the ledger already knows only bring their bodies.
        """
        fresh = 0
        covered = self._covered_through
        states, bodies_of, finished, dead = self.states, self._bodies, self._finished, self.dead
        wanted, ready = self.body_wanted, self._ready
        for i, (message_id, body, published, deliver_at) in enumerate(
            zip(ids, bodies, published_at_us, deliver_at_us, strict=True)
        ):
            if topic_versions is not None and topic_versions[i] <= covered:
                if message_id in self._unstarted:
                    self._unstarted.discard(message_id)
                elif message_id not in states:
                    continue  # FIN'd before the state was written
            if message_id in finished or message_id in dead:
                continue
            known = message_id in states
            expires = None if expires_at_us is None else expires_at_us[i]
            if expires is not None:
                self.has_own_expiries = True
            bodies_of[message_id] = (
                body,
                published,
                expires,
                None if headers is None else headers[i],
            )
            if wanted:
                wanted.discard(message_id)
            if not known:
                fresh += 1
                if deliver_at is None:
                    # What _place does with a fresh message (this runs once per row read).
                    states[message_id] = FRESH
                    ready.append(message_id)
                else:
                    self._place(message_id, initial(deliver_at), now_us)
        return fresh

    def attach_bodies(
        self,
        ids: Sequence[str],
        bodies: Sequence[bytes],
        published_at_us: Sequence[int],
        expires_at_us: Sequence[int | None] | None = None,
        headers: Sequence[Headers | None] | None = None,
    ) -> int:
        """Bodies looked up by id: only for messages still live (one FIN'd meanwhile must
        not come back as a new message). Returns how many were attached."""
        attached = 0
        expiries = [None] * len(ids) if expires_at_us is None else expires_at_us
        headers_of = [None] * len(ids) if headers is None else headers
        for message_id, body, published, expires, found in zip(
            ids, bodies, published_at_us, expiries, headers_of, strict=True
        ):
            if message_id in self.states and message_id not in self.dead:
                self.has_own_expiries = self.has_own_expiries or expires is not None
                self._bodies[message_id] = (body, published, expires, found)
                self.body_wanted.discard(message_id)
                attached += 1
        return attached

    def forget_finished(self) -> None:
        """Every row that existed at restore has been read: the finished set is not needed."""
        self._finished.clear()
        self._remember_finished = False

    def needs_body(self) -> list[str]:
        """Messages that can be delivered soon (not in flight) whose bodies are not loaded.
        In-flight messages get theirs when the reader passes their rows, or on demand
        (``body_wanted``) if their lease ends first: a restart with a million leases out does
        not read a million bodies."""
        return [
            m
            for m in self.states
            if m not in self._bodies and m not in self.in_flight and m not in self.dead
        ]

    # -- consuming ---------------------------------------------------------------------------

    def clock(self, now_us: int) -> int:
        """Event time: strictly increasing per channel, so memory and ledger fold alike."""
        self._last_at_us = max(now_us, self._last_at_us + 1)
        return self._last_at_us

    def take(
        self, limit: int, now_us: int, lease_us: int, consumer: str | None
    ) -> tuple[list[Delivery], list[LeaseEvent]]:
        """Lease up to ``limit`` ready messages to ``consumer``."""
        self.promote(now_us)
        at = self.clock(now_us)
        deliveries: list[Delivery] = []
        events: list[LeaseEvent] = []
        skipped: list[str] = []
        # Locals: this loop runs once per message delivered.
        ready, states, bodies = self._ready, self.states, self._bodies
        in_flight, deferred, expiries = self.in_flight, self.deferred, self._expiries
        expires_at = at + lease_us
        max_attempts = self.max_attempts
        may_expire = bool(self.ttl_us or self.has_own_expiries)
        nonce = _NONCES.getrandbits(48)
        # NamedTuples built with tuple.__new__: a field tuple, without the Python-level
        # __new__ each class has (half the cost; three are built per message delivered).
        new = tuple.__new__
        leases: dict[int, str] = {}
        deliver = EventKind.DELIVER
        push = heapq.heappush
        while len(deliveries) < limit and ready:
            message_id = ready.popleft()
            state = states.get(message_id)
            if state is None or message_id in in_flight or message_id in deferred or state.dead:
                continue  # a stale FIFO entry
            body = bodies.get(message_id)
            if body is None:
                skipped.append(message_id)  # its row is not loaded yet
                continue
            if may_expire:
                expires = self._expiry(body)
                if expires is not None and expires <= at:
                    events.append(self._expire(message_id, state, body, at))
                    continue
            attempt = state.attempts
            if max_attempts and attempt >= max_attempts:
                events.append(self._kill(message_id, state, body, at))
                continue
            attempt += 1
            lease = leases.get(attempt)
            if lease is None:
                lease = leases[attempt] = new_lease(attempt, nonce)
            event = new(
                LeaseEvent, (message_id, deliver, attempt, at, lease, expires_at, None, consumer)
            )
            if state.finished or (state.deliver_at_us is not None and state.deliver_at_us > at):
                continue  # not ready after all: apply() would refuse the DELIVER
            # apply()'s DELIVER, inlined (this runs once per message delivered; the property
            # tests hold the queue to the fold of its events): fields in declaration order.
            states[message_id] = new(
                MessageState,
                (
                    attempt,  # attempts
                    True,  # in_flight
                    False,  # finished
                    lease,  # lease
                    consumer,  # lease_owner
                    at,  # delivered_at_us
                    expires_at,  # lease_expires_at_us
                    lease_us,  # lease_duration_us
                    None,  # deliver_at_us
                    False,  # timed_out
                    state.requeues,  # requeues
                    state.timeouts,  # timeouts
                    False,  # dead
                    False,  # expired
                ),
            )
            # What _set does for a message going from ready to in flight.
            in_flight.add(message_id)
            push(expiries, (expires_at, message_id, attempt))
            events.append(event)
            deliveries.append(
                new(Delivery, (message_id, attempt, body[1], body[0], lease, body[3]))
            )
        self._ready.extendleft(reversed(skipped))
        self.body_wanted.update(skipped)
        return deliveries, events

    def expire_ready(self, now_us: int, limit: int = 10_000) -> list[LeaseEvent]:
        """Expire the ready messages at the head of the FIFO whose TTL has passed, without
        waiting for a consumer (what ``take`` would do to them). Only the head: as RabbitMQ
        expires per-message TTLs, a message further back expires once it reaches the head or a
        consumer passes it. A topic TTL expires in publish order, so the head is where it is."""
        events: list[LeaseEvent] = []
        ready, states, bodies = self._ready, self.states, self._bodies
        at: int | None = None
        while ready and len(events) < limit:
            message_id = ready[0]
            state = states.get(message_id)
            if (
                state is None
                or message_id in self.in_flight
                or message_id in self.deferred
                or state.dead
            ):
                ready.popleft()  # a stale FIFO entry
                continue
            body = bodies.get(message_id)
            if body is None:
                break
            expires = self._expiry(body)
            if expires is None or expires > now_us:
                break
            if at is None:
                at = self.clock(now_us)
            ready.popleft()
            events.append(self._expire(message_id, state, body, at))
        return events

    def empty(self, now_us: int) -> list[LeaseEvent]:
        """Drop every message held (ready, deferred, in flight, and those the state knows
        whose rows are not read yet): an EMPTY event each. Dead letters stay."""
        at = self.clock(now_us)
        events: list[LeaseEvent] = []
        for message_id, state in list(self.states.items()):
            event = LeaseEvent(message_id, EventKind.EMPTY, state.attempts, at)
            after = apply(state, event)
            if after is not state:
                self._set(message_id, after, at)
                events.append(event)
        for message_id in self._unstarted:
            events.append(LeaseEvent(message_id, EventKind.EMPTY, 0, at))
        self._unstarted = set()
        self._ready.clear()
        return events

    def _expiry(self, body: Loaded) -> int | None:
        """When a loaded message expires (µs): its own expiry, else the topic TTL's."""
        if body[2] is not None:
            return body[2]
        return body[1] + self.ttl_us if self.ttl_us else None

    def _expire(self, message_id: str, state: MessageState, body: Loaded, at: int) -> LeaseEvent:
        """A ready message past its TTL: an EXPIRE event, or dead-lettered (expired_dead)."""
        self.expired_count += 1
        if self.expired_dead:
            return self._kill(message_id, state, body, at, EventKind.EXPIRE)
        expire = LeaseEvent(message_id, EventKind.EXPIRE, state.attempts, at)
        self._set(message_id, apply(state, expire), at)
        return expire

    def _kill(
        self,
        message_id: str,
        state: MessageState,
        body: Loaded,
        at: int,
        cause: EventKind | None = None,
    ) -> LeaseEvent:
        """Dead-letter a ready message (at event time ``at``): it had all its attempts, or
        (``cause`` EXPIRE) its TTL passed."""
        event = LeaseEvent(message_id, EventKind.DEAD, state.attempts, at)
        self.dying.append(
            DeadLetter(
                message_id,
                body[0],
                body[1],
                state.attempts,
                state.lease_owner,
                cause.value
                if cause is not None
                else EventKind.TIMEOUT.value
                if state.timed_out
                else EventKind.REQ.value,
                at,
                body[2],
                body[3],
            )
        )
        self._set(message_id, apply(state, event), at)
        return event

    def redrive(self, ids: Iterable[str] | None, now_us: int) -> list[LeaseEvent]:
        """REDRIVE the dead messages named (all of them: None); they become ready with their
        attempts reset. A named id that is not dead fails the whole call (SettleError)."""
        wanted = sorted(self.dead) if ids is None else list(dict.fromkeys(ids))
        failed = [m for m in wanted if m not in self.dead]
        if failed:
            raise SettleError(failed)
        at = self.clock(now_us)
        events = []
        for message_id in wanted:
            event = LeaseEvent(message_id, EventKind.REDRIVE, self.states[message_id].attempts, at)
            self._set(message_id, apply(self.states[message_id], event), now_us)
            events.append(event)
        return events

    def settle(
        self,
        kind: EventKind,
        answers: Iterable[tuple[str, str]],
        now_us: int,
        *,
        delay_us: int = 0,
        lease_us: int | None = None,
        max_lease_us: int = 0,
    ) -> list[LeaseEvent]:
        """FIN, REQ or TOUCH every answer, or none of them (SettleError names the failures)."""
        at = self.clock(now_us)
        if kind is EventKind.FIN:
            return self._finish(answers, at)
        pending: dict[str, MessageState] = {}
        events: list[LeaseEvent] = []
        failed: list[str] = []
        states = self.states
        touch = kind is EventKind.TOUCH
        deliver_at = at + delay_us if kind is EventKind.REQ and delay_us > 0 else None
        for message_id, lease in answers:
            state = pending.get(message_id) or states.get(message_id)
            # The current lease names the current attempt (new_lease): parsed only otherwise.
            if state is not None and lease == state.lease:
                attempt: int | None = state.attempts
            else:
                attempt = lease_attempt(lease)
            if state is None or attempt is None:
                failed.append(message_id)
                continue
            expires = self._touched_until(state, at, lease_us, max_lease_us) if touch else None
            event = LeaseEvent(message_id, kind, attempt, at, lease, expires, deliver_at, None)
            after = apply(state, event)
            if after is state:
                failed.append(message_id)
                continue
            pending[message_id] = after
            events.append(event)
        if failed:
            raise SettleError(failed)
        by = self.requeued_by
        for message_id, after in pending.items():
            owner = states[message_id].lease_owner
            if owner is not None and kind is EventKind.REQ:
                by[owner] = by.get(owner, 0) + 1
            self._set(message_id, after, now_us)
        if kind is EventKind.REQ:
            self.requeue_count += len(events)
        if len(self._expiries) > 2 * len(self.in_flight) + _EXPIRIES_SLACK:
            self._compact_expiries()
        return events

    def _finish(self, answers: Iterable[tuple[str, str]], at: int) -> list[LeaseEvent]:
        """``settle``'s FIN, with apply()'s FIN rule inlined (this runs once per message
        consumed; the property tests hold the queue to the fold of its events): valid for
        the current lease while its attempt is in flight or timed out and not delivered
        again. A finished message leaves the queue, so its new state is never built."""
        states = self.states
        fin = EventKind.FIN
        events: list[LeaseEvent] = []
        failed: list[str] = []
        done: dict[str, MessageState] = {}
        new = tuple.__new__  # as in take()
        for message_id, lease in answers:
            state = states.get(message_id)
            if (
                state is None
                or lease != state.lease
                or message_id in done
                or state.finished
                or state.dead
                or not (state.in_flight or state.timed_out)
            ):
                failed.append(message_id)
                continue
            done[message_id] = state
            events.append(
                new(LeaseEvent, (message_id, fin, state.attempts, at, lease, None, None, None))
            )
        if failed:
            raise SettleError(failed)
        # What _set does for a finished message (one in flight or timed out is neither
        # deferred nor dead; a timed-out one's FIFO entry is skipped once its state is gone).
        by = self.finished_by
        in_flight, bodies = self.in_flight, self._bodies
        for message_id, state in done.items():
            owner = state.lease_owner
            if owner is not None:
                by[owner] = by.get(owner, 0) + 1
            del states[message_id]
            in_flight.discard(message_id)
            bodies.pop(message_id, None)
        if self._remember_finished:
            self._finished.update(done)
        self.finish_count += len(events)
        if len(self._expiries) > 2 * len(in_flight) + _EXPIRIES_SLACK:
            self._compact_expiries()
        return events

    def _compact_expiries(self) -> None:
        """Drop the expiry entries of leases that ended (FIN'd, REQ'd: they stay in the heap
        until their time otherwise). Without this the heap holds an entry and an id for every
        message settled within the last lease length: at 50,000 msg/s and a 60 s lease, three
        million of them. Rebuilt once stale entries outnumber live ones: O(1) amortized."""
        states, in_flight = self.states, self.in_flight
        live = []
        for entry in self._expiries:
            message_id = entry[1]
            if message_id in in_flight:
                state = states.get(message_id)
                if state is not None and state.attempts == entry[2]:
                    live.append(entry)
        heapq.heapify(live)
        self._expiries = live

    @staticmethod
    def _touched_until(state: MessageState, at: int, lease_us: int | None, max_us: int) -> int:
        """nsqd's TOUCH: now + the lease length, never past delivery + max_msg_timeout."""
        extended = at + (lease_us if lease_us is not None else state.lease_duration_us)
        if max_us and state.delivered_at_us is not None:
            extended = min(extended, state.delivered_at_us + max_us)
        return extended

    def expire(self, now_us: int) -> list[LeaseEvent]:
        """TIMEOUT every lease that ended by ``now_us``; due deferrals become ready."""
        self.promote(now_us)
        events: list[LeaseEvent] = []
        if not self._expiries or self._expiries[0][0] > now_us:
            return events
        at = self.clock(now_us)
        while self._expiries and self._expiries[0][0] <= at:
            _, message_id, attempt = heapq.heappop(self._expiries)
            state = self.states.get(message_id)
            if state is None or not state.in_flight or state.attempts != attempt:
                continue
            event = LeaseEvent(message_id, EventKind.TIMEOUT, attempt, at)
            after = apply(state, event)
            if after is state:
                continue  # extended by a TOUCH; its own expiry entry is in the heap
            self._set(message_id, after, now_us)
            self.timeout_count += 1
            events.append(event)
        return events

    def apply_foreign(self, events: Iterable[LeaseEvent], now_us: int) -> int:
        """Events another writer (the sweep's TIMEOUTs) appended to the ledger; returns how many
        changed a state. They are valid or not by the same rules as everything else."""
        changed = 0
        for event in events:
            state = self.states.get(event.id)
            if state is None:
                continue
            after = apply(state, event)
            if after is state:
                continue
            self._set(event.id, after, now_us)
            changed += 1
            if event.kind is EventKind.TIMEOUT:
                self.timeout_count += 1
        return changed

    def peek(self, limit: int, now_us: int) -> list[tuple[str, int, bytes, Headers | None]]:
        """The next ``limit`` messages a SUB would get, without leasing them: (id, attempts,
        body, headers), in delivery order. Messages whose bodies are not loaded yet are left
        out."""
        self.promote(now_us)
        found: list[tuple[str, int, bytes, Headers | None]] = []
        seen: set[str] = set()
        for message_id in self._ready:
            if len(found) >= limit:
                break
            state = self.states.get(message_id)
            if (
                state is None
                or message_id in seen
                or message_id in self.in_flight
                or message_id in self.deferred
                or message_id in self.dead
            ):
                continue
            seen.add(message_id)
            body = self._bodies.get(message_id)
            if body is not None:
                found.append((message_id, state.attempts, body[0], body[3]))
        return found

    def promote(self, now_us: int) -> None:
        """Deferred messages whose time has come join the ready FIFO."""
        while self._deferred and self._deferred[0][0] <= now_us:
            deliver_at, message_id = heapq.heappop(self._deferred)
            state = self.states.get(message_id)
            if state is None or message_id not in self.deferred:
                continue
            if state.deliver_at_us != deliver_at:
                continue  # deferred again since; a newer heap entry exists
            self.deferred.discard(message_id)
            self._ready.append(message_id)

    # -- internals ---------------------------------------------------------------------------

    def _set(self, message_id: str, state: MessageState, now_us: int) -> None:
        self.in_flight.discard(message_id)
        self.deferred.discard(message_id)
        self.dead.discard(message_id)
        if state.dead:
            # Its body is in the dead-letter table now; a redrive reads it back from there.
            self.states[message_id] = state
            self.dead.add(message_id)
            self._bodies.pop(message_id, None)
            return
        if state.finished:
            self.states.pop(message_id, None)
            self._bodies.pop(message_id, None)
            if self._remember_finished:
                self._finished.add(message_id)
            return
        self._place(message_id, state, now_us)

    def _place(self, message_id: str, state: MessageState, now_us: int) -> None:
        self.states[message_id] = state
        if state.dead:
            self.dead.add(message_id)
        elif state.in_flight:
            self.in_flight.add(message_id)
            expires = state.lease_expires_at_us or now_us
            heapq.heappush(self._expiries, (expires, message_id, state.attempts))
        elif state.deliver_at_us is not None and state.deliver_at_us > now_us:
            self.deferred.add(message_id)
            heapq.heappush(self._deferred, (state.deliver_at_us, message_id))
        else:
            self._ready.append(message_id)

    def __len__(self) -> int:
        return len(self.states)
