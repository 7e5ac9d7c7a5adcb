"""Which channel gets which topic rows (pure): NSQ's fanout rules over Delta versions.

A channel receives the rows of its topic committed after the channel's start version (the
topic version when it was created; for a topic's only channel, the version up to which the
topic had been drained or emptied), except a replay's copies for another channel (rows whose
``to_channel`` names one), and of those only the rows its filter holds for, each row by the
filter of its topic version (queue_engine.channel_filter). The same registry and rows always
give the same answer, so a replayed fanout batch routes exactly as the first attempt did.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.channel_filter import Fields, compile_filter
from queue_engine.registry import ChannelInfo, Registry
from queue_engine.topic_schema import TopicSchema, parse_schema

CHANNEL_COLUMNS = (
    "id",
    "body",
    "published_at",
    "deliver_at",
    "topic_version",
    "expires_at",
    "replay_of",
    "headers",
)
# How the fanout job writes channel rows (``deltaq fanout --channel-writes``): see
# queue_engine.spark.fanout_stream.
CHANNEL_WRITES = ("auto", "driver", "delta", "deltaq")
# Topic files (commits) a micro-batch reads at most (``deltaq fanout --max-files-per-trigger``).
# Publishes to many topics are a file each: at 200, micro-batches ~1 s apart over 10,000 topics
# moved ~200 messages each, and the fanout fell behind 500 msg/s spread over random topics.
MAX_FILES_PER_TRIGGER = 1000


def receivers(registry: Registry, topic: str) -> list[tuple[str, ChannelInfo]]:
    """The channels a topic's rows go to, in name order (none once the topic is deleted); each
    takes the rows whose ``topic_version`` is above its ``start_version``."""
    info = registry.topics.get(topic)
    return [] if info is None else sorted(info.channels.items())


def topic_schema(registry: Registry, topic: str) -> TopicSchema | None:
    """The topic's declared schema (None: untyped): its fields are columns of the channel rows
    too, converted from the body (queue_engine.topic_schema.TopicSchema.lenient_columns)."""
    info = registry.topics.get(topic)
    return None if info is None or info.schema is None else parse_schema(info.schema)


def fields_of(schema: TopicSchema | None) -> Fields:
    return () if schema is None else tuple(schema.kinds.items())


def for_channel(to_channel: pa.ChunkedArray | pa.Array, name: str) -> pa.Array:
    """Which rows go to channel ``name``: every row but a replay's copies for other channels."""
    return pc.or_kleene(pc.is_null(to_channel), pc.equal(to_channel, name))


def _segments(channel: ChannelInfo) -> list[tuple[int, int | None, str | None]]:
    """(after version, through version or None, filter or None) for each of the channel's
    filters, and first the rows from before any: unfiltered."""
    filters = channel.filters
    out: list[tuple[int, int | None, str | None]] = [(-1, filters[0][0], None)]
    for i, (start, text) in enumerate(filters):
        end = filters[i + 1][0] if i + 1 < len(filters) else None
        out.append((start, end, text))
    return out


def filter_expression(channel: ChannelInfo, fields: Fields = ()) -> pc.Expression | None:
    """The Arrow condition a row must meet to enter the channel (None: every row does);
    ``fields``: the topic's typed fields (columns of the rows)."""
    if not channel.filters:
        return None
    version = pc.field("topic_version")
    condition = None
    for start, end, text in _segments(channel):
        part = version > start
        if end is not None:
            part = part & (version <= end)
        if text is not None:
            part = part & compile_filter(text, fields).arrow
        condition = part if condition is None else condition | part
    return condition


def filter_sql(channel: ChannelInfo, fields: Fields = ()) -> str | None:
    """The same condition in Spark SQL (Spark's writer path)."""
    if not channel.filters:
        return None
    parts = []
    for start, end, text in _segments(channel):
        part = f"topic_version > {start}"
        if end is not None:
            part += f" AND topic_version <= {end}"
        if text is not None:
            part += f" AND ({compile_filter(text, fields).spark_sql})"
        parts.append(f"({part})")
    return " OR ".join(parts)


def route_noted(
    rows: pa.Table, registry: Registry
) -> tuple[dict[tuple[str, str], pa.Table], dict[tuple[str, str], tuple[int, int]]]:
    """Rows (with ``topic`` and ``topic_version`` columns) per (topic, channel), a typed topic's
    rows with its fields' columns last; and for each filtered channel what its commit notes
    (queue_engine.store.tables.batch_notes): the rows its filter kept out of the batch, and the
    newest topic version of the batch's rows of its topic. A filtered channel whose filter kept
    every row out gets an empty table: the note can still be committed."""
    out: dict[tuple[str, str], pa.Table] = {}
    notes: dict[tuple[str, str], tuple[int, int]] = {}
    if rows.num_rows == 0:
        return out, notes
    topics = pc.unique(rows["topic"]).to_pylist()
    for topic in topics:
        channels = receivers(registry, topic)
        if not channels:
            continue
        of_topic = rows.filter(pc.equal(rows["topic"], topic))
        schema = topic_schema(registry, topic)
        columns = list(CHANNEL_COLUMNS)
        if schema is not None:
            typed = schema.lenient_columns(of_topic["body"].to_pylist())
            for field, column in zip(schema.arrow_fields, typed, strict=True):
                of_topic = of_topic.append_column(field, column)
            columns += [f.name for f in schema.arrow_fields]
        reached = int(pc.max(of_topic["topic_version"]).as_py())
        for name, channel in channels:
            selected = of_topic.filter(
                pc.and_(
                    pc.greater(of_topic["topic_version"], channel.start_version),
                    for_channel(of_topic["to_channel"], name),
                )
            )
            condition = filter_expression(channel, fields_of(schema))
            if condition is not None and selected.num_rows:
                eligible = selected.num_rows
                selected = selected.filter(condition)
                notes[(topic, name)] = (eligible - selected.num_rows, reached)
            if selected.num_rows or (topic, name) in notes:
                out[(topic, name)] = selected.select(columns)
    return out, notes
