"""A typed topic's schema as written: Spark DDL (the column list of ``CREATE TABLE``), parsed
with sqlglot in Spark's dialect. Imported only when a schema is parsed."""

from __future__ import annotations

from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.filter_sql import sqlglot_reason
from queue_engine.topic_schema import _NAME, MAX_FIELDS, RESERVED, TYPES, SchemaField, _Type

# sqlglot's type -> the field type it declares (Spark's STRING is sqlglot's TEXT, and its
# TIMESTAMP an instant: TIMESTAMPTZ).
_TAKEN: dict[Any, _Type] = {
    exp.DataType.Type.TEXT: TYPES["STRING"],
    exp.DataType.Type.BOOLEAN: TYPES["BOOLEAN"],
    exp.DataType.Type.INT: TYPES["INT"],
    exp.DataType.Type.BIGINT: TYPES["BIGINT"],
    exp.DataType.Type.DOUBLE: TYPES["DOUBLE"],
    exp.DataType.Type.DATE: TYPES["DATE"],
    exp.DataType.Type.TIMESTAMPTZ: TYPES["TIMESTAMP"],
}
_TYPE_NAMES = ", ".join(TYPES)


def parse_fields(text: str) -> tuple[SchemaField, ...]:
    """The fields ``text`` declares (Spark DDL, within queue_engine.topic_schema's limits),
    or INVALID_SCHEMA saying why."""
    try:
        tree = sqlglot.parse_one(f"CREATE TABLE t ({text})", read="spark")
    except SqlglotError as exc:
        # The wrapper above is not the user's text.
        first = sqlglot_reason(exc).replace("CREATE TABLE t (", "", 1)
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
    return tuple(fields)


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
    spec = _TAKEN.get(kind.this)
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
