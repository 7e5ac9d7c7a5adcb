"""The fanout as a Structured Streaming query: every topic row into each of its channels.

Exactly once: Spark's checkpoint replays an unfinished micro-batch with the same offsets, the
registry routes it the same way (queue_engine.fanout), and each channel append carries the
app transaction ("deltaq-fanout", batch id), so a channel that already has the batch skips it.
"""

from __future__ import annotations

import logging

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from queue_engine.fanout import route
from queue_engine.store.append_once import append_once
from queue_engine.store.registry_store import RegistryReader
from queue_engine.store.tables import CHANNEL_MESSAGES_SCHEMA, Warehouse, open_or_create

log = logging.getLogger(__name__)

FANOUT_APP_ID = "deltaq-fanout"


def fanout_batch(
    warehouse: Warehouse, df: DataFrame, batch_id: int, registry_reader: RegistryReader
) -> int:
    """Write one micro-batch into the channel tables; return the number of rows written."""
    rows = df.toArrow()
    if rows.num_rows == 0:
        return 0
    registry = registry_reader.get()
    written = 0
    for (topic, channel), selected in route(rows, registry).items():
        path = warehouse.channel_messages_path(topic, channel)
        open_or_create(path, CHANNEL_MESSAGES_SCHEMA)
        if append_once(path, selected.cast(CHANNEL_MESSAGES_SCHEMA), FANOUT_APP_ID, batch_id):
            written += selected.num_rows
    log.info("fanout batch %d: %d rows in, %d channel rows out", batch_id, rows.num_rows, written)
    return written


def start_fanout(
    spark: SparkSession,
    warehouse: Warehouse,
    *,
    once: bool,
    checkpoint: str | None = None,
    max_files_per_trigger: int = 2000,
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

    def each_batch(df: DataFrame, batch_id: int) -> None:
        fanout_batch(warehouse, df, batch_id, registry_reader)

    writer = source.writeStream.foreachBatch(each_batch).option(
        "checkpointLocation", checkpoint or f"{warehouse.checkpoints_root}/fanout"
    )
    writer = (
        writer.trigger(availableNow=True) if once else writer.trigger(processingTime="0 seconds")
    )
    return writer.queryName("deltaq-fanout").start()
