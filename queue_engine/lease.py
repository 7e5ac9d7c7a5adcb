"""A message's delivery state on one channel, as the fold of its ledger events (pure).

This module is the single definition of what state a message is in. The API folds events as it
creates them; a restarted API, the sweep job and the SQL views fold the ledger table with the
same ``apply``. Time is never read here: events carry their time (``at_us``) and readers pass
``now_us`` to ``status``.

Order: a message's events are folded in ``at_us`` order (ties: ``RANK``). One API process gives
each channel's events strictly increasing times and applies them in that order, so its memory
and any later fold of the ledger agree.

Rules (nsqd's, made explicit so a stale event is recognisable by any reader):
- DELIVER starts attempt ``attempts + 1``; valid only when the message is ready (not in flight,
  not finished, not deferred past the event's time). Attempts count deliveries.
- FIN, REQ and TOUCH name the attempt and lease they answer. They are valid for the current
  attempt while it is in flight, and also after that attempt timed out but before it was
  delivered again: a consumer answering just after its lease ran out wins over the timeout.
- TIMEOUT of attempt n is valid only while n is in flight and its lease (as extended by TOUCH)
  had ended by the TIMEOUT's time.
- Nothing is valid after FIN: a finished message never comes back.
- DEAD (the channel's ``max_attempts`` reached: the message goes to the dead-letter table) is
  valid while the message is not in flight and names its current attempt count. Only REDRIVE
  is valid after DEAD; it makes the message ready again with its attempts reset to 0.
- EXPIRE (the topic's message TTL passed before the message could be delivered again) is
  valid while the message is neither in flight nor dead; like FIN, it ends the message.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class EventKind(StrEnum):
    DELIVER = "DELIVER"
    FIN = "FIN"
    REQ = "REQ"
    TOUCH = "TOUCH"
    TIMEOUT = "TIMEOUT"
    DEAD = "DEAD"
    REDRIVE = "REDRIVE"
    EXPIRE = "EXPIRE"
    # /channel/empty: every message the channel holds (ready, deferred, in flight) is dropped.
    EMPTY = "EMPTY"


# Tie-break for events of one message with the same time (only across processes).
RANK = {
    EventKind.DELIVER: 0,
    EventKind.TOUCH: 1,
    EventKind.TIMEOUT: 2,
    EventKind.REQ: 3,
    EventKind.FIN: 4,
    EventKind.DEAD: 5,
    EventKind.REDRIVE: 6,
    EventKind.EXPIRE: 7,
    EventKind.EMPTY: 8,
}


class Status(StrEnum):
    READY = "ready"
    DEFERRED = "deferred"
    IN_FLIGHT = "in_flight"
    FINISHED = "finished"
    DEAD = "dead"


# Events and states are NamedTuples: immutable like frozen dataclasses, and ~4x cheaper to
# build (a frozen dataclass sets each field through object.__setattr__), which matters as two
# of each are built per message consumed.


class LeaseEvent(NamedTuple):
    """One row of a channel's ledger."""

    id: str
    kind: EventKind
    attempt: int
    at_us: int
    # The lease token of the attempt (DELIVER creates it; FIN/REQ/TOUCH present it).
    lease: str | None = None
    # DELIVER and TOUCH: when the lease ends.
    lease_expires_at_us: int | None = None
    # REQ with a delay: not deliverable before this time.
    deliver_at_us: int | None = None
    consumer: str | None = None

    def sort_key(self) -> tuple[int, int]:
        return (self.at_us, RANK[self.kind])


class MessageState(NamedTuple):
    """Where one message stands on one channel."""

    attempts: int = 0
    in_flight: bool = False
    finished: bool = False
    # The current attempt's lease (kept after a timeout so a late FIN/TOUCH can still win).
    lease: str | None = None
    lease_owner: str | None = None
    delivered_at_us: int | None = None
    lease_expires_at_us: int | None = None
    # The lease length the consumer asked for at delivery; a TOUCH extends by as much.
    lease_duration_us: int = 0
    # Not deliverable before this (DPUB / defer=, or REQ with a delay).
    deliver_at_us: int | None = None
    # The current attempt ended by TIMEOUT and has not been delivered again.
    timed_out: bool = False
    requeues: int = 0
    timeouts: int = 0
    # In the dead-letter table: not delivered until redriven.
    dead: bool = False
    # Ended by EXPIRE rather than FIN (``finished`` is set as well).
    expired: bool = False

    def status(self, now_us: int) -> Status:
        if self.finished:
            return Status.FINISHED
        if self.dead:
            return Status.DEAD
        if self.in_flight:
            return Status.IN_FLIGHT
        if self.deliver_at_us is not None and self.deliver_at_us > now_us:
            return Status.DEFERRED
        return Status.READY


# A message no event has touched yet (shared: states are immutable).
FRESH = MessageState()


def initial(deliver_at_us: int | None) -> MessageState:
    """The state of a message entering a channel (deferred if published with a delay)."""
    return FRESH if deliver_at_us is None else MessageState(deliver_at_us=deliver_at_us)


def apply(state: MessageState, event: LeaseEvent) -> MessageState:
    """The state after ``event``; ``state`` itself (the same object) if the event is invalid."""
    if state.finished:
        return state
    kind = event.kind
    if state.dead:
        if kind is not EventKind.REDRIVE:
            return state
        # Attempts start again; the channel's requeue/timeout counters keep what happened.
        return MessageState(requeues=state.requeues, timeouts=state.timeouts)
    if kind is EventKind.DEAD:
        if state.in_flight or event.attempt != state.attempts:
            return state
        # Not deferred any more: a dead message waits for a REDRIVE, not for a time.
        return state._replace(dead=True, timed_out=False, deliver_at_us=None)
    if kind is EventKind.REDRIVE:
        return state
    if kind is EventKind.EXPIRE:
        if state.in_flight:
            return state
        return state._replace(finished=True, expired=True, timed_out=False)
    if kind is EventKind.EMPTY:
        # Whatever its attempt: nsqd's empty drops in-flight messages too (a late FIN fails).
        return state._replace(finished=True, in_flight=False, timed_out=False)
    if kind is EventKind.DELIVER:
        if (
            state.in_flight
            or event.attempt != state.attempts + 1
            or (state.deliver_at_us is not None and state.deliver_at_us > event.at_us)
        ):
            return state
        # Built directly, by position, rather than with _replace or keywords: this and FIN run
        # once per message delivered; keywords cost twice the positional call, _replace() more.
        # Fields in declaration order (test_lease_fold checks each).
        return MessageState(
            event.attempt,  # attempts
            True,  # in_flight
            False,  # finished
            event.lease,  # lease
            event.consumer,  # lease_owner
            event.at_us,  # delivered_at_us
            event.lease_expires_at_us,  # lease_expires_at_us
            (event.lease_expires_at_us or event.at_us) - event.at_us,  # lease_duration_us
            None,  # deliver_at_us
            False,  # timed_out
            state.requeues,  # requeues
            state.timeouts,  # timeouts
        )
    if event.attempt != state.attempts or state.attempts == 0:
        return state
    if kind is EventKind.TIMEOUT:
        if (
            not state.in_flight
            or state.lease_expires_at_us is None
            or state.lease_expires_at_us > event.at_us
        ):
            return state
        return state._replace(in_flight=False, timed_out=True, timeouts=state.timeouts + 1)
    # FIN, REQ, TOUCH: the consumer holding the current attempt's lease answers.
    if event.lease != state.lease or not (state.in_flight or state.timed_out):
        return state
    if kind is EventKind.FIN:
        return MessageState(
            state.attempts,  # attempts
            False,  # in_flight
            True,  # finished
            state.lease,  # lease
            state.lease_owner,  # lease_owner
            state.delivered_at_us,  # delivered_at_us
            state.lease_expires_at_us,  # lease_expires_at_us
            state.lease_duration_us,  # lease_duration_us
            state.deliver_at_us,  # deliver_at_us
            False,  # timed_out
            state.requeues,  # requeues
            state.timeouts,  # timeouts
        )
    if kind is EventKind.REQ:
        return state._replace(
            in_flight=False,
            timed_out=False,
            deliver_at_us=event.deliver_at_us,
            requeues=state.requeues + 1,
        )
    # TOUCH. After a timeout (not yet delivered again) it takes the lease back; the timeout
    # stays counted.
    return state._replace(
        in_flight=True, timed_out=False, lease_expires_at_us=event.lease_expires_at_us
    )


def fold(
    events: list[LeaseEvent], start: dict[str, MessageState] | None = None
) -> dict[str, MessageState]:
    """The state of every message the events mention, folding them in time order."""
    states: dict[str, MessageState] = dict(start or {})
    for event in sorted(events, key=LeaseEvent.sort_key):
        states[event.id] = apply(states.get(event.id, FRESH), event)
    return states
