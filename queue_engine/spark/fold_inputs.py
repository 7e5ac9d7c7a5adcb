"""The sweep's input as one scan (``format("deltaq")``, kind "fold_inputs").

The sweep folds, per channel, its last state, the message rows and the ledger events committed
since. It built that input as a union of one DataFrame per table and version range: over ten
thousand channels Spark spent many minutes analysing the union before any row was read. Here
every table and range is one entry of a single read; the files are resolved when the query is
planned, and each row comes out as a fold input row tagged with its channel's number.

    spark.read.format("deltaq").option("kind", "fold_inputs")
        .option("inputs", json.dumps([[kind, path, channel, a, b], ...])).load()

``kind`` is "state" (the table as of version ``a``), "messages" or "ledger" (the rows versions
``(a, b]`` added).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from queue_engine.spark.channel_tables import FILES_PER_PARTITION, TABLE_SCHEMAS
from queue_engine.state_fold import FOLD_INPUT_SCHEMA, event_input, message_input, state_input
from queue_engine.store.storage import filesystem, parquet_dataset

# The channel's number in the sweep's plan, on every input and output row.
CHANNEL_COLUMN = "chan"
INPUT_ARROW_SCHEMA = FOLD_INPUT_SCHEMA.append(pa.field(CHANNEL_COLUMN, pa.int32()))

_CONVERT: dict[str, Callable[[pa.Table], pa.Table]] = {
    "state": state_input,
    "messages": message_input,
    "ledger": event_input,
}

# One input: (kind, table path, channel number, a, b) as described above.
Input = tuple[str, str, int, int, int]


def encode(inputs: Sequence[Input]) -> str:
    return json.dumps([list(i) for i in inputs])


def _files(entry: Input) -> list[str]:
    # The batch reader's own file selection (imported here: source.py imports this module).
    from queue_engine.spark.source import Selection

    kind, path, _, a, b = entry
    if kind == "state":
        return Selection(version_as_of=a).files(path)
    return Selection(after_version=a, to_version=b).files(path)


class FoldInputsReader(DataSourceReader):
    """Fold input rows of every (kind, table, range) given, tagged with the channel."""

    def __init__(self, options: Any) -> None:
        self.inputs: list[Input] = [
            (str(k), str(p), int(c), int(a), int(b))
            for k, p, c, a, b in json.loads(str(options["inputs"]))
        ]

    def partitions(self) -> Sequence[InputPartition]:
        groups: list[InputPartition] = []
        for kind in _CONVERT:
            files = [
                (uri, entry[2])
                for entry in self.inputs
                if entry[0] == kind
                for uri in _files(entry)
            ]
            groups.extend(
                InputPartition((kind, tuple(files[i : i + FILES_PER_PARTITION])))
                for i in range(0, len(files), FILES_PER_PARTITION)
            )
        return groups or [InputPartition(("state", ()))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        kind, files = partition.value
        if not files:
            return
        owner = {filesystem(uri)[1]: chan for uri, chan in files}
        dataset = parquet_dataset([uri for uri, _ in files], TABLE_SCHEMAS[kind])
        for tagged in dataset.scanner().scan_batches():
            batch = tagged.record_batch
            if batch.num_rows == 0:
                continue
            rows = _CONVERT[kind](pa.Table.from_batches([batch]))
            chan = owner[tagged.fragment.path]
            rows = rows.append_column(CHANNEL_COLUMN, pa.array([chan] * rows.num_rows, pa.int32()))
            yield from rows.cast(INPUT_ARROW_SCHEMA).to_batches()
