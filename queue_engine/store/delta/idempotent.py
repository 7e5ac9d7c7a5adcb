"""Idempotent appends: a (app id, batch id) pair is committed at most once per table."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import Transaction

from queue_engine.store.delta.append import appender_for
from queue_engine.store.storage.fs_sync import sync_checkpoint

log = logging.getLogger(__name__)


class IdempotentAppender:
    """Appends to one table, each commit recording ``(app_id, batch id)`` as Delta's app
    transaction; a batch id at or below the recorded one is skipped.

    The recorded id is read once, at open: this appender must be the table's only writer of
    ``app_id`` (the fanout is, for channel tables), so its own commits keep it current, and
    after any error the caller opens a new one. Appends take the fast local path when the table
    allows it (~2 ms against 5-12 ms through delta-rs: a micro-batch waits for every channel's
    commit). Every ``checkpoint_interval`` versions ``schedule_checkpoint`` gets the job of
    writing a checkpoint, so readers' open time stays short; without it the checkpoint is
    written inline.
    """

    def __init__(
        self,
        path: str,
        app_id: str,
        checkpoint_interval: int = 100,
        schedule_checkpoint: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.path = path
        self.app_id = app_id
        self.checkpoint_interval = checkpoint_interval
        self._schedule = schedule_checkpoint
        dt = DeltaTable(path)
        self._schema = pa.schema(dt.schema().to_arrow())
        recorded = dt.transaction_version(app_id)
        self._done = -1 if recorded is None else int(recorded)
        self._appender = appender_for(path)

    def schema(self) -> pa.Schema:
        return self._schema

    def append(self, table: pa.Table, batch_id: int, user_metadata: str | None = None) -> bool:
        """Append unless ``batch_id`` is already recorded (no rows: a commit of no data file);
        True if written. ``user_metadata``: the commitInfo's ``userMetadata``."""
        if batch_id <= self._done:
            return False
        txn = Transaction(self.app_id, batch_id)
        version = self._appender.append(table, txn, user_metadata)
        self._done = batch_id
        if version % self.checkpoint_interval == 0:
            if self._schedule is None:
                self._checkpoint()
            else:
                self._schedule(self._checkpoint)
        return True

    def close(self) -> None:
        self._appender.close()

    def _checkpoint(self) -> None:
        try:
            DeltaTable(self.path).create_checkpoint()
            sync_checkpoint(self.path)
        except Exception:
            # A deleted channel, or a storage hiccup: the next interval tries again.
            log.warning("checkpoint of %s failed", self.path, exc_info=True)


def append_once(path: str, table: pa.Table | None, app_id: str, batch_id: int) -> bool:
    """Append ``table`` (None: an empty commit that only records the batch) unless
    ``(app_id, batch_id)`` is already recorded. True if written."""
    appender = IdempotentAppender(path, app_id)
    try:
        if table is None:
            table = pa.Table.from_batches([], schema=appender.schema())
        return appender.append(table, batch_id)
    finally:
        appender.close()
