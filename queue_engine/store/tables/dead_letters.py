"""A channel's dead-letter table: the messages it stopped delivering, with why and when.

The table is created on the first dead letter (a channel that never has one costs nothing).
Rows are appended before the ledger's DEAD events that name them, so the ledger stays the
truth: a row whose DEAD event never committed (a crash in between) is not a dead letter, and
the message is dead-lettered again, with a new ``dead_at``, when it is next taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from queue_engine.channel_queue import DeadLetter
from queue_engine.store.delta.append import Appender, append_or_fall_back, appender_for
from queue_engine.store.delta.open_table import open_or_create
from queue_engine.store.tables.schemas import DEAD_LETTER_SCHEMA, HEADERS_TYPE
from queue_engine.topic_schema import TopicSchema

_TS = pa.timestamp("us", tz="UTC")


def letters_to_arrow(letters: Sequence[DeadLetter]) -> pa.Table:
    ids, bodies, published, attempts, consumers, last_events, dead_at, expires, headers = zip(
        *letters, strict=True
    )
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.string()),
            pa.array(bodies, pa.binary()),
            pa.array(published, _TS),
            pa.array(attempts, pa.int32()),
            pa.array(consumers, pa.string()),
            pa.array(last_events, pa.string()),
            pa.array(dead_at, _TS),
            pa.array(expires, _TS),
            pa.array(headers, HEADERS_TYPE),
        ],
        schema=DEAD_LETTER_SCHEMA,
    )


class DeadLetterStore:
    """Appends dead letters to one channel's table and reads the newest of given ids back."""

    def __init__(
        self, path: str, schema_of: Callable[[], TopicSchema | None] = lambda: None
    ) -> None:
        self.path = path
        # A typed topic's schema: its fields are columns of the dead letters too, converted
        # from their bodies as on the channel's rows.
        self._schema_of = schema_of
        self._columns = DEAD_LETTER_SCHEMA
        self._appender: Appender | None = None
        self._lock = threading.Lock()

    def append(self, letters: Sequence[DeadLetter]) -> int:
        """Commit ``letters`` in one version (blocking); returns it."""
        if not letters:
            return -1
        table = letters_to_arrow(letters)
        schema = self._schema_of()
        if schema is not None:
            typed = schema.lenient_columns(table["body"].to_pylist())
            for field, column in zip(schema.arrow_fields, typed, strict=True):
                table = table.append_column(field, column)
        with self._lock:
            if self._appender is not None and table.schema != self._columns:
                self._appender.close()  # the topic's schema gained fields
                self._appender = None
            if self._appender is None:
                open_or_create(self.path, table.schema)
                self._columns = table.schema
                self._appender = appender_for(self.path)
            try:
                self._appender, version = append_or_fall_back(self._appender, self.path, table)
            except Exception:
                self._appender.reopen()
                raise
            return version

    def latest(self, ids: Sequence[str]) -> pa.Table:
        """The newest dead-letter row of each of ``ids`` (a message may have died before, been
        redriven, and died again), oldest death first."""
        if not ids:
            return DEAD_LETTER_SCHEMA.empty_table()
        try:
            dt = DeltaTable(self.path)
        except Exception:
            return DEAD_LETTER_SCHEMA.empty_table()
        table = dt.to_pyarrow_dataset().to_table(
            filter=pc.field("id").isin(pa.array(list(ids), pa.string()))
        )
        table = table.sort_by([("id", "ascending"), ("dead_at", "descending")])
        keep, previous = [], None
        for i, message_id in enumerate(table["id"].to_pylist()):
            if message_id != previous:
                keep.append(i)
                previous = message_id
        return table.take(pa.array(keep, pa.int64())).sort_by("dead_at")

    def close(self) -> None:
        with self._lock:
            if self._appender is not None:
                self._appender.close()
                self._appender = None
