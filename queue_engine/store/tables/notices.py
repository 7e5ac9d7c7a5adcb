"""Which channels changed: notes the fanout and the sweep leave for the API nodes.

Channel tables are appended by the fanout and ledgers by the sweep, both in other processes.
Instead of every node probing every channel's table (ten thousand channels: thousands of file
checks a second while idle, or thousands of LIST requests on an object store), each of those
writers keeps one small object, ``_deltaq/notices/<writer>.json``, naming the channels it
wrote in its last batches. A node reads that object when it changed (one stat, or one HEAD on
an object store, per poll) and looks at those channels only.

The API nodes post the same way which topics they committed to (``api-<lane>.json``, each
named as ``(topic, "")``), for the fanout: over ten thousand topics it probes only those and a
slice of the rest per micro-batch instead of every topic's log.

Notices are hints, never data: the object is overwritten in place (a plain PUT, a rename on
local disk), a writer that fails to post one only logs it, and a node still looks at every
channel now and then, so a lost notice costs latency, never a message.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from queue_engine.store.storage.object_store import (
    list_objects,
    read_whole,
    replace_whole,
    store_and_key,
)
from queue_engine.store.storage.paths import is_remote

log = logging.getLogger(__name__)

NOTICES_DIR = "_deltaq/notices"
# Writers whose notices a node follows.
WRITERS = ("fanout", "sweep")
# A notice object names at most this many batches and channels: a node further behind than
# that (or reading a writer that restarted) looks at every channel once.
KEEP_BATCHES = 64
KEEP_CHANNELS = 20_000

Channel = tuple[str, str]


# The API nodes' topic notices: ``api-<lane>`` (``api`` for a node without lanes).
TOPIC_WRITER_PREFIX = "api"


def notice_url(root: str, writer: str) -> str:
    return f"{root.rstrip('/')}/{NOTICES_DIR}/{writer}.json"


def topic_notice_writer(lane: int | None) -> str:
    return TOPIC_WRITER_PREFIX if lane is None else f"{TOPIC_WRITER_PREFIX}-{lane}"


def topic_notice_writers(root: str) -> list[str]:
    """The API nodes that posted topic notices in the warehouse at ``root``."""
    directory = f"{root.rstrip('/')}/{NOTICES_DIR}"
    if is_remote(root):
        names = list_objects(directory)
    else:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
    return sorted(
        name[: -len(".json")]
        for name in names
        if name.endswith(".json")
        and (name == f"{TOPIC_WRITER_PREFIX}.json" or name.startswith(f"{TOPIC_WRITER_PREFIX}-"))
    )


class NoticeWriter:
    """Posts, after each batch a writer committed, the channels that batch wrote.

    One writer of a kind at a time (one fanout, one sweep per warehouse): a new one continues
    the numbering of the notice it finds, so a sweep run from cron every minute is followed
    like a long-running one.
    """

    def __init__(
        self,
        root: str,
        writer: str,
        keep_batches: int = KEEP_BATCHES,
        keep_channels: int = KEEP_CHANNELS,
    ) -> None:
        self.url = notice_url(root, writer)
        self._poster: ThreadPoolExecutor | None = None
        self.keep_batches = keep_batches
        self.keep_channels = keep_channels
        self.run = uuid.uuid4().hex
        self.seq = 0
        self._recent: deque[tuple[int, list[Channel]]] = deque()
        try:
            body = read_whole(self.url)
            if body is not None:
                notice = json.loads(body)
                self.run, self.seq = str(notice["run"]), int(notice["seq"])
                for seq, chans in notice["batches"]:
                    self._recent.append((int(seq), [(t, c) for t, c in chans]))
        except Exception as exc:
            # Readers see a new run and look at every channel once.
            log.warning("%s: previous notice not read, starting a new one: %s", self.url, exc)
        self._count = sum(len(chans) for _, chans in self._recent)

    def post_soon(self, channels: Iterable[Channel]) -> None:
        """``post`` on this writer's own thread, in order, off the caller's path."""
        batch = list(channels)
        if batch:
            if self._poster is None:
                self._poster = ThreadPoolExecutor(1, thread_name_prefix="deltaq-notices")
            self._poster.submit(self.post, batch)

    def post(self, channels: Iterable[Channel]) -> None:
        """Publish the channels one batch wrote (after its commits). Never raises."""
        batch = sorted(set(channels))
        if not batch:
            return
        self.seq += 1
        self._recent.append((self.seq, batch))
        self._count += len(batch)
        while len(self._recent) > 1 and (
            len(self._recent) > self.keep_batches or self._count > self.keep_channels
        ):
            self._count -= len(self._recent.popleft()[1])
        body = json.dumps(
            {
                "run": self.run,
                "seq": self.seq,
                "batches": [[seq, [list(c) for c in chans]] for seq, chans in self._recent],
            },
            separators=(",", ":"),
        ).encode()
        try:
            replace_whole(self.url, body)
        except Exception as exc:
            log.warning("%s: notice not posted (nodes find the change later): %s", self.url, exc)


class NoticeReader:
    """Follows the notices of ``writers``: ``changes()`` says which channels changed since
    the previous call, or None for "any channel may have changed" (first call, a writer that
    restarted or ran further ahead than its notice keeps)."""

    def __init__(self, root: str, writers: Iterable[str] = WRITERS) -> None:
        self.root = root
        self._followed = [_Followed(notice_url(root, w)) for w in writers]
        self._first = True

    def follow(self, writers: Iterable[str]) -> None:
        """Follow these writers too (one new here makes the next ``changes()`` None)."""
        known = {f.url for f in self._followed}
        for writer in writers:
            url = notice_url(self.root, writer)
            if url not in known:
                self._followed.append(_Followed(url))
                known.add(url)

    def changes(self) -> set[Channel] | None:
        changed: set[Channel] = set()
        everything = self._first
        self._first = False
        for followed in self._followed:
            try:
                found = followed.changes()
            except Exception as exc:
                log.debug("%s: notice not read: %s", followed.url, exc)
                continue
            if found is None:
                everything = True
            else:
                changed |= found
        return None if everything else changed


@dataclass
class _Followed:
    url: str
    stamp: object = None
    run: str = ""
    seq: int = 0

    def changes(self) -> set[Channel] | None:
        stamp = _stamp(self.url)
        if stamp == self.stamp:
            return set()
        body = read_whole(self.url)
        self.stamp = stamp
        if body is None:
            return set()
        notice = json.loads(body)
        batches = [(int(seq), chans) for seq, chans in notice["batches"]]
        known_run, known_seq = self.run, self.seq
        self.run, self.seq = str(notice["run"]), int(notice["seq"])
        # known_run "": there was no notice when last looked, so this run's first is news.
        if known_run not in ("", self.run) or not batches or batches[0][0] > known_seq + 1:
            return None
        if known_run != self.run:
            known_seq = 0
        return {(t, c) for seq, chans in batches if seq > known_seq for t, c in chans}


def _stamp(url: str) -> object:
    """What changes whenever the object is replaced (None: there is none)."""
    if is_remote(url):
        import obstore

        store, key = store_and_key(url)
        try:
            return obstore.head(store, key)["e_tag"]
        except FileNotFoundError:
            return None
    try:
        st = os.stat(url)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
