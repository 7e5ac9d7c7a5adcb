"""The typed columns of a commit's bodies, read by Arrow's JSON reader with the GIL released.

Every body of a typed topic was checked by msgspec when it was published (topic_schema), on
the event loop. Making the columns again from decoded Python rows at the commit held the GIL
for ~1-1.4 us a row, and the event loop answering the next publishes waited for it: typed
``/mpub`` ran at 0.6x of untyped. Arrow's JSON reader parses the same bodies in C++ without
the GIL (~1.5 us a row of CPU, on the other core), so the commit no longer competes with the
loop.

Used only for bodies that all fitted the schema when checked: each is then one JSON object,
so joined by newlines they are one row each (a raw newline in a valid JSON text is
whitespace, and the reader is told when there are any). The reader and msgspec agree on
every fitting body (a property test holds them to it); where the reader still refuses a
batch (an instant with more than six fractional digits, a key given twice), ``None`` tells
the caller to convert with msgspec instead. Bodies that were never checked (taken before
the topic had its schema) do not come here: the reader is not made for arbitrary text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.json as pa_json

from queue_engine.topic_schema import TopicSchema

# Below this many rows msgspec is cheaper: the reader costs ~0.4 ms a call however few.
MIN_ROWS = 256
# The text is read in blocks of at most this many bytes, one chunk of the columns each: a
# commit may carry 64 MiB of bodies (commit_max_bytes), and the reader's buffers for one
# block of it are a few times its size. A body longer than a block (over max_msg_size) makes
# the reader refuse, and msgspec converts that commit.
BLOCK_BYTES = 8 << 20
# Text the reader reads as strings, cast after: it parses no date, and a timestamp's zone
# offset only through the cast.
_AS_TEXT = frozenset({"DATE", "TIMESTAMP"})


@functools.lru_cache(maxsize=256)
def _read_schema(schema: TopicSchema) -> pa.Schema:
    return pa.schema(
        pa.field(f.name, pa.string() if f.type.ddl in _AS_TEXT else f.type.arrow)
        for f in schema.fields
    )


def checked_columns(
    schema: TopicSchema, bodies: Sequence[bytes], min_rows: int = MIN_ROWS
) -> list[pa.Array] | None:
    """The typed columns of ``bodies``, each checked against ``schema`` when published
    (None: too few to be worth the reader, or the reader refused them)."""
    if len(bodies) < min_rows or not bodies:
        return None
    data = b"\n".join(bodies)
    try:
        table = pa_json.read_json(
            pa.BufferReader(data),
            read_options=pa_json.ReadOptions(
                use_threads=False, block_size=min(len(data) + 1, BLOCK_BYTES)
            ),
            parse_options=pa_json.ParseOptions(
                explicit_schema=_read_schema(schema),
                newlines_in_values=data.count(b"\n") != len(bodies) - 1,
                unexpected_field_behavior="ignore",
            ),
        )
        if table.num_rows != len(bodies):
            return None
        columns = []
        for field in schema.fields:
            column = table.column(field.name).combine_chunks()
            if field.type.ddl in _AS_TEXT:
                column = column.cast(field.type.arrow)
            columns.append(column)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    return columns
