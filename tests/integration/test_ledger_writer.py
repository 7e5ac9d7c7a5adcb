"""The ledger's commit on the event loop, and put-if-absent, on real Delta tables in tmp_path."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from deltalake import DeltaTable

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.lease import EventKind, LeaseEvent
from queue_engine.store.delta import WriterClosedError, fast_path_allowed
from queue_engine.store.storage import move_if_absent, put_if_absent
from queue_engine.store.tables import (
    EVENT_BYTES,
    LedgerWriter,
    LoopLedgerWriter,
    open_ledger_writer,
    read_ledger,
)

BASE_US = 1_790_000_000_000_000


def _events(prefix: str, n: int) -> list[LeaseEvent]:
    return [
        LeaseEvent(f"{prefix}{i:015x}", EventKind.DELIVER, 1, BASE_US + i, lease="1-0123456789ab")
        for i in range(n)
    ]


def _loop_writer(path: str) -> LoopLedgerWriter:
    """The writer a local ledger gets (call it on the running loop): the loop-committing one."""
    writer = open_ledger_writer(path, asyncio.get_running_loop(), lambda tokens, error: None)
    assert isinstance(writer, LoopLedgerWriter)
    return writer


def test_submissions_of_one_loop_iteration_share_one_commit(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        writer = _loop_writer(path)
        first = [loop.create_future() for _ in range(3)]
        for n, future in enumerate(first):
            writer.submit_events(_events(f"{n}", 10), future)
        # Nothing is committed until the loop runs the flush.
        assert DeltaTable(path).version() == 0
        await asyncio.gather(*first)
        assert DeltaTable(path).version() == 1
        later = loop.create_future()
        writer.submit_events(_events("9", 5), later)
        await later
        assert 1 in writer.own and 2 in writer.own and 3 not in writer.own
        writer.own.forget_through(1)
        assert 1 not in writer.own and 2 in writer.own

    asyncio.run(scenario())
    events, version = read_ledger(path)
    assert version == 2
    assert len(events) == 35 and len({e.id for e in events}) == 35


def test_lazy_submissions_commit_at_most_once_per_linger_and_an_awaited_one_takes_them(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "ledger")
    # Long enough that the five lazy submissions below fit in it on a loaded machine, whose
    # first commit alone can take a good part of a shorter one (it counts from its start).
    linger = 1.0

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        writer = open_ledger_writer(path, loop, lambda tokens, error: None, linger_s=linger)
        assert isinstance(writer, LoopLedgerWriter)
        # After a quiet spell the first lazy submission commits at once.
        first = loop.create_future()
        # Before the first commit starts, so before the linger does: no commit of lazy
        # submissions may come sooner than a linger after this, however long that commit takes.
        submitted_at = loop.time()
        writer.submit_events(_events("1", 2), first, lazy=True)
        await first
        assert DeltaTable(path).version() == 1
        # Within the linger, lazy submissions of many iterations wait for one commit.
        lazy = []
        for n in range(5):
            future = loop.create_future()
            writer.submit_events(_events(f"2{n}", 2), future, lazy=True)
            lazy.append(future)
            await asyncio.sleep(0.01)
        assert DeltaTable(path).version() == 1 and not any(f.done() for f in lazy)
        assert writer.pending_bytes == 10 * EVENT_BYTES
        await asyncio.gather(*lazy)
        assert writer.pending_bytes == 0
        assert loop.time() - submitted_at >= linger
        assert DeltaTable(path).version() == 2
        # Closing commits a lingering batch.
        last = loop.create_future()
        writer.submit_events(_events("3", 2), last, lazy=True)
        writer.close()
        assert last.done() and last.exception() is None
        assert DeltaTable(path).version() == 3

        # A submission someone waits on commits at once, with the lazy ones before it. The
        # same ledger, reopened with a linger of an hour: a commit held for the linger could
        # not come within the test's time, so no clock needs reading.
        patient = open_ledger_writer(path, loop, lambda tokens, error: None, linger_s=3600)
        assert isinstance(patient, LoopLedgerWriter)
        quiet = loop.create_future()
        patient.submit_events(_events("4", 2), quiet, lazy=True)
        await asyncio.wait_for(quiet, 60)  # the first after a quiet spell: at once
        waiting = loop.create_future()
        patient.submit_events(_events("5", 2), waiting, lazy=True)
        await asyncio.sleep(0.05)
        assert not waiting.done() and DeltaTable(path).version() == 4
        urgent = loop.create_future()
        patient.submit_events(_events("6", 2), urgent)
        try:
            await asyncio.wait_for(urgent, 60)
        except TimeoutError:
            raise AssertionError("an awaited submission waited for the lazy ones' linger") from None
        # One commit took both.
        assert waiting.done() and waiting.exception() is None
        assert DeltaTable(path).version() == 5
        patient.close()

    asyncio.run(scenario())
    events, version = read_ledger(path)
    assert version == 5
    assert len(events) == 2 + 10 + 2 + 2 + 2 + 2


def test_failed_commit_fails_every_request_of_the_batch_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "ledger")

    async def scenario() -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        writer = _loop_writer(path)
        # The commit log is gone while the batch commits (moved aside): it cannot land.
        log_dir = os.path.join(path, "_delta_log")
        os.rename(log_dir, log_dir + ".aside")
        try:
            futures = [loop.create_future() for _ in range(2)]
            for future in futures:
                writer.submit_events(_events("a", 3), future)
            return list(await asyncio.gather(*futures, return_exceptions=True))
        finally:
            os.rename(log_dir + ".aside", log_dir)

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, QueueError) and o.code is ErrorCode.E_COMMIT_FAILED for o in outcomes)
    assert read_ledger(path)[1] == 0


def test_close_commits_pending_events_then_refuses_more(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        writer = _loop_writer(path)
        future = loop.create_future()
        writer.submit_events(_events("c", 4), future)
        writer.close()
        assert future.done() and future.exception() is None
        with pytest.raises(WriterClosedError):
            writer.submit_events(_events("d", 1), loop.create_future())

    asyncio.run(scenario())
    assert len(read_ledger(path)[0]) == 4


def test_remote_or_unsupported_ledgers_keep_the_commit_thread(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger")
    LedgerWriter(path, lambda tokens, error: None).close()
    # A table feature the fast appender does not honour: delta-rs appends, from a thread.
    DeltaTable(path).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})

    plain = str(tmp_path / "plain")
    LedgerWriter(plain, lambda tokens, error: None).close()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        writer = open_ledger_writer(path, loop, lambda t, e: None)
        assert isinstance(writer, LedgerWriter)
        writer.close()
        # The control: a plain local ledger is appended on the loop.
        fast = open_ledger_writer(plain, loop, lambda t, e: None)
        assert isinstance(fast, LoopLedgerWriter)
        fast.close()

    asyncio.run(scenario())
    # An object store's ledger, whatever its protocol: never the local fast path.
    assert fast_path_allowed(plain)
    assert not fast_path_allowed("s3://bucket/ledger", DeltaTable(plain))


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "link-fallback"])
def test_move_if_absent_never_replaces(
    tmp_path: Path, renameat2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if renameat2 and put_if_absent._renameat2 is None:
        pytest.skip("no renameat2 here")
    if not renameat2:
        monkeypatch.setattr(put_if_absent, "_renameat2", None)
    first, second, target = tmp_path / "a", tmp_path / "b", tmp_path / "t"
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    assert move_if_absent(str(first), str(target))
    assert not first.exists() and target.read_bytes() == b"first"
    assert not move_if_absent(str(second), str(target))
    assert second.read_bytes() == b"second" and target.read_bytes() == b"first"
