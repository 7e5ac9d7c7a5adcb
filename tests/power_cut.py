"""A disk that forgets every byte not fsync'd, on command: ``../shared/tools/powercut`` (a FUSE
file system on mfusepy and Debian's fuse3) mounted over a directory of the test's."""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import psutil
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from tests.conftest import HOST, ROOT, Server
from tests.consumers import answer, body, sub

POWERCUT = ROOT.parent / "shared" / "tools" / "powercut"

# Settings under which a cut lands among journal rolls, checkpoints and table upkeep too.
BUSY_DISK = {
    "DELTAQ_JOURNAL_SEGMENT_BYTES": "65536",
    "DELTAQ_CHECKPOINT_INTERVAL_COMMITS": "5",
    "DELTAQ_CHECKPOINT_MIN_INTERVAL_S": "0.5",
    "DELTAQ_MAINTENANCE_INTERVAL_MS": "200",
}


def missing() -> str | None:
    """Why power-cut tests cannot run here (None: they can).

    What .ci/run installs (fuse3, and mfusepy with the test extras) is no reason under CI
    (``DELTAQ_CI``, which .ci/run sets): the tests then run and fail at the mount, saying what
    is missing, instead of skipping. ../shared and /dev/fuse (the machine's, not .ci/run's)
    are reasons everywhere."""
    if not (POWERCUT / "mount").exists():
        return f"no power-cut file system at {POWERCUT} (../shared is absent)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    return None if os.environ.get("DELTAQ_CI") else not_installed()


def not_installed() -> str | None:
    """What the power-cut file system needs that .ci/run installs and is missing here."""
    if shutil.which("fusermount3") is None:
        return "fuse3 is not installed (Debian: apt-get install fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "the mfusepy package is not installed"
    return None


class PowerCutDisk:
    """The mount point ``mnt`` over ``backing``: what is synced lands in ``backing``."""

    def __init__(self, root: Path) -> None:
        self.backing = root / "disk"
        self.mnt = root / "mnt"
        self.log = root / "mnt.log"
        self.ctl = root / "mnt.ctl"
        self.cuts = 0

    def mount(self) -> PowerCutDisk:
        absent = not_installed()
        if absent is not None:
            pytest.fail(f"{absent}; .ci/run installs it, so under CI this fails", pytrace=False)
        env = {**os.environ, "POWERCUT_PYTHON": sys.executable}
        subprocess.run(
            [str(POWERCUT / "mount"), str(self.backing), str(self.mnt)],
            check=True,
            env=env,
            capture_output=True,
            timeout=30,
        )
        return self

    def unmount(self) -> None:
        for _ in range(50):
            done = subprocess.run(
                ["fusermount3", "-u", str(self.mnt)], capture_output=True, check=False
            )
            if done.returncode == 0 or not self.mounted():
                break
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], check=False)
        # The file system's own process ends once unmounted.
        deadline = time.monotonic() + 10
        while self.mounted() and time.monotonic() < deadline:
            time.sleep(0.05)

    def mounted(self) -> bool:
        with open("/proc/mounts") as f:
            return any(line.split()[1] == str(self.mnt) for line in f)

    def cut(self, *pids: int) -> None:
        """A power cut under the processes ``pids`` and their children: all frozen at one
        instant, the unsynced bytes dropped, then killed; the disk comes back as a machine's
        disk does after the power returns (mounted again, holding only what was synced)."""
        victims = _tree(pids)
        for p in victims:
            _signal(p, signal.SIGSTOP)
        self.cuts += 1
        with open(self.ctl, "w") as f:
            f.write("cut\n")
        deadline = time.monotonic() + 30
        while self.log.read_text(errors="replace").count(" cut done ") < self.cuts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the power cut did not happen: {self.log.read_text()}")
            time.sleep(0.02)
        for p in victims:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        self.unmount()
        self.mount()


def _tree(pids: tuple[int, ...]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        found.append(parent)
        found.extend(parent.children(recursive=True))
    return found


def _signal(p: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        p.send_signal(sig)


class Load:
    """Producers and consumers on one server until told to stop; what each was told OK."""

    def __init__(
        self,
        server: Server,
        topic: str,
        channel: str,
        prefix: str,
        pace_s: float = 0.0,
        new_topics: bool = True,
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
        # Bodies /sub handed out (a /fin the cut interrupted may have been committed).
        self.delivered: set[bytes] = set()
        self.threads = [
            threading.Thread(target=self._http_pub, args=(n,), daemon=True) for n in range(3)
        ]
        self.threads.append(threading.Thread(target=self._http_mpub, daemon=True))
        self.threads.append(threading.Thread(target=self._tcp_pub, daemon=True))
        if new_topics:
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
                answer = frame(s)
                while answer == (0, b"_heartbeat_"):  # not this PUB's answer: NOP, read on
                    s.sendall(b"NOP\n")
                    answer = frame(s)
                if answer == (0, b"OK"):
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
                    with self.lock:
                        self.delivered.update(body(m) for m in got)
                    if got and answer(c, "fin", self.topic, self.channel, *got).text == "OK":
                        with self.lock:
                            self.finished.update(body(m) for m in got)
                except (httpx.HTTPError, AssertionError, OSError):
                    return


def frame(s: socket.socket) -> tuple[int, bytes]:
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


def count(path: Path) -> int:
    try:
        return int(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).num_rows)
    except Exception:  # not created yet
        return 0


def table_bodies(path: Path) -> list[bytes]:
    return list(DeltaTable(str(path)).to_pyarrow_table()["body"].to_pylist())


def committed_bodies(path: Path) -> list[bytes]:
    """The bodies of a table as its log says, read from version 0 up to the first commit that
    is missing or does not parse (what a cut may leave at the tail, which only a start sets
    aside): the table as a reader sees it right after a cut, before anything repairs it.
    (``commit_log.live_files`` replays the same log but raises at a commit that does not
    parse: a start repairs those first.)"""
    live: dict[str, None] = {}
    version = 0
    while True:
        entry = path / "_delta_log" / f"{version:020d}.json"
        try:
            actions = [json.loads(line) for line in entry.read_text().splitlines() if line]
        except (OSError, ValueError):
            break
        if not actions:
            break
        for action in actions:
            if "add" in action:
                live[urllib.parse.unquote(action["add"]["path"])] = None
            elif "remove" in action:
                live.pop(urllib.parse.unquote(action["remove"]["path"]), None)
        version += 1
    bodies: list[bytes] = []
    for name in live:
        bodies += pq.read_table(path / name, columns=["body"])["body"].to_pylist()
    return bodies
