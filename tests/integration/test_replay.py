"""Replay on real Delta tables: ranges by version and by time, copies committed once per replay
id, routed to their channel only, and refused when retention removed the range."""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.fanout import route_noted
from queue_engine.registry import Action, Registry, RegistryEvent
from queue_engine.replay import parse_bound, run_replay
from queue_engine.store.delta import commit_file, commit_info, remove_files
from queue_engine.store.tables import TopicWriter


class _Done:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0

    def __call__(self, tokens: list[Any], error: BaseException | None) -> None:
        assert error is None
        with self.cond:
            self.count += len(tokens)
            self.cond.notify_all()

    def wait(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.count >= count, 30)


def _topic(tmp_path: Path, bodies: list[bytes]) -> tuple[TopicWriter, list[int]]:
    """A topic with one commit per body; returns the writer and each body's version."""
    done = _Done()
    writer = TopicWriter(str(tmp_path / "topic"), done, commit_max_bytes=1 << 20)
    versions = []
    for i, body in enumerate(bodies):
        writer.submit_publish([body], time.time_ns() // 1000, None, i)
        done.wait(i + 1)
        versions.append(writer.stats().version)
        time.sleep(0.002)  # commits a few ms apart: each has its own commit time
    return writer, versions


def _rows(writer: TopicWriter) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = DeltaTable(writer.path).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: r["id"])


def test_a_replay_copies_a_range_once_per_id_for_its_channel_only(tmp_path: Path) -> None:
    writer, versions = _topic(tmp_path, [b"m0", b"m1", b"m2", b"m3"])
    originals = {r["body"]: r["id"] for r in _rows(writer)}
    v1, v2 = versions[1], versions[2]

    result = run_replay(writer, "a", ("version", v1), ("version", v2), "r1", 1000)
    assert (result.first_version, result.last_version, result.messages) == (v1, v2, 2)
    assert not result.repeated
    copies = [r for r in _rows(writer) if r["replay_of"] is not None]
    assert [(r["body"], r["replay_of"], r["to_channel"]) for r in copies] == [
        (b"m1", originals[b"m1"], "a"),
        (b"m2", originals[b"m2"], "a"),
    ]
    assert all(r["id"] > max(originals.values()) for r in copies)
    # The same replay id again: nothing is copied twice (the commit recorded it); the same
    # range with another id, or for another channel, is a new replay.
    again = run_replay(writer, "a", ("version", v1), ("version", v2), "r1", 1000)
    assert (again.messages, again.repeated) == (0, True)
    assert len(_rows(writer)) == 6
    other = run_replay(writer, "b", ("version", v1), ("version", v1), "r1", 1000)
    assert (other.messages, other.repeated) == (1, False)

    # A replay of a range holding copies for other channels leaves theirs out.
    newest = writer.stats().version
    mixed = run_replay(writer, "c", ("version", 0), ("version", newest), "all", 1000)
    assert mixed.messages == 4
    writer.close()

    # The fanout gives a copy to its channel only, every other row to every channel.
    registry = Registry()
    registry.apply(RegistryEvent(1, 0, Action.TOPIC_CREATE, "t"))
    for name in ("a", "b", "c"):
        registry.apply(RegistryEvent(2, 0, Action.CHANNEL_CREATE, "t", name, topic_version=-1))
    table = DeltaTable(writer.path).to_pyarrow_table()
    table = table.add_column(0, "topic", pa.array(["t"] * table.num_rows)).append_column(
        "topic_version", pa.array([1] * table.num_rows, pa.int64())
    )
    tables, _ = route_noted(table, registry)
    routed = {k[1]: sorted(v["body"].to_pylist()) for k, v in tables.items() if v.num_rows}
    assert routed == {
        "a": sorted([b"m0", b"m1", b"m2", b"m3", b"m1", b"m2"]),
        "b": sorted([b"m0", b"m1", b"m2", b"m3", b"m1"]),
        "c": sorted([b"m0", b"m1", b"m2", b"m3"] * 2),
    }


def test_a_range_written_by_several_nodes_is_exactly_its_versions_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes append to one topic, each with ids of its own lane; the clock of one runs an
    hour ahead, so their commits interleave while their ids do not follow the versions: a
    replay of some versions copies exactly those versions' rows, none of the other node's."""
    import queue_engine.store.tables.topic_writer as writer_module

    class _Clock:
        skew_ns = 0

        def time_ns(self) -> int:
            return time.time_ns() + self.skew_ns

    clock = _Clock()
    monkeypatch.setattr(writer_module, "time", clock)
    done = _Done()
    path = str(tmp_path / "topic")
    writers = [TopicWriter(path, done, commit_max_bytes=1 << 20, id_lane=lane) for lane in (0, 1)]
    by_version: dict[int, list[bytes]] = {}
    for i in range(8):
        writer = writers[i % 2]
        bodies = [f"v{i}-{k}".encode() for k in range(3)]
        clock.skew_ns = 3600 * 10**9 if i % 2 == 0 else 0
        writer.submit_publish(bodies, time.time_ns() // 1000, None, i)
        done.wait(i + 1)
        by_version[writer.stats().version] = bodies
    versions = sorted(by_version)
    first, last = versions[2], versions[5]
    ids = [r["id"] for r in _rows(writers[0])]
    assert len(set(ids)) == 24 and {int(i, 16) % 16 for i in ids} == {0, 1}

    clock.skew_ns = 0
    result = run_replay(writers[1], "a", ("version", first), ("version", last), "mixed", 1000)
    assert result.messages == 12
    copied = sorted(r["body"] for r in _rows(writers[0]) if r["replay_of"] is not None)
    assert copied == sorted(b for v in versions[2:6] for b in by_version[v])
    for writer in writers:
        writer.close()


def test_a_range_by_time_is_the_versions_committed_then(tmp_path: Path) -> None:
    writer, versions = _topic(tmp_path, [b"early", b"mid1", b"mid2", b"late"])
    # The times the log recorded for mid1's and mid2's commits bound the range exactly.
    stamps = [commit_info(writer.path, v)["timestamp"] for v in versions]  # type: ignore[index]
    assert stamps == sorted(set(stamps))
    start, end = (datetime.fromtimestamp(int(t) / 1000, UTC) for t in stamps[1:3])
    first, last = parse_bound(start.isoformat(), "from"), parse_bound(end.isoformat(), "to")
    assert first is not None and last is not None
    result = run_replay(writer, "a", first, last, "t", 1000)
    assert (result.first_version, result.last_version) == (versions[1], versions[2])
    copies = [r["body"] for r in _rows(writer) if r["replay_of"] is not None]
    assert copies == [b"mid1", b"mid2"]
    writer.close()


def test_bad_ranges_are_refused_and_write_nothing(tmp_path: Path) -> None:
    writer, versions = _topic(tmp_path, [b"a", b"b", b"c"])
    newest = versions[-1]
    cases: list[tuple[Any, Any, int, ErrorCode]] = [
        (("version", 3), ("version", 2), 1000, ErrorCode.INVALID_RANGE),
        (("version", newest + 1), None, 1000, ErrorCode.INVALID_RANGE),
        (("version", 1), ("version", newest + 5), 1000, ErrorCode.INVALID_RANGE),
        (("time", (time.time_ns() // 1000) + 60_000_000), None, 1000, ErrorCode.INVALID_RANGE),
        (("version", 0), None, 2, ErrorCode.INVALID_RANGE),
    ]
    for start, end, limit, code in cases:
        with pytest.raises(QueueError) as caught:
            run_replay(writer, "a", start, end, "x", limit)
        assert caught.value.code is code, (start, end)
    for value in ("abc", "2026-01-01T00:00:00", "-1", "1.5"):
        with pytest.raises(QueueError) as caught:
            parse_bound(value, "from")
        assert caught.value.code is ErrorCode.INVALID_RANGE
    assert DeltaTable(writer.path).version() == newest
    writer.close()


def test_a_range_retention_removed_or_the_log_forgot_is_refused(tmp_path: Path) -> None:
    writer, versions = _topic(tmp_path, [b"a", b"b", b"c"])
    writer.close()
    dt = DeltaTable(writer.path)
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    oldest = min(actions, key=lambda a: a["min.id"])
    # What retention commits: the removal of a whole file.
    assert remove_files(writer.path, dt, [(oldest["path"], oldest["size_bytes"])], "retention")
    writer = TopicWriter(writer.path, _Done(), commit_max_bytes=1 << 20)
    with pytest.raises(QueueError) as caught:
        run_replay(writer, "a", ("version", versions[0]), ("version", versions[1]), "x", 1000)
    assert caught.value.code is ErrorCode.RANGE_REMOVED
    assert "removed 1 of the 2" in caught.value.detail
    # The versions after it are still there.
    kept = run_replay(writer, "a", ("version", versions[1]), ("version", versions[2]), "y", 1000)
    assert kept.messages == 2
    # Versions whose commit files the log cleanup deleted (after a checkpoint).
    DeltaTable(writer.path).create_checkpoint()
    for version in range(versions[1] + 1):
        os.remove(f"{writer.path}/{commit_file(version)}")
    with pytest.raises(QueueError) as caught:
        run_replay(writer, "a", ("version", versions[1]), ("version", versions[2]), "z", 1000)
    assert caught.value.code is ErrorCode.RANGE_REMOVED
    writer.close()
