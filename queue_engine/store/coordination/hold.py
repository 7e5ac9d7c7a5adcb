"""An exclusive hold on a name in a warehouse, for as long as a process keeps it.

On local disk an exclusive ``flock`` on ``<path>.lock`` (the kernel drops it when the process
ends, however it ends, ``kill -9`` included), the holder's record written into the file; on an
object store a ``StoreLock`` on ``<path>.json`` (renewed while held; a killed holder's lapses
after ``lease_s``). API nodes hold their lanes this way, the fanout and the sweep their jobs.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

from queue_engine.store.coordination.store_lock import StoreLock
from queue_engine.store.storage.paths import is_remote


def hold_url(path: str) -> str:
    """Where the hold on ``path`` (a warehouse path without suffix) is kept."""
    return f"{path}.json" if is_remote(path) else f"{os.path.abspath(path)}.lock"


class Hold:
    """The hold on ``path`` for ``holder`` (a JSON-able record of who holds it)."""

    def __init__(
        self,
        path: str,
        holder: dict[str, Any],
        *,
        lease_s: float,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.url = hold_url(path)
        self.holder = holder
        self.lease_s = lease_s
        self._on_lost = on_lost
        self._fd: int | None = None
        self._lease: StoreLock | None = None

    def try_take(self) -> bool:
        """Take the hold if nobody has it; True when taken."""
        if is_remote(self.url):
            lease = StoreLock(self.url, self.holder, lease_s=self.lease_s, on_lost=self._on_lost)
            if not lease.try_acquire():
                return False
            self._lease = lease
            return True
        os.makedirs(os.path.dirname(self.url), exist_ok=True)
        fd = os.open(self.url, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.holder).encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None
