"""Group commit: one appender per table, many submissions per Delta commit.

Submissions that arrive while a commit is running wait in ``pending`` and all go into the next
commit, so the number of rows per commit grows with the load and throughput is not bounded by
commit latency. A commit is one Delta version: all of a batch's rows are in it or none.
Submissions are committed in the order they were made.

Commits run on a pool of threads shared by every writer (``COMMIT_THREADS``), not on a thread
per table: a writer with something pending has one task on the pool, which commits it and
queues the next task if more arrived meanwhile, so a writer's commits never overlap and keep
their order, busy tables take turns, and an idle table costs no thread (ten thousand topics
do not mean ten thousand threads).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa
from deltalake.transaction import Transaction
from prometheus_client import Histogram

from queue_engine.errors import storage_cause
from queue_engine.storage_health import STORAGE
from queue_engine.store.delta.append import (
    Appender,
    ConstraintViolation,
    RefusedAppender,
    append_or_fall_back,
    appender_for,
)
from queue_engine.store.delta.table_features import TableRefusedError

log = logging.getLogger(__name__)

# Called once per commit with the tokens of the submissions it carried and None, or the error
# that made the commit fail (then none of those rows is in the table).
Notify = Callable[[list[Any], BaseException | None], None]

T = TypeVar("T")

# A lingering writer commits at once when this much waits.
LINGER_MAX_BYTES = 8 * 1024 * 1024

# The longest pause between retries of a commit of acknowledged publishes.
_RETRY_MAX_S = 5.0

# How often a refused table is judged again (the feature may have been dropped since).
REJUDGE_REFUSED_S = 10.0


# Commits that can run at once across all tables. Each is mostly file I/O outside the GIL; more
# threads than this only queue behind the same disk or store.
COMMIT_THREADS = 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def commit_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="deltaq-commit")
        return _pool


class _Delayed:
    """Drains due later, put on the commit pool when due (one thread for every writer: a
    lingering writer holds no pool thread)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit_at(self, at: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="deltaq-commit-delay", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                while not self._heap or self._heap[0][0] > now:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                    now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for fn in due:
                commit_pool().submit(fn)


_delayed: _Delayed | None = None


def delayed() -> _Delayed:
    global _delayed
    with _pool_lock:
        if _delayed is None:
            _delayed = _Delayed()
        return _delayed


class WriterClosedError(RuntimeError):
    """The writer was closed (table deleted or process stopping) before the commit."""


@dataclass
class _Submission(Generic[T]):
    item: T
    nbytes: int
    token: Any


class GroupCommitter(ABC, Generic[T]):
    """The commit thread; subclasses turn a batch of items into one Arrow table."""

    def __init__(
        self,
        path: str,
        notify: Notify,
        *,
        commit_max_bytes: int,
        fast_appends: bool = True,
        name: str = "",
        histogram: Histogram | None = None,
    ) -> None:
        self.path = path
        # Where each commit's duration is observed (/metrics), if anywhere.
        self._histogram = histogram
        self._notify = notify
        self._commit_max_bytes = commit_max_bytes
        self._fast_appends = fast_appends
        self._appender: Appender = appender_for(path, allow_fast=fast_appends)
        self._judged_at = time.monotonic()
        self._reopen_requested = False
        # Durations of the latest commits, for /stats and benchmarks.
        self.commit_seconds: deque[float] = deque(maxlen=1000)
        self._cond = threading.Condition()
        # Held for each commit; exclusive() holds it to act between two commits.
        self._commit_lock = threading.Lock()
        self._pending: list[_Submission[T]] = []
        self._pending_bytes = 0
        # How long after a drain began the next may begin (None: as soon as it ends); asked
        # with True where the writer was idle (its previous drain began longer than that ago)
        # until the pending submissions came: then how long after the first of them. Set for
        # journaled publishes: they are durable already, so a topic may gather more per commit.
        self.linger: Callable[[bool], float] | None = None
        self._drain_started = 0.0
        # When the first of the pending submissions came (monotonic s).
        self._pending_since = 0.0
        # Bumped when a delayed drain is overtaken (expedite): the delayed task then does nothing.
        self._drain_gen = 0
        # A drain waits for its linger (not yet on the pool).
        self._lingering = False
        # Submissions made, and submissions whose commit ended (committed or failed): in order.
        self._submitted = 0
        self._settled = 0
        self._closed = False
        # True while this writer has a commit task on the pool (at most one).
        self._draining = False
        self._started = False

    def _start(self) -> None:
        """Subclasses call this once their own state is set up."""
        with self._cond:
            self._started = True
            self._schedule()

    def _schedule(self) -> None:
        """With ``_cond`` held: put a drain task on the pool if one is due and none is on
        (with a ``linger``, not before it has passed since the previous drain began)."""
        if self._started and self._pending and not self._draining:
            self._draining = True
            at = 0.0
            if self.linger is not None:
                at = self._drain_started + self.linger(False)
                if self._pending_since > at:
                    at = self._pending_since + self.linger(True)
            if at > time.monotonic() and not self._closed:
                self._lingering = True
                delayed().submit_at(at, functools.partial(self._drain, self._drain_gen))
            else:
                commit_pool().submit(self._drain, self._drain_gen)

    def hurry(self) -> None:
        """The linger may have become shorter (a consumer began waiting for this table's rows):
        a drain waiting for the old one is scheduled again by the new one."""
        with self._cond:
            if not self._lingering or self.linger is None:
                return
            self._drain_gen += 1  # the task waiting for the old linger finds itself stale
            self._lingering = False
            self._draining = False
            self._schedule()

    def expedite(self) -> None:
        """Drain now what waits for its linger (closing, or an admin change waiting on it)."""
        with self._cond:
            if self._lingering:
                self._lingering = False
                self._drain_gen += 1  # the delayed task finds itself stale
                commit_pool().submit(self._drain, self._drain_gen)

    # -- submitting side (any thread) ------------------------------------------------------

    def submit(self, item: T, nbytes: int, token: Any) -> None:
        """Queue ``item`` for the next commit; ``token`` comes back through ``notify``."""
        with self._cond:
            if self._closed:
                raise WriterClosedError(self.path)
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(_Submission(item, nbytes, token))
            self._pending_bytes += nbytes
            self._submitted += 1
            self._schedule()
            if self._lingering and self._pending_bytes >= min(
                self._commit_max_bytes, LINGER_MAX_BYTES
            ):
                # Enough for a commit of its own: lingering longer only holds memory.
                self._lingering = False
                self._drain_gen += 1
                commit_pool().submit(self._drain, self._drain_gen)

    def wait_settled(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything submitted before this call is committed (or failed); False
        on timeout. Blocking: call it from a thread."""
        with self._cond:
            target = self._submitted
        self.expedite()
        with self._cond:
            return self._cond.wait_for(lambda: self._settled >= target, timeout_s)

    def exclusive(self) -> threading.Lock:
        """A lock that, while held, keeps this writer from committing."""
        return self._commit_lock

    def request_reopen(self) -> None:
        """Reopen the table handle before the next commit (called after a new checkpoint).

        A long-lived handle's commit time grows with the log it has replayed (measured: 5 ms
        right after a checkpoint, 40 ms 300 commits later); a handle opened from a fresh
        checkpoint starts short again.
        """
        self._reopen_requested = True

    def refusal(self) -> TableRefusedError | None:
        """Why this table takes no appends (a feature deltaq cannot keep working with), or
        None. A refused table is judged again every REJUDGE_REFUSED_S."""
        appender = self._appender
        if not isinstance(appender, RefusedAppender):
            return None
        now = time.monotonic()
        if now - self._judged_at >= REJUDGE_REFUSED_S:
            self._judged_at = now
            with self._commit_lock:
                self._appender = appender_for(self.path, allow_fast=self._fast_appends)
            appender = self._appender
        return appender.refusal if isinstance(appender, RefusedAppender) else None

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is pending, then stop; later submits raise WriterClosedError."""
        with self._cond:
            self._closed = True
            self._schedule()
        self.expedite()
        with self._cond:
            self._cond.wait_for(lambda: not self._draining, timeout_s)
        self._appender.close()

    async def aclose(self) -> None:
        """``close`` from the event loop: the join happens in a thread, not on the loop."""
        await asyncio.to_thread(self.close)

    # -- the commit thread ----------------------------------------------------------------

    def _drain(self, gen: int = 0) -> None:
        """A pool task: one commit of what is pending; if more came meanwhile, the next
        commit goes to the back of the pool's queue (busy tables take turns)."""
        with self._cond:
            if gen != self._drain_gen:
                return  # expedited: another task drains instead
            self._lingering = False
            self._drain_started = time.monotonic()
            batch = self._take_batch()
        taken = len(batch)
        started = time.perf_counter()
        for attempt in itertools.count():
            error = self._commit_batch(batch)
            if error is None or batch == [] or not self._must_land([s.item for s in batch]):
                break
            if isinstance(error, ConstraintViolation) or self._closed:
                # Never committable, or the process stops: what was acknowledged stays in
                # the node journal (recovered at the next start) unless the table refuses it.
                break
            # Acknowledged already (journaled): retried in order, nothing after it commits first.
            time.sleep(min(_RETRY_MAX_S, 0.1 * 2**attempt))
        elapsed = time.perf_counter() - started
        self.commit_seconds.append(elapsed)
        if self._histogram is not None:
            self._histogram.observe(elapsed)
        if batch:
            if error is not None:
                self._dropped([s.item for s in batch])
            self._notify([s.token for s in batch], error)
        with self._cond:
            self._settled += taken
            self._draining = False
            self._schedule()
            self._cond.notify_all()

    def _commit_batch(self, batch: list[_Submission[T]]) -> BaseException | None:
        """Commit ``batch``; the error if it failed. A batch one of whose submissions broke a
        constraint is committed one submission at a time (each notified) and emptied."""
        try:
            with self._commit_lock:
                self._commit([s.item for s in batch])
        except ConstraintViolation as exc:
            if len(batch) == 1:
                return exc
            # One submission's rows broke a constraint of the table: the others must not
            # fail with it. Each is committed alone.
            self._commit_one_by_one(batch)
            batch.clear()
        except TableRefusedError as exc:
            return exc
        except BaseException as exc:  # reported to every submitter of the batch
            cause = storage_cause(exc)
            if cause is None:
                log.exception("commit to %s failed (%d submissions)", self.path, len(batch))
            else:
                STORAGE.failed(cause)  # one line per episode, not one per retry
            return exc
        STORAGE.succeeded()
        return None

    def _dropped(self, items: list[T]) -> None:
        """``items`` will not be committed (their commit failed; submitters were told)."""

    def _must_land(self, items: list[T]) -> bool:
        """Whether a failed commit of ``items`` is retried: they were acknowledged before it."""
        return False

    def _commit_one_by_one(self, batch: list[_Submission[T]]) -> None:
        for submission in batch:
            error: BaseException | None = None
            try:
                with self._commit_lock:
                    self._commit([submission.item])
            except BaseException as exc:
                error = exc
                self._dropped([submission.item])
            self._notify([submission.token], error)

    def _take_batch(self) -> list[_Submission[T]]:
        taken = 0
        size = 0
        for submission in self._pending:
            if taken and size + submission.nbytes > self._commit_max_bytes:
                break
            taken += 1
            size += submission.nbytes
        batch = self._pending[:taken]
        del self._pending[:taken]
        self._pending_bytes -= size
        return batch

    def _append(self, table: pa.Table, txn: Transaction | None = None) -> int:
        """Commit ``table`` as one version (holding the commit lock); return the version."""
        if self._reopen_requested:
            self._reopen_requested = False
            self._appender.reopen()
        try:
            self._appender, version = append_or_fall_back(self._appender, self.path, table, txn)
        except TableRefusedError as exc:
            # Later appends are refused at once, without touching the table.
            if not isinstance(self._appender, RefusedAppender):
                self._appender.close()
                self._appender = RefusedAppender(self.path, exc.feature)
                self._judged_at = time.monotonic()
            raise
        return version

    @abstractmethod
    def _commit(self, batch: list[T]) -> None:
        """Write one batch as one commit (holding the commit lock); raise if it failed."""
