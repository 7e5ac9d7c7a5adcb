"""Power cuts: the warehouse on a disk that forgets every byte not fsync'd (``tests.power_cut``),
cut at random moments while producers publish over HTTP and TCP (to old topics and to topics
their first publish creates), consumers FIN over HTTP and TCP, and the fanout, the sweep and
table upkeep run. After every cut deltaq starts again, and nothing acknowledged is lost or
doubled."""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from deltalake import DeltaTable

from tests import power_cut
from tests.conftest import HOST, ROOT, Server, free_port
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

    def __init__(
        self, server: Server, topic: str, channel: str, prefix: str, pace_s: float = 0.0
    ) -> None:
        self.server = server
        self.pace_s = pace_s  # a pause after each request (the Spark tests' disk is slow)
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
            self.stop.wait(self.pace_s)

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
            self.stop.wait(10 * self.pace_s)

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
                self.stop.wait(self.pace_s)
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
            self.stop.wait(max(0.05, 10 * self.pace_s))

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


def _count(path: Path) -> int:
    try:
        return int(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).num_rows)
    except Exception:  # not created yet
        return 0


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
    try:
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
    finally:
        server.stop()


class Up:
    """``deltaq up`` on a warehouse: the API, and the fanout and the sweep on local Spark."""

    def __init__(self, warehouse: Path, log_path: Path, env: dict[str, str]) -> None:
        self.warehouse = warehouse
        self.log_path = log_path
        self.env = env
        self.port, self.tcp_port = free_port(), free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Up:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env["DELTAQ_SPARK_CONNECT_PORT"] = str(free_port())
        mark = self.log_path.read_text(errors="replace").count("deltaq ready: ") + 1
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "deltaq", "up", "--warehouse", str(self.warehouse)),
                    *("--port", str(self.port), "--tcp-port", str(self.tcp_port)),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 180
        while self.log_path.read_text(errors="replace").count("deltaq ready: ") < mark:
            assert self.process.poll() is None, self.log_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "deltaq up did not get ready"
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


class TcpConsumer(threading.Thread):
    """NSQ's TCP protocol by hand: SUB, RDY, and a FIN for every message."""

    def __init__(self, port: int, topic: str, channel: str) -> None:
        super().__init__(daemon=True)
        self.port, self.topic, self.channel = port, topic, channel
        self.stop = threading.Event()
        self.finished = 0

    def run(self) -> None:
        try:
            s = socket.create_connection((HOST, self.port), timeout=5)
            s.sendall(b"  V2" + f"SUB {self.topic} {self.channel}\n".encode())
            if _frame(s) != (0, b"OK"):
                return
            s.sendall(b"RDY 50\n")
            while not self.stop.is_set():
                try:
                    kind, data = _frame(s)
                except TimeoutError:
                    continue
                if kind == 0 and data == b"_heartbeat_":
                    s.sendall(b"NOP\n")
                elif kind == 2:
                    s.sendall(b"FIN " + data[10:26] + b"\n")
                    self.finished += 1
        except OSError:
            return


@pytest.mark.parametrize("ack", ["journal", "commit"])
def test_up_after_power_cuts_channels_hold_every_message_once_and_fins_hold(
    disk: power_cut.PowerCutDisk, tmp_path: Path, ack: str
) -> None:
    warehouse = disk.mnt / "wh"
    env = {
        "DELTAQ_ACK": ack,
        "DELTAQ_JOURNAL_SEGMENT_BYTES": "65536",
        "DELTAQ_MSG_TIMEOUT_MS": "3000",
        # Fewer, larger topic commits: every file read and written passes through the
        # power-cut file system's Python, on the same two cores as Spark.
        "DELTAQ_DRAIN_LINGER_MS": "500",
        "DELTAQ_SWEEP_INTERVAL_S": "1",
        "DELTAQ_CHECKPOINT_INTERVAL_COMMITS": "5",
        "DELTAQ_CHECKPOINT_MIN_INTERVAL_S": "0.5",
        "DELTAQ_MAINTENANCE_INTERVAL_MS": "200",
    }
    rng = random.Random(int(os.environ.get("POWER_CUT_SEED", time.time_ns())))
    up = Up(warehouse, tmp_path / "up.log", env)
    up.log_path.touch()
    up.start()
    acked: list[bytes] = []
    finished: set[bytes] = set()
    channel_table = warehouse / "channels" / "cut" / "c" / "messages"
    try:
        with httpx.Client(base_url=up.url, timeout=10) as c:
            create_channel(c, "cut", "c")
        for round_ in range(2):
            server = Server(warehouse, port=up.port, tcp_port=up.tcp_port)
            load = Load(server, "cut", "c", f"r{round_}", pace_s=0.05).start()
            tcp = TcpConsumer(up.tcp_port, "cut", "c")
            tcp.start()
            # The cut lands while the fanout copies this round's messages.
            fanned = _count(channel_table)
            deadline = time.monotonic() + 120
            while _count(channel_table) <= fanned:
                assert time.monotonic() < deadline, "the fanout copied nothing"
                time.sleep(0.2)
            time.sleep(rng.uniform(0.5, 4.0))
            assert up.process is not None
            disk.cut(up.process.pid)
            load.halt()
            tcp.stop.set()
            acked += load.acked
            finished |= load.finished
            assert load.acked, f"round {round_}: nothing was acknowledged before the cut"
            up.start()

        with httpx.Client(base_url=up.url, timeout=30) as c:
            # Every acknowledged message reaches the channel's table exactly once.
            topic = Counter(_rows(warehouse / "topics" / "cut"))
            assert [b for b in acked if b not in topic] == []
            assert [b for b, n in topic.items() if n > 1] == []
            deadline = time.monotonic() + 60
            while len(rows := _rows(channel_table)) < len(topic):
                assert time.monotonic() < deadline, f"{len(rows)} of {len(topic)} fanned out"
                time.sleep(0.5)
            assert Counter(rows) == topic
            # Nothing whose /fin was answered OK is delivered again: drain the channel
            # (leases the cut left behind expire and come back through the sweep).
            again: list[bytes] = []
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < 8:
                got = sub(c, "cut", "c", max=500, wait_ms=1000)
                if got:
                    quiet_since = time.monotonic()
                    again += [body(m) for m in got]
                    assert answer(c, "fin", "cut", "c", *got).text == "OK"
            assert finished, "no /fin was answered before the cuts"
            assert sorted(finished & set(again)) == []
    finally:
        up.stop()
