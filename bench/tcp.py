"""nsqd's TCP protocol: deltaq beside the reference nsqd 1.3.0, same load generator, same run.

1. consume: a backlog of ``--backlog`` 200-byte messages on one channel (deltaq: fanned out
   first with ``deltaq fanout --once``), then 4 consumer processes (SUB, RDY 200, FIN each
   message) until it is empty. msg/s.
2. publish: 16 connections for ``--seconds`` each, ``PUB`` one message and wait for OK; then
   ``MPUB`` of 100. msg/s.
3. latency: one consumer (RDY 100, FIN each) on a channel, a publisher at ``--rate`` msg/s
   (default 1,000) pipelining ``PUB`` on one connection (it does not wait for each OK), each
   body its publish time (deltaq: the fanout streaming). p50/p99 publish -> delivered.

Prints each figure for both and the ratio deltaq / nsqd. The load generator is Python
(processes of raw sockets, frames parsed in bulk); both servers get the same.

With ``--store s3`` deltaq's warehouse is on moto's S3 server behind a loopback proxy adding
``--store-delay-ms`` to every request (nsqd keeps its files on local disk, as it always does).

    python -m bench.tcp [--backlog 200000] [--seconds 10] [--rate 1000] [--only consume]
                        [--consumers 4] [--store local|s3] [--store-delay-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import random
import socket
import struct
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.procs import (
    HOST,
    api_process,
    fanout_process,
    free_port,
    nsqd_process,
    object_store,
    post,
    stop,
)

BODY = b"x" * 200
CONSUMERS = 4
RDY = 200
PUBLISHERS = 16
PUBLISHER_PROCESSES = 2


@dataclass
class Target:
    name: str
    tcp_port: int
    http_port: int
    pid: int


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"  V2")
    return sock


def _frames(buffer: bytearray) -> tuple[list[tuple[int, bytes]], int]:
    """Whole frames at the start of ``buffer`` and how many bytes they took."""
    out = []
    at = 0
    end = len(buffer)
    while end - at >= 8:
        size, kind = struct.unpack_from(">ii", buffer, at)
        if end - at - 4 < size:
            break
        out.append((kind, bytes(buffer[at + 8 : at + 4 + size])))
        at += 4 + size
    return out, at


def _consume(
    port: int, topic: str, done: mp.Value, stop_at: mp.Value, latencies: mp.Queue | None
) -> None:  # type: ignore[type-arg]
    sock = _connect(port)
    sock.sendall(f"SUB {topic} c\nRDY {RDY}\n".encode())
    buffer = bytearray()
    count = 0
    samples = []
    sock.settimeout(0.2)
    while not stop_at.value:
        try:
            chunk = sock.recv(1 << 18)
        except TimeoutError:
            continue
        if not chunk:
            break
        now = time.time_ns()
        buffer += chunk
        frames, used = _frames(buffer)
        del buffer[:used]
        fins = []
        nops = []
        for kind, data in frames:
            if kind == 2:
                fins.append(b"FIN " + data[10:26] + b"\n")
                if latencies is not None and data[26:28] == b"t ":
                    samples.append((now - int(data[28:])) / 1e6)
            elif data == b"_heartbeat_":
                nops.append(b"NOP\n")
        if fins or nops:
            sock.sendall(b"".join(fins + nops))
        if fins:
            count += len(fins)
            with done.get_lock():
                done.value += len(fins)
    if latencies is not None:
        latencies.put(samples)
    sock.close()


def consume(
    target: Target, backlog: int, prepare: Callable[[], None], consumers: int = CONSUMERS
) -> float:
    topic = "bench_consume"
    post(target.http_port, f"/topic/create?topic={topic}")
    post(target.http_port, f"/channel/create?topic={topic}&channel=c")
    body = b"\n".join([BODY] * 1000)
    for _ in range(backlog // 1000):
        post(target.http_port, f"/mpub?topic={topic}", body)
    prepare()
    deadline = time.monotonic() + 600
    while _depth(target, topic) < backlog and time.monotonic() < deadline:
        time.sleep(0.2)
    done = mp.Value("q", 0)
    stop_at = mp.Value("b", 0)
    procs = [
        mp.Process(target=_consume, args=(target.tcp_port, topic, done, stop_at, None))
        for _ in range(consumers)
    ]
    server = psutil.Process(target.pid)
    before = peak = server.memory_info().rss
    # The server's own processes (deltaq's table upkeep), reported beside it.
    children_peak = 0
    started = time.perf_counter()
    for p in procs:
        p.start()
    for tick in itertools.count():
        if done.value >= backlog or time.perf_counter() - started >= 600:
            break
        time.sleep(0.005)
        peak = max(peak, server.memory_info().rss)
        if tick % 20 == 0:  # finding children reads every process's status: not as often
            children_peak = max(children_peak, _children_rss(server))
    elapsed = time.perf_counter() - started
    stop_at.value = 1
    for p in procs:
        p.join(30)
    rate = done.value / elapsed
    print(
        f"  {target.name}: consume {done.value:,} of {backlog:,}, {consumers} consumers RDY "
        f"{RDY}, FIN each: {rate:,.0f} msg/s ({elapsed:.1f} s; server RSS {before / 2**20:,.0f} "
        f"MiB before, peak {peak / 2**20:,.0f} MiB while consuming; its child processes "
        f"peak {children_peak / 2**20:,.0f} MiB)",
        flush=True,
    )
    return rate


def _children_rss(server: psutil.Process) -> int:
    total = 0
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


def _depth(target: Target, topic: str) -> int:
    url = f"http://{HOST}:{target.http_port}/stats?format=json&topic={topic}&channel=c"
    with urllib.request.urlopen(url) as answer:
        stats = json.loads(answer.read())
    topics = stats.get("topics") or []
    if not topics or not topics[0]["channels"]:
        return 0
    return int(topics[0]["channels"][0]["depth"])


def _publish(
    port: int,
    topic: str,
    batch: int,
    connections: int,
    seconds: float,
    out: mp.Queue,  # type: ignore[type-arg]
    topics: int = 0,
) -> None:
    """``connections`` sockets, each: one PUB (or MPUB of ``batch``) then wait for its OK;
    with ``topics``, each command goes to one of ``<topic>_0`` .. ``<topic>_<topics - 1>`` at
    random."""
    socks = [_connect(port) for _ in range(connections)]
    if batch == 1:
        tail = struct.pack(">i", len(BODY)) + BODY
        verb = "PUB"
    else:
        payload = struct.pack(">i", batch) + (struct.pack(">i", len(BODY)) + BODY) * batch
        tail = struct.pack(">i", len(payload)) + payload
        verb = "MPUB"
    names = [f"{topic}_{i}" for i in range(topics)] if topics else [topic]
    commands = [f"{verb} {name}\n".encode() + tail for name in names]

    def command() -> bytes:
        return commands[random.randrange(len(commands))]

    sent = 0
    end = time.monotonic() + seconds
    for sock in socks:
        sock.sendall(command())
    buffers = {sock: bytearray() for sock in socks}
    import selectors

    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    while time.monotonic() < end:
        for key, _ in selector.select(1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            buffer = buffers[sock]
            buffer += sock.recv(1 << 16)
            frames, used = _frames(buffer)
            del buffer[:used]
            for kind, data in frames:
                if data == b"_heartbeat_":
                    sock.sendall(b"NOP\n")
                    continue
                assert (kind, data) == (0, b"OK"), (kind, data)
                sent += batch
                sock.sendall(command())
    out.put(sent)
    for sock in socks:
        sock.close()


def publish(target: Target, batch: int, seconds: float, topics: int = 0) -> float:
    """msg/s of ``PUBLISHERS`` connections each waiting for every answer: to one topic, or
    with ``topics`` to that many at random (created first, without channels)."""
    topic = f"bench_pub_{batch}" + (f"_of_{topics}" if topics else "")
    for name in [f"{topic}_{i}" for i in range(topics)] if topics else [topic]:
        post(target.http_port, f"/topic/create?topic={name}")
    out: mp.Queue[int] = mp.Queue()
    per = PUBLISHERS // PUBLISHER_PROCESSES
    procs = [
        mp.Process(target=_publish, args=(target.tcp_port, topic, batch, per, seconds, out, topics))
        for _ in range(PUBLISHER_PROCESSES)
    ]
    for p in procs:
        p.start()
    total = sum(out.get() for _ in procs)
    for p in procs:
        p.join(30)
    rate = total / seconds
    what = "PUB" if batch == 1 else f"MPUB x{batch}"
    where = f" to {topics:,} topics at random" if topics else ""
    print(
        f"  {target.name}: {what}, {PUBLISHERS} connections{where}: {rate:,.0f} msg/s",
        flush=True,
    )
    return rate


def latency(
    target: Target,
    rate: int,
    seconds: float,
    topic: str = "bench_latency",
    before: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """p50 and p99 ms from publish to delivery, ``rate`` msg/s pipelined on one connection to
    ``topic`` whose channel has one consumer; ``before`` runs once the path is warm, just
    before the measured publishes (e.g. a burst to other topics)."""
    post(target.http_port, f"/topic/create?topic={topic}")
    post(target.http_port, f"/channel/create?topic={topic}&channel=c")
    done = mp.Value("q", 0)
    stop_at = mp.Value("b", 0)
    out: mp.Queue[list[float]] = mp.Queue()
    consumer = mp.Process(target=_consume, args=(target.tcp_port, topic, done, stop_at, out))
    consumer.start()
    sock = _connect(target.tcp_port)
    sock.settimeout(30)

    pending = bytearray()

    def pub(body: bytes) -> None:
        """PUB and wait for its OK, answering heartbeats meanwhile (the warm-up can outlast
        the heartbeat interval while deltaq's Spark starts)."""
        sock.sendall(f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body)
        while True:
            frames, used = _frames(pending)
            del pending[:used]
            for _, payload in frames:
                if payload == b"_heartbeat_":
                    sock.sendall(b"NOP\n")
                    continue
                assert payload == b"OK", payload
                return
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            pending.extend(data)

    # Until the path is warm (deltaq: the fanout stream is running and delivering).
    deadline = time.monotonic() + 180
    while done.value == 0 and time.monotonic() < deadline:
        pub(b"warmup")
        time.sleep(0.5)
    time.sleep(2)
    if before is not None:
        before()
        # A fresh connection: this one went unread while ``before`` ran, and a server closes
        # a connection that leaves two heartbeats unanswered.
        sock.close()
        sock = _connect(target.tcp_port)
        sock.settimeout(30)
        pending.clear()
    # From here the publisher pipelines, as go-nsq's PublishAsync and pynsq's Writer do: it
    # sends each PUB when due and reads the answers in another thread.
    answered = [0]

    def read_answers() -> None:
        buffer = bytearray(pending)  # what the warm-up read past its last answer
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            buffer += data
            frames, used = _frames(buffer)
            del buffer[:used]
            answered[0] += sum(1 for _, payload in frames if payload == b"OK")

    reader = threading.Thread(target=read_answers, daemon=True)
    reader.start()
    interval = 1 / rate
    next_at = time.monotonic()
    end = next_at + seconds
    sent = 0
    while time.monotonic() < end:
        body = f"t {time.time_ns()}".encode()
        sock.sendall(f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body)
        sent += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    time.sleep(3)
    stop_at.value = 1
    samples = sorted(out.get(timeout=30))
    consumer.join(30)
    sock.close()

    def p(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] if samples else float("nan")

    print(
        f"  {target.name}: publish -> delivered over TCP, {rate} msg/s for {seconds:.0f} s: "
        f"p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms ({len(samples)}/{sent} delivered)",
        flush=True,
    )
    return p(0.5), p(0.99)


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x nsqd" if theirs else "no nsqd to compare"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--only", choices=["consume", "publish", "latency"])
    parser.add_argument("--consumers", type=int, default=CONSUMERS)
    parser.add_argument("--store", default="local", choices=["local", "s3"])
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {"deltaq": {}, "nsqd": {}}
    with (
        tempfile.TemporaryDirectory() as tmp,
        object_store(args.store, args.store_delay_ms, Path(tmp)) as where,
    ):
        print(f"deltaq's warehouse: {where}", flush=True)
        for name in ("nsqd", "deltaq"):
            tcp_port, http_port = free_port(), free_port()
            wh = Path(tmp) / name / "wh"
            wh.parent.mkdir(parents=True)
            fanout = None
            if name == "nsqd":
                proc = nsqd_process(Path(tmp) / "nsqd-data", tcp_port, http_port)
                if proc is None:
                    print("nsqd: binary absent (../shared/tools/nsq-1.3.0): deltaq only")
                    continue
            else:
                proc = api_process(wh, http_port, tcp_port=tcp_port)
            target = Target(name, tcp_port, http_port, proc.pid)
            figures = results[name]
            try:
                if args.only in (None, "publish"):
                    figures["pub"] = publish(target, 1, args.seconds)
                    figures["mpub"] = publish(target, 100, args.seconds)
                if args.only in (None, "consume"):

                    def prepare(name: str = name, wh: Path = wh) -> None:
                        if name == "deltaq":
                            once = fanout_process(wh, "--once")
                            assert once.wait(1800) == 0

                    figures["consume"] = consume(target, args.backlog, prepare, args.consumers)
                if args.only in (None, "latency"):
                    if name == "deltaq":
                        fanout = fanout_process(wh)
                    figures["p50"], figures["p99"] = latency(target, args.rate, args.seconds)
            finally:
                if fanout is not None:
                    stop(fanout, group=True)
                stop(proc)
    ours, theirs = results["deltaq"], results["nsqd"]
    print("deltaq / nsqd:")
    for key, label in (
        ("consume", f"consume ({args.consumers} consumers, RDY {RDY})"),
        ("pub", f"PUB, {PUBLISHERS} connections"),
        ("mpub", f"MPUB x100, {PUBLISHERS} connections"),
    ):
        if key in ours:
            print(
                f"  {label}: {ours[key]:,.0f} vs {theirs.get(key, 0):,.0f} msg/s = "
                f"{_ratio(ours[key], theirs.get(key))}"
            )
    if "p50" in ours:
        print(
            f"  latency p50 {ours['p50']:.1f} vs {theirs.get('p50', float('nan')):.1f} ms, "
            f"p99 {ours['p99']:.1f} vs {theirs.get('p99', float('nan')):.1f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
