"""A typed topic's schema: fields declared in Spark DDL, and the conversion of JSON bodies into
the typed columns of the topic's rows.

A topic may declare ``sku STRING NOT NULL, amount DOUBLE, placed_at TIMESTAMP`` (the column
list of Spark's ``CREATE TABLE``, parsed with sqlglot in Spark's dialect). A body published to
it must then be a JSON object whose declared fields have values of their types (other fields
are allowed and stay in the body only); each declared field lands in a column of that name in
the topic, channel and dead-letter tables, beside the raw ``body`` NSQ consumers receive.

Bodies are decoded and checked by msgspec against a struct of the declared fields (in C,
~0.6 us a 200-byte body, measured), and each field becomes one Arrow column. Only a body that
fails is looked at again, to name its line, its field and the reason. (Arrow's own JSON
reader costs ~0.4-0.7 ms a call however small the batch: too much for a /pub of one message.)

Schemas evolve as Delta tables do without rewriting: fields may be added, nullable, at the
end; a field keeps its name and type, and NOT NULL may be dropped but never added.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Annotated, Any

import msgspec
import orjson
import pyarrow as pa

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

_INT32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
_INT64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# An instant (Spark's TIMESTAMP): RFC 3339 with its zone.
_INSTANT = Annotated[datetime, msgspec.Meta(tz=True)]


@dataclass(frozen=True)
class _Type:
    ddl: str
    arrow: pa.DataType
    # The Python type msgspec decodes a JSON value of the field into (and checks it against).
    python: Any
    # In the words of an error: what a value must be.
    wanted: str


# The field types taken, by their name in Spark DDL.
TYPES: dict[str, _Type] = {
    "STRING": _Type("STRING", pa.string(), str, "a string"),
    "BOOLEAN": _Type("BOOLEAN", pa.bool_(), bool, "true or false"),
    "INT": _Type("INT", pa.int32(), _INT32, "an integer from -2147483648 to 2147483647"),
    "BIGINT": _Type("BIGINT", pa.int64(), _INT64, "an integer within 64 bits"),
    "DOUBLE": _Type("DOUBLE", pa.float64(), float, "a number"),
    "DATE": _Type("DATE", pa.date32(), date, "a date as 2026-01-31"),
    "TIMESTAMP": _Type(
        "TIMESTAMP",
        pa.timestamp("us", tz="UTC"),
        _INSTANT,
        "an RFC 3339 time with its zone, as 2026-01-31T12:00:00Z or 2026-01-31 12:00:00.5+01:00",
    ),
}


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

    @functools.cached_property
    def _decoder(self) -> msgspec.json.Decoder[Any]:
        """Decodes and checks one body: its declared fields, others skipped. Attributes are
        ``f0``, ``f1``, ... (a field may be named as a Python keyword)."""
        fields: list[tuple[str, Any] | tuple[str, Any, None]] = []
        for i, f in enumerate(self.fields):
            if f.not_null:
                fields.append((f"f{i}", f.type.python))
            else:
                fields.append((f"f{i}", f.type.python | None, None))
        rename = {f"f{i}": f.name for i, f in enumerate(self.fields)}
        # gc=False: rows hold only scalars, so they cannot be in a cycle; untracked by the
        # collector, a body decodes ~40% faster, and the thousands of rows a busy topic's
        # writer holds do not set off collections.
        body = msgspec.defstruct("Body", fields, rename=rename, kw_only=True, gc=False)
        return msgspec.json.Decoder(body)

    @functools.cached_property
    def _getters(self) -> tuple[operator.attrgetter[Any], ...]:
        """Each field's value of a decoded row (attributes ``f0``, ``f1``, ...)."""
        return tuple(operator.attrgetter(f"f{i}") for i in range(len(self.fields)))

    def check(self, bodies: Sequence[bytes]) -> None:
        """INVALID_BODY unless every one of ``bodies`` fits: ``rows`` without keeping them
        (the commit makes its columns from the bodies, queue_engine.json_columns)."""
        self._decode(bodies)

    def rows(self, bodies: Sequence[bytes]) -> list[Any]:
        """``bodies`` decoded, which must fit (INVALID_BODY names the first that does not:
        its line, counted from 1 where there are several, its field and why): what ``arrays``
        makes columns of, later and for many publishes at once."""
        return self._decode(bodies)

    def lenient_rows(self, bodies: Sequence[bytes]) -> list[Any]:
        """``bodies`` decoded, a value that does not fit its field read as null.

        For bodies taken before a field was declared (the fanout, dead letters, a journal
        recovered after the schema changed): every body fitted the fields of its time, and a
        field keeps its type, so a field's value never depends on when it is converted.
        """
        decode = self._decoder.decode
        rows: list[Any] = []
        for body in bodies:
            try:
                rows.append(decode(body))
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                rows.append(self._fitting_part(body))
        # Arrow would keep such an instant as a timestamp no reader can convert: that row's
        # fitting part instead.
        for i, _ in self._out_of_range(rows):
            rows[i] = self._fitting_part(bodies[i])
        return rows

    def lenient_columns(self, bodies: Sequence[bytes]) -> list[pa.Array]:
        """The typed columns of ``bodies`` (``lenient_rows``)."""
        return self.arrays(self.lenient_rows(bodies))

    def arrays(self, rows: list[Any]) -> list[pa.Array]:
        """Decoded rows as the typed columns, one Arrow array a field (a value Arrow cannot
        hold, which only ``lenient_rows`` lets through, read as null)."""
        try:
            return self._arrays(rows)
        except _Unfit:
            # An instant before year 1 or after 9999 once in UTC.
            return self._arrays([self._fitting_part(msgspec.json.encode(r)) for r in rows])

    def _decode(self, bodies: Sequence[bytes]) -> list[Any]:
        try:
            rows = list(map(self._decoder.decode, bodies))  # the loop in C
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            raise self._refusal(bodies) from None
        for i, field in self._out_of_range(rows):
            raise _refused(i + 1, len(bodies), f"field {field.name}: out of range")
        return rows

    def _out_of_range(self, rows: list[Any]) -> Iterator[tuple[int, SchemaField]]:
        """(row index, field) of each value msgspec takes and a column cannot hold: an instant
        before year 1 or after 9999 once in UTC (0001-01-01T00:00:00+01:00)."""
        for field, get in zip(self.fields, self._getters, strict=True):
            if field.type.ddl != "TIMESTAMP":
                continue
            values = list(map(get, rows))
            # The years gathered in C first: a row is looked at only in a batch that has an
            # instant in year 1 or 9999.
            if _EDGE_YEARS.isdisjoint(map(_year, filter(None, values))):
                continue
            for i, value in enumerate(values):
                if value is not None and value.year in _EDGE_YEARS and _outside(field, value):
                    yield i, field

    def _refusal(self, bodies: Sequence[bytes]) -> QueueError:
        """INVALID_BODY for the first of ``bodies`` that does not decode: its line, field and
        why (looked for only once a batch has failed)."""
        decode = self._decoder.decode
        for line, body in enumerate(bodies, 1):
            try:
                decode(body)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return _refused(line, len(bodies), self._reason(body) or _msgspec_reason(str(exc)))
            except RecursionError:
                # msgspec's depth follows the stack: a body nested ~1000 deep (anywhere in it).
                return _refused(line, len(bodies), "not JSON (nested too deeply)")
        raise AssertionError("a batch that failed to decode decodes body by body")

    def _arrays(self, rows: list[Any]) -> list[pa.Array]:
        """The fields of decoded rows, one Arrow column each."""
        if not rows:
            return [pa.array([], f.type.arrow) for f in self.fields]
        # A column's values gathered in C: map() of an attrgetter over the rows (~50 ns a
        # row a field; astuple then zip(*rows) cost ~1.1 us a row, a getattr loop more).
        out = []
        for field, get in zip(self.fields, self._getters, strict=True):
            column = list(map(get, rows))
            try:
                if field.type.ddl == "TIMESTAMP":
                    out.append(_instants(column, field.type.arrow))
                else:
                    out.append(pa.array(column, field.type.arrow))
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, ValueError) as exc:
                raise _Unfit(field.name) from exc
        return out

    def _reason(self, body: bytes) -> str | None:
        """Why ``body`` does not fit, in deltaq's words (None: msgspec's say it better)."""
        try:
            value = orjson.loads(body)
        except (orjson.JSONDecodeError, RecursionError) as exc:
            return f"not JSON ({exc})"
        if not isinstance(value, dict):
            return f"a typed topic takes a JSON object, not {_json_kind(value)}"
        for field in self.fields:
            reason = _value_reason(field, value.get(field.name))
            if reason is not None:
                return f"field {field.name}: {reason}"
        return None

    def _fitting_part(self, body: bytes) -> Any:
        """A decoded row of the declared fields of ``body`` whose values fit (others null)."""
        try:
            value = orjson.loads(body)
        except (orjson.JSONDecodeError, RecursionError):
            value = {}
        if not isinstance(value, dict):
            value = {}
        kept = {
            f.name: value[f.name]
            for f in self.fields
            if value.get(f.name) is not None
            and _value_reason(SchemaField(f.name, f.type), value[f.name]) is None
        }
        return self._lenient._decoder.decode(orjson.dumps(kept))

    @functools.cached_property
    def _lenient(self) -> TopicSchema:
        """The same fields, none NOT NULL: what a fitting part is decoded with."""
        return TopicSchema(tuple(SchemaField(f.name, f.type) for f in self.fields))


_EDGE_YEARS = frozenset({1, 9999})
_year = operator.attrgetter("year")


class _Unfit(Exception):
    pass


_encode = msgspec.json.Encoder().encode
_decode_texts = msgspec.json.Decoder(list[str | None]).decode


def _instants(values: Sequence[datetime | None], arrow: pa.DataType) -> pa.Array:
    """Aware datetimes as a timestamp column. Arrow converts a datetime object through its
    zone's utcoffset() in Python, ~0.5 us a value; msgspec writes them as RFC 3339 text in C
    and Arrow parses that text in C: ~0.18 us a value, the same instants."""
    try:
        return pa.array(_decode_texts(_encode(values)), pa.string()).cast(arrow)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array(values, arrow)


def _outside(field: SchemaField, value: object) -> bool:
    """Whether ``value`` (decoded) lies outside what the field holds: an instant before year 1
    or after 9999 once in UTC (msgspec takes 0001-01-01T00:00:00+01:00)."""
    if not isinstance(value, datetime):
        return False
    try:
        value.astimezone(UTC)
    except OverflowError:
        return True
    return False


@functools.lru_cache(maxsize=64)
def _value_decoder(spec: _Type) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(msgspec.defstruct("Value", [("v", spec.python | None, None)]))


def _value_reason(field: SchemaField, value: object) -> str | None:
    """Why ``value`` does not fit ``field`` (None: it does): one value through the same
    decoder, so that the reason and the verdict never disagree."""
    if value is None:
        return "required (NOT NULL), absent or null" if field.not_null else None
    try:
        decoded = _value_decoder(field.type).decode(orjson.dumps({"v": value}))
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, TypeError):
        decoded = None
    if decoded is not None and not _outside(field, decoded.v):
        return None
    shown = orjson.dumps(value).decode()
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"expected {field.type.ddl}: {field.type.wanted}; got {_json_kind(value)} {shown}"


def _msgspec_reason(text: str) -> str:
    """msgspec's error as deltaq says it: ``field name: ...`` where it names one."""
    missing = re.match(r"Object missing required field `(.*)`", text)
    if missing:
        return f"field {missing.group(1)}: required (NOT NULL), absent or null"
    at = re.match(r"(.*) - at `\$\.(.*)`$", text)
    if at:
        return f"field {at.group(2)}: {at.group(1)}"
    return text


def _refused(line: int, lines: int, reason: str) -> QueueError:
    return QueueError(ErrorCode.INVALID_BODY, f"line {line}: {reason}" if lines > 1 else reason)


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
    # The parser is imported by the first schema: sqlglot is ~12 MiB of a serving process,
    # which a warehouse without typed topics or filters never needs.
    from queue_engine.schema_ddl import parse_fields

    return TopicSchema(parse_fields(text))


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
