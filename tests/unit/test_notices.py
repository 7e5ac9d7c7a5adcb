"""Notices of the channels the fanout and the sweep wrote: what a node learns from them."""

from __future__ import annotations

from pathlib import Path

from queue_engine.store.tables import KEEP_BATCHES, NoticeReader, NoticeWriter


def test_a_reader_learns_exactly_the_channels_written_since_it_last_looked(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    reader = NoticeReader(root)
    assert reader.changes() is None  # first look: anything may have changed
    assert reader.changes() == set()
    fanout = NoticeWriter(root, "fanout")
    fanout.post([("t", "a"), ("t", "b")])
    fanout.post([("t", "a")])
    NoticeWriter(root, "sweep").post([("u", "c")])
    assert reader.changes() == {("t", "a"), ("t", "b"), ("u", "c")}
    assert reader.changes() == set()
    fanout.post([])  # nothing written: nothing posted
    fanout.post([("t", "b")])
    assert reader.changes() == {("t", "b")}


def test_a_new_writer_continues_the_numbering_of_the_last_one(tmp_path: Path) -> None:
    root = str(tmp_path)
    NoticeWriter(root, "sweep").post([("t", "a")])
    reader = NoticeReader(root)
    reader.changes()
    # The next sweep is another process: its notices still read as "only these changed".
    NoticeWriter(root, "sweep").post([("t", "b")])
    assert reader.changes() == {("t", "b")}


def test_a_reader_further_behind_than_the_notice_keeps_looks_at_everything(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    fanout = NoticeWriter(root, "fanout")
    fanout.post([("t", "a")])
    reader = NoticeReader(root)
    reader.changes()
    for i in range(KEEP_BATCHES + 1):
        fanout.post([("t", f"c{i}")])
    assert reader.changes() is None
    fanout.post([("t", "z")])
    assert reader.changes() == {("t", "z")}


def test_a_damaged_notice_is_replaced_and_read_as_a_new_run(tmp_path: Path) -> None:
    root = str(tmp_path)
    fanout = NoticeWriter(root, "fanout")
    fanout.post([("t", "a")])
    reader = NoticeReader(root)
    reader.changes()
    Path(fanout.url).write_text("{not json")
    assert reader.changes() == set()  # unreadable: skipped, no error
    NoticeWriter(root, "fanout").post([("t", "b")])
    assert reader.changes() is None
