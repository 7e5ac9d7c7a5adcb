"""The fanout as a Structured Streaming query: every topic row into each of its channels.

Exactly once: Spark's checkpoint replays an unfinished micro-batch with the same offsets, the
registry routes it the same way (queue_engine.fanout), and each channel append carries the
app transaction ("deltaq-fanout", batch id), so a channel that already has the batch skips it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from queue_engine.fanout import route
from queue_engine.registry import ChannelInfo, Registry
from queue_engine.store.append_once import IdempotentAppender
from queue_engine.store.registry_store import RegistryReader
from queue_engine.store.tables import CHANNEL_MESSAGES_SCHEMA, Warehouse, open_or_create

log = logging.getLogger(__name__)

FANOUT_APP_ID = "deltaq-fanout"


class ChannelSinks:
    """One idempotent appender per channel table, kept across micro-batches.

    Keyed by the channel's creation time too: a channel deleted and created again has a new,
    empty table, which an appender of the old one (its next version number) must never touch.
    """

    def __init__(self, warehouse: Warehouse) -> None:
        self.warehouse = warehouse
        self._sinks: dict[tuple[str, int], IdempotentAppender] = {}
        # Checkpoints off the micro-batch's path (one replays up to 100 commits).
        self._upkeep = ThreadPoolExecutor(1, thread_name_prefix="deltaq-fanout-checkpoint")

    def append(self, topic: str, channel: ChannelInfo, rows: pa.Table, batch_id: int) -> bool:
        key = self._key(topic, channel)
        sink = self._sinks.get(key)
        if sink is None:
            open_or_create(key[0], CHANNEL_MESSAGES_SCHEMA)
            sink = self._sinks[key] = IdempotentAppender(
                key[0], FANOUT_APP_ID, schedule_checkpoint=self._upkeep.submit
            )
        try:
            return sink.append(rows.cast(CHANNEL_MESSAGES_SCHEMA), batch_id)
        except Exception:
            # A storage error: the next attempt starts from a freshly read table.
            del self._sinks[key]
            sink.close()
            raise

    def _key(self, topic: str, channel: ChannelInfo) -> tuple[str, int]:
        return (self.warehouse.channel_messages_path(topic, channel.name), channel.created_at_us)

    def retain(self, registry: Registry) -> None:
        """Close the appenders of channels the registry no longer has."""
        live = {
            self._key(t, c) for t, info in registry.topics.items() for c in info.channels.values()
        }
        for key in [k for k in self._sinks if k not in live]:
            self._sinks.pop(key).close()


def fanout_batch(
    df: DataFrame, batch_id: int, registry_reader: RegistryReader, sinks: ChannelSinks
) -> int:
    """Write one micro-batch into the channel tables; return the number of rows written."""
    started = time.perf_counter()
    rows = df.toArrow()
    read_s = time.perf_counter() - started
    if rows.num_rows == 0:
        return 0
    registry = registry_reader.get()
    sinks.retain(registry)
    written = 0
    for (topic, channel), selected in route(rows, registry).items():
        if sinks.append(topic, registry.topics[topic].channels[channel], selected, batch_id):
            written += selected.num_rows
    log.info(
        "fanout batch %d: %d rows in, %d channel rows out (read %.0f ms, write %.0f ms)",
        batch_id,
        rows.num_rows,
        written,
        read_s * 1000,
        (time.perf_counter() - started - read_s) * 1000,
    )
    return written


def start_fanout(
    spark: SparkSession,
    warehouse: Warehouse,
    *,
    once: bool,
    checkpoint: str | None = None,
    max_files_per_trigger: int = 200,
) -> StreamingQuery:
    """Start the query; with ``once`` it processes what is available now and stops."""
    source = (
        spark.readStream.format("deltaq")
        .option("warehouse", warehouse.root)
        .option("kind", "topics")
        .option("maxFilesPerTrigger", str(max_files_per_trigger))
        .load()
    )

    registry_reader = RegistryReader(warehouse.registry_path)
    sinks = ChannelSinks(warehouse)

    def each_batch(df: DataFrame, batch_id: int) -> None:
        fanout_batch(df, batch_id, registry_reader, sinks)

    writer = source.writeStream.foreachBatch(each_batch).option(
        "checkpointLocation", checkpoint or f"{warehouse.checkpoints_root}/fanout"
    )
    writer = (
        writer.trigger(availableNow=True) if once else writer.trigger(processingTime="0 seconds")
    )
    return writer.queryName("deltaq-fanout").start()
