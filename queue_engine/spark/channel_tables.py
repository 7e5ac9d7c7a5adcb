"""One DataFrame over one kind of table of many channels (``format("deltaq")``, kind
"channels"), and over every topic's row count (kind "topic_counts").

The SQL views once unioned a DataFrame per channel table: with thousands of channels, Spark
spent minutes analysing the union and asked the data source for a schema per table. Here a
view is one scan: the channels go in as an option, each table is resolved (its files at the
latest version, or as of a timestamp) when the query is planned, not when the view is
registered, and the rows carry ``topic`` and ``channel`` columns.

    spark.read.format("deltaq").option("kind", "channels").option("table", "ledger")
        .option("warehouse", W).option("channels", json.dumps([[topic, channel], ...]))
        [.option("timestampAsOf", iso)].load()
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from queue_engine.store.delta import live_files, open_as_of
from queue_engine.store.storage import filesystem, parquet_dataset
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    STATE_SCHEMA,
    Warehouse,
)

TABLE_SCHEMAS = {
    "messages": CHANNEL_MESSAGES_SCHEMA,
    "ledger": LEDGER_SCHEMA,
    "state": STATE_SCHEMA,
    "dead": DEAD_LETTER_SCHEMA,
}
TOPIC_COUNTS_SCHEMA = pa.schema(
    [pa.field("topic", pa.string()), pa.field("message_count", pa.int64())]
)
# Files per Spark task: a task starts in ~30 ms, a small file reads in well under 1 ms.
FILES_PER_PARTITION = 512


def with_names(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field("topic", pa.string()), pa.field("channel", pa.string()), *schema])


def channels_schema(options: Any) -> pa.Schema:
    return with_names(TABLE_SCHEMAS[str(options["table"])])


def _as_of(options: Any) -> datetime | None:
    value = options.get("timestampAsOf")
    return None if value is None else datetime.fromisoformat(str(value).replace("Z", "+00:00"))


class ChannelTablesReader(DataSourceReader):
    """The rows of one kind of table of the given channels, tagged with topic and channel."""

    def __init__(self, options: Any) -> None:
        self.table = str(options["table"])
        self.warehouse = Warehouse(str(options["warehouse"]))
        self.channels = [(str(t), str(c)) for t, c in json.loads(str(options["channels"]))]
        self.as_of = _as_of(options)

    def _path(self, topic: str, channel: str) -> str:
        root = self.warehouse.channel_root(topic, channel)
        return f"{root}/{self.table}"

    def partitions(self) -> Sequence[InputPartition]:
        files: list[tuple[str, int]] = []
        for n, (topic, channel) in enumerate(self.channels):
            path = self._path(topic, channel)
            # The latest files of a local table from its log (a tenth of opening it).
            uris = live_files(path) if self.as_of is None else None
            if uris is None:
                dt = open_as_of(path, self.as_of)
                uris = [] if dt is None else dt.file_uris()
            files.extend((uri, n) for uri in uris)
        groups = [
            InputPartition(tuple(files[i : i + FILES_PER_PARTITION]))
            for i in range(0, len(files), FILES_PER_PARTITION)
        ]
        return groups or [InputPartition(())]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        files: tuple[tuple[str, int], ...] = partition.value
        if not files:
            return
        schema = TABLE_SCHEMAS[self.table]
        owner = {filesystem(uri)[1]: n for uri, n in files}
        dataset = parquet_dataset([uri for uri, _ in files], schema)
        for tagged in dataset.scanner().scan_batches():
            batch = tagged.record_batch
            if batch.num_rows == 0:
                continue
            topic, channel = self.channels[owner[tagged.fragment.path]]
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([topic] * batch.num_rows, pa.string()),
                    pa.array([channel] * batch.num_rows, pa.string()),
                    *batch.columns,
                ],
                schema=with_names(schema),
            )


class TopicCountsReader(DataSourceReader):
    """Each topic's row count from its table's file statistics (no data read)."""

    def __init__(self, options: Any) -> None:
        self.warehouse = Warehouse(str(options["warehouse"]))
        self.topics = [str(t) for t in json.loads(str(options["topics"]))]
        self.as_of = _as_of(options)

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(tuple(self.topics))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        names: list[str] = []
        counts: list[int] = []
        for topic in partition.value:
            dt = open_as_of(self.warehouse.topic_path(topic), self.as_of)
            count = 0
            if dt is not None:
                actions = pa.table(dt.get_add_actions(flatten=True))
                count = sum(int(n or 0) for n in actions["num_records"].to_pylist())
            names.append(topic)
            counts.append(count)
        yield pa.RecordBatch.from_arrays(
            [pa.array(names, pa.string()), pa.array(counts, pa.int64())],
            schema=TOPIC_COUNTS_SCHEMA,
        )
