"""A channel filter's Spark SQL, parsed with sqlglot in Spark's dialect and translated into an
Arrow expression (the rules: queue_engine.channel_filter). Imported only when a filter is
compiled; queue_engine.topic_schema's DDL parser shares ``sqlglot_reason``."""

from __future__ import annotations

import contextvars
import re
from datetime import UTC, date, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from queue_engine.channel_filter import COLUMNS, Fields
from queue_engine.errors import ErrorCode, QueueError

_TS = pa.timestamp("us", tz="UTC")
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


class _Refused(Exception):
    pass


# The typed fields of the filter being compiled (one compile per thread at a time).
_FIELDS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "fields", default=None
)


# A typed field's DDL type -> its kind in a filter. Integers and doubles compare with each other
# and with number literals as Spark compares them (both as doubles, or both exactly).
_FIELD_KINDS = {
    "STRING": "string",
    "BOOLEAN": "boolean",
    "INT": "integer",
    "BIGINT": "integer",
    "DOUBLE": "double",
    "DATE": "date",
    "TIMESTAMP": "timestamp",
}
_INT64 = 1 << 63


def sqlglot_reason(exc: SqlglotError) -> str:
    """What sqlglot found wrong: a parse error's first description, or a tokenizer's message
    (an unclosed quote raises TokenError, which lists no errors)."""
    errors = getattr(exc, "errors", None)
    return str(errors[0]["description"]) if errors else str(exc)


def translate(text: str, fields: Fields) -> tuple[str, pc.Expression]:
    """``text`` as Spark evaluates it (written back from the tree that was checked) and as an
    Arrow expression, or INVALID_FILTER saying why."""
    try:
        tree = sqlglot.parse_one(text, read="spark")
    except RecursionError as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, "nested too deeply") from exc
    except SqlglotError as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, f"not Spark SQL: {sqlglot_reason(exc)}") from exc
    try:
        token = _FIELDS.set({name: _FIELD_KINDS[kind] for name, kind in fields})
        try:
            kind, arrow = _translate(tree)
        finally:
            _FIELDS.reset(token)
        if kind != "boolean":
            raise _Refused(f"a filter is a condition (true or false), not a {_shown(kind)}")
    except _Refused as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, str(exc)) from exc
    except RecursionError as exc:
        raise QueueError(ErrorCode.INVALID_FILTER, "nested too deeply") from exc
    # headers['k'] for a key a map lacks is null in Spark as in Arrow
    # (tests/spark/test_channel_filter.py draws such keys).
    return tree.sql(dialect="spark"), arrow


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
        left, right = _unified(left_kind, left, right_kind, right)
        return "boolean", _compare(op, left, right)
    if isinstance(node, exp.In):
        kind, value = _operand(node.this)
        if node.args.get("query") is not None or not node.expressions:
            raise _Refused("IN takes a list of values")
        result = None
        for item in node.expressions:
            item_kind, item_value = _operand(item)
            _same(kind, item_kind, "IN")
            this, item_value = _unified(kind, value, item_kind, item_value)
            equal = this == item_value
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
        above, low = _unified(kind, value, low_kind, low)
        below, high = _unified(kind, value, high_kind, high)
        return "boolean", (above >= low) & (below <= high)
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
    "published_at, deliver_at, expires_at, headers['name'] and a typed topic's fields"
)


def _boolean(node: exp.Expr) -> Any:
    kind, value = _translate(node)
    if kind != "boolean":
        raise _Refused(f"{node.sql(dialect='spark')!r} is a {_shown(kind)}, not a condition")
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
        fields = _FIELDS.get() or {}
        if name in fields:
            return fields[name], pc.field(name)
        if name not in COLUMNS:
            known = ", ".join([*COLUMNS, "headers", *fields])
            raise _Refused(f"no column {name!r} (the columns: {known})")
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
            return _number(node.this)
        return "string", pc.scalar(node.this)
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal) and not node.this.is_string:
        return _number("-" + node.this.this)
    if isinstance(node, exp.Cast):
        # sqlglot reads TIMESTAMP '...' and DATE '...' as casts of the string.
        literal = (
            type(node) is exp.Cast and isinstance(node.this, exp.Literal) and node.this.is_string
        )
        if literal and node.to.this is exp.DataType.Type.DATE:
            return "date", pc.scalar(pa.scalar(_date(node.this.this), pa.date32()))
        if not (
            literal and node.to.this in (exp.DataType.Type.TIMESTAMP, exp.DataType.Type.TIMESTAMPTZ)
        ):
            raise _Refused(
                f"{node.sql(dialect='spark')!r}: only TIMESTAMP '...' and DATE '...' literals"
            )
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


_INTEGER = re.compile(r"-?\d+")
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _number(text: str) -> tuple[str, Any]:
    """A number literal: an integer within 64 bits, or a decimal/exponent read as a double.
    Spark compares a decimal literal with an integer exactly and Arrow as doubles: with at
    most 15 significant digits and under 2**53 the two agree."""
    if _INTEGER.fullmatch(text):
        value = int(text)
        if not -_INT64 <= value < _INT64:
            raise _Refused(f"{text}: an integer literal fits in 64 bits")
        return "integer", pc.scalar(value)
    if not _DECIMAL.fullmatch(text):
        raise _Refused(f"{text}: not a number literal (as 12, 1.5 or 2e3)")
    mantissa = re.split("[eE]", text)[0]
    digits = mantissa.replace("-", "").replace(".", "").lstrip("0")
    double = float(text)
    if len(digits) > 15 or abs(double) >= 2**53:
        raise _Refused(f"{text}: a decimal literal has at most 15 digits and is under 2**53")
    return "double", pc.scalar(double)


_DATE = re.compile(r"\d{4}-\d\d-\d\d")


def _date(text: str) -> date:
    if not _DATE.fullmatch(text):
        raise _Refused(f"DATE {text!r}: give it as 2026-01-31")
    try:
        return date.fromisoformat(text)
    except ValueError as exc:
        raise _Refused(f"DATE {text!r}: not a date") from exc


_NUMERIC = ("integer", "double")


def _shown(kind: str) -> str:
    return "number" if kind in _NUMERIC else kind


def _same(left: str, right: str, op: str) -> None:
    if left != right and not (left in _NUMERIC and right in _NUMERIC):
        raise _Refused(f"{op} compares a {_shown(left)} with a {_shown(right)}")


def _unified(left_kind: str, left: Any, right_kind: str, right: Any) -> tuple[Any, Any]:
    """Numbers as Spark compares them: two integers as 64-bit integers, else as doubles."""
    if left_kind not in _NUMERIC:
        return left, right
    common = pa.int64() if left_kind == right_kind == "integer" else pa.float64()
    # Unchecked: a 64-bit integer past 2**53 rounds to the nearest double, as in Spark.
    return left.cast(common, safe=False), right.cast(common, safe=False)


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
