"""Group commit scheduled by the event loop: a local ledger's lease events, one commit in flight.

The threaded ``LedgerWriter`` wakes a commit thread for every batch and hands the result back
to the loop. Here the loop decides when to commit: the first submission of a loop iteration
schedules one flush (``call_soon``), and every submission made before it runs goes into the
same Delta commit, so concurrent consumers still share commits. The commit itself (two files
written and synced, the directories synced: ~2 ms of waiting for the disk, during which the
loop must keep serving) runs on a small shared pool, one at a time per ledger; what arrives
meanwhile goes into the next. Used only when the fast local appender applies; ledgers on
object stores keep the thread.

Submissions nobody waits on (a TCP connection's deliveries and FIN/REQ/TOUCH: ``lazy``) are
committed at most once per ``linger_s``; one that a request waits on (HTTP /sub, /fin) commits
at once and takes the lazy ones with it. A commit is two new files: on ext4 without a journal,
creating one after many recent deletions costs up to a millisecond of kernel time, and a
channel consumed at 100,000 msg/s committed ~600 times a second (measured: the kernel then
took more CPU than the whole of the serving process's Python).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from queue_engine.errors import QueueError
from queue_engine.lease import LeaseEvent
from queue_engine.metrics import ledger_histogram
from queue_engine.storage_health import STORAGE, commit_failed
from queue_engine.store.delta.append import (
    Appender,
    LocalAppender,
    append_or_fall_back,
    fast_path_allowed,
)
from queue_engine.store.delta.group_commit import Notify, WriterClosedError
from queue_engine.store.delta.open_table import open_or_create
from queue_engine.store.tables.ledger import EVENT_BYTES, LedgerWriter, OwnVersions, events_to_arrow
from queue_engine.store.tables.schemas import LEDGER_SCHEMA

log = logging.getLogger(__name__)


class LoopLedgerWriter:
    """One channel's ledger writer, committing on the event loop it was created for."""

    def __init__(
        self,
        path: str,
        loop: asyncio.AbstractEventLoop,
        *,
        version: int,
        name: str = "",
        linger_s: float = 0.0,
    ) -> None:
        """``version``: the ledger's latest version (``open_ledger_writer`` has loaded it);
        ``linger_s``: lazy submissions commit at most once per this long."""
        self.path = path
        self.name = name or path
        self._loop = loop
        self._appender: Appender = LocalAppender(path, version)
        # The newest version this writer knows of (its own commits move it).
        self.version = version
        self._pending: list[tuple[list[LeaseEvent], asyncio.Future[None]]] = []
        self._scheduled = False
        self._pending_events = 0
        self._linger_s = linger_s
        # A commit of lazy submissions waiting for the linger to pass.
        self._timer: asyncio.TimerHandle | None = None
        self._last_commit = float("-inf")
        self._closed = False
        # Set by the maintenance thread after a checkpoint; read before the next commit.
        self._reopen_requested = False
        self.own = OwnVersions()
        self._histogram = ledger_histogram(name) if name else None
        # The commit on the pool (None: none), and whether a flush came while it ran.
        self._in_flight: _Commit | None = None
        self._again = False

    def submit_events(
        self, events: list[LeaseEvent], future: asyncio.Future[None], *, lazy: bool = False
    ) -> None:
        """Queue ``events`` for this iteration's commit (``lazy``: for one at most ``linger_s``
        after the last); ``future`` resolves when it landed."""
        if self._closed:
            raise WriterClosedError(self.path)
        self._pending.append((events, future))
        self._pending_events += len(events)
        if self._scheduled or (lazy and self._timer is not None):
            return  # a commit that takes these is coming
        if lazy:
            due = self._last_commit + self._linger_s - self._loop.time()
            if due > 0:
                self._timer = self._loop.call_later(due, self._flush)
                return
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._scheduled = True
        self._loop.call_soon(self._flush)

    @property
    def pending_bytes(self) -> int:
        """About how much waits for the next commit (as the threaded writer counts it)."""
        return self._pending_events * EVENT_BYTES

    def request_reopen(self) -> None:
        self._reopen_requested = True

    def close(self) -> None:
        """Commit what is pending, then stop (later submits raise WriterClosedError). On the
        loop this writer belongs to; it waits (blocking) for the commit in flight."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._in_flight is not None:
            self._in_flight.result_or_error()
        batch, self._pending = self._pending, []
        self._pending_events = 0
        if batch:
            self._landed(batch, _Commit.run(self, self._table(batch)))
        self._appender.close()

    async def aclose(self) -> None:
        """``close``, called as the threaded writer's is."""
        while self._in_flight is not None:
            await asyncio.wrap_future(self._in_flight.future)
            await asyncio.sleep(0)  # its landing runs on the loop
        self.close()

    def _flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._in_flight is not None:
            self._again = True  # once the commit in flight lands
            return
        batch, self._pending = self._pending, []
        self._pending_events = 0
        if not batch:
            return
        self._last_commit = self._loop.time()
        commit = _Commit(self, self._table(batch))
        self._in_flight = commit
        commit.future.add_done_callback(
            lambda _: self._loop.call_soon_threadsafe(self._commit_done, batch, commit)
        )

    def _table(self, batch: list[tuple[list[LeaseEvent], asyncio.Future[None]]]) -> pa.Table:
        return events_to_arrow([event for events, _ in batch for event in events])

    def _commit_done(
        self, batch: list[tuple[list[LeaseEvent], asyncio.Future[None]]], commit: _Commit
    ) -> None:
        if self._in_flight is commit:
            self._in_flight = None
        self._landed(batch, commit.result_or_error())
        if self._again and not self._closed:
            self._again = False
            if self._pending and not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._flush)

    def _append(self, table: pa.Table) -> int:
        """The commit (on the pool)."""
        if self._reopen_requested:
            self._reopen_requested = False
            self._appender.reopen()
        started = time.perf_counter()
        self._appender, version = append_or_fall_back(self._appender, self.path, table)
        if self._histogram is not None:
            self._histogram.observe(time.perf_counter() - started)
        return version

    def _landed(
        self,
        batch: list[tuple[list[LeaseEvent], asyncio.Future[None]]],
        outcome: int | BaseException,
    ) -> None:
        """On the loop: a commit landed (its version) or failed; its requests are answered."""
        error: QueueError | None = None
        if isinstance(outcome, BaseException):
            error = commit_failed(outcome)
            if error.cause is None:  # a storage cause is logged once per episode
                log.error(
                    "commit to %s failed (%d requests)", self.name, len(batch), exc_info=outcome
                )
        else:
            self.own.add(outcome)
            self.version = max(self.version, outcome)
            STORAGE.succeeded()
        for _, future in batch:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


class _Commit:
    """One ledger commit running on the shared pool."""

    def __init__(self, writer: LoopLedgerWriter, table: pa.Table) -> None:
        self.future: Future[int] = _POOL.submit(writer._append, table)

    @staticmethod
    def run(writer: LoopLedgerWriter, table: pa.Table) -> int | BaseException:
        """The same commit, here and now (closing)."""
        try:
            return writer._append(table)
        except Exception as exc:
            return exc

    def result_or_error(self) -> int | BaseException:
        try:
            return self.future.result()
        except Exception as exc:
            return exc


# Ledger commits of every channel: mostly waiting for the disk's syncs (the GIL is free).
_POOL = ThreadPoolExecutor(4, thread_name_prefix="deltaq-ledger-commit")


def open_ledger_writer(
    path: str,
    loop: asyncio.AbstractEventLoop,
    notify: Notify,
    *,
    name: str = "",
    linger_s: float = 0.0,
) -> LoopLedgerWriter | LedgerWriter:
    """The writer for a channel's ledger (blocking: call it off the loop): on the loop where the
    fast local appender applies, else the threaded one (``notify`` resolves its futures; it
    commits whatever arrived during its last commit, tens of ms on an object store, so it has
    no linger of its own)."""
    dt = open_or_create(path, LEDGER_SCHEMA)
    if fast_path_allowed(path, dt):
        return LoopLedgerWriter(path, loop, version=dt.version(), name=name, linger_s=linger_s)
    return LedgerWriter(path, notify, name=name)
