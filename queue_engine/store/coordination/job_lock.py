"""One fanout and one sweep per warehouse: each holds its job's lock while it runs.

Two fanouts on one warehouse number their micro-batches each on its own, and a channel that
recorded batch N of one skips batch N of the other as a replay although it may hold other
rows: messages would be lost. Two sweeps fold the same ledgers into the same state tables
side by side. So a job takes its lock before it touches a table, and a second one waits a
little (a killed holder's lock may be about to lapse) and then refuses, naming the holder.

On a local warehouse the lock is an exclusive ``flock`` on ``_deltaq/jobs/<job>.lock`` (the
kernel drops it when the process ends, ``kill -9`` included); on an object store a
``StoreLock`` on ``_deltaq/jobs/<job>.json`` (a killed holder's lease lapses after
``store_lease_s``, which is how long a restarted job may wait).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from queue_engine.store.coordination.hold import Hold
from queue_engine.store.coordination.store_lock import describe
from queue_engine.store.storage.object_store import StoreError, read_whole
from queue_engine.store.storage.paths import is_remote

log = logging.getLogger(__name__)

JOBS_DIR = "_deltaq/jobs"
_POLL_S = 0.5


class JobBusyError(StoreError):
    """Another process runs this job on the warehouse."""


class JobLock:
    """The lock of job ``name`` (``fanout``, ``sweep``) on the warehouse at ``root``."""

    def __init__(self, root: str, name: str, *, lease_s: float) -> None:
        self.root = root.rstrip("/")
        self.name = name
        self.lease_s = lease_s
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self._hold = Hold(
            f"{self.root}/{JOBS_DIR}/{name}", holder, lease_s=lease_s, on_lost=self._lost
        )
        self.url = self._hold.url

    def acquire(self, wait_s: float | None = None) -> JobLock:
        """Take the lock, waiting up to ``wait_s``; ``JobBusyError`` if it stays held. By
        default a job on an object store waits a lease's length (a killed holder's lease
        lapses meanwhile); a local lock is held only by a live process, so no wait."""
        if wait_s is None:
            wait_s = self.lease_s + 5 if is_remote(self.root) else 0.0
        deadline = time.monotonic() + wait_s
        told = False
        while not self._hold.try_take():
            if time.monotonic() >= deadline:
                raise JobBusyError(
                    f"another {self.name} runs on warehouse {self.root} ({self._describe()}): "
                    f"run one {self.name} per warehouse"
                )
            if not told:
                log.info(
                    "%s: waiting for the %s that holds it (%s) to stop or lapse",
                    self.url,
                    self.name,
                    self._describe(),
                )
                told = True
            time.sleep(_POLL_S)
        return self

    def release(self) -> None:
        self._hold.release()

    def __enter__(self) -> JobLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _describe(self) -> str:
        try:
            body = read_whole(self.url)
            return describe(json.loads(body)) if body else "holder unknown"
        except Exception:
            return "holder unknown"

    def _lost(self) -> None:
        # Another process took the lease (this one could not renew it for a lease's length):
        # it runs the job now, so this one must stop before it writes again.
        log.critical("%s: the %s lock was taken over; exiting", self.url, self.name)
        os._exit(3)
