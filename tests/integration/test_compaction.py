"""The local compactor: same rows, log order kept, invisible to streaming readers, safe
against appends and against a second compactor."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from queue_engine.store.delta import LocalAppender, added_files, conform, open_or_create
from queue_engine.store.tables import TOPIC_SCHEMA
from queue_engine.store.upkeep import CompactionConflict, compact_small_files, compaction

TARGET = 1 << 20


def _rows(first: int, n: int) -> pa.Table:
    return conform(
        pa.table(
            {
                "id": [f"{i:016x}" for i in range(first, first + n)],
                "body": [b"x" * 50] * n,
                "published_at": pa.array([0] * n, pa.timestamp("us", "UTC")),
                "deliver_at": pa.array([None] * n, pa.timestamp("us", "UTC")),
            }
        ),
        TOPIC_SCHEMA,
    )


def _table(tmp_path: Path, commits: int) -> tuple[str, LocalAppender]:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    appender = LocalAppender(path)
    for i in range(commits):
        appender.append(_rows(i * 2, 2))
    return path, appender


def _id_stats(dt: DeltaTable) -> tuple[str, str, int, int]:
    """The statistics the table's one file's ``add`` carries: min and max id, rows, null ids."""
    [add] = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    return add["min.id"], add["max.id"], add["num_records"], add["null_count.id"]


def test_compaction_keeps_rows_in_log_order_and_old_versions(tmp_path: Path) -> None:
    path, _ = _table(tmp_path, 20)
    before = DeltaTable(path).to_pyarrow_table()
    done = compact_small_files(path, DeltaTable(path), TARGET)
    assert done is not None and (done.files_removed, done.rows, done.version) == (20, 40, 21)
    dt = DeltaTable(path)
    assert len(dt.file_uris()) == 1
    assert dt.to_pyarrow_table()["id"].to_pylist() == before["id"].to_pylist()
    assert _id_stats(dt) == (f"{0:016x}", f"{39:016x}", 40, 0)
    # Streaming readers skip it (dataChange=false); time travel still sees the old files.
    assert added_files(path, 20, 21) == []
    assert DeltaTable(path, version=20).to_pyarrow_table().equals(before)
    # Nothing small enough (under half of 64 bytes): nothing to do.
    assert compact_small_files(path, DeltaTable(path), 64) is None


def test_compaction_reads_and_writes_a_chunk_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs go into the output a few at a time (bounded memory); the output's rows, order
    and statistics are those of all of them."""
    path, _ = _table(tmp_path, 12)
    before = DeltaTable(path).to_pyarrow_table()
    sizes = sorted(os.path.getsize(u) for u in DeltaTable(path).file_uris())
    assert sizes[-1] < 1.5 * sizes[0]  # so a chunk of this many bytes is three inputs
    monkeypatch.setattr(compaction, "CHUNK_BYTES", 3 * sizes[0])
    done = compact_small_files(path, DeltaTable(path), TARGET)
    assert done is not None and (done.files_removed, done.rows) == (12, 24)
    dt = DeltaTable(path)
    [output] = dt.file_uris()
    assert pq.ParquetFile(output).metadata.num_row_groups == 4
    assert dt.to_pyarrow_table()["id"].to_pylist() == before["id"].to_pylist()
    assert _id_stats(dt) == (f"{0:016x}", f"{23:016x}", 24, 0)


def test_a_chunk_is_bounded_by_rows_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files whose rows compress to almost nothing (repeated bodies) are read a bounded number
    of rows at a time, whatever their bytes: each chunk is one row group of the output."""
    path, _ = _table(tmp_path, 12)  # two rows a file
    before = DeltaTable(path).to_pyarrow_table()
    monkeypatch.setattr(compaction, "CHUNK_ROWS", 5)
    done = compact_small_files(path, DeltaTable(path), TARGET)
    assert done is not None and (done.files_removed, done.rows) == (12, 24)
    [output] = DeltaTable(path).file_uris()
    metadata = pq.ParquetFile(output).metadata
    groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert groups == [6, 6, 6, 6]  # three files (six rows) reach five rows
    assert DeltaTable(path).to_pyarrow_table()["id"].to_pylist() == before["id"].to_pylist()


def test_compaction_while_appending_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    path, appender = _table(tmp_path, 10)
    stop = threading.Event()
    appended = [20]

    def append() -> None:
        while not stop.is_set() and appended[0] < 2000:
            appender.append(_rows(appended[0], 2))
            appended[0] += 2

    writer = threading.Thread(target=append)
    writer.start()
    compactions = 0
    try:
        for _ in range(10):
            if compact_small_files(path, _open(path), TARGET) is not None:
                compactions += 1
    finally:
        stop.set()
        writer.join()
    assert compactions >= 5
    ids = DeltaTable(path).to_pyarrow_table()["id"].to_pylist()
    assert sorted(ids) == [f"{i:016x}" for i in range(appended[0])]
    # Every append is still one streaming-visible version; compactions add none.
    assert len(added_files(path, -1, DeltaTable(path).version())) == appended[0] // 2


def _open(path: str) -> DeltaTable:
    """Open while another thread appends. delta-rs lists ``_delta_log`` with readdir, which may
    miss an entry created during the listing and see a later one (ext4 returns entries in hash
    order), and then refuses the "gap": a transient reader error, so open again (the
    maintenance thread does the same by retrying next round)."""
    for _ in range(20):
        try:
            return DeltaTable(path)
        except DeltaError as exc:
            if "gap" not in str(exc):
                raise
    return DeltaTable(path)


def test_second_compactor_of_the_same_files_is_refused(tmp_path: Path) -> None:
    path, _ = _table(tmp_path, 8)
    first, second = DeltaTable(path), DeltaTable(path)  # both plan the same 8 files
    assert compact_small_files(path, first, TARGET) is not None
    data_files = sorted(f for f in os.listdir(path) if f.endswith(".parquet"))
    with pytest.raises(CompactionConflict):
        compact_small_files(path, second, TARGET)
    # Nothing committed, and its output file is gone again.
    assert sorted(f for f in os.listdir(path) if f.endswith(".parquet")) == data_files
    assert DeltaTable(path).version() == 9
    assert DeltaTable(path).to_pyarrow_table().num_rows == 16
