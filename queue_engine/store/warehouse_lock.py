"""One API process per warehouse: an exclusive lock held for the process's life.

A channel's memory is the fold of its ledger, and only one writer may fold it: two API
processes serving one warehouse would each lease the same ready message to a consumer. The
API therefore takes a lock on ``<warehouse>/_deltaq/api.lock`` before it opens anything.

On a local warehouse it is an exclusive ``flock``: the kernel drops it when the process ends,
however it ends (``kill -9`` included), so there is nothing stale to clean up.

On an object store it is a lease (``StoreLease``): the object names its holder and when the
lease ends; it is created put-if-absent, renewed every few seconds with a conditional write on
the version the holder last wrote (If-Match), and taken over by another API only once it has
lapsed *and* nobody renewed it meanwhile (a conditional write again, so of two starting APIs
one wins). An API that finds its lease taken stops serving; one that cannot reach the store
keeps retrying (it cannot commit a delivery either) and goes on if, once the store answers,
the lease is still the version it wrote. A restarted API
after a ``kill -9`` therefore waits for the old lease to lapse (``STORE_LEASE_S``). Wall
clocks of the hosts are compared: they must agree to within a few seconds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LOCK_DIR = "_deltaq"
LOCK_FILE = "api.lock"


class WarehouseBusyError(RuntimeError):
    """Another API process serves this warehouse."""


# How long an object-store lease lasts unrenewed, and how often its holder renews it.
STORE_LEASE_S = 15.0
STORE_RENEW_S = 5.0
_RETRY_S = 0.5


def _busy(root: str, who: str) -> WarehouseBusyError:
    return WarehouseBusyError(
        f"warehouse {root} is already served by another deltaq API ({who}); "
        "one API process per warehouse: stop it, or use another --warehouse"
    )


class WarehouseLock:
    """Held from ``acquire`` to ``release`` (or the process's end): a ``flock`` on a local
    warehouse, a ``StoreLease`` on an object store (``on_lost`` is told if it is lost)."""

    def __init__(
        self,
        root: str,
        on_lost: Callable[[], None] | None = None,
        lease_s: float = STORE_LEASE_S,
    ) -> None:
        self.root = root
        self.path = os.path.join(os.path.abspath(root), LOCK_DIR, LOCK_FILE)
        self._fd: int | None = None
        self._lease = (
            None
            if self.enforced
            else StoreLease(root, lease_s=lease_s, renew_s=lease_s / 3, on_lost=on_lost)
        )

    @property
    def enforced(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")

    def acquire(self) -> None:
        if self._lease is not None:
            self._lease.acquire()
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _read_holder(fd)
            os.close(fd)
            raise _busy(self.root, who) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        return _describe(json.loads(os.pread(fd, 4096, 0) or b"{}"))
    except (ValueError, OSError):
        return "holder unknown"


def _describe(holder: dict[str, Any]) -> str:
    try:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(holder["since"])))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


class StoreLease:
    """The object-store form of the warehouse lock (see the module's docstring)."""

    def __init__(
        self,
        root: str,
        *,
        lease_s: float = STORE_LEASE_S,
        renew_s: float = STORE_RENEW_S,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        from queue_engine.store.object_store import store_and_key

        self.root = root
        self.lease_s = lease_s
        self.renew_s = renew_s
        self._on_lost = on_lost
        self._store, self._key = store_and_key(f"{root.rstrip('/')}/{LOCK_DIR}/{LOCK_FILE}")
        self._holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "token": uuid.uuid4().hex,
        }
        self._e_tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**self._holder, "expires_at": time.time() + self.lease_s}).encode()

    def acquire(self) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

        try:
            self._e_tag = obstore.put(self._store, self._key, self._body(), mode="create")["e_tag"]
        except AlreadyExistsError:
            try:
                current = obstore.get(self._store, self._key)
            except NotFoundError:  # released between the two calls: try once more
                self._e_tag = obstore.put(self._store, self._key, self._body(), mode="create")[
                    "e_tag"
                ]
            else:
                self._take_over(current.meta["e_tag"], json.loads(bytes(current.bytes())))
        except PreconditionError:
            raise _busy(self.root, "holder unknown") from None
        self._thread = threading.Thread(target=self._renew, name="warehouse-lease", daemon=True)
        self._thread.start()

    def _take_over(self, e_tag: str | None, holder: dict[str, Any]) -> None:
        """The lease exists: wait for it to lapse, then take it if nobody renewed it."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

        # A holder whose clock runs far ahead cannot keep a restarted API out for long.
        wait = min(float(holder.get("expires_at", 0)) - time.time(), self.lease_s + 5)
        if wait > 0:
            log.info(
                "warehouse %s: waiting %.1f s for the lease of %s to lapse",
                self.root,
                wait,
                _describe(holder),
            )
            time.sleep(wait + 0.5)
            try:
                now = obstore.head(self._store, self._key)["e_tag"]
            except NotFoundError:
                now = None
            if now is not None and now != e_tag:
                raise _busy(self.root, _describe(holder))
        try:
            mode: Any = {"e_tag": e_tag} if e_tag else "create"
            self._e_tag = obstore.put(self._store, self._key, self._body(), mode=mode)["e_tag"]
        except (PreconditionError, AlreadyExistsError):
            raise _busy(self.root, _describe(holder)) from None
        log.info("warehouse %s: took over the lapsed lease of %s", self.root, _describe(holder))

    def _renew(self) -> None:
        import obstore
        from obstore.exceptions import PreconditionError

        wait = self.renew_s
        while not self._stop.wait(wait):
            try:
                self._e_tag = obstore.put(
                    self._store, self._key, self._body(), mode={"e_tag": self._e_tag}
                )["e_tag"]
                wait = self.renew_s
                continue
            except PreconditionError:
                pass
            except Exception as exc:
                # The store is unreachable: so it is for this API's ledger commits, and
                # nothing can be delivered (a delivery is committed before it is answered).
                # Retried often, so that once the store is back a takeover is seen at once.
                log.warning("warehouse %s: lease not renewed (retrying): %s", self.root, exc)
                wait = min(self.renew_s, _RETRY_S)
                continue
            log.critical("warehouse %s: another API took the lease; stopping", self.root)
            if self._on_lost is not None:
                self._on_lost()
            return

    def release(self) -> None:
        import obstore

        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._e_tag is None:
            return
        try:
            # Only ours to delete if nobody took it over (checked, then deleted: S3 has no
            # conditional delete; a takeover needs a lapsed lease, so the window is harmless).
            if obstore.head(self._store, self._key)["e_tag"] == self._e_tag:
                obstore.delete(self._store, self._key)
        except Exception as exc:
            log.warning("warehouse %s: lease not released (it will lapse): %s", self.root, exc)
        self._e_tag = None
