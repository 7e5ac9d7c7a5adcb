"""The API nodes serving one warehouse: each holds a lane for its life.

Any number of API processes (up to ``LANES``) may serve one warehouse, as nsqd nodes serve one
cluster: any node takes publishes for any topic, and each channel is served by the one node
that owns it (``ownership``). A node's lane is its identity among the live
nodes: message ids carry it (two nodes never allocate the same id) and a channel's owner is
recorded as a lane plus the token of the process holding it.

On a local warehouse a lane is an exclusive ``flock`` on ``_deltaq/nodes/<lane>.lock``: the
kernel drops it when the process ends, however it ends (``kill -9`` included), so a node is
alive exactly while its lock is held, and another process can tell by trying a shared lock.
On an object store a lane is a ``StoreLock`` on ``_deltaq/nodes/<lane>.json``: alive while
renewed; a killed node's lane lapses after ``store_lease_s``.
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
from dataclasses import dataclass
from typing import Any

from queue_engine.message import LANES
from queue_engine.store.coordination.hold import Hold
from queue_engine.store.storage.paths import is_remote

log = logging.getLogger(__name__)

NODES_DIR = "_deltaq/nodes"


class WarehouseBusyError(RuntimeError):
    """No lane is free: the warehouse already has as many nodes as it can hold."""


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself in its lane."""

    lane: int
    token: str
    # Where clients reach it: ``http://host:port`` (redirects point there).
    http_url: str
    tcp_address: str | None
    pid: int
    host: str
    since: float

    def as_json(self) -> dict[str, Any]:
        return {
            "lane": self.lane,
            "token": self.token,
            "http_url": self.http_url,
            "tcp_address": self.tcp_address,
            "pid": self.pid,
            "host": self.host,
            "since": self.since,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeRecord:
        return cls(
            lane=int(data["lane"]),
            token=str(data["token"]),
            http_url=str(data["http_url"]),
            tcp_address=data.get("tcp_address"),
            pid=int(data.get("pid", 0)),
            host=str(data.get("host", "")),
            since=float(data.get("since", 0.0)),
        )


def _nodes_root(root: str) -> str:
    return f"{root.rstrip('/')}/{NODES_DIR}"


class Node:
    """This process's membership: ``join`` takes the lowest free lane; ``leave`` frees it."""

    def __init__(
        self,
        root: str,
        http_url: str,
        tcp_address: str | None = None,
        *,
        lease_s: float = 15.0,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.root = root
        self._http_url = http_url
        self._tcp_address = tcp_address
        self._lease_s = lease_s
        self._on_lost = on_lost
        self._hold: Hold | None = None
        self.record: NodeRecord | None = None

    @property
    def lane(self) -> int:
        assert self.record is not None, "node has not joined"
        return self.record.lane

    def join(self) -> NodeRecord:
        token = uuid.uuid4().hex
        record = None
        if is_remote(self.root):
            # A live lane with this node's own address is this node before a restart (after
            # a kill -9 its lease has not lapsed yet): wait for it and take that lane, so the
            # channels it owned are this node's again rather than stranded until it lapses.
            own = [n.lane for n in live_nodes(self.root).values() if n.http_url == self._http_url]
            if own:
                record = self._wait_for_lane(own[0], token)
        if record is None:
            for lane in range(LANES):
                candidate = self._record(lane, token)
                if self._take(candidate):
                    record = candidate
                    break
        if record is None:
            raise WarehouseBusyError(
                f"warehouse {self.root} already has {LANES} deltaq API nodes "
                f"({describe_nodes(live_nodes(self.root))}); stop one, or use another --warehouse"
            )
        self.record = record
        log.info("warehouse %s: serving as node %d (%s)", self.root, record.lane, self._http_url)
        return record

    def _record(self, lane: int, token: str) -> NodeRecord:
        return NodeRecord(
            lane,
            token,
            self._http_url,
            self._tcp_address,
            os.getpid(),
            socket.gethostname(),
            time.time(),
        )

    def _wait_for_lane(self, lane: int, token: str) -> NodeRecord:
        log.info(
            "warehouse %s: waiting up to %.0f s for the lane of this node's previous process "
            "(%s) to lapse",
            self.root,
            self._lease_s,
            self._http_url,
        )
        deadline = time.monotonic() + self._lease_s + 5
        while time.monotonic() < deadline:
            record = self._record(lane, token)
            if self._take(record):
                return record
            time.sleep(0.5)
        raise WarehouseBusyError(
            f"warehouse {self.root} is already served by a live node at {self._http_url}: "
            "stop it, or give this one another address (--port, --broadcast-address)"
        )

    def _take(self, record: NodeRecord) -> bool:
        hold = Hold(
            f"{_nodes_root(self.root)}/{record.lane}",
            record.as_json(),
            lease_s=self._lease_s,
            on_lost=self._on_lost,
        )
        if not hold.try_take():
            return False
        self._hold = hold
        return True

    def leave(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None


def live_nodes(root: str) -> dict[int, NodeRecord]:
    """The nodes serving the warehouse now, by lane."""
    if is_remote(root):
        return _live_remote(root)
    directory = _nodes_root(os.path.abspath(root))
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    found: dict[int, NodeRecord] = {}
    for name in names:
        if not name.endswith(".lock"):
            continue
        try:
            fd = os.open(f"{directory}/{name}", os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                # Held: a live node. Its record was written before it joined.
                record = _parse(os.pread(fd, 4096, 0))
                if record is not None:
                    found[record.lane] = record
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)  # free: whoever wrote it is gone
        finally:
            os.close(fd)
    return found


def _live_remote(root: str) -> dict[int, NodeRecord]:
    import obstore

    from queue_engine.store.storage.object_store import read_objects, store_and_key

    store, key = store_and_key(_nodes_root(root))
    prefix = f"{key}/"
    urls = [
        f"{_nodes_root(root)}/{str(meta['path'])[len(prefix) :]}"
        for chunk in obstore.list(store, prefix=prefix)
        for meta in chunk
        if str(meta["path"]).endswith(".json")
    ]
    now = time.time()
    found: dict[int, NodeRecord] = {}
    for raw in read_objects(urls):
        try:
            data = json.loads(raw or b"{}")
            record = NodeRecord.from_json(data)
        except (ValueError, KeyError, TypeError):
            continue
        if float(data.get("expires_at", 0)) > now:
            found[record.lane] = record
    return found


def _parse(raw: bytes) -> NodeRecord | None:
    try:
        return NodeRecord.from_json(json.loads(raw or b"{}"))
    except (ValueError, KeyError, TypeError):
        return None


def describe_nodes(nodes: dict[int, NodeRecord]) -> str:
    return ", ".join(f"{n.http_url} (pid {n.pid} on {n.host})" for n in nodes.values())


class NodeDirectory:
    """``live_nodes`` read at most every ``max_age_s`` (a redirect or /stats may use a view
    that old); decisions that hand a channel over read it fresh (``fresh``)."""

    def __init__(self, root: str, max_age_s: float = 1.0) -> None:
        self.root = root
        self.max_age_s = max_age_s
        self._nodes: dict[int, NodeRecord] = {}
        self._read_at = -1e9
        self._lock = threading.Lock()

    def fresh(self) -> dict[int, NodeRecord]:
        nodes = live_nodes(self.root)
        with self._lock:
            self._nodes, self._read_at = nodes, time.monotonic()
        return nodes

    def current(self) -> dict[int, NodeRecord]:
        with self._lock:
            if time.monotonic() - self._read_at < self.max_age_s:
                return self._nodes
        return self.fresh()
