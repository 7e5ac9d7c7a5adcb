"""One API process per warehouse: an exclusive lock held for the process's life.

A channel's memory is the fold of its ledger, and only one writer may fold it: two API
processes serving one warehouse would each lease the same ready message to a consumer. The
API therefore takes an exclusive ``flock`` on ``<warehouse>/_deltaq/api.lock`` before it opens
anything. The kernel drops the lock when the process ends, however it ends (``kill -9``
included), so there is nothing stale to clean up. The file names the holder, for the message
a second process prints.

Object-store warehouses have no such lock: there the exclusivity is not enforced (see the
README's limits).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

LOCK_DIR = "_deltaq"
LOCK_FILE = "api.lock"


class WarehouseBusyError(RuntimeError):
    """Another API process serves this warehouse."""


class WarehouseLock:
    """Held from ``acquire`` to ``release`` (or the process's end)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(os.path.abspath(root), LOCK_DIR, LOCK_FILE)
        self._fd: int | None = None

    @property
    def enforced(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")

    def acquire(self) -> None:
        if not self.enforced:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _read_holder(fd)
            os.close(fd)
            raise WarehouseBusyError(
                f"warehouse {self.root} is already served by another deltaq API ({who}); "
                "one API process per warehouse: stop it, or use another --warehouse"
            ) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(holder["since"])))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError, OSError):
        return "holder unknown"
