"""Many topics under load: publishing to random topics while some of them are consumed.

The API and ``deltaq fanout`` run as their own processes over ``--topics`` topics with one
channel each (created through the API, or those of ``--warehouse`` from an earlier run). For
``--seconds``, ``--connections`` keep-alive publishers each ``/pub`` a 200-byte message to a
random one of the first ``--active`` topics (default: all; ``ack = "commit"``: every answer
follows its Delta commit), while a consumer process long-polls the channels of ``--consumed``
of the topics and FINs what it gets. Printed: publish msg/s and latency, messages consumed,
publish -> consumed latency, and the fanout's batches (duration p50/p99, channels per batch)
and whole triggers (with the probing of every topic and Spark's logs) from its log. The bars
for 10,000 topics: >= 3,000 msg/s to random topics with 200 consumed; a fanout batch over 100
active topics p99 <= 1 s (``--active 100``).

    python -m bench.many_topics_load [--topics 10000] [--active N] [--consumed 200]
                                     [--connections 32] [--seconds 30] [--warehouse DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.loadgen import run
from bench.procs import (
    HOST,
    api_process,
    create_topics,
    fanout_process,
    free_port,
    post,
    stop,
    wait_all_open,
)

_BATCH = re.compile(
    r"fanout batch \d+: (\d+) rows in, \d+ channel rows out to (\d+) channels "
    r"\(read (\d+) ms, write (\d+) ms\)"
)
_TRIGGER = re.compile(r"fanout trigger \d+: (\d+) ms \(latestOffset (\d+),")


async def _call(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    path: str,
    body: bytes = b"",
) -> tuple[int, bytes]:
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return int(head[9:12]), await reader.readexactly(length) if length else b""


async def _consume(port: int, topic: str, since: float, deadline: float, seen: list[float]) -> None:
    reader, writer = await asyncio.open_connection(HOST, port)
    sub = f"/sub?topic={topic}&channel=c&max=100&wait_ms=1000&msg_timeout_ms=60000"
    try:
        while time.time() < deadline:
            status, body = await _call(reader, writer, "GET", sub)
            if status != 200:
                await asyncio.sleep(0.2)
                continue
            messages = json.loads(body)["messages"]
            if not messages:
                continue
            now = time.time()
            lines = "".join(f"{m['id']} {m['lease']}\n" for m in messages).encode()
            await _call(reader, writer, "POST", f"/fin?topic={topic}&channel=c", lines)
            # Only this run's messages (the warehouse may hold older ones of earlier runs).
            seen.extend(
                now - m["timestamp"] / 1e9 for m in messages if m["timestamp"] / 1e9 >= since
            )
    finally:
        writer.close()


def _consumers(port: int, topics: list[str], since: float, deadline: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    seen: list[float] = []

    async def main() -> None:
        await asyncio.gather(*(_consume(port, t, since, deadline, seen) for t in topics))

    asyncio.run(main())
    out.put(seen)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topics", type=int, default=10_000)
    parser.add_argument("--active", type=int, default=None, help="topics published to")
    parser.add_argument("--consumed", type=int, default=200)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warehouse", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        warehouse = args.warehouse or Path(tmp) / "wh"
        existing = (warehouse / "topics").is_dir()
        port = free_port()
        api = api_process(warehouse, port)
        fanout = None
        try:
            if not existing:
                create_topics(port, args.topics)
            wait_all_open(warehouse)
            fanout_log = warehouse.parent / "fanout.log"
            fanout_log.write_text("")
            fanout = fanout_process(warehouse, "--log-batches")
            deadline = time.monotonic() + 180
            while "fanout batch" not in fanout_log.read_text(errors="replace"):
                assert time.monotonic() < deadline, "the fanout did not start"
                post(port, "/pub?topic=t0", b"warm-up")
                time.sleep(1)
            skip = fanout_log.read_text(errors="replace").count("\n")

            consumed = [f"t{i}" for i in range(args.consumed)]
            out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            since = time.time()
            stop_at = since + args.seconds + 5  # consumers drain a little past the load
            consumer = mp.Process(target=_consumers, args=(port, consumed, since, stop_at, out))
            consumer.start()
            topics = [f"t{i}" for i in range(args.active or args.topics)]
            result = run(
                HOST,
                port,
                lambda: f"/pub?topic={random.choice(topics)}",
                b"x" * 200,
                args.connections,
                args.seconds,
            )
            seen = out.get(timeout=args.seconds + 60)
            consumer.join(10)
            lines = fanout_log.read_text(errors="replace").splitlines()[skip:]
            batches = [tuple(map(int, m.groups())) for line in lines if (m := _BATCH.search(line))]
            triggers = [
                tuple(map(int, m.groups())) for line in lines if (m := _TRIGGER.search(line))
            ]
        finally:
            if fanout is not None:
                stop(fanout, group=True)
            stop(api)
    rate = result.requests / result.elapsed_s
    print(
        f"/pub to a random one of {len(topics):,} of {args.topics:,} topics, "
        f"{args.connections} connections, "
        f"{args.seconds:.0f} s: {rate:,.0f} msg/s (bar: >= 3,000), "
        f"p50 {result.percentile_ms(0.5):.1f} ms, p99 {result.percentile_ms(0.99):.1f} ms, "
        f"{result.errors} errors"
    )
    # Publishes spread evenly over the active topics; the consumed ones are t0... too.
    expected = result.requests * min(args.consumed, len(topics)) / len(topics)
    print(
        f"consumed from {args.consumed} of them: {len(seen):,} of this run's messages "
        f"(~{expected:,.0f} published to them; drained for 5 s after); "
        f"publish -> consumed p50 {_percentile(seen, 0.5) * 1000:.0f} ms, "
        f"p99 {_percentile(seen, 0.99) * 1000:.0f} ms"
    )
    durations = [read + write for _, _, read, write in batches]
    channels = [n for _, n, _, _ in batches]
    print(
        f"fanout: {len(batches)} batches, {_percentile(channels, 0.5):.0f} channels per batch "
        f"(p50; max {max(channels, default=0)}), batch p50 {_percentile(durations, 0.5):.0f} ms, "
        f"p99 {_percentile(durations, 0.99):.0f} ms (bar over 100 active topics: <= 1,000 ms)"
    )
    whole = [total for total, _ in triggers]
    probes = [probe for _, probe in triggers]
    print(
        f"fanout triggers (batch + probing the topics + Spark's logs): "
        f"p50 {_percentile(whole, 0.5):.0f} ms, p99 {_percentile(whole, 0.99):.0f} ms; "
        f"probing (latestOffset) p50 {_percentile(probes, 0.5):.0f} ms, "
        f"p99 {_percentile(probes, 0.99):.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
