"""The sweep's quick fold (queue_engine.quick_fold) against the full fold of the same inputs."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_engine.lease import EventKind, LeaseEvent
from queue_engine.quick_fold import fold_quickly
from queue_engine.state_fold import FINISHED, FOLD_OUTPUT_SCHEMA, fold_tables
from queue_engine.store.tables import STATE_SCHEMA
from tests.ledgers import BASE_US, LEASES, Channel, channels

# How one message's events are drawn: mostly the shapes a consumed channel has (one DELIVER
# and its FIN), and near misses of that shape that the full fold must decide.
_SHAPES = [
    "none",
    "consumed",
    "consumed",
    "other_attempt",
    "other_lease",
    "fin_first",
    "same_time",
    "delivered",
    "requeued",
    "requeued_then_fin",
    "timed_out_then_fin",
    "twice",
    "delivered_twice",
]


def _shaped(
    m: str, shape: str, at: int, lease: str, attempt: int, expires: int
) -> list[LeaseEvent]:
    """One message's events in one of _SHAPES."""

    def deliver(t: int = at) -> LeaseEvent:
        return LeaseEvent(m, EventKind.DELIVER, attempt, t, lease, expires, consumer="c1")

    def answer(kind: EventKind, a: int = attempt, t: int = at + 5, lz: str = lease) -> LeaseEvent:
        return LeaseEvent(m, kind, a, t, lz, deliver_at_us=t if kind is EventKind.REQ else None)

    fin = EventKind.FIN
    return {
        "none": [],
        "consumed": [deliver(), answer(fin)],
        "other_attempt": [deliver(), answer(fin, a=attempt + 1)],
        "other_lease": [deliver(), answer(fin, lz=LEASES[(LEASES.index(lease) + 1) % 4])],
        "fin_first": [deliver(t=at + 10), answer(fin, t=at)],
        "same_time": [answer(fin, t=at), deliver(t=at)],
        "delivered": [deliver()],
        "requeued": [deliver(), answer(EventKind.REQ)],
        "requeued_then_fin": [deliver(), answer(EventKind.REQ), answer(fin, t=at + 7)],
        "timed_out_then_fin": [
            deliver(),
            LeaseEvent(m, EventKind.TIMEOUT, attempt, expires + 1),
            answer(fin, t=expires + 2),
        ],
        "twice": [deliver(), answer(fin), deliver(t=at + 9), answer(fin)],
        # The second DELIVER while the first is in flight is stale, and so is its FIN.
        "delivered_twice": [
            deliver(),
            LeaseEvent(m, EventKind.DELIVER, attempt + 1, at + 1, lease, expires, consumer="c2"),
            answer(fin, a=attempt + 1, t=at + 2),
        ],
    }[shape]


@st.composite
def consumptions(draw: st.DrawFn, max_messages: int = 12) -> Channel:
    n = draw(st.integers(1, max_messages))
    ids = [f"{i:016x}" for i in range(1, n + 1)]
    deliver_at = [
        draw(st.one_of(st.none(), st.integers(0, 200).map(lambda d: BASE_US + d))) for _ in ids
    ]
    events: list[LeaseEvent] = []
    for m in ids:
        at = BASE_US + draw(st.integers(0, 300))
        events += _shaped(
            m,
            draw(st.sampled_from(_SHAPES)),
            at,
            draw(st.sampled_from(LEASES)),
            draw(st.sampled_from([1, 1, 1, 2])),
            at + draw(st.integers(0, 80)),
        )
    return Channel(ids, deliver_at, events)


def _same_rows(quick: pa.Table, full: pa.Table) -> None:
    order = [("id", "ascending")]
    assert quick.schema == full.schema
    assert quick.sort_by(order).to_pylist() == full.sort_by(order).to_pylist()


@given(st.one_of(consumptions(), channels()), st.data())
@settings(max_examples=400, deadline=None)
def test_quick_fold_gives_the_full_folds_rows(channel: Channel, data: st.DataObject) -> None:
    """From no state, and from the state of an earlier fold of each message's first events
    (a cut drawn per message) and of some of the channel's rows: the same rows, column for
    column."""
    ordered = sorted(channel.events, key=LeaseEvent.sort_key)
    cuts = {m: data.draw(st.integers(0, sum(e.id == m for e in ordered))) for m in channel.ids}
    before: list[LeaseEvent] = []
    after: list[LeaseEvent] = []
    for event in ordered:
        (before if cuts[event.id] > 0 else after).append(event)
        cuts[event.id] -= 1
    msgs_cut = data.draw(st.integers(0, len(channel.ids)))
    messages = channel.messages()
    first_now = BASE_US + data.draw(st.integers(-1, 400))
    first = fold_tables(
        None,
        messages.slice(0, msgs_cut),
        Channel(channel.ids, channel.deliver_at, before).ledger(),
        first_now,
        ledger_version=0,
    )
    state = first.filter(pc.not_equal(first["status"], FINISHED)).select(STATE_SCHEMA.names)
    state = state.cast(STATE_SCHEMA)
    rest = Channel(channel.ids, channel.deliver_at, after).ledger()
    now = first_now + data.draw(st.integers(0, 400))
    for inputs in (
        (state, messages.slice(msgs_cut), rest),
        (None, messages, channel.ledger()),
        (state, None, None),
        (None, None, rest),
        # A row twice in the channel table is one message (the fold takes its first row).
        (state, pa.concat_tables([messages, messages]), rest),
    ):
        _same_rows(fold_quickly(*inputs, now, 7), fold_tables(*inputs, now, 7))


def test_what_falls_due_exactly_now_is_folded() -> None:
    """A lease that ends at ``now`` times out, a deferral that ends at ``now`` is ready: neither
    state row is carried over as it was, and a lease delivered since that ends at ``now``
    times out too."""
    leased, deferred, later = "0000000000000001", "0000000000000002", "0000000000000003"
    now = BASE_US + 100
    events = [LeaseEvent(leased, EventKind.DELIVER, 1, BASE_US, LEASES[0], now, consumer="c")]
    channel = Channel([leased, deferred, later], [None, now, None], events)
    state = fold_tables(None, channel.messages(), channel.ledger(), BASE_US + 1, 0)
    assert state["status"].to_pylist() == ["in_flight", "deferred", "ready"]
    state = state.select(STATE_SCHEMA.names).cast(STATE_SCHEMA)
    since = Channel(
        channel.ids,
        channel.deliver_at,
        [LeaseEvent(later, EventKind.DELIVER, 1, BASE_US + 2, LEASES[1], now, consumer="c")],
    ).ledger()
    rows = fold_quickly(state, None, since, now, 1)
    _same_rows(rows, fold_tables(state, None, since, now, 1))
    by_id = {r["id"]: (r["status"], r["swept_timeout"]) for r in rows.to_pylist()}
    assert by_id == {leased: ("ready", True), deferred: ("ready", False), later: ("ready", True)}


def _one_state_row(events: list[LeaseEvent], now: int, **changes: Any) -> pa.Table:
    """The state a sweep at ``now`` writes for message A after ``events``, with ``changes``."""
    channel = Channel([A], [None], events)
    row = fold_tables(None, channel.messages(), channel.ledger(), now, 0).to_pylist()[0]
    return (
        pa.Table.from_pylist([row | changes], schema=FOLD_OUTPUT_SCHEMA)
        .select(STATE_SCHEMA.names)
        .cast(STATE_SCHEMA)
    )


A = "0000000000000001"


def test_state_rows_unlike_a_sweeps_and_odd_times_give_the_full_folds_rows() -> None:
    """Rows a sweep would not write (an id twice, a finished or unknown status, attempts that
    do not fit the status), a clock behind the last sweep's, a lease ending at the epoch."""
    deliver = LeaseEvent(A, EventKind.DELIVER, 1, BASE_US, LEASES[0], BASE_US + 10**6)
    fin = Channel([A], [None], [LeaseEvent(A, EventKind.FIN, 1, BASE_US + 5, LEASES[0])])
    ready = _one_state_row([], BASE_US)
    held = _one_state_row([deliver], BASE_US + 1)
    cases = [
        (pa.concat_tables([ready, ready]), None, None, BASE_US),
        (pa.concat_tables([held, held]), None, fin.ledger(), BASE_US + 9),
        (_one_state_row([deliver], BASE_US + 1, attempts=0), None, None, BASE_US + 9),
        (_one_state_row([deliver], BASE_US + 1, attempts=0), None, fin.ledger(), BASE_US + 9),
        (_one_state_row([], BASE_US + 100, deliver_at=BASE_US + 50), None, None, BASE_US + 10),
        (_one_state_row([], BASE_US, status=FINISHED), None, None, BASE_US),
        (_one_state_row([], BASE_US, status="lost"), None, None, BASE_US),
        (
            _one_state_row([], BASE_US, attempts=-1),
            None,
            Channel(
                [A], [None], [LeaseEvent(A, EventKind.DELIVER, 0, BASE_US, LEASES[0], 1)]
            ).ledger(),
            BASE_US + 9,
        ),
        (
            None,
            Channel([A], [None], []).messages(),
            Channel(
                [A], [None], [LeaseEvent(A, EventKind.DELIVER, 1, BASE_US, LEASES[0], 0)]
            ).ledger(),
            BASE_US + 9,
        ),
    ]
    for state, messages, ledger, now in cases:
        _same_rows(
            fold_quickly(state, messages, ledger, now, 3),
            fold_tables(state, messages, ledger, now, 3),
        )


def test_a_consumed_backlog_is_folded_without_the_row_by_row_fold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10,000 messages in the state, 4,500 of them in flight there. Since: those 4,500 FIN'd,
    4,500 more delivered and FIN'd, 500 delivered (half of these leases ended by now), 2,000
    new messages (half deferred past now). The rows come out as the full fold's, and none
    went through ``fold_tables``."""
    import queue_engine.quick_fold as quick

    n = 12_000
    ids = [f"{i:016x}" for i in range(1, n + 1)]
    now = BASE_US + 10**7
    delivers = [
        LeaseEvent(m, EventKind.DELIVER, 1, BASE_US + i, LEASES[i % 4], BASE_US + 10**8, None, "c")
        for i, m in enumerate(ids[:9_000])
    ]
    fins = [
        LeaseEvent(m, EventKind.FIN, 1, BASE_US + 10**6 + i, LEASES[i % 4])
        for i, m in enumerate(ids[:9_000])
    ]
    held = [
        LeaseEvent(m, EventKind.DELIVER, 1, BASE_US + i, None, now + (-1) ** i * 10**6, None, "c")
        for i, m in enumerate(ids[9_000:9_500])
    ]
    deliver_at = [None] * 11_000 + [now + 1] * 1_000
    channel = Channel(ids, deliver_at, delivers[:4_500])
    messages = channel.messages()
    state = fold_tables(None, messages.slice(0, 10_000), channel.ledger(), BASE_US + 10**5, 0)
    state = state.select(STATE_SCHEMA.names).cast(STATE_SCHEMA)
    assert pc.sum(pc.equal(state["status"], "in_flight")).as_py() == 4_500
    ledger = Channel(ids, deliver_at, delivers[4_500:] + fins + held).ledger()
    seen: list[int] = []

    def counting(*tables_then_times: Any) -> pa.Table:
        seen.append(sum(t.num_rows for t in tables_then_times[:3] if t is not None))
        return fold_tables(*tables_then_times)

    monkeypatch.setattr(quick, "fold_tables", counting)
    new = messages.slice(10_000)
    rows = fold_quickly(state, new, ledger, now, 1)
    assert seen == [0]
    _same_rows(rows, fold_tables(state, new, ledger, now, 1))
    statuses = pc.value_counts(rows["status"]).to_pylist()
    assert {s["values"]: s["counts"] for s in statuses} == {
        FINISHED: 9_000,
        "in_flight": 250,
        "ready": 500 + 250 + 1_000,
        "deferred": 1_000,
    }
    assert pc.sum(rows["swept_timeout"]).as_py() == 250
