"""Spark's streaming offset log as the fanout (Spark's query or its loop) reads it back."""

from __future__ import annotations

from pathlib import Path

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
    _log(tmp_path, "offsets", 2, "v2", METADATA, "0:-")
    assert logged_offsets(str(tmp_path), 2) == {}


def test_a_torn_tail_is_set_aside_and_the_batch_before_it_kept(tmp_path: Path) -> None:
    _log(tmp_path, "offsets", 0, "v1", METADATA, '{"t": [0, 3]}')
    torn = _log(tmp_path, "offsets", 1, "v1", METADATA, '{"t": [0,')
    assert repair_checkpoint(str(tmp_path)) == [str(torn)]
    assert not torn.exists()
    assert logged_offsets(str(tmp_path), 0) == {"t": [0, 3]}


def test_a_first_batch_logged_before_any_commit_is_synced_and_read_back(tmp_path: Path) -> None:
    """A fanout killed in its first batch leaves ``offsets/0`` and no commit log directory at
    all: the restart syncs what there is (and did fail on the missing directory)."""
    (tmp_path / "metadata").write_text('{"id": "q"}')
    _log(tmp_path, "offsets", 0, "v1", METADATA, '{"t": [0, 3]}')
    assert not (tmp_path / "commits").exists()
    sync_batch(str(tmp_path), 0)
    assert repair_checkpoint(str(tmp_path)) == []
    assert logged_offsets(str(tmp_path), 0) == {"t": [0, 3]}
    # The same for a later batch whose predecessor's commit never reached the disk.
    _log(tmp_path, "offsets", 1, "v1", METADATA, '{"t": [0, 5]}')
    sync_batch(str(tmp_path), 1)
    assert logged_offsets(str(tmp_path), 1) == {"t": [0, 5]}
