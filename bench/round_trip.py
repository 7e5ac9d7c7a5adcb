"""Where a producer's round trip goes: one connection sending ``PUB`` and waiting for each
``OK`` (as go-nsq's ``Publish`` and ``bench_writer --batch-size 1`` do), to a topic with a
channel, on ``deltaq up`` as users run it, on a bare ``deltaq api``, and on nsqd 1.3.0 in the
same run.

For each server it prints the client's round trips (p50 / p90 / p99) and, over the same
seconds, what the serving process did for each of them: its CPU, and, where ``perf`` can
trace it, each thread's system calls, most time first: calls per round trip / microseconds
per round trip (microseconds per call). Among them the journal's ``pwrite64`` and
``fdatasync``, the wake-ups between threads (``futex``: time spent waiting in it is a
thread's idle time), the event loop's polls, the socket's reads and writes. Threads are
named by py-spy where it is installed (``py-spy dump``), else by their ids. Nothing is
asserted: the figures go in docs/benchmarks.md.

    python -m bench.round_trip [--seconds 10] [--only up,api,nsqd] [--no-trace]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil

from bench import tcp
from bench.procs import api_process, free_port, nsqd_process, post, stop
from bench.up import settle, stop_up, up_process

BODY = b"x" * 200
TOPIC = "round_trip"
CHANNEL = "ch"
# A thread's system call is shown where it makes at least this many calls a round trip.
SHOWN_CALLS = 0.05


@dataclass
class Trips:
    rtt_us: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    seconds: float = 0.0
    # thread name -> syscall -> (calls, total ms)
    syscalls: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    # thread name -> CPU seconds (user + system) over the round trips
    thread_cpu_s: dict[str, float] = field(default_factory=dict)


def _read_ok(sock: socket.socket, reader: BinaryIO) -> None:
    """Read one frame, which must be ``OK`` (heartbeats answered on the way)."""
    while True:
        size, kind = struct.unpack(">ii", reader.read(8))
        data = reader.read(size - 4)
        if data == b"_heartbeat_":
            sock.sendall(b"NOP\n")
            continue
        assert (kind, data) == (0, b"OK"), (kind, data)
        return


def _trips(sock: socket.socket, seconds: float) -> list[float]:
    command = f"PUB {TOPIC}\n".encode() + struct.pack(">i", len(BODY)) + BODY
    reader = sock.makefile("rb")
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter_ns()
        sock.sendall(command)
        _read_ok(sock, reader)
        out.append((time.perf_counter_ns() - started) / 1000)
    return out


def _threads_cpu(pid: int) -> dict[int, float]:
    """Each thread of ``pid``: CPU seconds so far (user + system, from /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> its Python thread's name (py-spy), where py-spy is there. A dump can
    fail while the process changes its threads: tried a few times."""
    spy = shutil.which("py-spy")
    if spy is None:
        return {}
    for _ in range(3):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True,
                check=False,
                text=True,
                timeout=30,
            ).stdout
            names = {int(t): n for t, n in re.findall(r"Thread (\d+) \(\w+\): \"([^\"]+)\"", dump)}
            if names:
                return names
        time.sleep(0.5)
    return {}


_THREAD = re.compile(r"^\s*(\S.*?) \((\d+)\), \d+ events")
_ROW = re.compile(r"^\s+(\w+)\s+(\d+)\s+\d+\s+([\d.]+)\s")


def _parse_summary(text: str, names: dict[int, str]) -> dict[str, dict[str, tuple[int, float]]]:
    """``perf trace -s``'s per-thread summary: name -> syscall -> (calls, total ms)."""
    out: dict[str, dict[str, tuple[int, float]]] = {}
    current: dict[str, tuple[int, float]] | None = None
    for line in text.splitlines():
        thread = _THREAD.match(line)
        if thread:
            tid = int(thread.group(2))
            name = names.get(tid, f"{thread.group(1)} {tid}")
            current = out.setdefault(name, {})
            continue
        row = _ROW.match(line)
        if row and current is not None:
            calls, total = int(row.group(2)), float(row.group(3))
            old = current.get(row.group(1), (0, 0.0))
            current[row.group(1)] = (old[0] + calls, old[1] + total)
    return out


@contextlib.contextmanager
def _traced(pid: int, seconds: float, trace: bool) -> Iterator[list[str]]:
    """``perf trace -s`` of ``pid``'s threads while the block runs: its summary text."""
    perf = shutil.which("perf") if trace else None
    out: list[str] = []
    proc = None
    log = Path(tempfile.mkstemp(suffix=".perf")[1])
    if perf is not None:
        proc = subprocess.Popen(
            [perf, "trace", "-s", "-p", str(pid), "-o", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # perf attaches to each thread
    try:
        yield out
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            out.append(log.read_text(errors="replace"))
        log.unlink(missing_ok=True)


def measure(pid: int, tcp_port: int, seconds: float, trace: bool) -> Trips:
    """Round trips from one connection for ``seconds`` (after 1 s of warm-up), and what
    process ``pid`` did meanwhile."""
    server = psutil.Process(pid)
    sock = tcp._connect(tcp_port)
    try:
        _trips(sock, 1.0)
        names = _thread_names(pid)
        with _traced(pid, seconds, trace) as summary:
            before = server.cpu_times()
            threads_before = _threads_cpu(pid)
            started = time.monotonic()
            rtt = _trips(sock, seconds)
            elapsed = time.monotonic() - started
            after = server.cpu_times()
            threads_after = _threads_cpu(pid)
    finally:
        sock.close()
    trips = Trips(rtt, (after.user + after.system) - (before.user + before.system), elapsed)
    for tid, cpu in threads_after.items():
        used = cpu - threads_before.get(tid, 0.0)
        if used > 0:
            name = names.get(tid, str(tid))
            trips.thread_cpu_s[name] = trips.thread_cpu_s.get(name, 0.0) + used
    if summary:
        trips.syscalls = _parse_summary(summary[0], names)
    return trips


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name: str, trips: Trips) -> None:
    n = len(trips.rtt_us)
    print(
        f"{name}: {n / trips.seconds:,.0f} round trips/s, p50 {_pct(trips.rtt_us, 0.5):.0f} us, "
        f"p90 {_pct(trips.rtt_us, 0.9):.0f} us, p99 {_pct(trips.rtt_us, 0.99):.0f} us; "
        f"the server's CPU {trips.cpu_s / n * 1e6:.0f} us a round trip",
        flush=True,
    )
    busy = sorted(trips.thread_cpu_s.items(), key=lambda kv: -kv[1])
    print(
        "  CPU a round trip by thread: "
        + ", ".join(f"{name} {cpu / n * 1e6:.0f} us" for name, cpu in busy if cpu / n >= 1e-6)
    )
    if not trips.syscalls:
        return
    print("  thread: system call calls per round trip / us per round trip (us per call)")
    for thread, calls in sorted(
        trips.syscalls.items(), key=lambda kv: -sum(c for c, _ in kv[1].values())
    ):
        shown = [
            f"{syscall} {made / n:.2f}/{total_ms * 1000 / n:.0f} ({total_ms * 1000 / made:.0f})"
            for syscall, (made, total_ms) in sorted(calls.items(), key=lambda kv: -kv[1][1])
            if made / n >= SHOWN_CALLS
        ]
        if shown:
            print(f"  {thread}: " + ", ".join(shown))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--only", default="up,api,nsqd")
    parser.add_argument("--no-trace", action="store_true", help="leave perf out")
    args = parser.parse_args()
    only = set(args.only.split(","))
    trace = not args.no_trace
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "up" in only:
            (root / "up").mkdir()
            started = up_process(root / "up")
            if started is None:
                print("deltaq up did not start", file=sys.stderr)
                return 1
            proc, http_port, tcp_port = started
            try:
                _create(http_port)
                settle(proc.pid)
                api = _api_child(proc.pid, http_port)
                report("deltaq up", measure(api, tcp_port, args.seconds, trace))
            finally:
                stop_up(proc)
        if "api" in only:
            (root / "api").mkdir()
            tcp_port = free_port()
            http_port = free_port()
            server = api_process(root / "api" / "wh", http_port, tcp_port=tcp_port)
            try:
                _create(http_port)
                report("bare deltaq api", measure(server.pid, tcp_port, args.seconds, trace))
            finally:
                stop(server)
        if "nsqd" in only:
            tcp_port, http_port = free_port(), free_port()
            nsqd = nsqd_process(root / "nsqd", tcp_port, http_port)
            if nsqd is None:
                print("nsqd: not found (../shared/tools), skipped")
            else:
                try:
                    _create(http_port)
                    report("nsqd 1.3.0", measure(nsqd.pid, tcp_port, args.seconds, trace))
                finally:
                    stop(nsqd)
    return 0


def _create(http_port: int) -> None:
    post(http_port, f"/topic/create?topic={TOPIC}")
    post(http_port, f"/channel/create?topic={TOPIC}&channel={CHANNEL}")


def _api_child(up_pid: int, http_port: int) -> int:
    """The process of ``deltaq up``'s tree that listens on ``http_port``: the API."""
    root = psutil.Process(up_pid)
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            for conn in process.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == http_port:
                    return int(process.pid)
    return up_pid


if __name__ == "__main__":
    sys.exit(main())
