"""The sweep's fold (state_fold) against lease.apply, and its checkpoint against one pass."""

from __future__ import annotations

import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_engine.state_fold import FINISHED, fold_tables
from queue_engine.store.tables import STATE_SCHEMA
from tests.ledgers import BASE_US, Channel, channels, comparable, python_fold, rows_as_states


@given(channels(), st.integers(0, 600))
@settings(max_examples=300, deadline=None)
def test_fold_of_tables_is_the_fold_of_events(channel: Channel, later: int) -> None:
    now = BASE_US + later
    rows = fold_tables(None, channel.messages(), channel.ledger(), now, ledger_version=3)
    assert comparable(rows_as_states(rows)) == comparable(python_fold(channel, now))
    # Every message has a row (channels() draws at least one), each stamped with the ledger
    # version folded: a subset of {3} would also hold for no rows at all.
    assert rows["ledger_version"].to_pylist() == [3] * len(channel.ids)


@given(channels(max_events=60), st.data())
@settings(max_examples=300, deadline=None)
def test_state_plus_tail_equals_one_pass(channel: Channel, data: st.DataObject) -> None:
    """A sweep that checkpointed part of the ledger (FIN'd messages dropped) and a later sweep
    of the rest give what one pass over everything gives."""
    cut = data.draw(st.integers(0, len(channel.events)))
    msgs_cut = data.draw(st.integers(0, len(channel.ids)))
    ordered = sorted(channel.events, key=lambda e: e.at_us)
    first_ledger = Channel(channel.ids, channel.deliver_at, ordered[:cut]).ledger()
    messages = channel.messages()
    # The first sweep happens before any lease can have ended: nothing of its own is folded in.
    first = fold_tables(
        None, messages.slice(0, msgs_cut), first_ledger, BASE_US - 1, ledger_version=0
    )
    # Events of messages whose rows the first sweep had not read are replayed with those rows.
    early_ids = set(channel.ids[:msgs_cut])
    late = [e for e in ordered[:cut] if e.id not in early_ids]
    rest = Channel(channel.ids, channel.deliver_at, late + ordered[cut:]).ledger()
    state = first.filter(pc.not_equal(first["status"], FINISHED)).select(STATE_SCHEMA.names)
    now = BASE_US + data.draw(st.integers(0, 600))
    second = fold_tables(state, messages.slice(msgs_cut), rest, now, ledger_version=1)
    one_pass = fold_tables(None, messages, channel.ledger(), now, ledger_version=1)
    live = {k: v for k, v in comparable(rows_as_states(one_pass)).items() if v[0] != FINISHED}
    # Messages FIN'd by the first sweep are gone from the state for good.
    gone = set(first.filter(pc.equal(first["status"], FINISHED))["id"].to_pylist())
    got = {k: v for k, v in comparable(rows_as_states(second)).items() if v[0] != FINISHED}
    assert got == {k: v for k, v in live.items() if k not in gone}
    assert not gone & set(got)


def test_a_redriven_message_keeps_its_counts_through_a_state_row() -> None:
    """Redriven: attempts are 0 again, but the timeout it had still counts (a row that looked
    never delivered once lost it)."""
    from queue_engine.lease import EventKind, LeaseEvent

    m = "0000000000000001"
    lease = "1-aaaaaaaaaaaa"
    events = [
        LeaseEvent(m, EventKind.DELIVER, 1, BASE_US, lease, BASE_US + 10),
        LeaseEvent(m, EventKind.TIMEOUT, 1, BASE_US + 20),
        LeaseEvent(m, EventKind.DEAD, 1, BASE_US + 30),
        LeaseEvent(m, EventKind.REDRIVE, 1, BASE_US + 40),
    ]
    channel = Channel([m], [None], events)
    rows = fold_tables(None, channel.messages(), channel.ledger(), BASE_US + 50, ledger_version=0)
    [row] = rows.to_pylist()
    assert (row["status"], row["attempts"], row["timeouts"]) == ("ready", 0, 1)
    assert comparable(rows_as_states(rows)) == comparable(python_fold(channel, BASE_US + 50))
