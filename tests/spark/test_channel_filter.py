"""Channel filters give Spark's answers: each random filter over random rows (a typed topic's
fields among their columns) keeps, in Arrow (the fanout loop and driver), exactly the rows
Spark's own WHERE keeps (its writer path)."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from queue_engine.channel_filter import compile_filter
from queue_engine.errors import QueueError
from queue_engine.fanout import filter_expression, filter_sql
from queue_engine.registry import ChannelInfo
from queue_engine.store.tables import HEADERS_TYPE
from queue_engine.topic_schema import parse_schema

TYPED = parse_schema(
    "sku STRING, amount DOUBLE, qty INT, big BIGINT, day DATE, gift BOOLEAN, at TIMESTAMP"
)
FIELDS = tuple(TYPED.kinds.items())
_NUMBERS = ["0", "1", "-1", "2.5", "-0.5", "1e3", "3", "2147483647", "9007199254740993", ".5"]

_TS = pa.timestamp("us", tz="UTC")
_BASE = datetime(2026, 1, 1, tzinfo=UTC)
_VALUES = ["a", "b", "ab", "b%", "eu", "", "é"]
_KEYS = ["region", "k", "x y"]

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("replay_of", pa.string()),
        pa.field("published_at", _TS),
        pa.field("deliver_at", _TS),
        pa.field("expires_at", _TS),
        pa.field("headers", HEADERS_TYPE),
        pa.field("topic_version", pa.int64()),
        *TYPED.arrow_fields,
    ]
)


def _rows(rng: random.Random, n: int) -> pa.Table:
    def maybe(value: object) -> object:
        return None if rng.random() < 0.2 else value

    def when() -> datetime:
        return _BASE + timedelta(seconds=rng.randrange(0, 5))

    def headers() -> dict[str, str] | None:
        if rng.random() < 0.2:
            return None
        return {k: rng.choice(_VALUES) for k in rng.sample(_KEYS, rng.randrange(0, 3))}

    return pa.table(
        {
            "id": [f"{i:04d}" for i in range(n)],
            "replay_of": [maybe(rng.choice(_VALUES)) for _ in range(n)],
            "published_at": [when() for _ in range(n)],
            "deliver_at": [maybe(when()) for _ in range(n)],
            "expires_at": [maybe(when()) for _ in range(n)],
            "headers": [headers() for _ in range(n)],
            "topic_version": [rng.randrange(0, 6) for _ in range(n)],
            "sku": [maybe(rng.choice(_VALUES)) for _ in range(n)],
            "amount": [
                maybe(rng.choice([0.0, 1.0, -1.0, 2.5, -0.5, 1000.0, 3.25])) for _ in range(n)
            ],
            "qty": [maybe(rng.choice([0, 1, -1, 3, 2147483647, -2147483648])) for _ in range(n)],
            "big": [
                maybe(rng.choice([0, 3, 9007199254740993, -(2**63), 2**63 - 1])) for _ in range(n)
            ],
            "day": [maybe(date(2026, 1, rng.randrange(1, 4))) for _ in range(n)],
            "gift": [maybe(rng.random() < 0.5) for _ in range(n)],
            "at": [maybe(when()) for _ in range(n)],
        },
        schema=SCHEMA,
    )


def _string(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"headers['{rng.choice(_KEYS)}']"
    return rng.choice(["id", "replay_of"])


def _literal(rng: random.Random) -> str:
    return "'" + rng.choice([*_VALUES, "0001", "0010"]).replace("'", "''") + "'"


def _time(rng: random.Random) -> str:
    at = _BASE + timedelta(seconds=rng.randrange(0, 5))
    return f"TIMESTAMP '{at.isoformat()}'"


def _typed(rng: random.Random) -> str:
    """A condition over the typed fields."""
    match rng.randrange(6):
        case 0 | 1:
            op = rng.choice(["=", "!=", "<", "<=", ">", ">="])
            left = rng.choice(["amount", "qty", "big"])
            right = rng.choice([*_NUMBERS, "amount", "qty", "big"])
            return f"{left} {op} {right}"
        case 2:
            items = ", ".join(rng.choice(_NUMBERS) for _ in range(rng.randrange(1, 4)))
            return f"{rng.choice(['amount', 'qty', 'big'])} {rng.choice(['', 'NOT '])}IN ({items})"
        case 3:
            low, high = rng.choice(_NUMBERS), rng.choice(_NUMBERS)
            return f"{rng.choice(['amount', 'qty'])} BETWEEN {low} AND {high}"
        case 4:
            day = f"DATE '2026-01-0{rng.randrange(1, 4)}'"
            return rng.choice([f"day {rng.choice(['<', '=', '>='])} {day}", "gift", "NOT gift"])
        case _:
            return rng.choice(
                [f"at >= {_time(rng)}", f"sku = {_literal(rng)}", "gift = TRUE", "sku IS NULL"]
            )


def _condition(rng: random.Random, depth: int = 0) -> str:
    pick = rng.randrange(11 if depth < 3 else 8)
    if pick == 7:
        return _typed(rng)
    if pick > 7:
        pick -= 1
    match pick:
        case 0 | 1:
            op = rng.choice(["=", "!=", "<>", "<", "<=", ">", ">="])
            return f"{_string(rng)} {op} {_literal(rng)}"
        case 2:
            column = rng.choice(["published_at", "deliver_at", "expires_at"])
            return f"{column} {rng.choice(['<', '>=', '='])} {_time(rng)}"
        case 3:
            return f"{_string(rng)} IS {rng.choice(['', 'NOT '])}NULL"
        case 4:
            items = ", ".join(_literal(rng) for _ in range(rng.randrange(1, 4)))
            return f"{_string(rng)} {rng.choice(['', 'NOT '])}IN ({items})"
        case 5:
            low, high = _literal(rng), _literal(rng)
            return f"{_string(rng)} {rng.choice(['', 'NOT '])}BETWEEN {low} AND {high}"
        case 6:
            pattern = rng.choice(["a%", "%b", "_", "%", "e_", "b\\\\%"])
            return f"{_string(rng)} {rng.choice(['', 'NOT '])}LIKE '{pattern}'"
        case 7:
            return f"NOT ({_condition(rng, depth + 1)})"
        case _:
            joined = rng.choice(["AND", "OR"])
            return f"({_condition(rng, depth + 1)}) {joined} ({_condition(rng, depth + 1)})"


def test_random_filters_keep_the_rows_spark_keeps(spark: SparkSession) -> None:
    rng = random.Random(20261127)
    rows = _rows(rng, 300)
    filters = [_condition(rng) for _ in range(300)]
    # Every filter at once, in one Spark job: a boolean column each (null where Spark's WHERE
    # would drop the row as well), for the filter as deltaq writes it back (what Spark's
    # writer path runs) and as the user wrote it (what the filter means in Spark).
    data = [
        {**r, "headers": None if r["headers"] is None else dict(r["headers"])}
        for r in rows.to_pylist()
    ]
    df = spark.createDataFrame(data, from_arrow_schema(SCHEMA))
    verdicts = df.select(
        "id",
        *(
            F.expr(compile_filter(f, FIELDS).spark_sql).alias(f"f{i}")
            for i, f in enumerate(filters)
        ),
        *(F.expr(f).alias(f"raw{i}") for i, f in enumerate(filters)),
    ).collect()
    for i, text in enumerate(filters):
        by_spark = sorted(r["id"] for r in verdicts if r[f"f{i}"] is True)
        as_written = sorted(r["id"] for r in verdicts if r[f"raw{i}"] is True)
        by_arrow = sorted(rows.filter(compile_filter(text, FIELDS).arrow)["id"].to_pylist())
        assert by_arrow == by_spark == as_written, text

    # A channel's filters over its topic versions: the loop's condition and the one Spark's
    # writer path runs.
    channel = ChannelInfo(
        "c", 0, 0, filters=((1, filters[0]), (2, None), (3, filters[1]), (4, filters[2]))
    )
    condition = filter_expression(channel, FIELDS)
    assert condition is not None
    by_arrow = sorted(rows.filter(condition)["id"].to_pylist())
    sql = filter_sql(channel, FIELDS)
    assert sql is not None
    by_spark = sorted(r["id"] for r in df.filter(F.expr(sql)).select("id").collect())
    assert by_arrow == [r for r in by_spark] and by_arrow
    # Each row under the filter in force at its topic version: the last one recorded at a
    # version below it (none before the first: every row).
    kept = {
        text: set(rows.filter(compile_filter(text, FIELDS).arrow)["id"].to_pylist())
        for _, text in channel.filters
        if text is not None
    }

    def taken(row: dict[str, Any]) -> bool:
        in_force = [text for start, text in channel.filters if start < row["topic_version"]]
        return not in_force or in_force[-1] is None or row["id"] in kept[in_force[-1]]

    assert by_arrow == sorted(r["id"] for r in rows.to_pylist() if taken(r))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("id =", "not Spark SQL"),
        ("body = `x", "not Spark SQL: Error tokenizing"),  # an unclosed quote
        ("body = 'x", "not Spark SQL: Error tokenizing"),
        ("region = 'eu'", "no column 'region'"),
        ("headers = 'eu'", "headers is a map"),
        ("headers[1] = 'eu'", "a header is named by a string"),
        ("id = 7", "= compares a string with a number"),
        ("published_at > 'yesterday'", "> compares a timestamp with a string"),
        ("published_at > TIMESTAMP '2026-01-01 00:00:00'", "give it with its zone"),
        ("published_at > current_timestamp()", "is not taken in a filter"),
        ("id IN (SELECT 1)", "IN takes a list of values"),
        ("headers['a'] = NULL", "NULL is compared with IS NULL"),
        ("id", "a filter is a condition"),
        ("id BETWEEN SYMMETRIC 'b' AND 'a'", "BETWEEN SYMMETRIC is not taken"),
        ("id LIKE 'C:\\\\dir%'", "escapes only %, _ and"),
        ("published_at > TRY_CAST('2026-01-01 00:00:00Z' AS TIMESTAMP)", "only TIMESTAMP"),
        ("published_at > TIMESTAMP '20260131T120000Z'", "with its zone, as 2026-01-31 12:00:00Z"),
        ("NOT " * 900 + "id = 'a'", "nested too deeply"),
    ],
)
def test_a_filter_spark_would_read_otherwise_or_not_at_all_is_refused(
    text: str, reason: str
) -> None:
    with pytest.raises(QueueError) as refused:
        compile_filter(text)
    assert reason in refused.value.detail


def test_a_filter_is_parsed_once_however_many_batches_apply_it() -> None:
    """The fanout compiles a filtered channel's filter for each batch: the same text and
    fields give the same compiled filter, not a new parse."""
    fields = (("region", "STRING"),)
    first = compile_filter("region = 'eu'", fields)
    assert compile_filter("region = 'eu'", fields) is first
    assert compile_filter("region = 'us'", fields) is not first
