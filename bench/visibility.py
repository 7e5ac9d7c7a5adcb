"""Publish -> visible in the topic table with ``ack = "journal"``: how long after its
acknowledgement a message is in its topic's Delta table, for one busy topic and for 1,000
active topics at the same total rate.

For each topic count, a fresh ``deltaq api`` on 127.0.0.1: the topics are created, then
publisher processes ``/pub`` to a random one of them at ``--rate`` msg/s in all for
``--seconds``, each recording when its ``OK`` came. Afterwards each topic's commit log says
when each commit was made (``commitInfo.timestamp``, taken just before the commit file is put
in place) and which data files it added; a message's body names its publish. Latency = commit
time - acknowledgement time (the two clocks are the machine's one wall clock).

    python -m bench.visibility [--topics 1,1000] [--rate 2000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq

from bench.procs import HOST, api_process, file_create_us, free_port, post, stop

PUBLISHERS = 4


def _publish(port: int, topics: int, rate: float, seconds: float, name: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """``/pub`` at ``rate`` msg/s over one keep-alive connection; (body, ack time) for each OK."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    acked: list[tuple[str, float]] = []
    interval = 1.0 / rate
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    n = 0
    while time.monotonic() < end:
        body = f"{name}-{n}"
        conn.request("POST", f"/pub?topic=v{random.randrange(topics)}", body=body.encode())
        response = conn.getresponse()
        if response.read() == b"OK" and response.status == 200:
            acked.append((body, time.time()))
        n += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    conn.close()
    out.put(acked)


def _visible_at(topics_root: Path, seen_files: dict[str, float], found: dict[str, float]) -> None:
    """Add to ``found`` body -> commit time (s) for every data file committed so far."""
    for topic in os.scandir(topics_root):
        log_dir = Path(topic.path) / "_delta_log"
        if not log_dir.is_dir():
            continue
        for entry in os.scandir(log_dir):
            if not entry.name.endswith(".json") or entry.path in seen_files:
                continue
            actions = [json.loads(line) for line in Path(entry.path).read_text().splitlines()]
            committed_ms = next(
                (a["commitInfo"]["timestamp"] for a in actions if "commitInfo" in a), None
            )
            seen_files[entry.path] = 0.0
            if committed_ms is None:
                continue
            for action in actions:
                if "add" not in action:
                    continue
                data = Path(topic.path) / action["add"]["path"]
                for body in pq.read_table(data, columns=["body"])["body"].to_pylist():
                    found[body.decode()] = committed_ms / 1000


def _percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def run(topics: int, rate: int, seconds: float, workdir: Path) -> None:
    warehouse = workdir / f"topics-{topics}" / "wh"
    warehouse.parent.mkdir(parents=True)
    port = free_port()
    api = api_process(warehouse, port)
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: post(port, f"/topic/create?topic=v{i}"), range(topics)))
        create_us = file_create_us(workdir / f"probe-{topics}")
        out: mp.Queue[list[tuple[str, float]]] = mp.Queue()
        per = rate / PUBLISHERS
        procs = [
            mp.Process(target=_publish, args=(port, topics, per, seconds, f"p{i}", out))
            for i in range(PUBLISHERS)
        ]
        for p in procs:
            p.start()
        acked = dict(pair for _ in procs for pair in out.get())
        for p in procs:
            p.join(30)
        found: dict[str, float] = {}
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _visible_at(warehouse / "topics", seen, found)
            if all(body in found for body in acked):
                break
            time.sleep(0.5)
    finally:
        stop(api)
    latencies = sorted(found[b] - at for b, at in acked.items() if b in found)
    missing = sum(1 for b in acked if b not in found)
    print(
        f"{topics:>6} topics: {len(acked) / seconds:,.0f} msg/s acknowledged; publish -> "
        f"visible p50 {_percentile(latencies, 0.5) * 1000:,.0f} ms, p90 "
        f"{_percentile(latencies, 0.9) * 1000:,.0f} ms, p99 "
        f"{_percentile(latencies, 0.99) * 1000:,.0f} ms, max {latencies[-1] * 1000:,.0f} ms "
        f"({len(latencies)} visible, {missing} not after 60 s; file create {create_us:.0f} us)",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topics", default="1,1000")
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(
        f'ack = "journal", local disk, {args.rate} msg/s of /pub for {args.seconds:.0f} s, '
        f"{PUBLISHERS} publishers, each message to a random topic",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for topics in (int(t) for t in args.topics.split(",")):
            run(topics, args.rate, args.seconds, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
