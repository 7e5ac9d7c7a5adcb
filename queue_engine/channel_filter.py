"""A channel's filter: a Spark SQL boolean expression over a message's columns.

Given at ``/channel/create`` or ``/channel/configure``, parsed with sqlglot in Spark's dialect
(queue_engine.filter_sql), and checked before anything is recorded: columns the topic has,
operands of one type, and only constructs that evaluate the same in Arrow (the fanout loop
and its driver) as in Spark (its writer path). Rows for which the expression is false or null
do not enter the channel, as Spark's ``WHERE``. Only deterministic expressions: a replayed
fanout batch must route as the first attempt did.

What is taken: the columns ``id``, ``replay_of`` (strings), ``published_at``, ``deliver_at``,
``expires_at`` (timestamps), ``headers['name']`` (a string, null where the message lacks it),
and a typed topic's fields (queue_engine.topic_schema); string, number, ``DATE '...'`` and
``TIMESTAMP '...'`` literals (with their zone), ``TRUE``/``FALSE``; ``=``, ``!=``,
``<>``, ``<``, ``<=``, ``>``, ``>=``, ``AND``, ``OR``, ``NOT``, ``IS [NOT] NULL``,
``[NOT] IN (...)``, ``[NOT] BETWEEN``, ``[NOT] LIKE``, parentheses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pyarrow.compute as pc

from queue_engine.errors import ErrorCode, QueueError

MAX_FILTER_CHARS = 4096

# Column -> its type in a filter (headers only through headers['name']).
COLUMNS = {
    "id": "string",
    "replay_of": "string",
    "published_at": "timestamp",
    "deliver_at": "timestamp",
    "expires_at": "timestamp",
}
# (field, DDL type) of a typed topic's fields (queue_engine.topic_schema.TopicSchema.kinds).
Fields = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ChannelFilter:
    text: str
    # The expression as Spark evaluates it (written back from the parsed tree).
    spark_sql: str
    arrow: pc.Expression


# The fanout compiles each filtered channel's filter for every batch: parsed once.
@functools.lru_cache(maxsize=4096)
def compile_filter(text: str, fields: Fields = ()) -> ChannelFilter:
    """``text`` checked and translated, or INVALID_FILTER saying why; ``fields``: the typed
    topic's fields it may name besides the message's own columns."""
    if not text.strip():
        raise QueueError(ErrorCode.INVALID_FILTER, "empty: leave filter out for every message")
    if len(text) > MAX_FILTER_CHARS:
        raise QueueError(ErrorCode.INVALID_FILTER, f"over {MAX_FILTER_CHARS} characters")
    # The parser is imported by the first filter: sqlglot is ~12 MiB of a serving process,
    # which a warehouse without filters or typed topics never needs.
    from queue_engine.filter_sql import translate

    spark_sql, arrow = translate(text, fields)
    return ChannelFilter(text, spark_sql, arrow)
