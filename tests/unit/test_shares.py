"""Who serves which share of a channel: the plan each node claims by, checked over random
clusters (hypothesis), and the claims as stored."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_engine.message import LANES, IdAllocator, id_to_hex
from queue_engine.shares import Holder, in_lanes, keep_lanes, lane_of, plan, served_by
from queue_engine.store.coordination import NodeRecord, Ownership


def node(lane: int, token: str = "t") -> NodeRecord:
    return NodeRecord(lane, f"{token}{lane}", f"http://n{lane}", None, 1, "h", 0.0)


def test_an_ids_lane_is_the_lane_of_the_node_that_allocated_it() -> None:
    for lane in (0, 5, 15):
        ids = IdAllocator(floor=123_456, lane=lane)
        first = ids.allocate(3, 1_700_000_000_000)
        hexes = [id_to_hex(first + i * LANES) for i in range(3)]
        assert {lane_of(h) for h in hexes} == {lane}
        mask = in_lanes(pa.array(hexes), frozenset({lane}))
        assert mask.to_pylist() == [True] * 3
        assert in_lanes(pa.array(hexes), frozenset({(lane + 1) % LANES})).to_pylist() == [False] * 3
    table = pa.table({"id": [id_to_hex(v) for v in range(40)]})
    kept = keep_lanes(table, frozenset({1, 2}))
    assert [int(i, 16) % LANES for i in kept["id"].to_pylist()] == [1, 2, 1, 2, 1, 2]
    assert keep_lanes(table, None) is table


def test_a_node_takes_its_own_share_and_every_share_without_a_live_node() -> None:
    a, b = node(0), node(1)
    first = plan({}, {0: a}, a)
    assert served_by(first, a) == frozenset(range(LANES))
    # B joins: A still holds B's share (B leaves it), and A hands it back on its next plan.
    joined = {0: a, 1: b}
    assert plan(first, joined, b) == first
    back = plan(first, joined, a)
    assert back[1] == Holder.of(b)
    assert served_by(back, a) == frozenset(range(LANES)) - {1}
    # B then plans with nothing to change; A dies: B takes every share with no live node.
    assert plan(back, joined, b) == back
    after = plan(back, {1: b}, b)
    assert served_by(after, b) == frozenset(range(LANES))


def test_a_pinned_share_stays_where_an_admin_moved_it() -> None:
    a, b = node(0), node(1)
    shares = {lane: Holder.of(b, pinned=lane == 0) for lane in range(LANES)}
    shares[1] = Holder.of(b)
    after = plan(shares, {0: a, 1: b}, b)
    assert after[0].pinned and after[0].is_node(b)
    # Its holder gone, a pinned share goes back to the rules.
    assert plan(shares, {0: a}, a)[0] == Holder.of(a)


@settings(max_examples=300, deadline=None)
@given(
    st.data(),
    st.sets(st.integers(0, LANES - 1), min_size=1, max_size=5),
)
def test_plans_never_let_two_live_nodes_hold_one_share(
    data: st.DataObject, lanes: set[int]
) -> None:
    """Nodes join, die and plan in random order, each plan made from the shares as they are
    (a put-if-absent claim made after a newer one fails, and its node reads again): a share
    is only ever taken from a node that is not live, and once every live node has planned
    twice in a quiet cluster every share is held by a live node, each live node holding its
    own."""
    generation = dict.fromkeys(lanes, 0)
    live = {lane: node(lane, "g0-") for lane in lanes}
    shares: dict[int, Holder] = {}
    for _ in range(data.draw(st.integers(1, 30))):
        step = data.draw(st.sampled_from(["plan", "plan", "plan", "die", "join"]))
        if step == "die" and len(live) > 1:
            gone = data.draw(st.sampled_from(sorted(live)))
            del live[gone]
        elif step == "join":
            lane = data.draw(st.sampled_from(sorted(lanes)))
            if lane not in live:
                generation[lane] += 1
                live[lane] = node(lane, f"g{generation[lane]}-")
        else:
            me = live[data.draw(st.sampled_from(sorted(live)))]
            after = plan(shares, live, me)
            for lane, holder in shares.items():
                new = after.get(lane)
                if holder.live(live) is not None and new != holder:
                    # Only the holder itself gives a live holder's share away.
                    assert holder.is_node(me), (lane, holder, me)
            shares = after
    for _ in range(2):
        for me in list(live.values()):
            shares = plan(shares, live, me)
    for lane in range(LANES):
        holder = shares[lane]
        assert holder.live(live) is not None, (lane, holder)
        if lane in live:
            assert holder.is_node(live[lane])


def test_claims_round_trip_and_old_single_holder_claims_hold_every_share(
    tmp_path: Path,
) -> None:
    owners = Ownership(str(tmp_path))
    a, b = node(0), node(1)
    assert owners.current("t", "c") is None
    assert owners.claim("t", "c", None, a)  # the form before shares
    legacy = owners.current("t", "c")
    assert legacy is not None and served_by(legacy.shares, a) == frozenset(range(LANES))
    shares = {0: Holder.of(a), 1: Holder.of(b, pinned=True)}
    assert owners.claim_shares("t", "c", legacy, shares)
    assert not owners.claim_shares("t", "c", legacy, {})  # that number is taken
    current = owners.current("t", "c")
    assert current is not None and dict(current.shares) == shares
