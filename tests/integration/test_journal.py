"""The node journal on real files and real Delta tables: durable writes, torn tails, drains
that a crash makes run twice, truncation, and a server that recovers what a dead one left."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable

from queue_engine.broker import Broker
from queue_engine.settings import load_settings
from queue_engine.store.journal import (
    Journal,
    Record,
    app_id,
    encode,
    journal_tokens,
    read_journal,
)
from queue_engine.store.journal import node_journal as journal_module
from queue_engine.store.storage import fs_sync
from queue_engine.store.tables import TopicWriter, Warehouse
from tests.conftest import Server, read_topic, topic_rows


class _Durable:
    """Collects what the journal says is durable."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.tokens: list[Any] = []
        self.errors: list[BaseException] = []
        self.cond = threading.Condition()

    def __call__(
        self, records: list[Record], tokens: list[Any], error: BaseException | None
    ) -> None:
        with self.cond:
            self.records += records
            self.tokens += tokens
            if error is not None:
                self.errors.append(error)
            self.cond.notify_all()

    def wait(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.tokens) >= count, 10)


def _journal_with(wh: Path, token: str, topic: str, bodies: list[list[bytes]]) -> list[Record]:
    durable = _Durable()
    journal = Journal(str(wh), token, durable)
    for n, group in enumerate(bodies):
        journal.append(topic, group, 1_000 + n, None, None, n)
    durable.wait(len(bodies))
    journal.close()
    assert durable.errors == [] and durable.tokens == list(range(len(bodies)))
    return durable.records


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def test_positions_increase_and_every_write_is_whole_on_disk(tmp_path: Path) -> None:
    records = _journal_with(tmp_path, "tok", "t", [[b"a"], [b"b", b"c"], [b"d"]])
    positions = [r.position for r in records]
    assert positions == sorted(set(positions))
    assert journal_tokens(str(tmp_path)) == ["tok"]
    # Written into a file filled with zeros beforehand.
    [segment] = _segments(tmp_path / "_deltaq" / "journal" / "tok")
    assert segment.stat().st_size == journal_module.SEGMENT_BYTES
    recovered = read_journal(str(tmp_path), "tok")
    assert recovered.records == records and recovered.torn == []


def test_a_torn_tail_is_reported_and_everything_before_it_recovered(tmp_path: Path) -> None:
    records = _journal_with(tmp_path, "tok", "t", [[b"a"], [b"b"]])
    [segment] = _segments(tmp_path / "_deltaq" / "journal" / "tok")
    with open(segment, "r+b") as f:
        # Where the written part ends (the zeros begin), a frame the crash cut short.
        written = sum(len(encode(r)) for r in records)
        f.seek(written)
        f.write(b"\x00\x00\x01\x00garbage")
    recovered = read_journal(str(tmp_path), "tok")
    assert recovered.records == records
    # The zeros after it make it whole in length: its checksum fails, where it begins.
    assert len(recovered.torn) == 1 and f"checksum at byte {written}" in recovered.torn[0]


def test_waiting_for_the_hand_off_covers_publishes_answered_before_it(tmp_path: Path) -> None:
    """A publish is answered before the journal's thread hands it to its topic's writer: an
    admin change that follows the answer (topic/empty, channel/create) waits for the hand-off
    of everything appended before it."""
    answered = threading.Event()
    release = threading.Event()
    handed: list[int] = []

    def durable(records: list[Record], tokens: list[Any], error: BaseException | None) -> None:
        answered.set()  # the publisher has its answer here
        assert release.wait(10)
        handed.extend(tokens)

    journal = Journal(str(tmp_path), "tok", durable)
    try:
        assert journal.wait_handed_on(0.01)  # nothing appended yet
        journal.append("t", [b"a"], 1_000, None, None, 0)
        assert answered.wait(10)
        assert not journal.wait_handed_on(0.2) and handed == []
        release.set()
        assert journal.wait_handed_on(10) and handed == [0]
    finally:
        release.set()
        journal.close()


def test_an_empty_after_an_acknowledged_publish_drops_it_however_late_its_hand_off(
    tmp_path: Path,
) -> None:
    """nsqd's /topic/empty right after a publish's OK: the message is among those emptied
    even when the journal's thread hands it to the topic's writer only later (here 0.3 s)."""

    async def scenario() -> tuple[int, int]:
        broker = Broker(load_settings(None, warehouse=str(tmp_path / "wh")))
        await broker.start()
        try:
            await broker.create_topic("t")
            writer = await broker.topics.writer("t")
            hand_off = writer.submit_publish

            def late(*args: Any, **kwargs: Any) -> None:
                time.sleep(0.3)  # on the journal's thread, after the publisher's answer
                hand_off(*args, **kwargs)

            writer.submit_publish = late  # type: ignore[method-assign]
            acknowledged = await broker.start_publish("t", [b"m"])
            await acknowledged
            await broker.empty_topic("t")
            info = broker.registry.topics["t"]
            return info.empty_message_count, writer.stats().message_count
        finally:
            await broker.close()

    assert asyncio.run(scenario()) == (1, 1)


def test_a_drain_run_again_after_a_crash_adds_no_row_twice(tmp_path: Path) -> None:
    """A crash between a topic commit and the journal's truncation: the next drain of the same
    journal skips what the topic's commits already carry (the journal's app transaction)."""
    records = _journal_with(tmp_path, "tok", "t", [[b"a"], [b"b", b"c"], [b"d"]])
    path = Warehouse(str(tmp_path)).topic_path("t")
    writer = TopicWriter(path, lambda tokens, error: None, commit_max_bytes=1 << 20)
    try:
        assert writer.commit_recovered(records[:2], app_id("tok")) == 3
        assert DeltaTable(path).transaction_version(app_id("tok")) == records[1].position
        assert writer.commit_recovered(records, app_id("tok")) == 1
        assert writer.commit_recovered(records, app_id("tok")) == 0
        # Another journal's publishes are its own: not mistaken for these.
        assert writer.commit_recovered(records[:1], app_id("other")) == 1
    finally:
        writer.close()
    bodies = sorted(read_topic(tmp_path, "t")["body"].to_pylist())
    assert bodies == [b"a", b"a", b"b", b"c", b"d"]


def test_segments_are_deleted_once_drained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drained segments go, the undrained ones and the one being written stay; every directory
    on a segment's path is synced (its name survives a power cut: a rename or create is durable
    only once its directory is)."""
    directory = tmp_path / "_deltaq" / "journal" / "tok"
    synced: list[str] = []

    def sync(path: str) -> None:
        synced.append(path)
        fs_sync.sync_directory(path)

    monkeypatch.setattr(journal_module, "sync_directory", sync)
    durable = _Durable()
    journal = Journal(str(tmp_path), "tok", durable, segment_bytes=64)
    for n in range(6):
        journal.append("t", [b"x" * 100], n, None, None, n)
        durable.wait(n + 1)
    assert len(_segments(directory)) == 6  # one write per segment past 64 bytes
    assert journal.undrained == 6
    assert {str(directory.parent), str(directory.parent.parent)} <= set(synced)
    assert synced.count(str(directory)) == 6  # at each roll, before the segment takes a write
    journal.drained([r.position for r in durable.records[:4]])
    journal.append("t", [b"y"], 7, None, None, 7)
    durable.wait(7)
    # The four drained segments go (after the write that follows); the undrained ones and the
    # one being written stay.
    deadline = time.monotonic() + 5
    while len(_segments(directory)) != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_segments(directory)) == 3
    journal.close()
    assert not journal.remove_if_drained()
    journal.drained([r.position for r in durable.records[4:]])
    assert journal.remove_if_drained()
    assert not directory.exists()


def test_a_server_commits_what_a_dead_processs_journal_holds_once(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """The state kill -9 leaves in the middle of a drain: a journal of four publishes, two of
    which a topic commit already carries. The next start commits the other two, once."""
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    assert httpx.post(f"{server.url}/topic/create", params={"topic": "t"}).status_code == 200
    server.stop()
    records = _journal_with(wh, "dead", "t", [[b"a"], [b"b"], [b"c"], [b"d"]])
    writer = TopicWriter(
        Warehouse(str(wh)).topic_path("t"), lambda t, e: None, commit_max_bytes=1 << 20
    )
    writer.commit_recovered(records[:2], app_id("dead"))
    writer.close()

    restarted = server_factory(wh).start()
    assert sorted(read_topic(wh, "t")["body"].to_pylist()) == [b"a", b"b", b"c", b"d"]
    assert "dead" not in journal_tokens(str(wh))
    assert httpx.post(f"{restarted.url}/pub", params={"topic": "t"}, content=b"e").text == "OK"
    assert sorted(topic_rows(wh, "t", 5)["body"].to_pylist()) == [b"a", b"b", b"c", b"d", b"e"]
    # The writer opened to recover is the live journal's too: its commits record that journal.
    [live] = journal_tokens(str(wh))
    path = Warehouse(str(wh)).topic_path("t")
    assert DeltaTable(path).transaction_version(app_id(live)) is not None
