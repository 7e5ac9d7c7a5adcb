"""Random channels for property tests: message rows and a ledger of (often nonsensical) events."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from hypothesis import strategies as st

from queue_engine.lease import EventKind, LeaseEvent, MessageState, apply, initial
from queue_engine.state_fold import FINISHED, sweep_timeout
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    HEADERS_TYPE,
    STATE_SCHEMA,
    columns_as_lists,
    events_to_arrow,
    state_from_values,
)

LEASES = ["1-aaaaaaaaaaaa", "2-bbbbbbbbbbbb", "3-cccccccccccc", "2-dddddddddddd"]
_TS = pa.timestamp("us", tz="UTC")
# Event times are µs after this base (a real epoch, so Spark's timestamps are ordinary).
BASE_US = 1_790_000_000_000_000


@dataclass
class Channel:
    ids: list[str]
    deliver_at: list[int | None]
    events: list[LeaseEvent]

    def messages(self) -> pa.Table:
        n = len(self.ids)
        return pa.Table.from_arrays(
            [
                pa.array(self.ids, pa.string()),
                pa.array([b"x"] * n, pa.binary()),
                pa.array([BASE_US] * n, pa.int64()).cast(_TS),
                pa.array(self.deliver_at, pa.int64()).cast(_TS),
                pa.array(list(range(n)), pa.int64()),
                pa.nulls(n, _TS),
                pa.nulls(n, pa.string()),
                pa.nulls(n, HEADERS_TYPE),
            ],
            schema=CHANNEL_MESSAGES_SCHEMA,
        )

    def ledger(self) -> pa.Table:
        return events_to_arrow(self.events)


@st.composite
def channels(draw: st.DrawFn, max_messages: int = 6, max_events: int = 40) -> Channel:
    n = draw(st.integers(1, max_messages))
    ids = [f"{i:016x}" for i in range(1, n + 1)]
    deliver_at = [
        draw(st.one_of(st.none(), st.integers(0, 200).map(lambda d: BASE_US + d))) for _ in ids
    ]
    events = []
    at = BASE_US
    for _ in range(draw(st.integers(0, max_events))):
        at += draw(st.integers(0, 30))  # ties happen: the fold breaks them by RANK
        kind = draw(st.sampled_from(list(EventKind)))
        expires = at + draw(st.integers(0, 80))
        events.append(
            LeaseEvent(
                draw(st.sampled_from(ids)),
                kind,
                draw(st.integers(1, 4)),
                at,
                lease=draw(st.sampled_from(LEASES)),
                lease_expires_at_us=expires
                if kind in (EventKind.DELIVER, EventKind.TOUCH)
                else None,
                deliver_at_us=at + draw(st.integers(0, 60)) if kind is EventKind.REQ else None,
                consumer=draw(st.sampled_from([None, "c1", "c2"])),
            )
        )
    return Channel(ids, deliver_at, events)


def python_fold(channel: Channel, now_us: int) -> dict[str, tuple[MessageState, str, bool]]:
    """The reference: lease.apply over each message's events in time order, then the sweep's
    TIMEOUT at ``now_us``. id -> (state, status, swept timeout)."""
    states = {m: initial(d) for m, d in zip(channel.ids, channel.deliver_at, strict=True)}
    for event in sorted(channel.events, key=LeaseEvent.sort_key):
        states[event.id] = apply(states[event.id], event)
    out = {}
    for message_id, state in states.items():
        swept = sweep_timeout(state, now_us)
        status = FINISHED if swept.finished else swept.status(now_us).value
        out[message_id] = (swept, status, swept is not state)
    return out


def rows_as_states(table: pa.Table) -> dict[str, tuple[MessageState, str, bool]]:
    """Fold output rows (STATE_SCHEMA + swept_timeout) read back as the reference's shape."""
    fields = [f for f in STATE_SCHEMA.names if f not in _NOT_STATE]
    ids, statuses, swept, *values = columns_as_lists(
        table, ["id", "status", "swept_timeout", *fields]
    )
    out = {}
    for i, message_id in enumerate(ids):
        status = str(statuses[i])
        state = state_from_values([v[i] for v in values], status)
        if status == FINISHED:
            state = _finished(state)
        out[str(message_id)] = (state, status, bool(swept[i]))
    return out


_NOT_STATE = {"id", "status", "published_at", "topic_version", "ledger_version", "swept_at"}


def _finished(state: MessageState) -> MessageState:
    return state._replace(finished=True, in_flight=False, timed_out=False)


def comparable(
    states: dict[str, tuple[MessageState, str, bool]],
) -> dict[str, tuple[object, ...]]:
    """What a state row records (a finished message's lease details do not matter)."""
    out: dict[str, tuple[object, ...]] = {}
    for message_id, (s, status, swept) in states.items():
        if status == FINISHED:
            out[message_id] = (status, s.attempts, s.requeues, s.timeouts)
        else:
            out[message_id] = (
                status,
                s.attempts,
                s.in_flight,
                s.lease,
                s.lease_owner,
                s.delivered_at_us,
                s.lease_expires_at_us,
                s.lease_duration_us,
                s.deliver_at_us,
                s.timed_out,
                s.requeues,
                s.timeouts,
                swept,
            )
    return out
