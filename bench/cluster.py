"""One channel served by 1, 2 and 3 API nodes on one warehouse (nsqd's TCP protocol).

For each node count, on a fresh warehouse: ``--nodes`` ``deltaq api`` processes and one
``deltaq fanout``; one topic with one channel.

1. consume: a backlog of ``--backlog`` 200-byte messages published through every node in
   turn (``/mpub``), fanned out with ``deltaq fanout --once``; then two consumer processes per
   node (SUB, RDY 200, FIN each message) until every message is FIN'd. msg/s, and the CPU
   seconds and peak RSS each node used meanwhile.
2. latency: the fanout streaming; one pipelining publisher per node, ``--rate`` msg/s in all
   spread over the nodes, and one consumer per node; for ``--seconds``. p50/p99
   publish -> delivered, delivered msg/s, and each node's CPU.
3. takeover (two nodes or more): 1,000 messages published through the last node wait in its
   share; a consumer on each other node; ``kill -9`` of the last node. How long until the
   survivors serve every share, and until their consumers got all 1,000.

Every process shares this machine's cores (the loads too): read the CPU per node to see what
more cores would give.

    python -m bench.cluster [--nodes 1,2,3] [--backlog 200000] [--rate 600] [--seconds 10]
                            [--only consume|latency|takeover]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import struct
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.procs import HOST, api_process, fanout_process, free_port, post, stop
from bench.tcp import BODY, _connect, _consume

TOPIC = "hot"
CONSUMERS_PER_NODE = 2


class Nodes:
    """``count`` API nodes on ``warehouse`` and their processes' CPU and memory."""

    def __init__(self, warehouse: Path, count: int) -> None:
        self.http = [free_port() for _ in range(count)]
        self.tcp = [free_port() for _ in range(count)]
        self.procs = [
            api_process(warehouse, http, tcp_port=tcp)
            for http, tcp in zip(self.http, self.tcp, strict=True)
        ]
        self.ps = [psutil.Process(p.pid) for p in self.procs]
        self.peak_rss = [0.0] * count
        self._cpu = [0.0] * count

    def mark(self) -> None:
        self._cpu = [_cpu(p) for p in self.ps]

    def cpu(self) -> list[float]:
        """CPU seconds each node used since ``mark``."""
        return [_cpu(p) - before for p, before in zip(self.ps, self._cpu, strict=True)]

    def sample(self) -> None:
        for i, p in enumerate(self.ps):
            self.peak_rss[i] = max(self.peak_rss[i], p.memory_info().rss / 2**20)

    def lanes(self) -> list[list[int]]:
        """The lanes each node serves of the channel."""
        return [_channel_stats(port).get("lanes") or [] for port in self.http]

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc)


def _cpu(p: psutil.Process) -> float:
    times = p.cpu_times()
    return float(times.user + times.system)


def _wait_shared(nodes: Nodes) -> None:
    """Until every node serves its shares (a node learns of the channel within a second)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lanes = nodes.lanes()
        if all(lanes) and sum(len(x) for x in lanes) == 16:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nodes never shared the channel: {nodes.lanes()}")


def consume(warehouse: Path, nodes: Nodes, backlog: int) -> dict[str, float]:
    body = b"\n".join([BODY] * 1000)
    for i in range(backlog // 1000):
        post(nodes.http[i % len(nodes.http)], f"/mpub?topic={TOPIC}", body)
    once = fanout_process(warehouse, "--once")
    assert once.wait(1800) == 0
    done = mp.Value("q", 0)
    stop_at = mp.Value("b", 0)
    procs = [
        mp.Process(target=_consume, args=(port, TOPIC, done, stop_at, None))
        for port in nodes.tcp
        for _ in range(CONSUMERS_PER_NODE)
    ]
    nodes.mark()
    started = time.perf_counter()
    for p in procs:
        p.start()
    while done.value < backlog and time.perf_counter() - started < 600:
        nodes.sample()
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    cpu = nodes.cpu()
    stop_at.value = 1
    for p in procs:
        p.join(30)
    rate = done.value / elapsed
    print(
        f"  consume {done.value:,} of {backlog:,} ({len(procs)} consumers RDY 200): "
        f"{rate:,.0f} msg/s in {elapsed:.1f} s; CPU per node "
        + ", ".join(f"{c / elapsed:.0%}" for c in cpu)
        + "; peak RSS per node "
        + ", ".join(f"{r:,.0f} MiB" for r in nodes.peak_rss),
        flush=True,
    )
    return {"consume": rate}


def _pipelined(port: int, rate: float, seconds: float, stop_at: mp.Value) -> None:  # type: ignore[type-arg]
    """PUB at ``rate`` msg/s on one connection without waiting for each OK (go-nsq's
    PublishAsync), each body its publish time."""
    sock = _connect(port)
    sock.settimeout(30)

    def drain() -> None:
        while True:
            try:
                if not sock.recv(65536):
                    return
            except OSError:
                return

    threading.Thread(target=drain, daemon=True).start()
    interval = 1 / rate
    next_at = time.monotonic()
    end = next_at + seconds
    while time.monotonic() < end and not stop_at.value:
        body = f"t {time.time_ns()}".encode()
        sock.sendall(f"PUB {TOPIC}\n".encode() + struct.pack(">i", len(body)) + body)
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    time.sleep(0.5)
    sock.close()


def latency(warehouse: Path, nodes: Nodes, rate: int, seconds: float) -> dict[str, float]:
    fanout = fanout_process(warehouse)
    done = mp.Value("q", 0)
    stop_at = mp.Value("b", 0)
    out: mp.Queue[list[float]] = mp.Queue()
    consumers = [
        mp.Process(target=_consume, args=(port, TOPIC, done, stop_at, out)) for port in nodes.tcp
    ]
    try:
        for p in consumers:
            p.start()
        # Until the path is warm (the fanout stream is running and delivering).
        deadline = time.monotonic() + 180
        while done.value == 0 and time.monotonic() < deadline:
            for port in nodes.http:
                post(port, f"/pub?topic={TOPIC}", b"warmup")
            time.sleep(0.5)
        time.sleep(2)
        before = done.value
        nodes.mark()
        started = time.perf_counter()
        publishers = [
            mp.Process(target=_pipelined, args=(port, rate / len(nodes.tcp), seconds, stop_at))
            for port in nodes.tcp
        ]
        for p in publishers:
            p.start()
        for p in publishers:
            p.join(seconds + 60)
        time.sleep(3)
        elapsed = time.perf_counter() - started
        cpu = nodes.cpu()
        delivered = done.value - before
    finally:
        stop_at.value = 1
        samples = sorted(s for _ in consumers for s in out.get(timeout=30))
        for p in consumers:
            p.join(30)
        stop(fanout, group=True)

    def p(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] if samples else float("nan")

    sent = int(rate * seconds)
    print(
        f"  publish -> delivered at {rate} msg/s over {len(nodes.tcp)} nodes for "
        f"{seconds:.0f} s: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms ({len(samples):,}/"
        f"{sent:,} delivered); CPU per node " + ", ".join(f"{c / elapsed:.0%}" for c in cpu),
        flush=True,
    )
    return {"p50": p(0.5), "p99": p(0.99), "delivered": delivered}


def takeover(warehouse: Path, nodes: Nodes) -> dict[str, float]:
    victim = len(nodes.procs) - 1
    count = 1000
    fanout = fanout_process(warehouse)
    done = mp.Value("q", 0)
    stop_at = mp.Value("b", 0)
    try:
        post(nodes.http[victim], f"/mpub?topic={TOPIC}", b"\n".join([BODY] * count))
        deadline = time.monotonic() + 120
        while _depth(nodes.http[victim]) < count:
            assert time.monotonic() < deadline, "the messages never reached the channel"
            time.sleep(0.1)
        consumers = [
            mp.Process(target=_consume, args=(port, TOPIC, done, stop_at, None))
            for port in nodes.tcp[:victim]
        ]
        for consumer in consumers:
            consumer.start()
        time.sleep(1)
        assert done.value == 0, "a survivor served the victim's share before it died"
        nodes.procs[victim].kill()
        killed = time.monotonic()
        nodes.procs[victim].wait(10)
        served = None
        delivered = None
        while (served is None or delivered is None) and time.monotonic() - killed < 120:
            lanes = [_channel_stats(port).get("lanes") or [] for port in nodes.http[:victim]]
            if served is None and sum(len(x) for x in lanes) == 16:
                served = time.monotonic() - killed
            if delivered is None and done.value >= count:
                delivered = time.monotonic() - killed
            time.sleep(0.02)
        stop_at.value = 1
        for consumer in consumers:
            consumer.join(30)
    finally:
        stop(fanout, group=True)
    print(
        f"  takeover after kill -9 of node {victim}: survivors serve every share after "
        f"{_seconds(served)}; all {count:,} of its waiting messages delivered by the "
        f"survivors' consumers after {_seconds(delivered)} ({done.value:,} got)",
        flush=True,
    )
    return {"served": served or float("nan"), "delivered": delivered or float("nan")}


def _seconds(value: float | None) -> str:
    return "never (120 s)" if value is None else f"{value:.2f} s"


def _depth(port: int) -> int:
    return int(_channel_stats(port).get("depth") or 0)


def _channel_stats(port: int) -> dict[str, Any]:
    """The channel's /stats figures on the node at ``port`` (empty before it knows it)."""
    url = f"http://{HOST}:{port}/stats?format=json&topic={TOPIC}&channel=c"
    with urllib.request.urlopen(url) as answer:
        stats = json.loads(answer.read())
    channels = stats["topics"][0]["channels"] if stats["topics"] else []
    return dict(channels[0]) if channels else {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=600)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--only", choices=["consume", "latency", "takeover"])
    args = parser.parse_args()
    print(f"cores: {psutil.cpu_count()}", flush=True)
    for count in (int(n) for n in args.nodes.split(",")):
        print(f"{count} node{'s' if count > 1 else ''}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            warehouse = Path(tmp) / "wh"
            warehouse.mkdir()
            nodes = Nodes(warehouse, count)
            try:
                post(nodes.http[0], f"/topic/create?topic={TOPIC}")
                post(nodes.http[0], f"/channel/create?topic={TOPIC}&channel=c")
                _wait_shared(nodes)
                print(f"  lanes per node: {nodes.lanes()}", flush=True)
                if args.only in (None, "consume"):
                    consume(warehouse, nodes, args.backlog)
                if args.only in (None, "latency"):
                    latency(warehouse, nodes, args.rate, args.seconds)
                if args.only in (None, "takeover") and count > 1:
                    takeover(warehouse, nodes)
            finally:
                nodes.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
