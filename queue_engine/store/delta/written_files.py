"""Appends whose data files were written elsewhere, as Spark's tasks write them: each task
writes its rows as one Parquet file straight into the table's storage (``write_data_file``),
and one process then commits every task's files in one log entry (``commit_written_files``),
synced as deltaq's own commits are. What a failed or replayed write left is removed
(``discard_files``)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

from queue_engine.store.delta.append import file_stats_json
from queue_engine.store.storage.files import filesystem
from queue_engine.store.storage.fs_sync import sync_commits, sync_file

# A written file: its name relative to the table, its size in bytes, its Delta statistics.
WrittenFile = tuple[str, int, str]


def table_schema(path: str) -> pa.Schema:
    """The Arrow schema of the Delta table at ``path``."""
    return pa.schema(DeltaTable(path).schema().to_arrow())


def write_data_file(path: str, batches: Iterable[pa.RecordBatch]) -> list[WrittenFile]:
    """The rows as one Parquet data file in the table's directory (none for no rows), not yet
    part of the table. A local file is written under a temporary name, synced and renamed; an
    object store's object appears whole when its upload completes."""
    rows = [batch for batch in batches if batch.num_rows]
    if not rows:
        return []
    table = pa.Table.from_batches(rows).cast(table_schema(path))
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    fs, root = filesystem(path)
    target = f"{root.rstrip('/')}/{name}"
    if isinstance(fs, pafs.LocalFileSystem):
        staging = f"{root.rstrip('/')}/.{name}.tmp"
        pq.write_table(table, staging, filesystem=fs, compression="snappy")
        sync_file(staging)  # durable before the commit that names it
        fs.move(staging, target)
    else:
        pq.write_table(table, target, filesystem=fs, compression="snappy")
    size = fs.get_file_info(target).size
    return [(name, int(size or 0), file_stats_json(table))]


def commit_written_files(
    path: str,
    files: Sequence[WrittenFile],
    transaction: tuple[str, int] | None,
    *,
    overwrite: bool,
    user_metadata: str | None = None,
) -> bool:
    """Commit ``files`` in one log entry, recording the app transaction ``(app_id, version)``
    when given (and ``user_metadata`` as the commitInfo's ``userMetadata``). A table that
    already recorded that transaction (or a later one) gets nothing: the files are removed,
    the write was done before. Returns whether a commit was made."""
    dt = DeltaTable(path)
    if transaction is not None:
        recorded = dt.transaction_version(transaction[0])
        if recorded is not None and recorded >= transaction[1]:
            discard_files(path, [name for name, _, _ in files])
            return False
    elif not files and not overwrite:
        return False
    now_ms = int(time.time() * 1000)
    adds: list[AddAction | RemoveAction] = [
        AddAction(name, size, {}, now_ms, True, stats) for name, size, stats in files
    ]
    properties = None
    if transaction is not None or user_metadata is not None:
        txns = None
        if transaction is not None:
            txns = [Transaction(transaction[0], transaction[1], now_ms)]
        metadata = None if user_metadata is None else {"userMetadata": user_metadata}
        properties = CommitProperties(app_transactions=txns, custom_metadata=metadata)
    before = int(dt.version())
    dt.create_write_transaction(
        adds,
        mode="overwrite" if overwrite else "append",
        schema=table_schema(path),
        commit_properties=properties,
    )
    sync_commits(path, before + 1, int(dt.version()))
    return True


def discard_files(path: str, names: Iterable[str]) -> None:
    """Remove data files written into the table's directory that no commit names."""
    fs, root = filesystem(path)
    for name in names:
        with contextlib.suppress(OSError):
            fs.delete_file(f"{root.rstrip('/')}/{name}")
