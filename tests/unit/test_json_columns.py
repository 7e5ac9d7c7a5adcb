"""A commit's typed columns read by Arrow's JSON reader: the values msgspec reads from the same
checked bodies, or None where the reader refuses them (the writer then uses msgspec)."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from queue_engine import json_columns
from queue_engine.json_columns import MIN_ROWS, checked_columns
from queue_engine.topic_schema import TopicSchema, parse_schema

SCHEMA = parse_schema(
    "sku STRING NOT NULL, amount DOUBLE, qty INT, big BIGINT, placed_at TIMESTAMP, "
    "day DATE, gift BOOLEAN"
)


def _msgspec_columns(schema: TopicSchema, bodies: list[bytes]) -> list[list[object]]:
    return [c.to_pylist() for c in schema.arrays(schema.rows(bodies))]


def _body(rnd: random.Random) -> bytes:
    value: dict[str, object] = {
        "sku": "".join(rnd.choice('ab\u00e9\u4e2d\U0001f600"\\\n\t') for _ in range(5)),
        "amount": rnd.choice([rnd.uniform(-1e300, 1e300), rnd.randint(-(2**62), 2**62), -0.0]),
        "qty": rnd.randint(-(2**31), 2**31 - 1),
        "big": rnd.randint(-(2**63), 2**63 - 1),
        "placed_at": f"{rnd.randint(1, 9998):04d}-0{rnd.randint(1, 9)}-1{rnd.randint(0, 9)}"
        f"{rnd.choice('T ')}12:34:56{rnd.choice(['', '.5', '.123456'])}"
        f"{rnd.choice(['Z', '+05:30', '-11:00', '-00:00'])}",
        "day": f"{rnd.randint(1, 9999):04d}-12-31",
        "gift": rnd.choice([True, False, None]),
        "other": {"nested": [1, None, {"x": "y"}], "empty": {}},
    }
    for name in ("amount", "qty", "big", "placed_at", "day"):
        if rnd.random() < 0.2:
            del value[name]
    items = list(value.items())
    rnd.shuffle(items)
    # Some pretty-printed: newlines between tokens, which the reader must not take for rows.
    indent = rnd.choice([None, None, 2])
    return json.dumps(dict(items), indent=indent, ensure_ascii=rnd.random() < 0.5).encode()


def test_the_reader_gives_msgspecs_values_for_a_commit_of_checked_bodies() -> None:
    rnd = random.Random(7)
    bodies = [_body(rnd) for _ in range(2 * MIN_ROWS)]
    SCHEMA.check(bodies)
    got = checked_columns(SCHEMA, bodies)
    assert got is not None
    assert [c.type for c in got] == [f.type for f in SCHEMA.arrow_fields]
    assert [c.to_pylist() for c in got] == _msgspec_columns(SCHEMA, bodies)
    assert any(b"\n" in b for b in bodies)


def test_an_escaped_key_names_its_field() -> None:
    bodies = [b'{"s\\u006bu": "k%d", "qty": %d}' % (i, i) for i in range(3)]
    got = checked_columns(SCHEMA, bodies, min_rows=1)
    assert got is not None
    assert got[0].to_pylist() == ["k0", "k1", "k2"]
    assert got[2].to_pylist() == [0, 1, 2]


@pytest.mark.parametrize(
    "odd",
    [
        # msgspec rounds a seventh fractional digit; the reader refuses it.
        b'{"sku": "a", "placed_at": "2026-01-31T12:00:00.1234567Z"}',
        # A key given twice: msgspec takes the last, the reader refuses.
        b'{"sku": "a", "sku": "b"}',
        # Lower-case separators, which RFC 3339 allows and the reader does not.
        b'{"sku": "a", "placed_at": "2026-01-31t12:00:00z"}',
    ],
)
def test_bodies_the_reader_refuses_are_left_to_msgspec(odd: bytes) -> None:
    bodies = [b'{"sku": "fine"}'] * 10 + [odd]
    SCHEMA.check(bodies)
    assert checked_columns(SCHEMA, bodies, min_rows=1) is None


def test_a_commit_of_few_rows_is_left_to_msgspec() -> None:
    bodies = [b'{"sku": "a"}'] * (MIN_ROWS - 1)
    assert checked_columns(SCHEMA, bodies) is None
    columns = checked_columns(SCHEMA, [*bodies, b'{"sku": "b"}'])
    assert columns is not None
    assert columns[0] == pa.array(["a"] * (MIN_ROWS - 1) + ["b"])


def test_a_commit_longer_than_a_block_is_read_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks end between rows, pretty-printed bodies included; a body longer than a block
    is left to msgspec."""
    rnd = random.Random(11)
    bodies = [_body(rnd) for _ in range(MIN_ROWS)]
    monkeypatch.setattr(json_columns, "BLOCK_BYTES", 2048)
    got = checked_columns(SCHEMA, bodies)
    assert got is not None
    assert [c.to_pylist() for c in got] == _msgspec_columns(SCHEMA, bodies)
    long = b'{"sku": "%s"}' % (b"y" * 4096)
    assert checked_columns(SCHEMA, [*bodies, long]) is None
