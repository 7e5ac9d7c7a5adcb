"""Spark SQL over the queue: ``register_views(spark, warehouse)`` and then plain SQL.

Views (every per-channel view has ``topic`` and ``channel`` columns first):

- ``topics``: one row per topic (created_at, paused, channel_count, message_count).
- ``channels``: one row per channel (created_at, paused, ephemeral).
- ``messages``: every channel-table row (id, body, published_at, deliver_at, topic_version).
- ``ledger``: every lease event (DELIVER / FIN / REQ / TOUCH / TIMEOUT / DEAD / REDRIVE /
  EXPIRE), i.e. every attempt.
- ``state``: the live messages as of each channel's last sweep (status, attempts, lease_owner,
  lease_expires_at, deliver_at, ..., swept_at).
- ``dead_letters``: every time a message was dead-lettered (id, body, published_at, attempts,
  last_consumer, last_event, dead_at) and when it was redriven (redriven_at; null: still dead).
- ``queue_stats``: per channel, as of its last sweep: depth, in_flight, deferred, dead, expired
  (EXPIRE events, ever),
  oldest_ready_age_s, requeues, timeouts (nsqd's counters: every message the channel had),
  fin_per_s (FINs in the minute before the sweep / 60, to 3 decimals).

``as_of`` (a timestamp) reads every table as it was then (Delta time travel): the registry,
the channel tables, the ledgers, and the state each channel's sweep had written by then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from functools import reduce

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from queue_engine.registry import Registry
from queue_engine.spark.session import read_format, register
from queue_engine.store.registry_store import events_from_table
from queue_engine.store.state import STATE_SCHEMA, StateMeta, meta_of
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    Warehouse,
)

log = logging.getLogger(__name__)

VIEWS = ("topics", "channels", "messages", "ledger", "state", "dead_letters", "queue_stats")


def _parse(as_of: str | datetime | None) -> datetime | None:
    if as_of is None or isinstance(as_of, datetime):
        return as_of
    parsed = datetime.fromisoformat(as_of.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _table(path: str, as_of: datetime | None) -> DeltaTable | None:
    """The table at ``path`` as of ``as_of`` (None: it did not exist then)."""
    try:
        dt = DeltaTable(path)
        if as_of is not None:
            dt.load_as_version(as_of)
    except Exception:
        return None
    return dt


def _registry(warehouse: Warehouse, as_of: datetime | None) -> Registry:
    dt = _table(warehouse.registry_path, as_of)
    if dt is None:
        return Registry()
    return Registry.fold(events_from_table(dt.to_pyarrow_table()))


def _empty(spark: SparkSession, schema: pa.Schema) -> DataFrame:
    from pyspark.sql.pandas.types import from_arrow_schema

    frame: DataFrame = spark.createDataFrame([], schema=from_arrow_schema(schema))
    return frame


def _with_names(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field("topic", pa.string()), pa.field("channel", pa.string()), *schema])


def _union(
    spark: SparkSession,
    channels: list[tuple[str, str]],
    path_of: Callable[[str, str], str],
    schema: pa.Schema,
    as_of: datetime | None,
) -> DataFrame:
    frames: list[DataFrame] = []
    table_format = read_format(spark)
    for topic, channel in channels:
        dt = _table(path_of(topic, channel), as_of)
        if dt is None:
            continue
        df = (
            spark.read.format(table_format)
            .option("versionAsOf", str(dt.version()))
            .load(path_of(topic, channel))
        )
        frames.append(
            df.select(
                F.lit(topic).alias("topic"),
                F.lit(channel).alias("channel"),
                *[F.col(name) for name in schema.names],
            )
        )
    if not frames:
        return _empty(spark, _with_names(schema))
    return reduce(DataFrame.unionByName, frames)


def register_views(
    spark: SparkSession, warehouse: str | Warehouse, *, as_of: str | datetime | None = None
) -> list[str]:
    """Create or replace the temp views on ``spark``; returns their names."""
    register(spark)
    wh = warehouse if isinstance(warehouse, Warehouse) else Warehouse(warehouse)
    when = _parse(as_of)
    registry = _registry(wh, when)
    channels = sorted((t.name, c) for t in registry.topics.values() for c in t.channels)

    topic_rows = []
    for t in sorted(registry.topics.values(), key=lambda t: t.name):
        dt = _table(wh.topic_path(t.name), when)
        count = 0
        if dt is not None:
            actions = pa.table(dt.get_add_actions(flatten=True))
            count = sum(int(n or 0) for n in actions["num_records"].to_pylist())
        topic_rows.append((t.name, _ts(t.created_at_us), t.paused, len(t.channels), count))
    spark.createDataFrame(
        topic_rows,
        "topic string, created_at timestamp, paused boolean, channel_count long, "
        "message_count long",
    ).createOrReplaceTempView("topics")

    channel_rows = [
        (t.name, c.name, _ts(c.created_at_us), c.paused, c.ephemeral)
        for t in sorted(registry.topics.values(), key=lambda t: t.name)
        for c in sorted(t.channels.values(), key=lambda c: c.name)
    ]
    spark.createDataFrame(
        channel_rows,
        "topic string, channel string, created_at timestamp, paused boolean, ephemeral boolean",
    ).createOrReplaceTempView("channels")

    _union(
        spark, channels, wh.channel_messages_path, CHANNEL_MESSAGES_SCHEMA, when
    ).createOrReplaceTempView("messages")
    _union(spark, channels, wh.channel_ledger_path, LEDGER_SCHEMA, when).createOrReplaceTempView(
        "ledger"
    )
    _union(spark, channels, wh.channel_state_path, STATE_SCHEMA, when).createOrReplaceTempView(
        "state"
    )

    _union(spark, channels, wh.channel_dead_path, DEAD_LETTER_SCHEMA, when).createOrReplaceTempView(
        "_deltaq_dead"
    )
    spark.sql(_DEAD_LETTERS).createOrReplaceTempView("dead_letters")

    metas: list[tuple[str, str, StateMeta]] = []
    for topic, channel in channels:
        dt = _table(wh.channel_state_path(topic, channel), when)
        meta = meta_of(dt) if dt is not None else None
        if meta is not None:
            metas.append((topic, channel, meta))
    spark.createDataFrame(
        [(t, c, _ts(m.swept_at_us), m.finished_requeues, m.finished_timeouts) for t, c, m in metas],
        "topic string, channel string, swept_at timestamp, finished_requeues long, "
        "finished_timeouts long",
    ).createOrReplaceTempView("_deltaq_sweeps")
    spark.sql(_QUEUE_STATS).createOrReplaceTempView("queue_stats")
    return list(VIEWS)


def _ts(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1_000_000, tz=UTC)


# A dead-letter row counts only with its ledger DEAD event (same id and time): a row written
# before a crash that lost its event is not a dead letter (the message died again later).
_DEAD_LETTERS = """
WITH deaths AS (
  SELECT d.topic, d.channel, d.id, d.dead_at, MIN(r.at) AS redriven_at
  FROM _deltaq_dead d
  JOIN ledger x
    ON x.event = 'DEAD' AND x.topic = d.topic AND x.channel = d.channel
    AND x.id = d.id AND x.at = d.dead_at
  LEFT JOIN ledger r
    ON r.event = 'REDRIVE' AND r.topic = d.topic AND r.channel = d.channel
    AND r.id = d.id AND r.at > d.dead_at
  GROUP BY d.topic, d.channel, d.id, d.dead_at
)
SELECT d.topic, d.channel, d.id, d.body, d.published_at, d.attempts, d.last_consumer,
  d.last_event, d.dead_at, s.redriven_at
FROM _deltaq_dead d
JOIN deaths s
  ON s.topic = d.topic AND s.channel = d.channel AND s.id = d.id AND s.dead_at = d.dead_at
"""

# Per channel as of its last sweep. Channels never swept have no row.
_QUEUE_STATS = """
SELECT
  s.topic,
  s.channel,
  COALESCE(a.depth, 0) AS depth,
  COALESCE(a.in_flight, 0) AS in_flight,
  COALESCE(a.deferred, 0) AS deferred,
  COALESCE(a.dead, 0) AS dead,
  COALESCE(x.expired, 0) AS expired,
  CAST(unix_micros(s.swept_at) - unix_micros(a.oldest_ready) AS DOUBLE) / 1e6
    AS oldest_ready_age_s,
  s.finished_requeues + COALESCE(a.requeues, 0) AS requeues,
  s.finished_timeouts + COALESCE(a.timeouts, 0) AS timeouts,
  ROUND(CAST(COALESCE(f.fins, 0) AS DOUBLE) / 60, 3) AS fin_per_s,
  s.swept_at
FROM _deltaq_sweeps s
LEFT JOIN (
  SELECT topic, channel,
    COUNT_IF(status = 'ready') AS depth,
    COUNT_IF(status = 'in_flight') AS in_flight,
    COUNT_IF(status = 'deferred') AS deferred,
    COUNT_IF(status = 'dead') AS dead,
    MIN(CASE WHEN status = 'ready' THEN published_at END) AS oldest_ready,
    SUM(requeues) AS requeues,
    SUM(timeouts) AS timeouts
  FROM state GROUP BY topic, channel
) a ON a.topic = s.topic AND a.channel = s.channel
LEFT JOIN (
  SELECT l.topic, l.channel, COUNT(*) AS fins
  FROM ledger l JOIN _deltaq_sweeps w ON l.topic = w.topic AND l.channel = w.channel
  WHERE l.event = 'FIN' AND l.at > w.swept_at - INTERVAL 60 SECONDS AND l.at <= w.swept_at
  GROUP BY l.topic, l.channel
) f ON f.topic = s.topic AND f.channel = s.channel
LEFT JOIN (
  SELECT l.topic, l.channel, COUNT(*) AS expired
  FROM ledger l JOIN _deltaq_sweeps w ON l.topic = w.topic AND l.channel = w.channel
  WHERE l.event = 'EXPIRE' AND l.at <= w.swept_at
  GROUP BY l.topic, l.channel
) x ON x.topic = s.topic AND x.channel = s.channel
"""
