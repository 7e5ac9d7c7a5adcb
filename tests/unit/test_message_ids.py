from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_engine.message import (
    LANES,
    SEQUENCE_BITS,
    IdAllocator,
    id_from_hex,
    id_timestamp_ms,
    id_to_hex,
)
from queue_engine.store.tables import hex_id_array


def test_ids_never_go_backwards_even_if_the_clock_does() -> None:
    ids = IdAllocator()
    a = ids.allocate(3, now_ms=1_000)
    b = ids.allocate(2, now_ms=500)  # the clock jumped back
    c = ids.allocate(1, now_ms=2_000)
    assert a == 1_000 << SEQUENCE_BITS
    assert b == a + 3 * LANES
    assert c == 2_000 << SEQUENCE_BITS
    assert id_timestamp_ms(c) == 2_000


def test_floor_from_existing_table_wins() -> None:
    ids = IdAllocator(floor=(5_000 << SEQUENCE_BITS) + 7)
    assert ids.allocate(1, now_ms=4_000) == (5_000 << SEQUENCE_BITS) + LANES


@given(
    st.lists(
        st.tuples(st.integers(0, LANES - 1), st.integers(1, 50), st.integers(0, 3)),
        max_size=60,
    ),
    st.integers(min_value=0, max_value=1 << 40),
)
def test_nodes_in_different_lanes_never_share_an_id(
    steps: list[tuple[int, int, int]], floor: int
) -> None:
    """Nodes allocate at the same milliseconds from the same table floor: no id twice, and
    each node's own ids only grow."""
    nodes = {lane: IdAllocator(floor, lane) for lane in range(LANES)}
    seen: set[int] = set()
    last: dict[int, int] = {}
    now = 1_000
    for lane, count, tick in steps:
        now += tick
        first = nodes[lane].allocate(count, now)
        block = range(first, first + count * LANES, LANES)
        assert first >= floor and first > last.get(lane, -1)
        assert all(i % LANES == lane for i in block)
        assert seen.isdisjoint(block)
        seen.update(block)
        last[lane] = block[-1]


def test_a_lane_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="id lane"):
        IdAllocator(0, LANES)


@given(
    st.integers(min_value=0, max_value=(1 << 62)),
    st.integers(min_value=1, max_value=300),
    st.sampled_from([1, LANES]),
)
def test_hex_array_matches_python_formatting(first: int, count: int, step: int) -> None:
    expected = [id_to_hex(v) for v in range(first, first + count * step, step)]
    assert hex_id_array(first, count, step).to_pylist() == expected
    assert all(id_from_hex(h) == first + i * step for i, h in enumerate(expected))
