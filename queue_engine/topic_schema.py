"""A typed topic's schema: fields declared in Spark DDL, and the conversion of JSON bodies into
the typed columns of the topic's rows.

A topic may declare ``sku STRING NOT NULL, amount DOUBLE, placed_at TIMESTAMP`` (the column
list of Spark's ``CREATE TABLE``, parsed with sqlglot in Spark's dialect). A body published to
it must then be a JSON object whose declared fields have values of their types (other fields
are allowed and stay in the body only); each declared field lands in a column of that name in
the topic, channel and dead-letter tables, beside the raw ``body`` NSQ consumers receive.

Bodies are converted a whole batch at a time by Arrow's JSON reader with the schema given
(dates and timestamps are read as strings, checked with one regular expression over the
column, then cast). Only a batch that fails is looked at body by body, to name the line, the
field and the reason.

Schemas evolve as Delta tables do without rewriting: fields may be added, nullable, at the
end; a field keeps its name and type, and NOT NULL may be dropped but never added.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
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
_TIMESTAMP_TEXT = _DATE_TEXT + r"[T ]\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)"


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
    def _read_schema(self) -> pa.Schema:
        return pa.schema([pa.field(f.name, f.type.read_as) for f in self.fields])

    @functools.cached_property
    def kinds(self) -> dict[str, str]:
        """Field -> its DDL type (what a channel filter compares it as)."""
        return {f.name: f.type.ddl for f in self.fields}

    def columns(self, bodies: Sequence[bytes]) -> list[pa.Array]:
        """The typed columns of ``bodies``, which must fit (INVALID_BODY names the first that
        does not: its line, counted from 1, its field and why)."""
        try:
            return self._convert(bodies)
        except _Unfit:
            pass
        for line, body in enumerate(bodies, 1):
            reason = self.explain(body)
            if reason is not None:
                at = f"line {line}: " if len(bodies) > 1 else ""
                raise QueueError(ErrorCode.INVALID_BODY, at + reason)
        raise QueueError(ErrorCode.INVALID_BODY, "the batch does not convert")  # not reached

    def lenient_columns(self, bodies: Sequence[bytes]) -> list[pa.Array]:
        """The typed columns of ``bodies``, a value that does not fit its field read as null.

        For bodies taken before a field was declared (the fanout, dead letters, a journal
        recovered after the schema changed): every body fitted the fields of its time, and a
        field keeps its type, so a field's value never depends on when it is converted.
        """
        try:
            return self._convert(bodies, strict=False)
        except _Unfit:
            pass
        fitted = [
            body if self.explain(body) is None else self._fitting_part(body) for body in bodies
        ]
        return self._convert(fitted, strict=False)

    def explain(self, body: bytes) -> str | None:
        """Why ``body`` does not fit (None: it does)."""
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return f"not JSON ({exc})"
        if not isinstance(value, dict):
            return f"a typed topic takes a JSON object, not {_json_kind(value)}"
        for field in self.fields:
            reason = self._field_reason(field, value.get(field.name))
            if reason is not None:
                return f"field {field.name}: {reason}"
        try:
            self._convert([body])
        except _Unfit as exc:
            return str(exc)
        return None

    def _field_reason(self, field: SchemaField, value: object) -> str | None:
        if value is None:
            return "required (NOT NULL), absent or null" if field.not_null else None
        one = TopicSchema((SchemaField(field.name, field.type),))
        try:
            one._convert([orjson.dumps({field.name: value})])
        except _Unfit:
            shown = orjson.dumps(value).decode()
            if len(shown) > 60:
                shown = shown[:57] + "..."
            return (
                f"expected {field.type.ddl}: {field.type.wanted}; got {_json_kind(value)} {shown}"
            )
        return None

    def _fitting_part(self, body: bytes) -> bytes:
        """The declared fields of ``body`` whose values fit, as a JSON object."""
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return b"{}"
        if not isinstance(value, dict):
            return b"{}"
        kept = {
            f.name: value[f.name]
            for f in self.fields
            if value.get(f.name) is not None and self._field_reason(f, value[f.name]) is None
        }
        return orjson.dumps(kept)

    def _convert(self, bodies: Sequence[bytes], *, strict: bool = True) -> list[pa.Array]:
        if not bodies:
            return [pa.array([], f.type.arrow) for f in self.fields]
        # One body a line: a body's own line breaks (pretty-printed JSON) are whitespace, read
        # as the same object once compacted.
        try:
            lines = [
                orjson.dumps(orjson.loads(b)) if b"\n" in b or b"\r" in b else b for b in bodies
            ]
        except orjson.JSONDecodeError as exc:
            raise _Unfit(f"not JSON ({exc})") from exc
        # Only objects reach Arrow's reader: a block starting with a bare null crashes it
        # (pyarrow 26: a segmentation fault, not an error).
        if not all(line.lstrip(b" \t")[:1] == b"{" for line in lines):
            raise _Unfit("a typed topic takes a JSON object")
        data = b"\n".join(lines)
        try:
            table = pj.read_json(
                io.BytesIO(data),
                read_options=pj.ReadOptions(block_size=max(len(data) + 1, 1 << 20)),
                parse_options=pj.ParseOptions(
                    explicit_schema=self._read_schema, unexpected_field_behavior="ignore"
                ),
            )
        except pa.ArrowInvalid as exc:
            raise _Unfit(_arrow_reason(str(exc))) from exc
        if table.num_rows != len(bodies):
            raise _Unfit("not one JSON object")
        out: list[pa.Array] = []
        for field in self.fields:
            column = table.column(field.name).combine_chunks()
            if strict and field.not_null and column.null_count:
                raise _Unfit(f"field {field.name}: required (NOT NULL), absent or null")
            if field.type.pattern is not None:
                fits = pc.match_substring_regex(column, f"^{field.type.pattern}$")
                if not pc.all(pc.or_kleene(fits, pc.is_null(column))).as_py():
                    raise _Unfit(f"field {field.name}: {field.type.wanted}")
                try:
                    column = pc.cast(column, field.type.arrow)
                except pa.ArrowInvalid as exc:
                    raise _Unfit(f"field {field.name}: {field.type.wanted}") from exc
            out.append(column)
        return out


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


_TWICE = re.compile(r"Column\(/(.*)\) was specified twice")


def _arrow_reason(text: str) -> str:
    twice = _TWICE.search(text)
    if twice:
        return f"field {twice.group(1)}: given twice"
    return text.replace("JSON parse error: ", "").split("\n")[0]


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
