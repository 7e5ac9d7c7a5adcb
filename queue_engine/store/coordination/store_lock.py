"""A lock held in an object store: one small object naming its holder and when its hold ends.

It is created put-if-absent, renewed every ``renew_s`` with a conditional write on the version
the holder last wrote (If-Match), and taken by someone else only once it has lapsed *and*
nobody renewed it meanwhile (a conditional write again, so of two takers one wins). A holder
that finds its lease taken is told (``on_lost``) and must stop acting on it; one that cannot
reach the store keeps retrying and goes on if, once the store answers, the lease is still the
version it wrote. Wall clocks of the hosts are compared: they must agree to within a few
seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_RETRY_S = 0.5


class StoreLock:
    """A lock held in the object at ``url`` (see the module's docstring)."""

    def __init__(
        self,
        url: str,
        holder: dict[str, Any],
        *,
        lease_s: float,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        from queue_engine.store.storage.object_store import store_and_key

        self.url = url
        self.lease_s = lease_s
        self.renew_s = lease_s / 3
        self.holder = holder
        self._on_lost = on_lost
        self._store, self._key = store_and_key(url)
        self._e_tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**self.holder, "expires_at": time.time() + self.lease_s}).encode()

    def try_acquire(self) -> bool:
        """Take the lease if nobody holds it (absent, or lapsed and not renewed since it was
        read); True when taken, and then it is renewed until ``release``."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

        try:
            self._e_tag = obstore.put(self._store, self._key, self._body(), mode="create")["e_tag"]
        except AlreadyExistsError:
            try:
                current = obstore.get(self._store, self._key)
            except NotFoundError:
                return False  # released between the two calls: the next try may take it
            held = json.loads(bytes(current.bytes()))
            if float(held.get("expires_at", 0)) > time.time():
                return False
            try:
                self._e_tag = obstore.put(
                    self._store, self._key, self._body(), mode={"e_tag": current.meta["e_tag"]}
                )["e_tag"]
            except (PreconditionError, AlreadyExistsError):
                return False
            log.info("%s: took over the lapsed lease of %s", self.url, describe(held))
        except PreconditionError:
            return False
        self._thread = threading.Thread(target=self._renew, name="store-lease", daemon=True)
        self._thread.start()
        return True

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
                # The store is unreachable: so it is for the holder's commits. Retried often,
                # so that once the store is back a takeover is seen at once.
                log.warning("%s: lease not renewed (retrying): %s", self.url, exc)
                wait = min(self.renew_s, _RETRY_S)
                continue
            log.critical("%s: someone else took the lease; stopping", self.url)
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
            log.warning("%s: lease not released (it will lapse): %s", self.url, exc)
        self._e_tag = None


def describe(holder: dict[str, Any]) -> str:
    """``pid P on HOST, since T`` for a lease's holder record."""
    try:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(holder["since"])))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
