"""Group commit: one thread and one open Delta handle per topic table.

Publishes that arrive while a commit is running wait in ``pending`` and all go into the next
commit, so the number of messages per commit grows with the load and throughput is not bounded
by commit latency. A commit is one Delta version: all of a batch's messages are in it or none.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from queue_engine.message import IdAllocator, id_from_hex
from queue_engine.store.append import (
    Appender,
    DeltaRsAppender,
    ProtocolChangedError,
    appender_for,
)
from queue_engine.store.ids import hex_id_array
from queue_engine.store.tables import TOPIC_SCHEMA, open_or_create

log = logging.getLogger(__name__)

_TS = pa.timestamp("us", tz="UTC")

# Called once per commit with the tokens of the publishes it carried and None, or the error
# that made the commit fail (then none of those messages is in the table).
Notify = Callable[[list[Any], BaseException | None], None]


@dataclass
class _Publish:
    bodies: list[bytes]
    nbytes: int
    published_at_us: int
    deliver_at_us: int | None
    token: Any


class WriterClosedError(RuntimeError):
    """The writer was closed (topic deleted or process stopping) before the commit."""


@dataclass(frozen=True)
class CommitStats:
    version: int
    message_count: int
    commits: int
    committed_messages: int
    committed_bytes: int


class TopicWriter:
    """Appends published messages to one topic table, many publishes per Delta commit."""

    def __init__(
        self,
        path: str,
        notify: Notify,
        *,
        commit_max_bytes: int,
        fast_appends: bool = True,
        name: str = "",
    ) -> None:
        self.path = path
        self._notify = notify
        self._commit_max_bytes = commit_max_bytes
        dt = open_or_create(path, TOPIC_SCHEMA)
        floor, count = _scan(dt)
        self._appender: Appender = appender_for(path, allow_fast=fast_appends)
        self._ids = IdAllocator(floor)
        self._reopen_requested = False
        # Durations of the latest commits, for /stats and benchmarks.
        self.commit_seconds: deque[float] = deque(maxlen=1000)
        self._cond = threading.Condition()
        # Held for each commit; exclusive() holds it to act between two commits.
        self._commit_lock = threading.Lock()
        self._pending: list[_Publish] = []
        self._pending_bytes = 0
        self._closed = False
        self._version = dt.version()
        self._message_count = count
        self._commits = 0
        self._committed_messages = 0
        self._committed_bytes = 0
        self._thread = threading.Thread(
            target=self._run, name=f"deltaq-writer-{name or path}", daemon=True
        )
        self._thread.start()

    # -- producer side (any thread) -------------------------------------------------------

    def submit(
        self,
        bodies: list[bytes],
        published_at_us: int,
        deliver_at_us: int | None,
        token: Any,
    ) -> None:
        """Queue messages for the next commit; ``token`` comes back through ``notify``."""
        nbytes = sum(map(len, bodies))
        with self._cond:
            if self._closed:
                raise WriterClosedError(self.path)
            self._pending.append(_Publish(bodies, nbytes, published_at_us, deliver_at_us, token))
            self._pending_bytes += nbytes
            self._cond.notify()

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

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def stats(self) -> CommitStats:
        with self._cond:
            return CommitStats(
                self._version,
                self._message_count,
                self._commits,
                self._committed_messages,
                self._committed_bytes,
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is pending, then stop; later submits raise WriterClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # -- the commit thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                batch = self._take_batch()
            error: BaseException | None = None
            started = time.perf_counter()
            try:
                with self._commit_lock:
                    self._commit(batch)
            except BaseException as exc:  # reported to every publisher of the batch
                log.exception("commit to %s failed (%d publishes)", self.path, len(batch))
                error = exc
            self.commit_seconds.append(time.perf_counter() - started)
            self._notify([p.token for p in batch], error)

    def _take_batch(self) -> list[_Publish]:
        taken = 0
        size = 0
        for publish in self._pending:
            if taken and size + publish.nbytes > self._commit_max_bytes:
                break
            taken += 1
            size += publish.nbytes
        batch = self._pending[:taken]
        del self._pending[:taken]
        self._pending_bytes -= size
        return batch

    def _commit(self, batch: list[_Publish]) -> None:
        count = sum(len(p.bodies) for p in batch)
        first = self._ids.allocate(count, time.time_ns() // 1_000_000)
        table = _to_arrow(batch, first, count)
        if self._reopen_requested:
            self._reopen_requested = False
            self._appender.reopen()
        try:
            version = self._appender.append(table)
        except ProtocolChangedError:
            log.warning("%s changed protocol or metadata; appending through delta-rs", self.path)
            self._appender = DeltaRsAppender(self.path)
            version = self._appender.append(table)
        nbytes = sum(p.nbytes for p in batch)
        with self._cond:
            self._version = max(self._version, version)
            self._message_count += count
            self._commits += 1
            self._committed_messages += count
            self._committed_bytes += nbytes


def _to_arrow(batch: list[_Publish], first_id: int, count: int) -> pa.Table:
    bodies = pa.array(
        list(itertools.chain.from_iterable(p.bodies for p in batch)), type=pa.binary()
    )
    per_publish = np.fromiter((len(p.bodies) for p in batch), dtype=np.int64, count=len(batch))
    published = np.repeat(
        np.fromiter((p.published_at_us for p in batch), dtype=np.int64, count=len(batch)),
        per_publish,
    )
    if all(p.deliver_at_us is None for p in batch):
        deliver = pa.nulls(count, type=_TS)
    else:
        values = np.repeat(
            np.fromiter((p.deliver_at_us or 0 for p in batch), dtype=np.int64, count=len(batch)),
            per_publish,
        )
        missing = np.repeat(
            np.fromiter((p.deliver_at_us is None for p in batch), dtype=bool, count=len(batch)),
            per_publish,
        )
        deliver = pa.array(values, type=_TS, mask=missing)
    return pa.Table.from_arrays(
        [hex_id_array(first_id, count), bodies, pa.array(published, type=_TS), deliver],
        schema=TOPIC_SCHEMA,
    )


def _scan(dt: DeltaTable) -> tuple[int, int]:
    """(one past the largest message id, number of messages) from the table's file stats."""
    actions = pa.table(dt.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return 0, 0
    count = int(pc.sum(actions["num_records"]).as_py() or 0)
    largest = pc.max(actions["max.id"]).as_py() if "max.id" in actions.column_names else None
    return (id_from_hex(largest) + 1 if largest else 0), count
