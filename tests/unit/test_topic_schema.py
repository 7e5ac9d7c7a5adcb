"""Typed topics' schemas: arbitrary JSON against arbitrary schemas is accepted exactly when it
fits by the rules docs/http-api.md states, and converts to the values those rules give; the
reason a body is refused names its line and field; schemas parse and evolve by their rules."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.json_columns import checked_columns
from queue_engine.topic_schema import RESERVED, TopicSchema, evolve, parse_schema

TYPES = ("STRING", "BOOLEAN", "INT", "BIGINT", "DOUBLE", "DATE", "TIMESTAMP")
NAMES = ("a", "b_2", "Sku", "amount")
# RFC 3339, as docs/http-api.md states it: T, t or a space between date and time; a fraction
# of a second of any length, rounded to the microsecond; Z, z, +hh:mm or +hhmm.
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d+))?"
    r"([Zz]|([+-])(\d\d):?(\d\d))",
    re.ASCII,
)
_DATE = re.compile(r"\d{4}-\d\d-\d\d", re.ASCII)


def expected(kind: str, value: Any) -> tuple[bool, Any]:
    """(fits, its column value) by the documented rules."""
    if value is None:
        return True, None
    match kind:
        case "STRING":
            return isinstance(value, str), value
        case "BOOLEAN":
            return isinstance(value, bool), value
        case "INT" | "BIGINT":
            bits = 31 if kind == "INT" else 63
            fits = (
                isinstance(value, int)
                and not isinstance(value, bool)
                and -(2**bits) <= value < 2**bits
            )
            return fits, value
        case "DOUBLE":
            if isinstance(value, bool) or not isinstance(value, int | float):
                return False, None
            return True, float(value)
        case "DATE":
            if not isinstance(value, str) or not _DATE.fullmatch(value):
                return False, None
            try:
                return True, dt.date.fromisoformat(value)
            except ValueError:
                return False, None
        case _:
            match = _TIMESTAMP.fullmatch(value) if isinstance(value, str) else None
            if match is None:
                return False, None
            year, month, day, hour, minute, second, fraction, _, sign, oh, om = match.groups()
            try:
                offset = dt.timedelta(hours=int(oh or 0), minutes=int(om or 0))
                if offset >= dt.timedelta(hours=24) or int(om or 0) > 59:
                    return False, None
                local = dt.datetime(
                    int(year), int(month), int(day), int(hour), int(minute), int(second)
                )
                micros = round(float(f"0.{fraction or 0}") * 1_000_000)
                zone = dt.timezone(-offset if sign == "-" else offset)
                instant = (local + dt.timedelta(microseconds=micros)).replace(tzinfo=zone)
                return True, instant.astimezone(dt.UTC)
            except (ValueError, OverflowError):
                return False, None


_dates = st.dates().map(dt.date.isoformat)
_offsets = st.sampled_from(
    ["Z", "z", "+00:00", "+01:00", "-0530", "+23:59", "+24:00", "-00:60", "+1", ""]
)
_timestamps = st.builds(
    lambda d, sep, frac, zone: d.strftime(f"%Y-%m-%d{sep}%H:%M:%S") + frac + zone,
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31)),
    st.sampled_from(["T", " ", "t", "_"]),
    st.sampled_from(["", ".5", ".123456", ".1234567", "."]),
    _offsets,
)
_near_dates = st.builds(
    lambda y, m, d: f"{y:04d}-{m:02d}-{d:02d}",
    st.integers(0, 10000),
    st.integers(0, 13),
    st.integers(0, 32),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    _dates,
    _near_dates,
    _timestamps,
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_schemas = st.lists(
    st.tuples(st.sampled_from(NAMES), st.sampled_from(TYPES), st.booleans()),
    min_size=1,
    max_size=4,
    unique_by=lambda f: f[0].lower(),
)
_objects = st.dictionaries(st.sampled_from([*NAMES, "other"]), _json, max_size=5)
_bodies = st.one_of(_objects, _objects, _objects, _json)


# Values of each type around what fits it: random JSON almost never puts a value of the
# right kind under a declared field's name.
_KIND_VALUES = {
    "STRING": st.text(max_size=8),
    "BOOLEAN": st.booleans(),
    "INT": st.one_of(
        st.integers(-(2**31) - 1, 2**31), st.sampled_from([-(2**31) - 1, -(2**31), 2**31 - 1])
    ),
    "BIGINT": st.one_of(
        st.integers(-(2**63) - 1, 2**63), st.sampled_from([-(2**63) - 1, -(2**63), 2**63 - 1])
    ),
    "DOUBLE": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers()),
    "DATE": st.one_of(_dates, _near_dates),
    "TIMESTAMP": _timestamps,
}


def _bodies_for(fields: list[tuple[str, str, bool]]) -> st.SearchStrategy[Any]:
    """Bodies whose declared fields mostly hold values of (or near) their type."""
    typed = st.fixed_dictionaries(
        {},
        optional={
            **{name: st.one_of(_KIND_VALUES[kind], _json) for name, kind, _ in fields},
            "other": _json,
        },
    )
    return st.one_of(typed, typed, typed, _bodies)


def _draw_bodies(fields: list[tuple[str, str, bool]], data: Any) -> list[Any]:
    """Bodies drawn for ``fields``, or given as they are by an ``@example``."""
    if isinstance(data, list):
        return data
    return list(data.draw(st.lists(_bodies_for(fields), min_size=1, max_size=6)))


def schema_of(fields: list[tuple[str, str, bool]]) -> TopicSchema:
    return parse_schema(", ".join(f"{n} {t}{' NOT NULL' if nn else ''}" for n, t, nn in fields))


@given(_schemas, st.data())
@example([("at", "TIMESTAMP", False)], [{"at": "2026-01-31 00:00:00.5+01:00"}])
@example([("n", "INT", True)], [{"n": -(2**31)}, {"n": 2**31 - 1}])
@example([("n", "INT", False)], [{"n": -(2**31) - 1}])
def test_bodies_are_taken_exactly_when_they_fit_and_convert_to_their_values(
    fields: list[tuple[str, str, bool]], data: Any
) -> None:
    values = _draw_bodies(fields, data)
    schema = schema_of(fields)
    bodies = [json.dumps(v).encode() for v in values]
    first_unfit = None
    columns: list[list[Any]] = [[] for _ in fields]
    for line, value in enumerate(values, 1):
        fits = isinstance(value, dict)
        for i, (name, kind, not_null) in enumerate(fields):
            field_value = value.get(name) if isinstance(value, dict) else None
            ok, converted = expected(kind, field_value)
            fits = fits and ok and not (not_null and field_value is None)
            columns[i].append(converted)
        if not fits and first_unfit is None:
            first_unfit = line
    if first_unfit is None:
        schema.check(bodies)
        got = [c.to_pylist() for c in schema.arrays(schema.rows(bodies))]
        assert got == columns
        # What a commit of bodies that were checked converts them with: the same values, or
        # None where the reader refuses them (the writer then converts with msgspec).
        by_reader = checked_columns(schema, bodies, min_rows=1)
        assert by_reader is None or [c.to_pylist() for c in by_reader] == columns
        return
    with pytest.raises(QueueError) as checked:
        schema.check(bodies)
    assert checked.value.code is ErrorCode.INVALID_BODY
    with pytest.raises(QueueError) as refused:
        schema.rows(bodies)
    assert refused.value.code is ErrorCode.INVALID_BODY
    if len(bodies) > 1:
        assert refused.value.detail.startswith(f"line {first_unfit}: "), refused.value.detail


@given(_schemas, st.data())
@example([("at", "TIMESTAMP", False)], [{"at": "2026-01-31 00:00:00.5+01:00"}])
def test_lenient_conversion_keeps_every_value_that_fits_its_field(
    fields: list[tuple[str, str, bool]], data: Any
) -> None:
    """What the fanout and dead letters use: never refuses, each field on its own."""
    values = _draw_bodies(fields, data)
    schema = schema_of(fields)
    got = [c.to_pylist() for c in schema.lenient_columns([json.dumps(v).encode() for v in values])]
    want = []
    for name, kind, _ in fields:
        column = []
        for value in values:
            field_value = value.get(name) if isinstance(value, dict) else None
            ok, converted = expected(kind, field_value)
            column.append(converted if ok else None)
        want.append(column)
    assert got == want


def test_lenient_conversion_reads_an_instant_no_column_holds_as_null() -> None:
    """RFC 3339 takes these and msgspec decodes them; in UTC they fall before year 1 or after
    9999. A body published before its field was declared may hold one: it reads null, and the
    body's other fields keep their values."""
    schema = parse_schema("at TIMESTAMP, n INT")
    bodies = [
        b'{"at": "0001-01-01T00:00:00+01:00", "n": 1}',
        b'{"at": "9999-12-31T23:00:00-02:00", "n": 2}',
        b'{"at": "0001-01-01T00:00:00Z", "n": 3}',
    ]
    at, n = schema.lenient_columns(bodies)
    assert at.to_pylist() == [None, None, dt.datetime(1, 1, 1, tzinfo=dt.UTC)]
    assert n.to_pylist() == [1, 2, 3]


def test_the_reason_names_the_field_and_what_it_must_be() -> None:
    schema = parse_schema("sku STRING NOT NULL, qty INT, at TIMESTAMP")
    cases = {
        b'{"qty": 1}': "field sku: required (NOT NULL), absent or null",
        b'{"sku": "a", "qty": "2"}': (
            'field qty: expected INT: an integer from -2147483648 to 2147483647; got a string "2"'
        ),
        b'{"sku": "a", "at": 5}': (
            "field at: expected TIMESTAMP: an RFC 3339 time with its zone, as "
            "2026-01-31T12:00:00Z or 2026-01-31 12:00:00.5+01:00; got an integer 5"
        ),
        b"[]": "a typed topic takes a JSON object, not an array",
        # RFC 3339 takes it; in UTC it is before year 1, which no column holds.
        b'{"sku": "a", "at": "0001-01-01T00:00:00+01:00"}': "field at: out of range",
    }
    for content, reason in cases.items():
        with pytest.raises(QueueError) as refused:
            schema.rows([b'{"sku": "fine"}', content])
        assert refused.value.detail == f"line 2: {reason}"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("a", "'a': name TYPE"),
        ("a INT, A BIGINT", "field A twice"),
        ("a DECIMAL(10,2)", "field a: type DECIMAL(10, 2) is not taken"),
        ("a ARRAY<INT>", "field a: type ARRAY<INT> is not taken"),
        ("a INT DEFAULT 1", "field a: 'DEFAULT 1' is not taken"),
        ("a INT) USING delta AS SELECT 1 --", "a list of fields"),
        ("a INT b", "not Spark DDL"),
        ("`a INT", "not Spark DDL: Error tokenizing '`a INT'"),  # unclosed quote
        ("a STRING COMMENT 'x", "not Spark DDL: Error tokenizing"),
        ("`a b` INT", "field 'a b': a name is"),
        *[
            (f"{name} STRING", f"field '{name}': the tables' own column")
            for name in sorted(RESERVED)
        ],
    ],
)
def test_schemas_that_are_not_taken_say_why(text: str, reason: str) -> None:
    with pytest.raises(QueueError) as refused:
        parse_schema(text)
    assert refused.value.code is ErrorCode.INVALID_SCHEMA
    assert refused.value.detail.startswith(reason), refused.value.detail


def test_a_schema_has_one_canonical_text() -> None:
    schema = parse_schema("sku string not null COMMENT 'the item', `qty` int NULL, at timestamp")
    assert schema.ddl == "`sku` STRING NOT NULL, `qty` INT, `at` TIMESTAMP"
    assert parse_schema(schema.ddl) == schema


@pytest.mark.parametrize(
    ("new", "refusal"),
    [
        ("a INT NOT NULL, b STRING", None),
        ("a INT, b STRING", None),  # NOT NULL relaxed
        ("a INT NOT NULL, b STRING, c DATE", None),
        ("a INT NOT NULL", "field b is dropped"),
        ("a BIGINT NOT NULL, b STRING", "field a: INT to BIGINT"),
        ("a INT NOT NULL, b STRING NOT NULL", "field b: NOT NULL added"),
        ("a INT NOT NULL, b STRING, c DATE NOT NULL", "field c: a field added later is nullable"),
        ("b STRING, a INT NOT NULL", "fields keep their order"),
        ("a INT NOT NULL, c DATE, b STRING", "fields keep their order"),  # a new one goes last
        ("A INT NOT NULL, b STRING", "field a renamed to A"),
    ],
)
def test_a_schema_evolves_by_deltas_rules(new: str, refusal: str | None) -> None:
    old = parse_schema("a INT NOT NULL, b STRING")
    if refusal is None:
        evolve(old, parse_schema(new))
        return
    with pytest.raises(QueueError) as refused:
        evolve(old, parse_schema(new))
    assert refused.value.code is ErrorCode.SCHEMA_CHANGE_REFUSED
    assert refused.value.detail.startswith(refusal), refused.value.detail


def test_a_body_nested_too_deeply_is_refused_and_read_as_nulls_where_it_was_taken() -> None:
    """msgspec's depth follows Python's stack: a body nested thousands deep (in a field the
    schema does not declare) is refused, not a crash; taken before the topic was typed, it
    converts leniently to nulls instead of stopping the fanout."""
    schema = parse_schema("a DOUBLE")
    deep = b'{"a": 1, "doc": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(QueueError) as refused:
        schema.rows([b'{"a": 2}', deep])
    assert refused.value.detail == "line 2: not JSON (nested too deeply)"
    assert [c.to_pylist() for c in schema.lenient_columns([b'{"a": 2}', deep])] == [[2.0, None]]
