"""The node journal: every publish a node takes, durable before it is acknowledged.

One append-only journal per process (``_deltaq/journal/<token>/`` under the warehouse, so any
node can recover it), whatever the topic. Publishes that arrive while a write is under way go
into the next one (group commit): on local disk one ``write`` + ``fdatasync`` of a segment
file; on an object store one object per write (a write takes one PUT, ~20 ms: the window).

Local segments are written into files filled with zeros ahead of time (``_prepare_segment``):
a write then lands on blocks the file already has, and its ``fdatasync`` has only the data to
flush, no new size or block allocation (measured on ext4: 91 against 162 us for a 2.4 KB
write). A segment's written part ends where its zeros begin (no frame's header is all zeros).

Once durable, each publish is acknowledged and handed to its topic's writer; the topic's
commit records the journal's app transaction (``deltaq-journal-<token>``, version = the
newest position it carries), so a journal drained twice (a crash between a topic commit and
the journal's truncation) never adds a row twice.

Positions are microseconds of the wall clock, forced to increase: a journal's app transaction
only ever grows.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from queue_engine.errors import storage_cause
from queue_engine.headers import Headers
from queue_engine.storage_health import STORAGE
from queue_engine.store.journal.records import Record, decode, encode
from queue_engine.store.storage.files import delete_tree
from queue_engine.store.storage.fs_sync import sync_directory
from queue_engine.store.storage.object_store import (
    delete_objects,
    list_objects,
    put_objects,
    read_objects,
)
from queue_engine.store.storage.paths import is_remote

log = logging.getLogger(__name__)

JOURNAL_DIR = "_deltaq/journal"
# A local segment is closed and a new one started past this size (by default); closed
# segments whose publishes are all in their topics' tables are deleted.
SEGMENT_BYTES = 16 * 1024 * 1024
# The file the next local segment is written into, filled with zeros ahead of time.
PREPARED_NAME = "next.zeros"
_ZEROS = 1 << 20
# Journal writes (PUTs) under way at once on an object store.
REMOTE_IN_FLIGHT = 4
# How often drained objects of a journal on an object store are deleted (one bulk request).
REMOTE_TRUNCATE_S = 1.0

# Called from the journal's thread once a write is durable (error None) or failed: the
# records written, and the tokens of their publishers.
Durable = Callable[[list[Record], list[Any], BaseException | None], None]


class JournalClosedError(RuntimeError):
    """The journal stopped (the node is stopping) before the publish was written."""


def app_id(token: str) -> str:
    """The Delta app transaction id under which a journal's publishes are committed."""
    return f"deltaq-journal-{token}"


def journal_root(warehouse: str) -> str:
    return f"{warehouse.rstrip('/')}/{JOURNAL_DIR}"


@dataclass
class _Write:
    records: list[Record]
    tokens: list[Any]
    future: Future[None]


def _object_name(first: int, last: int) -> str:
    return f"{first:020d}-{last:020d}.jrn"


def _unlink_drained(directory: str, paths: list[str]) -> None:
    # Every topic commit that drained these segments was synced before it was reported
    # (fs_sync): deleting them can no longer outlive those commits in a power cut.
    try:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    except OSError:
        # Left for recovery: a drained segment left behind costs a re-read, never a duplicate.
        log.warning("truncating the journal %s failed", directory, exc_info=True)


def _prepare_segment(path: str, size: int) -> None:
    """Fill ``path`` with ``size`` zero bytes, on disk. Whatever a crash leaves of it reads as
    zeros (written or not yet): a file taken before this ended is still a correct segment."""
    zeros = bytes(min(size, _ZEROS))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, zeros[: min(left, len(zeros))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete_quietly(urls: list[str]) -> None:
    try:
        delete_objects(urls)
    except Exception:
        log.warning("deleting %d drained journal objects failed", len(urls), exc_info=True)


@dataclass
class _Segment:
    name: str
    first: int
    last: int


class Journal:
    """One process's journal (``token``: the process's node token)."""

    def __init__(
        self,
        warehouse: str,
        token: str,
        on_durable: Durable,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self.token = token
        self._segment_bytes = segment_bytes
        self.app_id = app_id(token)
        self.path = f"{journal_root(warehouse)}/{token}"
        self._remote = is_remote(warehouse)
        self._on_durable = on_durable
        self._cond = threading.Condition()
        self._pending: list[tuple[Record, bytes, Any]] = []
        self._position = 0
        # The newest position whose write has been handed on (on_durable returned); its own
        # condition, so that append's notify() always wakes the journal's thread.
        self._handed_on = 0
        self._handoff = threading.Condition()
        self._closed = False
        self._writing = False
        # Positions written but not yet in their topic's table (a heap, and what left it).
        self._undrained: list[int] = []
        self._drained: set[int] = set()
        self._segments: list[_Segment] = []
        self._fd: int | None = None
        self._size = 0
        self._truncated_at = 0.0
        # On an object store writes overlap (each is a PUT of tens of ms); their publishes are
        # still handed on in order.
        self._max_in_flight = REMOTE_IN_FLIGHT if self._remote else 1
        self._puts = (
            ThreadPoolExecutor(REMOTE_IN_FLIGHT + 1, thread_name_prefix="deltaq-journal-put")
            if self._remote
            else None
        )
        # Deletes drained local segments (their topic commits were synced as they were made).
        self._unlinker = ThreadPoolExecutor(1, thread_name_prefix="deltaq-journal-truncate")
        # Fills the next local segment's file with zeros while the current one takes writes.
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="deltaq-journal-prepare")
        self._prepared: Future[None] | None = None
        if not self._remote:
            os.makedirs(self.path, exist_ok=True)
            # The journal's directory and the ones above it, up to the warehouse: a segment's
            # name is durable only once every directory on its path is.
            sync_directory(os.path.dirname(self.path))
            sync_directory(os.path.dirname(os.path.dirname(self.path)))
            self._prepare_next()
        self._thread = threading.Thread(target=self._run, name="deltaq-journal", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------

    def append(
        self,
        topic: str,
        bodies: list[bytes],
        published_at_us: int,
        deliver_at_us: int | None,
        expires_at_us: int | None,
        token: Any,
        headers: list[Headers | None] | None = None,
        checked: Any = None,
    ) -> None:
        """Queue a publish for the next write; ``token`` comes back through ``on_durable``;
        ``checked``: handed on with the record, never written."""
        with self._cond:
            if self._closed:
                raise JournalClosedError(self.path)
            self._position = max(self._position + 1, time.time_ns() // 1000)
            record = Record(
                self._position,
                topic,
                published_at_us,
                deliver_at_us,
                expires_at_us,
                bodies,
                headers,
                checked,
            )
            self._pending.append((record, encode(record), token))
            self._cond.notify()

    def drained(self, positions: list[int]) -> None:
        """These positions are in their topics' tables (or their topic is gone)."""
        with self._cond:
            self._drained.update(positions)

    def wait_handed_on(self, timeout_s: float = 30.0) -> bool:
        """Wait until every publish appended before this call has been handed on through
        ``on_durable`` (acknowledged or failed); False on timeout. Its answer
        goes out before its hand-off, so an admin change that follows an acknowledged
        publish waits here before it asks the topic's writer what it holds. Blocking."""
        with self._cond:
            target = self._position
        with self._handoff:
            return self._handoff.wait_for(lambda: self._handed_on >= target, timeout_s)

    @property
    def undrained(self) -> int:
        with self._cond:
            return len(self._undrained) - len(self._drained)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop taking publishes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def remove_if_drained(self) -> bool:
        """After ``close`` and the topic writers' last commits: the journal is removed if
        every publish it holds is in its table (else the next start recovers it)."""
        with self._cond:
            self._watermark()
            if self._undrained:
                log.warning(
                    "journal %s keeps %d publishes not yet in their tables",
                    self.path,
                    len(self._undrained),
                )
                return False
        self._unlinker.shutdown(wait=True)
        self._preparer.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        delete_tree(self.path)
        return True

    # -- the journal's thread ---------------------------------------------------------------

    def _run(self) -> None:
        """Take what is pending as one write, at most ``_max_in_flight`` at once (on an object
        store PUTs overlap; on local disk one write + fdatasync at a time); hand writes on
        in the order they were taken, whatever order they end in."""
        in_flight: collections.deque[_Write] = collections.deque()
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        (bool(self._pending) and len(in_flight) < self._max_in_flight)
                        or (bool(in_flight) and in_flight[0].future.done())
                        or (self._closed and not in_flight)
                    ),
                    timeout=1.0,
                )
                batch: list[tuple[Record, bytes, Any]] = []
                if len(in_flight) < self._max_in_flight:
                    batch, self._pending = self._pending, []
                stop = self._closed and not self._pending
            if batch:
                in_flight.append(self._start_write(batch))
            while in_flight and in_flight[0].future.done():
                self._finish_write(in_flight.popleft())
            if not batch and not in_flight:
                if stop:
                    if self._puts is not None:
                        self._puts.shutdown(wait=True)
                    return
                self._truncate()

    def _start_write(self, batch: list[tuple[Record, bytes, Any]]) -> _Write:
        records = [r for r, _, _ in batch]
        data = b"".join(frame for _, frame, _ in batch)
        write = _Write(records, [t for _, _, t in batch], Future())
        if self._puts is not None:
            write.future = self._puts.submit(self._put, records, data)
            write.future.add_done_callback(self._wake)
            return write
        try:
            self._write_local(records, data)
            write.future.set_result(None)
        except BaseException as exc:  # reported to every publisher of the write
            write.future.set_exception(exc)
        return write

    def _wake(self, _: Future[None]) -> None:
        with self._cond:
            self._cond.notify_all()

    def _finish_write(self, write: _Write) -> None:
        records = write.records
        error = write.future.exception()
        if error is not None:
            cause = storage_cause(error)
            if cause is None:
                log.error("writing %d publishes to the journal failed: %s", len(records), error)
            else:
                STORAGE.failed(cause)  # one line per episode
        else:
            STORAGE.succeeded()
            if self._remote:
                first, last = records[0].position, records[-1].position
                self._segments.append(_Segment(_object_name(first, last), first, last))
            with self._cond:
                for record in records:
                    heapq.heappush(self._undrained, record.position)
        try:
            self._on_durable(records, write.tokens, error)
        except Exception:
            log.exception("handing %d journaled publishes on failed", len(records))
        with self._handoff:
            self._handed_on = records[-1].position
            self._handoff.notify_all()
        self._truncate()

    def _put(self, records: list[Record], data: bytes) -> None:
        name = _object_name(records[0].position, records[-1].position)
        put_objects([(f"{self.path}/{name}", data)])

    def _write_local(self, records: list[Record], data: bytes) -> None:
        first, last = records[0].position, records[-1].position
        if self._fd is None or self._size >= self._segment_bytes:
            self._roll(first)
        assert self._fd is not None
        view = memoryview(data)
        at = self._size
        while view:
            written = os.pwrite(self._fd, view, at)
            view = view[written:]
            at += written
        os.fdatasync(self._fd)
        self._size = at
        self._segments[-1].last = last

    def _prepare_next(self) -> None:
        self._prepared = self._preparer.submit(
            _prepare_segment, os.path.join(self.path, PREPARED_NAME), self._segment_bytes
        )

    def _roll(self, first: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        name = f"{first:020d}.log"
        path = os.path.join(self.path, name)
        prepared = self._prepared
        assert prepared is not None  # a local journal prepares from its start
        if not self._segments:
            # The first segment waits for its zeros (once, tens of ms); later ones never do.
            with contextlib.suppress(Exception):
                prepared.result()
        if prepared.done():
            if prepared.exception() is None:
                # Zeros on disk already: writes to this segment allocate nothing.
                try:
                    os.rename(os.path.join(self.path, PREPARED_NAME), path)
                except OSError:
                    log.warning("the journal's prepared segment is gone; writing a new file")
            self._prepare_next()
        # Otherwise (still being filled, or preparing failed) this segment is a file that grows
        # with each write; the next roll takes the prepared one.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        # The new file's directory entry must survive a power loss too.
        sync_directory(self.path)
        self._size = 0
        self._segments.append(_Segment(name, first, first))

    def _watermark(self) -> int:
        """With ``_cond`` held: positions below this are all drained."""
        while self._undrained and self._undrained[0] in self._drained:
            self._drained.discard(heapq.heappop(self._undrained))
        return self._undrained[0] if self._undrained else self._position + 1

    def _truncate(self) -> None:
        """Delete the segments (objects) whose publishes are all drained; the local segment
        being written to stays. (Outside ``_cond``: publishers never wait on this I/O.)"""
        with self._cond:
            mark = self._watermark()
        keep = 0 if self._remote else 1
        done = [s for s in self._segments[: len(self._segments) - keep] if s.last < mark]
        if not done:
            return
        try:
            if self._remote:
                if time.monotonic() - self._truncated_at < REMOTE_TRUNCATE_S:
                    return
                self._truncated_at = time.monotonic()
                assert self._puts is not None
                # Beside the PUTs, not in their way; objects a failed delete leaves are read
                # again at recovery and skipped there (their publishes are committed).
                self._puts.submit(_delete_quietly, [f"{self.path}/{s.name}" for s in done])
            else:
                # Off this thread (acknowledgements wait for it): the commits holding these
                # publishes are made durable, then the segments go.
                self._unlinker.submit(
                    _unlink_drained, self.path, [os.path.join(self.path, s.name) for s in done]
                )
        except Exception:
            # Kept for the next pass: a drained segment left behind costs a re-read at recovery.
            log.warning("truncating the journal %s failed (retried)", self.path, exc_info=True)
            return
        gone = {id(s) for s in done}
        self._segments = [s for s in self._segments if id(s) not in gone]


# -- recovery ---------------------------------------------------------------------------


def journal_tokens(warehouse: str) -> list[str]:
    """The tokens of every journal under the warehouse (live processes' and dead ones')."""
    root = journal_root(warehouse)
    if is_remote(warehouse):
        return sorted({key.split("/", 1)[0] for key in list_objects(root) if "/" in key})
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir())
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Recovered:
    records: list[Record]
    # One line per torn or corrupt frame met (what follows it in that file is not read).
    torn: list[str]


def read_journal(warehouse: str, token: str) -> Recovered:
    """Every whole record of a journal, in position order."""
    path = f"{journal_root(warehouse)}/{token}"
    records: list[Record] = []
    torn: list[str] = []
    if is_remote(warehouse):
        names = [n for n in list_objects(path) if n.endswith(".jrn")]
        blobs = read_objects([f"{path}/{n}" for n in names])
        files = [(n, b) for n, b in zip(names, blobs, strict=True) if b is not None]
    else:
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(".log"))
        except FileNotFoundError:
            names = []
        files = []
        for name in names:
            with open(os.path.join(path, name), "rb") as f:
                files.append((name, f.read()))
    for name, data in files:
        decoded = decode(data)
        records.extend(decoded.records)
        if decoded.torn is not None:
            torn.append(f"{path}/{name}: {decoded.torn}")
    records.sort(key=lambda r: r.position)
    return Recovered(records, torn)


def remove_journal(warehouse: str, token: str) -> None:
    delete_tree(f"{journal_root(warehouse)}/{token}")
