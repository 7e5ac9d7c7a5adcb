from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from queue_engine.message import SEQUENCE_BITS, IdAllocator, id_from_hex, id_timestamp_ms, id_to_hex
from queue_engine.store.ids import hex_id_array


def test_ids_never_go_backwards_even_if_the_clock_does() -> None:
    ids = IdAllocator()
    a = ids.allocate(3, now_ms=1_000)
    b = ids.allocate(2, now_ms=500)  # the clock jumped back
    c = ids.allocate(1, now_ms=2_000)
    assert a == 1_000 << SEQUENCE_BITS
    assert b == a + 3
    assert c == 2_000 << SEQUENCE_BITS
    assert id_timestamp_ms(c) == 2_000


def test_floor_from_existing_table_wins() -> None:
    ids = IdAllocator(floor=(5_000 << SEQUENCE_BITS) + 7)
    assert ids.allocate(1, now_ms=4_000) == (5_000 << SEQUENCE_BITS) + 7


@given(st.integers(min_value=0, max_value=(1 << 62)), st.integers(min_value=1, max_value=300))
def test_hex_array_matches_python_formatting(first: int, count: int) -> None:
    expected = [id_to_hex(v) for v in range(first, first + count)]
    assert hex_id_array(first, count).to_pylist() == expected
    assert all(id_from_hex(h) == first + i for i, h in enumerate(expected))
