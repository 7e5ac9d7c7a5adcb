"""Power cuts: the warehouse on a disk that forgets every byte not fsync'd (``tests.power_cut``),
cut at random moments while producers publish over HTTP and TCP (to old topics and to topics
their first publish creates), consumers FIN over HTTP and TCP, and the fanout, the sweep and
table upkeep run. After every cut deltaq starts again, and nothing acknowledged is lost or
doubled."""

from __future__ import annotations

import http.client
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltalake import DeltaTable

from tests import power_cut
from tests.conftest import HOST, Server
from tests.consumers import answer, body, create_channel, sub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(power_cut.missing() is not None, reason=str(power_cut.missing())),
]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[power_cut.PowerCutDisk]:
    d = power_cut.PowerCutDisk(tmp_path).mount()
    yield d
    d.unmount()


class Load:
    """Producers and consumers on one server until told to stop; what each was told OK."""

    def __init__(self, server: Server, topic: str, channel: str, prefix: str) -> None:
        self.server = server
        self.topic = topic
        self.channel = channel
        self.prefix = prefix
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: list[bytes] = []  # bodies whose publish was answered OK
        self.new_topics: dict[str, list[bytes]] = {}
        self.finished: set[bytes] = set()  # bodies whose HTTP /fin was answered OK
        self.threads = [
            threading.Thread(target=self._http_pub, args=(n,), daemon=True) for n in range(3)
        ]
        self.threads.append(threading.Thread(target=self._http_mpub, daemon=True))
        self.threads.append(threading.Thread(target=self._tcp_pub, daemon=True))
        self.threads.append(threading.Thread(target=self._new_topics, daemon=True))
        self.threads.append(threading.Thread(target=self._http_fin, daemon=True))

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)

    def _ok(self, bodies: list[bytes], topic: str | None = None) -> None:
        with self.lock:
            if topic is None:
                self.acked.extend(bodies)
            else:
                self.new_topics.setdefault(topic, []).extend(bodies)

    def _http_pub(self, n: int) -> None:
        conn = http.client.HTTPConnection(HOST, self.server.port, timeout=10)
        i = 0
        while not self.stop.is_set():
            b = f"{self.prefix}-h{n}-{i}".encode()
            i += 1
            try:
                conn.request("POST", f"/pub?topic={self.topic}", body=b)
                r = conn.getresponse()
                if r.read() == b"OK" and r.status == 200:
                    self._ok([b])
            except (OSError, http.client.HTTPException):
                return

    def _http_mpub(self) -> None:
        conn = http.client.HTTPConnection(HOST, self.server.port, timeout=10)
        i = 0
        while not self.stop.is_set():
            batch = [f"{self.prefix}-m{i}-{k}".encode() for k in range(20)]
            i += 1
            try:
                conn.request("POST", f"/mpub?topic={self.topic}", body=b"\n".join(batch))
                r = conn.getresponse()
                if r.read() == b"OK" and r.status == 200:
                    self._ok(batch)
            except (OSError, http.client.HTTPException):
                return

    def _tcp_pub(self) -> None:
        try:
            s = socket.create_connection((HOST, self.server.tcp_port), timeout=10)
            s.sendall(b"  V2")
            i = 0
            while not self.stop.is_set():
                b = f"{self.prefix}-t-{i}".encode()
                i += 1
                s.sendall(f"PUB {self.topic}\n".encode() + struct.pack(">i", len(b)) + b)
                if _frame(s) == (0, b"OK"):
                    self._ok([b])
        except OSError:
            return

    def _new_topics(self) -> None:
        """Each publish to a topic it creates (the registry, then the table, then the ack)."""
        conn = http.client.HTTPConnection(HOST, self.server.port, timeout=10)
        i = 0
        while not self.stop.is_set():
            topic = f"{self.prefix}-new-{i}"
            b = f"{topic}-first".encode()
            i += 1
            try:
                conn.request("POST", f"/pub?topic={topic}", body=b)
                r = conn.getresponse()
                if r.read() == b"OK" and r.status == 200:
                    self._ok([b], topic)
            except (OSError, http.client.HTTPException):
                return
            time.sleep(0.05)

    def _http_fin(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=10) as c:
            while not self.stop.is_set():
                try:
                    got = sub(c, self.topic, self.channel, max=20, wait_ms=200)
                    if got and answer(c, "fin", self.topic, self.channel, *got).text == "OK":
                        with self.lock:
                            self.finished.update(body(m) for m in got)
                except (httpx.HTTPError, AssertionError, OSError):
                    return


def _frame(s: socket.socket) -> tuple[int, bytes]:
    head = _read(s, 8)
    size, kind = struct.unpack(">ii", head)
    return kind, _read(s, size - 4)


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def _rows(path: Path) -> list[bytes]:
    return list(DeltaTable(str(path)).to_pyarrow_table()["body"].to_pylist())


@pytest.mark.parametrize("ack", ["journal", "commit"])
def test_api_starts_after_power_cuts_and_keeps_every_acknowledged_publish(
    disk: power_cut.PowerCutDisk, tmp_path: Path, ack: str
) -> None:
    warehouse = disk.mnt / "wh"
    env = {
        "DELTAQ_ACK": ack,
        "DELTAQ_JOURNAL_SEGMENT_BYTES": "65536",
        # Upkeep often: cuts land among checkpoints and compactions too.
        "DELTAQ_CHECKPOINT_INTERVAL_COMMITS": "5",
        "DELTAQ_CHECKPOINT_MIN_INTERVAL_S": "0.5",
        "DELTAQ_COMPACT_MIN_SMALL_FILES": "4",
        "DELTAQ_COMPACT_INTERVAL_S": "1",
        "DELTAQ_MAINTENANCE_INTERVAL_MS": "200",
    }
    rng = random.Random(int(os.environ.get("POWER_CUT_SEED", time.time_ns())))
    logs = tmp_path / "server.log"  # beside the cut disk: it keeps what the server said
    server = Server(warehouse, env=env, log_path=logs).start(timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        create_channel(c, "cut", "c")
    acked: list[bytes] = []
    new_topics: dict[str, list[bytes]] = {}
    for round_ in range(3):
        load = Load(server, "cut", "c", f"r{round_}").start()
        time.sleep(rng.uniform(1.0, 3.0))
        disk.cut(server.process.pid)  # type: ignore[union-attr]
        load.halt()
        acked += load.acked
        for topic, bodies in load.new_topics.items():
            new_topics.setdefault(topic, []).extend(bodies)
        assert load.acked, f"round {round_}: nothing was acknowledged before the cut"

        server = Server(
            warehouse, env=env, port=server.port, tcp_port=server.tcp_port, log_path=logs
        )
        server.start(timeout_s=60)
        with httpx.Client(base_url=server.url, timeout=10) as c:
            # Recovery commits the journal before the API serves: the tables hold it all.
            rows = Counter(_rows(warehouse / "topics" / "cut"))
            lost = [b for b in acked if b not in rows]
            assert lost == [], f"round {round_}: {len(lost)} acknowledged publishes lost"
            doubled = [b for b, n in rows.items() if n > 1]
            assert doubled == [], f"round {round_}: {len(doubled)} doubled"
            for topic, bodies in new_topics.items():
                assert sorted(_rows(warehouse / "topics" / topic)) == sorted(bodies), topic
            after = f"after-{round_}".encode()
            assert c.post("/pub", params={"topic": "cut"}, content=after).text == "OK"
            acked.append(after)
    server.stop()
