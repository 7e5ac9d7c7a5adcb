"""What a power cut leaves at a table's tail is set aside when the table is opened, and nothing
else is: another engine's sound commit, an older commit naming a vacuumed file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from queue_engine.spark.checkpoint_sync import repair_checkpoint
from queue_engine.store.delta import (
    SET_ASIDE_DIR,
    LocalAppender,
    TableDamagedError,
    open_or_create,
    repair,
)
from queue_engine.store.tables import HEADERS_TYPE, TOPIC_SCHEMA


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table(
        {
            "id": [f"{i:016x}" for i in range(start, start + n)],
            "body": [f"m{i}".encode() for i in range(start, start + n)],
            "published_at": pa.array([0] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "deliver_at": pa.nulls(n, pa.timestamp("us", tz="UTC")),
            "expires_at": pa.nulls(n, pa.timestamp("us", tz="UTC")),
            "to_channel": pa.nulls(n, pa.string()),
            "replay_of": pa.nulls(n, pa.string()),
            "headers": pa.nulls(n, HEADERS_TYPE),
        },
        schema=TOPIC_SCHEMA,
    )


def _table(tmp_path: Path, commits: int) -> Path:
    path = tmp_path / "t"
    open_or_create(str(path), TOPIC_SCHEMA)
    appender = LocalAppender(str(path))
    for i in range(commits):
        appender.append(_rows(2, 2 * i))
    appender.close()
    return path


def _commit(path: Path, version: int) -> Path:
    return path / "_delta_log" / f"{version:020d}.json"


def test_an_empty_tail_commit_becomes_a_commit_that_adds_nothing(tmp_path: Path) -> None:
    path = _table(tmp_path, 3)
    _commit(path, 3).write_bytes(b"")

    done = repair(str(path))
    assert done is not None and done.versions == (3,)
    dt = DeltaTable(str(path))
    # The version stays (readers that passed it agree), and adds nothing.
    assert dt.version() == 3
    assert dt.to_pyarrow_table().num_rows == 4
    [info] = [json.loads(line) for line in _commit(path, 3).read_text().splitlines()]
    assert info["commitInfo"]["operation"] == "REPAIR"
    assert (path / SET_ASIDE_DIR).is_dir()
    # The next append follows it.
    assert LocalAppender(str(path)).append(_rows(1, 100)) == 4


def test_a_torn_line_and_a_missing_data_file_are_set_aside_newest_first(
    tmp_path: Path,
) -> None:
    path = _table(tmp_path, 3)
    text = _commit(path, 3).read_bytes()
    _commit(path, 3).write_bytes(text[: len(text) // 2])
    added = next(
        json.loads(line)["add"]["path"]
        for line in _commit(path, 2).read_text().splitlines()
        if '"add"' in line
    )
    os.unlink(path / added)  # the data file's name never reached the disk

    done = repair(str(path))
    assert done is not None and done.versions == (2, 3)
    # Versions 1..3 appended m0-m1, m2-m3, m4-m5: only the first is left.
    assert sorted(DeltaTable(str(path)).to_pyarrow_table()["body"].to_pylist()) == [b"m0", b"m1"]


def test_sound_commits_of_any_engine_are_left_alone(tmp_path: Path) -> None:
    path = _table(tmp_path, 2)
    write_deltalake(str(path), _rows(3, 50), mode="append")  # another engine's commit
    before = {p.name: p.read_bytes() for p in (path / "_delta_log").iterdir()}
    # An older commit may name a file a later commit removed and a vacuum deleted.
    added = next(
        json.loads(line)["add"]["path"]
        for line in _commit(path, 1).read_text().splitlines()
        if '"add"' in line
    )
    os.unlink(path / added)
    done = repair(str(path))
    assert done is not None and not done
    assert {p.name: p.read_bytes() for p in (path / "_delta_log").iterdir()} == before


def test_a_torn_creation_is_removed_and_the_table_created_again(tmp_path: Path) -> None:
    path = tmp_path / "t"
    DeltaTable.create(str(path), schema=TOPIC_SCHEMA)
    _commit(path, 0).write_bytes(b"")
    open_or_create(str(path), TOPIC_SCHEMA)  # repairs, then creates
    dt = DeltaTable(str(path))
    assert dt.version() == 0
    assert dt.schema().to_arrow().names == TOPIC_SCHEMA.names


def test_a_torn_checkpoint_and_its_pointer_are_set_aside(tmp_path: Path) -> None:
    path = _table(tmp_path, 3)
    DeltaTable(str(path)).create_checkpoint()
    log = path / "_delta_log"
    [checkpoint] = log.glob("*.checkpoint.parquet")
    checkpoint.write_bytes(b"")
    (log / "_last_checkpoint").write_bytes(b'{"vers')

    done = repair(str(path))
    assert done is not None and set(done.checkpoints) == {checkpoint.name, "_last_checkpoint"}
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 6


def test_damage_a_cut_cannot_leave_refuses_the_table_by_name(tmp_path: Path) -> None:
    path = _table(tmp_path, 60)
    # Version 2 of 60 is far older than anything in flight at a cut.
    _commit(path, 2).write_bytes(b"not json\n")
    with pytest.raises(TableDamagedError) as refused:
        open_or_create(str(path), TOPIC_SCHEMA)
    assert str(path) in str(refused.value)


def test_a_torn_fanout_checkpoint_tail_is_set_aside(tmp_path: Path) -> None:
    root = tmp_path / "cp"
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "metadata").write_text('{"id":"q"}\n')
    offsets = '{"batchWatermarkMs":0,"batchTimestampMs":0,"conf":{}}\n{"t":1}'
    for batch in range(3):
        (root / "offsets" / str(batch)).write_text(f"v1\n{offsets}")
    for batch in range(2):
        (root / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (root / "commits" / f".{batch}.crc").write_bytes(b"crc")
    (root / "offsets" / "2").write_bytes(b"")
    (root / "commits" / "1").write_bytes(b'v1\n{"next')

    gone = repair_checkpoint(str(root))
    assert sorted(Path(p).relative_to(root).as_posix() for p in gone) == [
        "commits/1",
        "offsets/2",
    ]
    assert sorted(p.name for p in (root / "offsets").iterdir()) == ["0", "1"]
    # The sound tail's checksum goes too: it may not have reached the disk with it.
    assert sorted(p.name for p in (root / "commits").iterdir()) == ["0"]

    (root / "metadata").write_bytes(b"")
    assert str(root / "metadata") in repair_checkpoint(str(root))
    assert not (root / "metadata").exists()
