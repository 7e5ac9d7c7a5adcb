"""Group commit on the event loop: a local ledger's lease events committed without a thread.

The threaded ``LedgerWriter`` hands every batch to a commit thread and the result back to the
loop. On a local warehouse a commit is ~0.5-1 ms of file calls, and each of them makes the
commit thread win the GIL back from a busy loop (up to a switch interval each, ~10 per commit)
plus two cross-thread wake-ups per request: measured, the hand-offs cost more than the commit.
Here the loop commits itself: the first submission of a loop iteration schedules one flush
(``call_soon``), and every submission made before it runs goes into the same Delta commit, so
concurrent consumers still share commits. Used only when the fast local appender applies;
ledgers on object stores, where a commit takes tens of ms, keep the thread.

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

from queue_engine.errors import QueueError
from queue_engine.lease import LeaseEvent
from queue_engine.metrics import ledger_histogram
from queue_engine.storage_health import STORAGE, commit_failed
from queue_engine.store.append import (
    Appender,
    LocalAppender,
    append_or_fall_back,
    fast_path_allowed,
)
from queue_engine.store.group_commit import Notify, WriterClosedError
from queue_engine.store.ledger import EVENT_BYTES, LedgerWriter, OwnVersions, events_to_arrow
from queue_engine.store.tables import LEDGER_SCHEMA, open_or_create

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
        loop this writer belongs to."""
        self._closed = True
        self._flush()
        self._appender.close()

    async def aclose(self) -> None:
        """``close``, called as the threaded writer's is (it commits on this loop)."""
        self.close()

    def _flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        self._pending_events = 0
        if not batch:
            return
        self._last_commit = self._loop.time()
        error: QueueError | None = None
        try:
            if self._reopen_requested:
                self._reopen_requested = False
                self._appender.reopen()
            started = time.perf_counter()
            table = events_to_arrow([event for events, _ in batch for event in events])
            self._appender, version = append_or_fall_back(self._appender, self.path, table)
            self.own.add(version)
            self.version = max(self.version, version)
            if self._histogram is not None:
                self._histogram.observe(time.perf_counter() - started)
        except Exception as exc:  # reported to every request of the batch
            error = commit_failed(exc)
            if error.cause is None:  # a storage cause is logged once per episode
                log.exception("commit to %s failed (%d requests)", self.name, len(batch))
        else:
            STORAGE.succeeded()
        for _, future in batch:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


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
