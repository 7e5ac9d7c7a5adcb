"""A channel's filter: a Spark SQL boolean expression over a message's columns.

Given at ``/channel/create`` or ``/channel/configure``, parsed with sqlglot in Spark's dialect,
and checked before anything is recorded: columns the topic has, operands of one type, and only
constructs that evaluate the same in Arrow (the fanout loop and its driver) as in Spark (its
writer path). Rows for which the expression is false or null do not enter the channel, as
Spark's ``WHERE``. Only deterministic expressions: a replayed fanout batch must route as the
first attempt did.

What is taken: the columns ``id``, ``replay_of`` (strings), ``published_at``, ``deliver_at``,
``expires_at`` (timestamps), ``headers['name']`` (a string, null where the message lacks it);
string and ``TIMESTAMP '...'`` literals (with their zone), ``TRUE``/``FALSE``; ``=``, ``!=``,
``<>``, ``<``, ``<=``, ``>``, ``>=``, ``AND``, ``OR``, ``NOT``, ``IS [NOT] NULL``,
``[NOT] IN (...)``, ``[NOT] BETWEEN``, ``[NOT] LIKE``, parentheses.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from queue_engine.errors import ErrorCode, QueueError

MAX_FILTER_CHARS = 4096

_TS = pa.timestamp("us", tz="UTC")
# Column -> its type in a filter (headers only through headers['name']).
COLUMNS = {
    "id": "string",
    "replay_of": "string",
    "published_at": "timestamp",
    "deliver_at": "timestamp",
    "expires_at": "timestamp",
}

# A LIKE pattern whose backslashes escape only %, _ or a backslash.
_LIKE_ESCAPES = re.compile(r"(?:[^\\]|\\[%_\\])*")
# The timestamp form Spark and Python read as the same instant.
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(?::\d\d(?:\.\d{1,6})?)?(?:Z|[+-]\d\d:\d\d)")

_COMPARISONS: dict[type[exp.Expr], str] = {
    exp.EQ: "=",
    exp.NEQ: "!=",
    exp.LT: "<",
    exp.LTE: "<=",
    exp.GT: ">",
    exp.GTE: ">=",
}


@dataclass(frozen=True)
class ChannelFilter:
    text: str
    # The expression as Spark evaluates it (written back from the parsed tree).
    spark_sql: str
    arrow: pc.Expression


class _Refused(Exception):
    pass


@functools.lru_cache(maxsize=4096)
def compile_filter(text: str) -> ChannelFilter:
    """``text`` checked and translated, or INVALID_FILTER saying why."""
    if not text.strip():
        raise QueueError(ErrorCode.INVALID_FILTER, "empty: leave filter out for every message")
    if len(text) > MAX_FILTER_CHARS:
        raise QueueError(ErrorCode.INVALID_FILTER, f"over {MAX_FILTER_CHARS} characters")
    try:
        tree = sqlglot.parse_one(text, read="spark")
    except RecursionError as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, "nested too deeply") from exc
    except ParseError as exc:
        first = exc.errors[0]["description"] if exc.errors else str(exc)
        raise QueueError(ErrorCode.INVALID_FILTER, f"not Spark SQL: {first}") from exc
    try:
        kind, arrow = _translate(tree)
        if kind != "boolean":
            raise _Refused(f"a filter is a condition (true or false), not a {kind}")
    except _Refused as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, str(exc)) from exc
    except RecursionError as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, "nested too deeply") from exc
    # Written back from the tree that was checked. headers['k'] for a key a map lacks is null
    # in Spark as in Arrow (tests/spark/test_channel_filter.py draws such keys).
    return ChannelFilter(text, tree.sql(dialect="spark"), arrow)


def _translate(node: exp.Expr) -> tuple[str, Any]:
    """(the node's type, its Arrow expression)."""
    kind, value = _translate_positive(node)
    # sqlglot keeps some negations on the node itself (``x NOT LIKE 'p'``).
    if node.args.get("negate"):
        return kind, ~value
    return kind, value


def _translate_positive(node: exp.Expr) -> tuple[str, Any]:
    if isinstance(node, exp.Paren):
        return _translate(node.this)
    if isinstance(node, (exp.And, exp.Or)):
        left = _boolean(node.this)
        right = _boolean(node.expression)
        return "boolean", (left & right) if isinstance(node, exp.And) else (left | right)
    if isinstance(node, exp.Not):
        return "boolean", ~_boolean(node.this)
    if isinstance(node, exp.Is):
        if not isinstance(node.expression, exp.Null):
            raise _Refused("IS takes NULL or NOT NULL only")
        _, value = _operand(node.this)
        return "boolean", value.is_null()
    if type(node) in _COMPARISONS:
        op = _COMPARISONS[type(node)]
        left_kind, left = _operand(node.this)
        right_kind, right = _operand(node.expression)
        _same(left_kind, right_kind, op)
        return "boolean", _compare(op, left, right)
    if isinstance(node, exp.In):
        kind, value = _operand(node.this)
        if node.args.get("query") is not None or not node.expressions:
            raise _Refused("IN takes a list of values")
        result = None
        for item in node.expressions:
            item_kind, item_value = _operand(item)
            _same(kind, item_kind, "IN")
            equal = value == item_value
            result = equal if result is None else result | equal
        return "boolean", result
    if isinstance(node, exp.Between):
        if node.args.get("symmetric"):
            raise _Refused("BETWEEN SYMMETRIC is not taken: give the bounds in order")
        kind, value = _operand(node.this)
        low_kind, low = _operand(node.args["low"])
        high_kind, high = _operand(node.args["high"])
        _same(kind, low_kind, "BETWEEN")
        _same(kind, high_kind, "BETWEEN")
        return "boolean", (value >= low) & (value <= high)
    if isinstance(node, exp.Like):
        kind, value = _operand(node.this)
        pattern = node.expression
        if kind != "string" or not (isinstance(pattern, exp.Literal) and pattern.is_string):
            raise _Refused("LIKE compares a string with a string pattern")
        if not _LIKE_ESCAPES.fullmatch(pattern.this):
            # Spark refuses other escapes at run time; Arrow would read them as the letter.
            raise _Refused(f"LIKE {pattern.this!r}: \\ escapes only %, _ and \\")
        return "boolean", pc.match_like(value, pattern.this)
    if isinstance(node, (exp.Column, exp.Bracket, exp.Literal, exp.Cast, exp.Null, exp.Boolean)):
        return _operand(node)
    raise _Refused(f"{node.sql(dialect='spark')!r} is not taken in a filter ({_TAKEN})")


_TAKEN = (
    "comparisons, AND, OR, NOT, IS [NOT] NULL, IN, BETWEEN and LIKE over id, replay_of, "
    "published_at, deliver_at, expires_at and headers['name']"
)


def _boolean(node: exp.Expr) -> Any:
    kind, value = _translate(node)
    if kind != "boolean":
        raise _Refused(f"{node.sql(dialect='spark')!r} is a {kind}, not a condition")
    return value


def _operand(node: exp.Expr) -> tuple[str, Any]:
    """A value: a column, headers['name'] or a literal."""
    if isinstance(node, exp.Paren):
        return _operand(node.this)
    if isinstance(node, exp.Column):
        if node.table:
            raise _Refused(f"{node.sql(dialect='spark')!r}: name columns alone")
        name = node.name
        if name == "headers":
            raise _Refused("headers is a map: name one, headers['name']")
        if name not in COLUMNS:
            raise _Refused(f"no column {name!r} (the columns: {', '.join(COLUMNS)}, headers)")
        return COLUMNS[name], pc.field(name)
    if isinstance(node, exp.Bracket):
        target = node.this
        keys = node.expressions
        if not (isinstance(target, exp.Column) and target.name == "headers" and not target.table):
            raise _Refused(f"{node.sql(dialect='spark')!r}: only headers['name'] is indexed")
        if len(keys) != 1 or not (isinstance(keys[0], exp.Literal) and keys[0].is_string):
            raise _Refused("a header is named by a string: headers['name']")
        return "string", pc.map_lookup(pc.field("headers"), pa.scalar(keys[0].this), "first")
    if isinstance(node, exp.Literal):
        if not node.is_string:
            raise _Refused(f"{node.this}: no column is a number (as text: '{node.this}')")
        return "string", pc.scalar(node.this)
    if isinstance(node, exp.Cast):
        # sqlglot reads TIMESTAMP '...' as a cast of the string.
        if not (
            type(node) is exp.Cast
            and isinstance(node.this, exp.Literal)
            and node.this.is_string
            and node.to.this in (exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ)
        ):
            raise _Refused(f"{node.sql(dialect='spark')!r}: only TIMESTAMP '...' literals")
        return "timestamp", pc.scalar(pa.scalar(_timestamp(node.this.this), _TS))
    if isinstance(node, exp.Null):
        raise _Refused("NULL is compared with IS NULL or IS NOT NULL")
    if isinstance(node, exp.Boolean):
        return "boolean", pc.scalar(bool(node.this))
    raise _Refused(f"{node.sql(dialect='spark')!r} is not taken in a filter ({_TAKEN})")


def _timestamp(text: str) -> datetime:
    """A TIMESTAMP literal with its zone (Spark would read one without it in the session's
    zone, which the fanout's paths need not share), in the one form both read alike."""
    if not _TIMESTAMP.fullmatch(text):
        raise _Refused(
            f"TIMESTAMP {text!r}: give it with its zone, as 2026-01-31 12:00:00Z (or +hh:mm)"
        )
    try:
        value = datetime.fromisoformat(text.replace(" ", "T", 1))
    except ValueError as exc:
        raise _Refused(f"TIMESTAMP {text!r}: not a time (2026-01-31 12:00:00Z)") from exc
    if value.tzinfo is None:
        raise _Refused(f"TIMESTAMP {text!r}: give its zone (Z or +hh:mm)")
    return value.astimezone(UTC)


def _same(left: str, right: str, op: str) -> None:
    if left != right:
        raise _Refused(f"{op} compares a {left} with a {right}")


def _compare(op: str, left: Any, right: Any) -> Any:
    match op:
        case "=":
            return left == right
        case "!=":
            return left != right
        case "<":
            return left < right
        case "<=":
            return left <= right
        case ">":
            return left > right
        case _:
            return left >= right
