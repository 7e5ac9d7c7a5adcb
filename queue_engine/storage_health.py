"""Whether the warehouse's storage is refusing writes, and why (a full disk): one log line when
an episode starts and one when it ends, and the cause for /stats, /info and the console."""

from __future__ import annotations

import logging
import threading
import time

from queue_engine.errors import ErrorCode, QueueError, storage_cause

log = logging.getLogger(__name__)


class StorageHealth:
    """The current storage problem of this process's writes (None: writes succeed)."""

    def __init__(self, settle_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self.problem: str | None = None
        self.since_s: float | None = None
        self.refused = 0  # writes refused in the current episode
        self._failed_at = 0.0
        # An episode ends at a success this long after its last failure: on a disk that is
        # nearly full, small writes succeed between refused big ones.
        self._settle_s = settle_s

    def failed(self, cause: str) -> None:
        """A write failed for ``cause``: logged once per episode."""
        with self._lock:
            self.refused += 1
            self._failed_at = time.monotonic()
            if self.problem == cause:
                return
            self.problem, self.since_s, self.refused = cause, time.time(), 1
        log.error(
            "writes to the warehouse fail: %s; publishes and consumer answers get "
            "E_COMMIT_FAILED until it is fixed (nothing acknowledged is lost)",
            cause,
        )

    def succeeded(self) -> None:
        """A write succeeded: an episode, if any, is over."""
        if self.problem is None or time.monotonic() - self._failed_at < self._settle_s:
            return
        with self._lock:
            problem, refused = self.problem, self.refused
            self.problem, self.since_s, self.refused = None, None, 0
        if problem is not None:
            log.warning(
                "writes to the warehouse succeed again (%d refused while %s)", refused, problem
            )

    def health(self) -> str:
        """nsqd's health string: "OK", or "NOK - <why>" while writes fail."""
        problem = self.problem
        return "OK" if problem is None else f"NOK - {problem}"

    def report(self) -> dict[str, object]:
        """For /stats and /info: ``{"problem": ..., "since": unix s, "refused": n}``."""
        with self._lock:
            return {"problem": self.problem, "since": self.since_s, "refused": self.refused}


STORAGE = StorageHealth()


def commit_failed(error: BaseException) -> QueueError:
    """E_COMMIT_FAILED for a failed write, naming the cause where the storage says it (a full
    disk): the answer, the stats and the one log line per episode all say so."""
    cause = storage_cause(error)
    failed = QueueError(ErrorCode.E_COMMIT_FAILED, cause or str(error), cause=cause)
    if cause is not None:
        STORAGE.failed(cause)
    return failed
