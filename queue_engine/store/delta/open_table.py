"""Opening a Delta table: created when absent, evolved to the columns deltaq's code writes, and
refused by name when its log cannot be read (after what a power cut leaves is set aside)."""

from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.schema import Field as DeltaField

from queue_engine.store.delta.table_features import TableRefusedError
from queue_engine.store.delta.torn_tail import repair_once
from queue_engine.store.storage.fs_sync import sync_commits, sync_created
from queue_engine.store.storage.paths import is_remote

if TYPE_CHECKING:
    # Only named: importing pyarrow.dataset imports pandas where it is installed (~0.3 s and
    # ~50 MiB), which a Spark Python worker planning a read of format("deltaq") never needs.
    import pyarrow.dataset as ds

log = logging.getLogger(__name__)


def is_table(path: str) -> bool:
    """Whether a Delta table can be opened at ``path``."""
    try:
        DeltaTable(path)
    except Exception:
        return False
    return True


def read_dataset(path: str, version: int | None = None) -> ds.Dataset:
    """The table at ``path`` (as of ``version``) as one pyarrow dataset: its files, read in
    parallel by one scan. Raises when there is no table."""
    return DeltaTable(path, version=version).to_pyarrow_dataset()


def open_as_of(path: str, as_of: int | datetime | None = None) -> DeltaTable | None:
    """The table at ``path`` (as of a version or a time); None if it did not exist (then)."""
    if "://" not in path and not os.path.isdir(f"{path}/_delta_log"):
        return None  # no table: not worth asking delta-rs
    try:
        dt = DeltaTable(path)
        if as_of is not None:
            dt.load_as_version(as_of)
    except Exception:
        return None
    return dt


def file_uris(path: str, as_of: int | datetime | None = None) -> list[str]:
    """The data files of the table at ``path`` (as of a version or a time)."""
    dt = DeltaTable(path)
    if as_of is not None:
        dt.load_as_version(as_of)
    return list(dt.file_uris())


def app_transaction_version(path: str, app_id: str) -> int | None:
    """The newest version of ``app_id``'s transaction the table at ``path`` records (None: no
    such table, or no such transaction)."""
    try:
        version = DeltaTable(path).transaction_version(app_id)
    except TableNotFoundError:
        return None
    return None if version is None else int(version)


def open_or_create(path: str, schema: pa.Schema) -> DeltaTable:
    """Open the Delta table at ``path``, creating it (empty, with ``schema``) if absent, and
    adding the nullable columns of ``schema`` an older table lacks.

    Created tables use reader 1 / writer 2, which delta-spark reads and writes as well.
    """
    repair_once(path)
    try:
        return add_missing_columns(_open_sound(path), schema)
    except TableNotFoundError:
        pass
    try:
        created = DeltaTable.create(path, schema=schema, mode="error")
    except Exception:
        # Another process may have created it between the two calls; opening decides.
        return add_missing_columns(_open_sound(path), schema)
    sync_created(path)
    return created


def _open_sound(path: str) -> DeltaTable:
    """``DeltaTable(path)``; a log no reader can follow (after ``repair_once`` set aside what a
    power cut leaves) is refused by name: TableDamagedError."""
    try:
        return DeltaTable(path)
    except TableNotFoundError:
        raise
    except DeltaError as exc:
        if is_remote(path):
            raise
        raise TableDamagedError(path, str(exc)) from exc


class TableDamagedError(TableRefusedError):
    """A local table whose log cannot be read: damage other than what a power cut leaves at its
    tail (which is set aside when the table is opened). The other tables keep serving."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(path, "a damaged log", f"its log cannot be read ({detail})")


def add_missing_columns(dt: DeltaTable, schema: pa.Schema) -> DeltaTable:
    """Evolve ``dt`` to ``schema``: add (at the end) the nullable fields it does not have.

    A metadata commit; done by a writer when it opens a table, before it appends, so its own
    appends never race it (another writer's append that does fails its commit and retries).
    """
    have = set(pa.schema(dt.schema().to_arrow()).names)
    missing = [f for f in schema if f.name not in have]
    if not missing:
        return dt
    if any(not f.nullable for f in missing):
        raise ValueError(f"{dt.table_uri}: cannot add required columns {missing}")
    before = int(dt.version())
    try:
        dt.alter.add_columns([DeltaField.from_arrow(f) for f in missing])
        sync_commits(dt.table_uri, before + 1, int(dt.version()))
    except Exception:
        # Another writer may have added them first: re-read and check.
        dt.update_incremental()
        if any(f.name not in set(pa.schema(dt.schema().to_arrow()).names) for f in missing):
            raise
    log.info("%s: added columns %s", dt.table_uri, [f.name for f in missing])
    return dt


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` as ``schema``: its columns in that order, cast, and the nullable ones a file
    written before they were added lacks filled with nulls."""
    if table.schema.equals(schema):
        return table  # what every file written since the last column was added reads as
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(schema.names).cast(schema)
