"""Power cuts under ``deltaq up``: producers over HTTP and TCP, consumers FIN'ing over HTTP and
TCP, the fanout and the sweep on local Spark, all on a disk that forgets every byte not
fsync'd. After each cut deltaq up starts again; every acknowledged message is in its channel's
table exactly once, and nothing whose /fin was answered OK is delivered again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest

from tests import power_cut
from tests.conftest import HOST, ROOT, Server, free_port
from tests.consumers import answer, body, create_channel, sub
from tests.power_cut import Load, count, frame, table_bodies

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(power_cut.missing() is not None, reason=str(power_cut.missing())),
]


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
        # Bodies delivered and FIN'd (a FIN has no answer: it may not hold across a cut).
        self.delivered: set[bytes] = set()
        self.subscribed = False
        self._socket: socket.socket | None = None
        self._writing = threading.Lock()

    def send(self, line: bytes) -> None:
        with self._writing:
            assert self._socket is not None
            self._socket.sendall(line)

    def pause(self) -> None:
        """RDY 0: no more messages (those in flight are FIN'd), still connected."""
        self.send(b"RDY 0\n")

    def run(self) -> None:
        try:
            s = self._socket = socket.create_connection((HOST, self.port), timeout=5)
            self.send(b"  V2" + f"SUB {self.topic} {self.channel}\n".encode())
            if frame(s) != (0, b"OK"):
                return
            self.subscribed = True
            self.send(b"RDY 50\n")
            while not self.stop.is_set():
                try:
                    kind, data = frame(s)
                except TimeoutError:
                    continue
                if kind == 0 and data == b"_heartbeat_":
                    self.send(b"NOP\n")
                elif kind == 2:
                    self.delivered.add(data[26:])  # after timestamp, attempts and id
                    self.send(b"FIN " + data[10:26] + b"\n")
        except OSError:
            return


# One ack mode per file (test_power_cut_up_commit.py has the other), so that the two run side
# by side: each deltaq up start on this disk takes ~30 s, a replayed fanout batch as long.
# deltaq up started three times on the power-cut disk, beside the rest of the suite.
@pytest.mark.timeout(900)
def test_up_after_power_cuts_channels_hold_every_message_once_and_fins_hold(
    disk: power_cut.PowerCutDisk, tmp_path: Path
) -> None:
    cut_up_and_check(disk, tmp_path, ack="journal", cuts=2)


def cut_up_and_check(disk: power_cut.PowerCutDisk, tmp_path: Path, *, ack: str, cuts: int) -> None:
    """Cut deltaq up ``cuts`` times under load, then check the tables and the FINs."""
    warehouse = disk.mnt / "wh"
    env = {
        **power_cut.BUSY_DISK,
        "DELTAQ_ACK": ack,
        "DELTAQ_MSG_TIMEOUT_MS": "3000",
        # Fewer, larger topic commits: every file read and written passes through the
        # power-cut file system's Python, on the same two cores as Spark.
        "DELTAQ_DRAIN_LINGER_MS": "500",
        "DELTAQ_SWEEP_INTERVAL_S": "1",
    }
    rng = random.Random(int(os.environ.get("POWER_CUT_SEED", time.time_ns())))
    up = Up(warehouse, tmp_path / "up.log", env)
    up.log_path.touch()
    up.start()
    acked: list[bytes] = []
    finished: set[bytes] = set()
    tcp_delivered: set[bytes] = set()
    delivered: set[bytes] = set()  # by /sub, whether or not its /fin was answered
    # Delivered by /sub and never FIN'd since: their leases must run out and bring them back.
    held: set[bytes] = set()
    channel_table = warehouse / "channels" / "cut" / "c" / "messages"
    try:
        with httpx.Client(base_url=up.url, timeout=10) as c:
            create_channel(c, "cut", "c")
            assert c.get("/info").json()["ack"] == ack
        for round_ in range(cuts):
            server = Server(warehouse, port=up.port, tcp_port=up.tcp_port)
            # Topics created by their first publish are the API test's: each is a table more
            # for the fanout to read through the power-cut file system.
            load = Load(server, "cut", "c", f"r{round_}", pace_s=0.05, new_topics=False)
            load.start()
            tcp = TcpConsumer(up.tcp_port, "cut", "c")
            tcp.start()
            # The cut lands while the fanout copies this round's messages, once the consumer
            # has had a /fin answered (what must not come back after the cut).
            fanned = count(channel_table)
            deadline = time.monotonic() + 240
            while count(channel_table) <= fanned or not load.finished:
                assert time.monotonic() < deadline, (
                    f"round {round_}: the fanout copied nothing or no /fin was answered "
                    f"({len(load.finished)}); deltaq up's log ends:\n"
                    + up.log_path.read_text(errors="replace")[-6000:]
                )
                time.sleep(0.2)
            time.sleep(rng.uniform(0.5, 4.0))
            # Leased just before the cut and never FIN'd: the lease must run out after it (the
            # TCP consumer, which would take them first, asks for no more meanwhile).
            assert tcp.subscribed, f"round {round_}: the TCP consumer's SUB was refused"
            tcp.pause()
            with httpx.Client(base_url=up.url, timeout=10) as c:
                leased = sub(c, "cut", "c", max=5, wait_ms=3000)
            assert leased, f"round {round_}: /sub had nothing to lease before the cut"
            assert up.process is not None
            disk.cut(up.process.pid)
            load.halt()
            tcp.stop.set()
            tcp.join(10)
            tcp_delivered |= tcp.delivered
            acked += load.acked
            finished |= load.finished
            delivered |= load.delivered
            # Those an earlier cut left leased came back in this round; this cut leaves more.
            held = (held - load.delivered - tcp.delivered) | {body(m) for m in leased}
            assert load.acked, f"round {round_}: nothing was acknowledged before the cut"
            if ack == "commit":
                # Answered OK only once in a committed version: in the table as the cut left
                # it, before any journal could put it there.
                in_table = set(power_cut.committed_bodies(warehouse / "topics" / "cut"))
                assert [b for b in load.acked if b not in in_table] == []
            up.start()

        with httpx.Client(base_url=up.url, timeout=30) as c:
            # Every acknowledged message reaches the channel's table exactly once.
            topic = Counter(table_bodies(warehouse / "topics" / "cut"))
            assert [b for b in acked if b not in topic] == []
            assert [b for b, n in topic.items() if n > 1] == []
            deadline = time.monotonic() + 240  # a replayed batch, on a busy machine
            while len(rows := table_bodies(channel_table)) < len(topic):
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
            # ... and the drain ran: every message was delivered, before the cuts or after.
            assert sorted(set(topic) - delivered - tcp_delivered - set(again)) == []
            # The leases the last cut left open ran out and their messages came back.
            assert sorted(held - set(again)) == []
            # Over TCP too: the consumer had messages, and a PUB was answered.
            assert tcp_delivered and any(b"-t-" in b for b in acked)
            # The drain's fanout batches (a replayed one included) added no copy.
            assert Counter(table_bodies(channel_table)) == topic
    finally:
        up.stop()
