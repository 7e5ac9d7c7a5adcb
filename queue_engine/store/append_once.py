"""Idempotent appends: a (app id, batch id) pair is committed at most once per table."""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction


class IdempotentAppender:
    """``append_once`` for one table with a long-lived handle, checkpointing as it goes.

    The fanout is the only writer of a channel table, so a handle it keeps stays current after
    its own commits; reopening per batch would replay the log each time. Every
    ``checkpoint_interval`` commits it writes a checkpoint and reopens from it, which keeps both
    this handle and every reader's open time short.
    """

    def __init__(self, path: str, checkpoint_interval: int = 100) -> None:
        self.path = path
        self.checkpoint_interval = checkpoint_interval
        self._dt = DeltaTable(path)

    def schema(self) -> pa.Schema:
        return pa.schema(self._dt.schema().to_arrow())

    def append(self, table: pa.Table, app_id: str, batch_id: int) -> bool:
        """Append unless ``(app_id, batch_id)`` is recorded; check and write go through the same
        handle (delta-rs does not refuse a repeated transaction version itself)."""
        done = self._dt.transaction_version(app_id)
        if done is not None and done >= batch_id:
            return False
        props = CommitProperties(app_transactions=[Transaction(app_id, batch_id)])
        write_deltalake(self._dt, table, mode="append", commit_properties=props)
        if self._dt.version() % self.checkpoint_interval == 0:
            self._dt.create_checkpoint()
            self._dt = DeltaTable(self.path)
        return True


def append_once(path: str, table: pa.Table | None, app_id: str, batch_id: int) -> bool:
    """Append ``table`` (None: an empty commit that only records the batch) unless
    ``(app_id, batch_id)`` is already recorded. True if written."""
    appender = IdempotentAppender(path)
    if table is None:
        table = pa.Table.from_batches([], schema=pa.schema(appender.schema()))
    return appender.append(table, app_id, batch_id)
