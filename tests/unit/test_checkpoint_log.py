"""Spark's streaming offset log as the fanout (Spark's query or its loop) reads it back."""

from __future__ import annotations

from pathlib import Path

import pytest

from queue_engine.spark import checkpoint_sync
from queue_engine.spark.checkpoint_sync import logged_offsets, repair_checkpoint, sync_batch

METADATA = '{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{}}'


def _log(root: Path, name: str, batch: int, *lines: str) -> Path:
    path = root / name / str(batch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def test_offsets_in_either_of_sparks_formats_are_read_and_kept(tmp_path: Path) -> None:
    """Format 1 logs the source's offset alone, format 2 after its id (``0:{...}``, Spark with
    source evolution); ``-`` is a source with no offset yet."""
    _log(tmp_path, "offsets", 0, "v1", METADATA, '{"t": [0, 3]}')
    _log(tmp_path, "offsets", 1, "v2", METADATA, '0:{"t": [0, 5]}')
    _log(tmp_path, "commits", 0, "v1", '{"nextBatchWatermarkMs":0}')
    assert repair_checkpoint(str(tmp_path)) == []  # both whole: nothing set aside
    assert logged_offsets(str(tmp_path), 0) == {"t": [0, 3]}
    assert logged_offsets(str(tmp_path), 1) == {"t": [0, 5]}
    assert logged_offsets(str(tmp_path), -1) == {}
    # The newest batch with no offset yet, in either format: whole, kept by the repair.
    for batch, line in ((2, "0:-"), (3, "-")):
        newest = _log(tmp_path, "offsets", batch, f"v{2 if ':' in line else 1}", METADATA, line)
        assert repair_checkpoint(str(tmp_path)) == []
        assert newest.exists()
        assert logged_offsets(str(tmp_path), batch) == {}


def test_a_torn_tail_is_set_aside_and_the_batch_before_it_kept(tmp_path: Path) -> None:
    _log(tmp_path, "offsets", 0, "v1", METADATA, '{"t": [0, 3]}')
    torn = _log(tmp_path, "offsets", 1, "v1", METADATA, '{"t": [0,')
    assert repair_checkpoint(str(tmp_path)) == [str(torn)]
    assert not torn.exists()
    assert logged_offsets(str(tmp_path), 0) == {"t": [0, 3]}


def test_a_first_batch_logged_before_any_commit_is_synced_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fanout killed in its first batch leaves ``offsets/0`` and no commit log directory at
    all: the restart syncs what there is (and did fail on the missing directory)."""
    files: list[str] = []
    directories: list[str] = []
    monkeypatch.setattr(checkpoint_sync, "sync_file", lambda path: _synced(path, files))
    monkeypatch.setattr(checkpoint_sync, "sync_directory", directories.append)
    (tmp_path / "metadata").write_text('{"id": "q"}')
    _log(tmp_path, "offsets", 0, "v1", METADATA, '{"t": [0, 3]}')
    assert not (tmp_path / "commits").exists()
    sync_batch(str(tmp_path), 0)
    # The batch's offsets, the query's metadata, and the directories that name them.
    assert files == [str(tmp_path / "offsets" / "0"), str(tmp_path / "metadata")]
    assert set(directories) == {str(tmp_path / "offsets"), str(tmp_path), str(tmp_path.parent)}
    assert repair_checkpoint(str(tmp_path)) == []
    assert logged_offsets(str(tmp_path), 0) == {"t": [0, 3]}
    # The same for a later batch whose predecessor's commit never reached the disk.
    _log(tmp_path, "offsets", 1, "v1", METADATA, '{"t": [0, 5]}')
    files.clear()
    sync_batch(str(tmp_path), 1)
    assert files[0] == str(tmp_path / "offsets" / "1")
    assert logged_offsets(str(tmp_path), 1) == {"t": [0, 5]}
    # Once batch 0's commit is logged, batch 1's sync takes it too.
    _log(tmp_path, "commits", 0, "v1", '{"nextBatchWatermarkMs":0}')
    files.clear()
    sync_batch(str(tmp_path), 1)
    assert files == [str(tmp_path / "offsets" / "1"), str(tmp_path / "commits" / "0")]


def _synced(path: str, into: list[str]) -> None:
    """A recording sync_file: as the real one, a missing file raises FileNotFoundError."""
    if not Path(path).exists():
        raise FileNotFoundError(path)
    into.append(path)
