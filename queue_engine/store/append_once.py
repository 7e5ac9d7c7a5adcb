"""Idempotent appends: a (app id, batch id) pair is committed at most once per table."""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction


def append_once(path: str, table: pa.Table | None, app_id: str, batch_id: int) -> bool:
    """Append ``table`` unless ``(app_id, batch_id)`` is already recorded. True if written.

    The check and the write go through the same DeltaTable object: delta-rs does not refuse a
    repeated transaction version itself, and checking on one handle while writing through
    another let duplicates through.
    """
    dt = DeltaTable(path)
    done = dt.transaction_version(app_id)
    if done is not None and done >= batch_id:
        return False
    if table is None:
        table = pa.Table.from_batches([], schema=pa.schema(dt.schema().to_arrow()))
    props = CommitProperties(app_transactions=[Transaction(app_id, batch_id)])
    write_deltalake(dt, table, mode="append", commit_properties=props)
    return True
