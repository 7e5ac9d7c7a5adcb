"""Files and directories of a warehouse, local or on an object store, through pyarrow's
filesystems.

pyarrow is imported by the functions, not by this module: the storage package is imported by
every deltaq command at its start, before a serving process leaves pandas and numpy out of
what pyarrow loads (queue_engine.process_memory)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

log = logging.getLogger(__name__)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
    return fs, str(path)


def parquet_dataset(paths: list[str], schema: pa.Schema | None = None) -> ds.Dataset:
    """One pyarrow dataset over data files of one table (one scan reads them in parallel)."""
    import pyarrow.dataset as ds

    fs, _ = filesystem(paths[0])
    return ds.dataset(
        [filesystem(p)[1] for p in paths], format="parquet", filesystem=fs, schema=schema
    )


def delete_tree(uri: str) -> None:
    """Remove a directory (local or object store) and everything under it, if it exists."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return
    fs.delete_dir(path)
    log.info("deleted %s", uri)


def list_dirs(uri: str) -> list[str]:
    """Names of the directories directly under ``uri`` (none if it does not exist)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(info.base_name for info in infos if info.type == pafs.FileType.Directory)
