"""A typed topic's schema: fields declared in Spark DDL, and the conversion of JSON bodies into
the typed columns of the topic's rows.

A topic may declare ``sku STRING NOT NULL, amount DOUBLE, placed_at TIMESTAMP`` (the column
list of Spark's ``CREATE TABLE``, parsed with sqlglot in Spark's dialect). A body published to
it must then be a JSON object whose declared fields have values of their types (other fields
are allowed and stay in the body only); each declared field lands in a column of that name in
the topic, channel and dead-letter tables, beside the raw ``body`` NSQ consumers receive.

Bodies are parsed by orjson and converted a whole column at a time: one pass over the Python
types of a field's values, then Arrow builds (and range-checks) the column; dates and
timestamps are checked with one regular expression over the column and cast. Only a column
that fails is looked at value by value, to name the line, the field and the reason. (Arrow's
own JSON reader costs ~0.4-0.7 ms a call however small the batch, measured: too much for a
/pub of one message.)

Schemas evolve as Delta tables do without rewriting: fields may be added, nullable, at the
end; a field keeps its name and type, and NOT NULL may be dropped but never added.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from queue_engine.errors import ErrorCode, QueueError

MAX_SCHEMA_CHARS = 16_384
MAX_FIELDS = 200
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# Columns of deltaq's own tables: a field may not take their names (compared case-insensitively,
# as Spark resolves columns).
RESERVED = frozenset(
    {
        "id",
        "body",
        "published_at",
        "deliver_at",
        "expires_at",
        "to_channel",
        "replay_of",
        "headers",
        "topic_version",
        "attempts",
        "last_consumer",
        "last_event",
        "dead_at",
        "topic",
    }
)

# Years 0001-9999, as Spark's dates.
_DATE_TEXT = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})-\d\d-\d\d"
# RFC 3339 with a zone (an instant: Spark's TIMESTAMP), microseconds at most.
_TIMESTAMP_TEXT = (
    _DATE_TEXT
    + r"[T ](?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
)


@dataclass(frozen=True)
class _Type:
    ddl: str
    arrow: pa.DataType
    # What the JSON reader is asked for (a string for dates and timestamps, cast after).
    read_as: pa.DataType
    # In the words of an error: what a value must be.
    wanted: str
    # The pattern a string must match (dates and timestamps).
    pattern: str | None = None


_TYPES: dict[Any, _Type] = {
    exp.DataType.Type.TEXT: _Type("STRING", pa.string(), pa.string(), "a string"),
    exp.DataType.Type.BOOLEAN: _Type("BOOLEAN", pa.bool_(), pa.bool_(), "true or false"),
    exp.DataType.Type.INT: _Type(
        "INT", pa.int32(), pa.int32(), "an integer from -2147483648 to 2147483647"
    ),
    exp.DataType.Type.BIGINT: _Type(
        "BIGINT", pa.int64(), pa.int64(), "an integer that fits in 64 bits"
    ),
    exp.DataType.Type.DOUBLE: _Type("DOUBLE", pa.float64(), pa.float64(), "a number"),
    exp.DataType.Type.DATE: _Type(
        "DATE", pa.date32(), pa.string(), "a date as 2026-01-31", _DATE_TEXT
    ),
    exp.DataType.Type.TIMESTAMPTZ: _Type(
        "TIMESTAMP",
        pa.timestamp("us", tz="UTC"),
        pa.string(),
        "a time with its zone, as 2026-01-31T12:00:00Z or 2026-01-31 12:00:00.5+01:00",
        _TIMESTAMP_TEXT,
    ),
}
_TYPE_NAMES = ", ".join(t.ddl for t in _TYPES.values())


@dataclass(frozen=True)
class SchemaField:
    name: str
    type: _Type
    not_null: bool = False

    @property
    def ddl(self) -> str:
        return f"`{self.name}` {self.type.ddl}{' NOT NULL' if self.not_null else ''}"


@dataclass(frozen=True)
class TopicSchema:
    fields: tuple[SchemaField, ...]

    @property
    def ddl(self) -> str:
        """The canonical text: what the registry records and /stats shows."""
        return ", ".join(f.ddl for f in self.fields)

    @functools.cached_property
    def arrow_fields(self) -> tuple[pa.Field, ...]:
        """The typed columns (nullable in the tables: Delta adds columns only nullable, and a
        field added later reads null in older rows; NOT NULL is held at publishing)."""
        return tuple(pa.field(f.name, f.type.arrow, nullable=True) for f in self.fields)

    @functools.cached_property
    def kinds(self) -> dict[str, str]:
        """Field -> its DDL type (what a channel filter compares it as)."""
        return {f.name: f.type.ddl for f in self.fields}

    def columns(self, bodies: Sequence[bytes]) -> list[pa.Array]:
        """The typed columns of ``bodies``, which must fit (INVALID_BODY names the first that
        does not: its line, counted from 1 where there are several, its field and why)."""
        parsed = [_loads(body) for body in bodies]
        objects = [v for v in parsed if not isinstance(v, _Unfit)]
        out = []
        if len(objects) == len(parsed):
            for field in self.fields:
                values = [o.get(field.name) for o in objects]
                try:
                    column = _column(field.type, values)
                except _Unfit:
                    break
                if field.not_null and column.null_count:
                    break
                out.append(column)
            else:
                return out
        # Something does not fit: the first line that does not, and why.
        for line, value in enumerate(parsed, 1):
            if isinstance(value, _Unfit):
                raise _refused(line, len(bodies), str(value))
            for field in self.fields:
                reason = _reason(field, value.get(field.name))
                if reason is not None:
                    raise _refused(line, len(bodies), f"field {field.name}: {reason}")
        raise AssertionError("a column failed that no value of fails")

    def check(self, bodies: Sequence[bytes]) -> None:
        """Refuse (INVALID_BODY, as ``columns``) unless every body fits. A few bodies (a /pub,
        a small /mpub) are checked value by value in Python: building Arrow columns costs
        ~10 us a field however few the values, which a publish of one message would pay for
        each; more are converted as whole columns."""
        if len(bodies) > _FEW:
            self.columns(bodies)
            return
        for line, body in enumerate(bodies, 1):
            value = _loads(body)
            if isinstance(value, _Unfit):
                raise _refused(line, len(bodies), str(value))
            for field in self.fields:
                reason = _reason(field, value.get(field.name))
                if reason is not None:
                    raise _refused(line, len(bodies), f"field {field.name}: {reason}")

    def lenient_columns(self, bodies: Sequence[bytes]) -> list[pa.Array]:
        """The typed columns of ``bodies``, a value that does not fit its field read as null.

        For bodies taken before a field was declared (the fanout, dead letters, a journal
        recovered after the schema changed): every body fitted the fields of its time, and a
        field keeps its type, so a field's value never depends on when it is converted.
        """
        objects = []
        for body in bodies:
            value = _loads(body)
            objects.append({} if isinstance(value, _Unfit) else value)
        out = []
        for field in self.fields:
            values = [o.get(field.name) for o in objects]
            try:
                out.append(_column(field.type, values))
            except _Unfit:
                kept = [v if _reason(field, v) is None else None for v in values]
                out.append(_column(field.type, kept))
        return out

    def explain(self, body: bytes) -> str | None:
        """Why ``body`` does not fit (None: it does)."""
        try:
            self.columns([body])
        except QueueError as exc:
            return exc.detail
        return None


def _refused(line: int, lines: int, reason: str) -> QueueError:
    return QueueError(ErrorCode.INVALID_BODY, f"line {line}: {reason}" if lines > 1 else reason)


def _loads(body: bytes) -> dict[str, object] | _Unfit:
    """The body's JSON object, or why it is not one. orjson: strict JSON (no NaN), integers
    past 64 bits read as doubles; of a name given twice, the last value."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return _Unfit(f"not JSON ({exc})")
    if not isinstance(value, dict):
        return _Unfit(f"a typed topic takes a JSON object, not {_json_kind(value)}")
    return value


# The Python types orjson gives for the JSON values each type takes (None: null or absent).
_TAKES: dict[str, frozenset[type]] = {
    "STRING": frozenset({str, type(None)}),
    "BOOLEAN": frozenset({bool, type(None)}),
    "INT": frozenset({int, type(None)}),
    "BIGINT": frozenset({int, type(None)}),
    "DOUBLE": frozenset({int, float, type(None)}),
    "DATE": frozenset({str, type(None)}),
    "TIMESTAMP": frozenset({str, type(None)}),
}


# Up to this many values a date or timestamp column is checked by Python's regular expression.
_FEW = 256
_PATTERNS = {p: re.compile(p, re.ASCII) for p in (_DATE_TEXT, _TIMESTAMP_TEXT)}


def _column(spec: _Type, values: list[object]) -> pa.Array:
    """``values`` as one Arrow column of ``spec``'s type: one pass over their Python types,
    then Arrow converts (and range-checks) the whole column; _Unfit if any does not fit."""
    kinds = {type(v) for v in values}
    if not kinds <= _TAKES[spec.ddl]:
        raise _Unfit(spec.wanted)
    if spec.ddl == "DOUBLE" and int in kinds:
        # A JSON integer in a DOUBLE field is that number as a double (past 2**53: rounded).
        values = [float(v) if type(v) is int else v for v in values]
    try:
        column = pa.array(values, spec.read_as)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise _Unfit(spec.wanted) from exc
    if spec.pattern is not None:
        if len(values) <= _FEW:
            # Python's compiled pattern, value by value: Arrow compiles its own at each call
            # (~75 us), which a publish of a few messages would pay for each field.
            pattern = _PATTERNS[spec.pattern]
            fits = all(v is None or pattern.fullmatch(str(v)) for v in values)
        else:
            matched = pc.match_substring_regex(column, f"^{spec.pattern}$")
            fits = pc.all(pc.or_kleene(matched, pc.is_null(column))).as_py()
        if not fits:
            raise _Unfit(spec.wanted)
        try:
            column = pc.cast(column, spec.arrow)
        except pa.ArrowInvalid as exc:
            raise _Unfit(spec.wanted) from exc
    return column


def _reason(field: SchemaField, value: object) -> str | None:
    """Why ``value`` does not fit ``field`` (None: it does): the rules ``_column`` applies to
    a whole column, for one value."""
    if value is None:
        return "required (NOT NULL), absent or null" if field.not_null else None
    if _fits(field.type.ddl, value):
        return None
    shown = orjson.dumps(value).decode()
    if len(shown) > 60:
        shown = shown[:57] + "..."
    got = f"{_json_kind(value)} {shown}"
    return f"expected {field.type.ddl}: {field.type.wanted}; got {got}"


def _fits(ddl: str, value: object) -> bool:
    kind = type(value)
    match ddl:
        case "STRING":
            return kind is str
        case "BOOLEAN":
            return kind is bool
        case "INT":
            return kind is int and -(2**31) <= value < 2**31  # type: ignore[operator]
        case "BIGINT":
            return kind is int and -(2**63) <= value < 2**63  # type: ignore[operator]
        case "DOUBLE":
            return kind is int or kind is float
        case "DATE":
            if kind is not str or not _PATTERNS[_DATE_TEXT].fullmatch(str(value)):
                return False
            try:
                date.fromisoformat(str(value))
            except ValueError:
                return False
            return True
        case _:
            if kind is not str or not _PATTERNS[_TIMESTAMP_TEXT].fullmatch(str(value)):
                return False
            try:
                datetime.fromisoformat(str(value).replace(" ", "T", 1)).astimezone(UTC)
            except (ValueError, OverflowError):
                return False
            return True


class _Unfit(Exception):
    pass


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


@functools.lru_cache(maxsize=1024)
def parse_schema(text: str) -> TopicSchema:
    """``text`` (Spark DDL: ``name TYPE [NOT NULL] [COMMENT '...'], ...``) checked, or
    INVALID_SCHEMA saying why."""
    if not text.strip():
        raise QueueError(ErrorCode.INVALID_SCHEMA, "empty: name at least one field")
    if len(text) > MAX_SCHEMA_CHARS:
        raise QueueError(ErrorCode.INVALID_SCHEMA, f"over {MAX_SCHEMA_CHARS} characters")
    try:
        tree = sqlglot.parse_one(f"CREATE TABLE t ({text})", read="spark")
    except ParseError as exc:
        first = exc.errors[0]["description"] if exc.errors else str(exc)
        raise QueueError(ErrorCode.INVALID_SCHEMA, f"not Spark DDL: {first}") from exc
    except RecursionError as exc:
        raise QueueError(ErrorCode.INVALID_SCHEMA, "nested too deeply") from exc
    if not (
        isinstance(tree, exp.Create)
        and isinstance(tree.this, exp.Schema)
        and not any(v for k, v in tree.args.items() if k not in ("this", "kind"))
    ):
        raise QueueError(ErrorCode.INVALID_SCHEMA, "a list of fields: name TYPE, ...")
    fields: list[SchemaField] = []
    seen: set[str] = set()
    for column in tree.this.expressions:
        if not isinstance(column, exp.ColumnDef) or column.args.get("kind") is None:
            raise QueueError(
                ErrorCode.INVALID_SCHEMA, f"{column.sql(dialect='spark')!r}: name TYPE"
            )
        fields.append(_field(column))
        key = fields[-1].name.lower()
        if key in seen:
            raise QueueError(ErrorCode.INVALID_SCHEMA, f"field {fields[-1].name} twice")
        seen.add(key)
    if len(fields) > MAX_FIELDS:
        raise QueueError(ErrorCode.INVALID_SCHEMA, f"over {MAX_FIELDS} fields")
    return TopicSchema(tuple(fields))


def _field(column: exp.ColumnDef) -> SchemaField:
    name = column.name
    if not _NAME.fullmatch(name):
        raise QueueError(
            ErrorCode.INVALID_SCHEMA,
            f"field {name!r}: a name is 1-128 of letters, digits and _, not starting with a digit",
        )
    if name.lower() in RESERVED:
        raise QueueError(
            ErrorCode.INVALID_SCHEMA, f"field {name!r}: the tables' own column (rename the field)"
        )
    kind = column.args["kind"]
    spec = _TYPES.get(kind.this)
    if spec is None or kind.expressions:
        raise QueueError(
            ErrorCode.INVALID_SCHEMA,
            f"field {name}: type {kind.sql(dialect='spark')} is not taken (taken: {_TYPE_NAMES})",
        )
    not_null = False
    for constraint in column.args.get("constraints") or []:
        what = constraint.args.get("kind")
        if isinstance(what, exp.NotNullColumnConstraint):
            not_null = not what.args.get("allow_null")  # NULL: nullable, as without it
        elif not isinstance(what, exp.CommentColumnConstraint):
            raise QueueError(
                ErrorCode.INVALID_SCHEMA,
                f"field {name}: {constraint.sql(dialect='spark')!r} is not taken "
                "(NOT NULL and COMMENT are)",
            )
    return SchemaField(name, spec, not_null)


def evolve(old: TopicSchema | None, new: TopicSchema) -> None:
    """Refuse (SCHEMA_CHANGE_REFUSED) a change from ``old`` to ``new`` that existing rows or
    their readers could not follow."""
    if old is None:
        return
    by_name = {f.name.lower(): f for f in new.fields}
    for field in old.fields:
        now = by_name.get(field.name.lower())
        if now is None:
            raise QueueError(
                ErrorCode.SCHEMA_CHANGE_REFUSED,
                f"field {field.name} is dropped: a field stays once declared",
            )
        if now.name != field.name:
            raise QueueError(
                ErrorCode.SCHEMA_CHANGE_REFUSED, f"field {field.name} renamed to {now.name}"
            )
        if now.type != field.type:
            raise QueueError(
                ErrorCode.SCHEMA_CHANGE_REFUSED,
                f"field {field.name}: {field.type.ddl} to {now.type.ddl} (a field keeps its type)",
            )
        if now.not_null and not field.not_null:
            raise QueueError(
                ErrorCode.SCHEMA_CHANGE_REFUSED,
                f"field {field.name}: NOT NULL added (older messages may lack it)",
            )
    known = {f.name.lower() for f in old.fields}
    added = [f for f in new.fields if f.name.lower() not in known]
    for field in added:
        if field.not_null:
            raise QueueError(
                ErrorCode.SCHEMA_CHANGE_REFUSED,
                f"field {field.name}: a field added later is nullable (older messages lack it)",
            )
    order = [f.name.lower() for f in new.fields]
    if order[: len(old.fields)] != [f.name.lower() for f in old.fields]:
        raise QueueError(
            ErrorCode.SCHEMA_CHANGE_REFUSED,
            "fields keep their order, and new ones go last (as Delta adds columns)",
        )
