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
  fin_per_s (FINs in the minute before the query, or before ``as_of``, / 60, to 3 decimals:
  it falls to 0 when a channel goes quiet).

And one view per typed topic (queue_engine.topic_schema), ``topic_<t>`` (named as its catalog
entry, queue_engine.spark.catalog): the topic table's rows with the typed fields as columns.

``as_of`` (a timestamp) reads every table as it was then (Delta time travel): the registry,
the channel tables, the ledgers, and the state each channel's sweep had written by then.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from queue_engine.registry import Registry
from queue_engine.spark.channel_tables import (
    TABLE_SCHEMAS,
    TOPIC_COUNTS_SCHEMA,
    with_names,
)
from queue_engine.spark.session import register
from queue_engine.store.delta import open_as_of
from queue_engine.store.tables import (
    StateMeta,
    Warehouse,
    current_meta,
    events_from_table,
    load_marks,
    meta_of,
)

log = logging.getLogger(__name__)

VIEWS = ("topics", "channels", "messages", "ledger", "state", "dead_letters", "queue_stats")


def _parse(as_of: str | datetime | None) -> datetime | None:
    if as_of is None or isinstance(as_of, datetime):
        return as_of
    parsed = datetime.fromisoformat(as_of.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def read_registry(warehouse: Warehouse, as_of: datetime | None) -> Registry:
    """The registry folded as of ``as_of`` (None: now); empty where there is none."""
    dt = open_as_of(warehouse.registry_path, as_of)
    if dt is None:
        return Registry()
    return Registry.fold(events_from_table(dt.to_pyarrow_table()))


def _channel_tables(
    spark: SparkSession,
    warehouse: Warehouse,
    channels: list[tuple[str, str]],
    table: str,
    as_of: datetime | None,
) -> DataFrame:
    """One kind of table of every channel, as one scan (queue_engine/spark/channel_tables)."""
    reader = (
        spark.read.format("deltaq")
        .schema(from_arrow_schema(with_names(TABLE_SCHEMAS[table])))
        .option("kind", "channels")
        .option("table", table)
        .option("warehouse", warehouse.root)
        .option("channels", json.dumps(channels))
    )
    if as_of is not None:
        reader = reader.option("timestampAsOf", as_of.isoformat())
    return reader.load()


def _sweep_metas(
    warehouse: Warehouse, registry: Registry, as_of: datetime | None
) -> list[tuple[str, str, StateMeta]]:
    """Each channel's newest sweep meta (as of ``as_of``): from the sweep's marks where they
    still describe the state table (a probe), else from the table's history."""
    marks = load_marks(warehouse.root) if as_of is None else {}
    metas = []
    for info in sorted(registry.topics.values(), key=lambda t: t.name):
        for name in sorted(info.channels):
            path = warehouse.channel_state_path(info.name, name)
            if as_of is None:
                mark = marks.get((info.name, name))
                meta = current_meta(mark, info.channels[name].created_at_us, path)
            else:
                dt = open_as_of(path, as_of)
                meta = meta_of(dt) if dt is not None else None
            if meta is not None:
                metas.append((info.name, name, meta))
    return metas


def register_views(
    spark: SparkSession,
    warehouse: str | Warehouse,
    *,
    as_of: str | datetime | None = None,
    database: str | None = None,
) -> list[str]:
    """Create or replace the temp views on ``spark``; returns their names. ``database``: also
    enter every table in the session's catalog there (queue_engine/spark/catalog.py)."""
    register(spark)
    wh = warehouse if isinstance(warehouse, Warehouse) else Warehouse(warehouse)
    if database is not None:
        from queue_engine.spark.catalog import register_tables

        register_tables(spark, wh, database)
    when = _parse(as_of)
    registry = read_registry(wh, when)
    channels = sorted((t.name, c) for t in registry.topics.values() for c in t.channels)

    spark.createDataFrame(
        [
            (t.name, _ts(t.created_at_us), t.paused, len(t.channels))
            for t in sorted(registry.topics.values(), key=lambda t: t.name)
        ],
        "topic string, created_at timestamp, paused boolean, channel_count long",
    ).createOrReplaceTempView("_deltaq_topics")
    counts = (
        spark.read.format("deltaq")
        .schema(from_arrow_schema(TOPIC_COUNTS_SCHEMA))
        .option("kind", "topic_counts")
        .option("warehouse", wh.root)
        .option("topics", json.dumps(sorted(registry.topics)))
    )
    if when is not None:
        counts = counts.option("timestampAsOf", when.isoformat())
    counts.load().createOrReplaceTempView("_deltaq_topic_counts")
    spark.sql(_TOPICS).createOrReplaceTempView("topics")

    channel_rows = [
        (t.name, c.name, _ts(c.created_at_us), c.paused, c.ephemeral)
        for t in sorted(registry.topics.values(), key=lambda t: t.name)
        for c in sorted(t.channels.values(), key=lambda c: c.name)
    ]
    spark.createDataFrame(
        channel_rows,
        "topic string, channel string, created_at timestamp, paused boolean, ephemeral boolean",
    ).createOrReplaceTempView("channels")

    for view, table in (
        ("messages", "messages"),
        ("ledger", "ledger"),
        ("state", "state"),
        ("_deltaq_dead", "dead"),
    ):
        _channel_tables(spark, wh, channels, table, when).createOrReplaceTempView(view)
    spark.sql(_DEAD_LETTERS).createOrReplaceTempView("dead_letters")

    metas = _sweep_metas(wh, registry, when)
    spark.createDataFrame(
        [(t, c, _ts(m.swept_at_us), m.finished_requeues, m.finished_timeouts) for t, c, m in metas],
        "topic string, channel string, swept_at timestamp, finished_requeues long, "
        "finished_timeouts long",
    ).createOrReplaceTempView("_deltaq_sweeps")
    # fin_per_s counts the minute before this moment (or as_of): a channel that went quiet
    # falls to 0, though its last sweep (skipped since: nothing changed) saw FINs.
    now_us = int((when or datetime.now(UTC)).timestamp() * 1_000_000)
    spark.sql(_QUEUE_STATS.format(now_us=now_us)).createOrReplaceTempView("queue_stats")
    return list(VIEWS) + _topic_views(spark, wh, registry, when)


def _topic_views(
    spark: SparkSession, wh: Warehouse, registry: Registry, as_of: datetime | None
) -> list[str]:
    """A view of each typed topic's table, its typed columns included."""
    from queue_engine.spark.catalog import catalog_name

    names = []
    for info in sorted(registry.topics.values(), key=lambda t: t.name):
        if info.schema is None:
            continue
        reader = spark.read.format("deltaq")
        if as_of is not None:
            if open_as_of(wh.topic_path(info.name), as_of) is None:
                continue
            reader = reader.option("timestampAsOf", as_of.isoformat())
        name = catalog_name("topic", info.name)
        reader.load(wh.topic_path(info.name)).createOrReplaceTempView(name)
        names.append(name)
    return names


def _ts(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1_000_000, tz=UTC)


_TOPICS = """
SELECT r.topic, r.created_at, r.paused, r.channel_count,
  COALESCE(c.message_count, 0) AS message_count
FROM _deltaq_topics r LEFT JOIN _deltaq_topic_counts c ON c.topic = r.topic
"""

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
  d.last_event, d.dead_at, s.redriven_at, d.headers
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
  FROM ledger l
  WHERE l.event = 'FIN' AND l.at > timestamp_micros({now_us} - 60000000)
    AND l.at <= timestamp_micros({now_us})
  GROUP BY l.topic, l.channel
) f ON f.topic = s.topic AND f.channel = s.channel
LEFT JOIN (
  SELECT l.topic, l.channel, COUNT(*) AS expired
  FROM ledger l JOIN _deltaq_sweeps w ON l.topic = w.topic AND l.channel = w.channel
  WHERE l.event = 'EXPIRE' AND l.at <= w.swept_at
  GROUP BY l.topic, l.channel
) x ON x.topic = s.topic AND x.channel = s.channel
"""
