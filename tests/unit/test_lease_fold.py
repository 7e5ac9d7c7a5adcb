"""The fold of lease events: random histories never break the queue's promises."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_engine.channel_queue import _EXPIRIES_SLACK, Answer, ChannelQueue, SettleError
from queue_engine.lease import (
    FRESH,
    EventKind,
    LeaseEvent,
    MessageState,
    apply,
    fold,
    initial,
)

LEASES = ["1-aaaaaaaaaaaa", "2-bbbbbbbbbbbb", "3-cccccccccccc", "2-dddddddddddd"]


@st.composite
def histories(draw: st.DrawFn) -> list[LeaseEvent]:
    """Arbitrary (often nonsensical) event sequences for one message, times increasing."""
    count = draw(st.integers(0, 30))
    events = []
    at = 0
    for _ in range(count):
        at += draw(st.integers(1, 50))
        kind = draw(st.sampled_from(list(EventKind)))
        attempt = draw(st.integers(1, 4))
        lease = draw(st.sampled_from(LEASES))
        expires = at + draw(st.integers(0, 80))
        events.append(
            LeaseEvent(
                "m",
                kind,
                attempt,
                at,
                lease=lease,
                lease_expires_at_us=expires
                if kind in (EventKind.DELIVER, EventKind.TOUCH)
                else None,
                deliver_at_us=at + draw(st.integers(0, 60)) if kind is EventKind.REQ else None,
            )
        )
    return events


@given(histories())
@settings(max_examples=400, deadline=None)
def test_no_two_valid_leases_no_resurrection_attempts_counted(events: list[LeaseEvent]) -> None:
    state = FRESH
    delivers = 0
    # The end of the current lease: when it was given back (REQ/FIN), or the TIMEOUT's time.
    lease_end: int | None = None
    lease_expires: int | None = None
    finished = False
    dead = False
    for event in events:
        after = apply(state, event)
        accepted = after is not state
        if finished:
            assert not accepted, "an event was accepted after FIN"
        if dead and accepted:
            assert event.kind is EventKind.REDRIVE, "a dead message took an event"
        if accepted and event.kind is EventKind.REDRIVE:
            assert dead, "a live message was redriven"
            dead, delivers = False, 0
        elif accepted and event.kind is EventKind.DEAD:
            assert not state.in_flight and event.attempt == delivers
            dead = True
        elif accepted and event.kind is EventKind.EXPIRE:
            assert not state.in_flight
            finished = True
        elif accepted and event.kind is EventKind.EMPTY:
            # Drops the message whatever it was doing (a dead letter excepted).
            assert not dead
            finished = True
        if accepted and event.kind is EventKind.DELIVER:
            if delivers:
                # The previous lease had ended (handed back, or timed out at/after its expiry).
                assert lease_end is not None and lease_end <= event.at_us
            delivers += 1
            assert event.attempt == delivers
            lease_end, lease_expires = None, event.lease_expires_at_us
        elif accepted and event.kind is EventKind.TOUCH:
            lease_end, lease_expires = None, event.lease_expires_at_us
        elif accepted and event.kind is EventKind.TIMEOUT:
            assert lease_expires is not None and lease_expires <= event.at_us
            lease_end = event.at_us
        elif accepted and event.kind in (EventKind.REQ, EventKind.FIN):
            lease_end = event.at_us
            finished = event.kind is EventKind.FIN
        state = after
        assert state.attempts == delivers
        assert state.finished == finished
        assert state.dead == dead
    # Folding in any arrival order gives the same state: the fold orders by event time.
    shuffled = list(events)
    random.Random(len(events)).shuffle(shuffled)
    assert fold(shuffled).get("m", FRESH) == state


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Random consumer traffic: (op, message index or batch size, time step)."""
    ops = st.tuples(
        st.sampled_from(
            [
                "take",
                "fin",
                "req",
                "req_delay",
                "touch",
                "stale_fin",
                "expire",
                "redrive",
                "expire_ready",
                "fin_batch",
            ]
        ),
        st.integers(0, 5),
        st.integers(0, 40),
    )
    return draw(st.lists(ops, max_size=60))


@given(operations(), st.integers(0, 3), st.sampled_from([0, 60, 300]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_live_queue_is_the_fold_of_what_it_wrote(
    ops: list[tuple[str, int, int]], max_attempts: int, ttl_us: int, expired_dead: bool
) -> None:
    """Memory (ChannelQueue) equals the fold of the ledger events it produced, at every step;
    a message is never leased twice at once, and never delivered more than max_attempts times
    between redrives."""
    queue = ChannelQueue()
    queue.max_attempts = max_attempts
    queue.ttl_us = ttl_us
    queue.expired_dead = expired_dead
    ids = [f"{i:016x}" for i in range(6)]
    now = 1_000
    # Message 2 has its own expiry, which replaces the topic's TTL for it.
    own = [None, None, now + 100, None, None, None]
    queue.add(ids, [b"x"] * 6, [now] * 6, [None, None, None, None, None, now + 50], now, None, own)
    expiry = {m: own[i] if own[i] is not None else 1_000 + ttl_us if ttl_us else None
              for i, m in enumerate(ids)}  # fmt: skip
    ledger: list[LeaseEvent] = []
    held: dict[str, str] = {}  # message id -> lease the "consumer" holds
    expired_letters = 0

    def check_dying(events: list[LeaseEvent]) -> None:
        nonlocal expired_letters
        dying, queue.dying = queue.dying, []
        assert [e.id for e in events if e.kind is EventKind.DEAD] == [x.id for x in dying]
        for letter in dying:
            assert queue.states[letter.id].dead and letter.body == b"x"
            if letter.last_event == "EXPIRE":
                limit = expiry[letter.id]
                assert expired_dead and limit is not None and letter.dead_at_us >= limit
                expired_letters += 1
            else:
                assert letter.attempts == max_attempts
                assert letter.last_event in ("REQ", "TIMEOUT")
        # With expired_dead, expiry dead-letters: no EXPIRE event ends a message.
        assert not expired_dead or all(e.kind is not EventKind.EXPIRE for e in events)

    for op, n, step in ops:
        now += step
        if op == "take":
            deliveries, events = queue.take(n + 1, now, 30, "c")
            for d in deliveries:
                holder = queue.states[d.id]
                assert holder.in_flight and holder.lease == d.lease
                assert not max_attempts or d.attempts <= max_attempts
                limit = expiry[d.id]
                assert limit is None or now < limit
            check_dying(events)
            ledger += events
            held.update({d.id: d.lease for d in deliveries})
        elif op == "expire_ready":
            events = queue.expire_ready(now)
            assert all(e.kind in (EventKind.EXPIRE, EventKind.DEAD) for e in events)
            for e in events:
                limit = expiry[e.id]
                assert limit is not None and e.at_us >= limit
            check_dying(events)
            ledger += events
        elif op == "expire":
            ledger += queue.expire(now)
        elif op == "redrive":
            revived = queue.redrive(None, now)
            assert {e.id for e in revived} == {m for m in ids if m in ledger_dead(ledger)}
            ledger += revived
            # A redrive reads bodies and own expiries back from the dead-letter table.
            queue.attach_bodies(
                [e.id for e in revived],
                [b"x"] * len(revived),
                [1_000] * len(revived),
                [own[ids.index(e.id)] for e in revived],
            )
            assert not queue.dead
        elif op == "fin_batch" and held:
            # Every held lease in one FIN (all or none): with n == 0 one of them twice, which
            # fails the whole batch and changes nothing.
            answers = [Answer(m, lease) for m, lease in sorted(held.items())]
            if n == 0:
                answers.append(answers[0])
            before = dict(queue.states)
            try:
                events = queue.settle(EventKind.FIN, answers, now)
            except SettleError as exc:
                assert queue.states == before
                assert n == 0 or any(
                    (state := queue.states.get(a.id)) is None
                    or not (state.in_flight or state.timed_out)
                    or state.lease != a.lease
                    for a in answers
                ), exc.failed
            else:
                assert n != 0 and [e.id for e in events] == [a.id for a in answers]
                ledger += events
                held.clear()
        elif held:
            message_id = sorted(held)[n % len(held)]
            lease = held[message_id]
            if op == "stale_fin":
                lease = "9-ffffffffffff"
            kind = {
                "fin": EventKind.FIN,
                "stale_fin": EventKind.FIN,
                "req": EventKind.REQ,
                "req_delay": EventKind.REQ,
                "touch": EventKind.TOUCH,
            }[op]
            try:
                ledger += queue.settle(
                    kind,
                    [Answer(message_id, lease)],
                    now,
                    delay_us=25 if op == "req_delay" else 0,
                    max_lease_us=100,
                )
            except SettleError:
                assert (
                    op == "stale_fin"
                    or queue.states.get(message_id) is None
                    or not (
                        queue.states[message_id].in_flight or queue.states[message_id].timed_out
                    )
                    or queue.states[message_id].lease != lease
                )
            else:
                assert op != "stale_fin"
                if kind is not EventKind.TOUCH:
                    held.pop(message_id)
        folded = fold(ledger)
        # Expired either way: ended by EXPIRE, or dead-lettered for it (expired_dead).
        expired_events = sum(e.kind is EventKind.EXPIRE for e in ledger)
        assert queue.expired_count == expired_events + expired_letters
        for message_id in ids:
            live = queue.states.get(message_id)
            expected = folded.get(message_id)
            if expected is None:
                assert live is not None and live.attempts == 0
            elif expected.finished:
                assert live is None
            else:
                assert live == expected
        assert queue.ready_count + len(queue.in_flight) + len(queue.deferred) + len(
            queue.dead
        ) == len(queue)


def ledger_dead(ledger: list[LeaseEvent]) -> set[str]:
    """The messages the fold of ``ledger`` has dead."""
    return {m for m, s in fold(ledger).items() if s.dead}


def test_touch_never_extends_past_delivery_plus_max_msg_timeout() -> None:
    queue = ChannelQueue()
    queue.add(["0000000000000001"], [b"x"], [0], [None], 0)
    [delivery], _ = queue.take(1, 1_000, 400, "c")
    for now in (1_300, 1_600, 1_900):
        queue.settle(
            EventKind.TOUCH, [Answer(delivery.id, delivery.lease)], now, max_lease_us=1_000
        )
    # Delivered at 1000 with max 1000: capped at 2000, not 1900 + 400.
    assert queue.states[delivery.id].lease_expires_at_us == 2_000
    assert queue.expire(1_999) == []
    [timeout] = queue.expire(2_000)
    assert timeout.kind is EventKind.TIMEOUT


def test_a_late_fin_wins_over_a_timeout_until_the_message_is_delivered_again() -> None:
    queue = ChannelQueue()
    queue.add(["0000000000000001", "0000000000000002"], [b"a", b"b"], [0, 0], [None, None], 0)
    (first, second), _ = queue.take(2, 10, 100, "c")
    assert len(queue.expire(200)) == 2
    # first: answered after its timeout, before anyone else took it: the FIN counts.
    queue.settle(EventKind.FIN, [Answer(first.id, first.lease)], 210)
    assert first.id not in queue.states
    # second: delivered again, so the old lease is stale.
    [again], _ = queue.take(5, 220, 100, "c")
    assert again.id == second.id and again.attempts == 2
    try:
        queue.settle(EventKind.FIN, [Answer(second.id, second.lease)], 230)
    except SettleError as exc:
        assert exc.failed == [second.id]
    else:
        raise AssertionError("a stale lease was accepted")


def test_batch_answers_are_all_or_nothing() -> None:
    queue = ChannelQueue()
    queue.add(["0000000000000001", "0000000000000002"], [b"a", b"b"], [0, 0], [None, None], 0)
    (one, two), _ = queue.take(2, 10, 100, "c")
    # pytest.raises, not try/except: a batch that did not fail would skip an except's assert.
    with pytest.raises(SettleError) as bad_lease:
        queue.settle(
            EventKind.FIN, [Answer(one.id, one.lease), Answer(two.id, "1-000000000000")], 20
        )
    assert bad_lease.value.failed == [two.id]
    assert queue.states[one.id].in_flight  # nothing applied
    # The same id twice in one batch: the second FIN is not valid after the first.
    with pytest.raises(SettleError) as twice:
        queue.settle(EventKind.FIN, [Answer(one.id, one.lease), Answer(one.id, one.lease)], 30)
    assert twice.value.failed == [one.id]
    assert queue.states[one.id].in_flight


def test_deferred_messages_wait_for_their_time_and_req_delay_defers() -> None:
    queue = ChannelQueue()
    queue.add(["0000000000000001"], [b"a"], [0], [500], 0)
    assert queue.take(1, 499, 100, "c")[0] == [] and len(queue.deferred) == 1
    [d], _ = queue.take(1, 500, 100, "c")
    queue.settle(EventKind.REQ, [Answer(d.id, d.lease)], 510, delay_us=50)
    assert queue.take(1, 550, 100, "c")[0] == []
    [again], _ = queue.take(1, 562, 100, "c")
    assert again.attempts == 2 and queue.requeue_count == 1


def test_states_are_immutable_values() -> None:
    # FRESH is one object shared by every message no event has touched (initial(), fold()):
    # a state that could change in place would change all of them at once.
    assert initial(None) is FRESH
    with pytest.raises(AttributeError):
        FRESH.attempts = 1  # type: ignore[misc]
    deliver = LeaseEvent("m", EventKind.DELIVER, 1, 10, "1-aaaaaaaaaaaa", 70, None, "c1")
    delivered = apply(FRESH, deliver)
    # apply() answers with a new state and leaves the one it was given as it was.
    assert delivered is not FRESH and delivered.in_flight and delivered.attempts == 1
    # A fold starts every message from FRESH: "n", whose only event is invalid (a TOUCH of an
    # attempt never delivered), is FRESH itself, untouched by "m"'s delivery.
    touch = LeaseEvent("n", EventKind.TOUCH, 1, 20, "1-aaaaaaaaaaaa", 80)
    states = fold([deliver, touch])
    assert states["m"] == delivered and states["n"] is FRESH
    assert MessageState() == FRESH and not FRESH.in_flight and FRESH.attempts == 0
    # Values: states built alike are equal and hash alike, whichever object holds them.
    again = apply(MessageState(), deliver)
    assert again is not delivered and again == delivered and hash(again) == hash(delivered)


def test_settled_leases_leave_the_expiry_heap_while_live_ones_still_time_out() -> None:
    queue = ChannelQueue()
    count = 30_000
    ids = [f"{i:016x}" for i in range(count)]
    queue.add(ids, [b"x"] * count, [0] * count, [None] * count, 0)
    kept: list[str] = []
    now = 10
    while True:
        deliveries, _ = queue.take(500, now, 60_000_000, "c")
        if not deliveries:
            break
        # All but one of each batch is FIN'd; that one stays in flight until its lease ends.
        *done, held = deliveries
        queue.settle(EventKind.FIN, [Answer(d.id, d.lease) for d in done], now)
        kept.append(held.id)
        now += 1
    assert len(queue.in_flight) == len(kept) == count // 500
    # Without compaction one entry per delivery would stay until its lease ended (60 s).
    assert len(queue._expiries) <= 2 * len(kept) + _EXPIRIES_SLACK < count
    timeouts = queue.expire(now + 120_000_000)
    assert sorted(e.id for e in timeouts) == sorted(kept)
    assert not queue.in_flight


def test_deliver_and_fin_states_carry_every_field() -> None:
    before = MessageState(attempts=1, requeues=2, timeouts=3, deliver_at_us=5, timed_out=True)
    deliver = LeaseEvent("m", EventKind.DELIVER, 2, 100, "2-00000000000a", 160, None, "c1")
    leased = MessageState(
        attempts=2,
        in_flight=True,
        lease="2-00000000000a",
        lease_owner="c1",
        delivered_at_us=100,
        lease_expires_at_us=160,
        lease_duration_us=60,
        requeues=2,
        timeouts=3,
    )
    delivered = apply(before, deliver)
    assert delivered == leased
    fin = LeaseEvent("m", EventKind.FIN, 2, 120, "2-00000000000a", None, None, None)
    assert apply(delivered, fin) == leased._replace(in_flight=False, finished=True)
