"""Consumer throughput and publish -> delivered latency, with the API and the fanout running.

1. Throughput: ``--backlog`` 200-byte messages are published to a topic with one channel per
   case and fanned out (``deltaq fanout --once``); then 1 and 8 consumer processes each loop
   ``GET /sub?max=100`` + one batch ``POST /fin`` until the channel is empty. Prints msg/s
   (every message leased and FIN'd, both committed to the ledger before the answers).
2. Latency: ``deltaq fanout`` streaming, two consumers long-polling (max=100), a publisher at
   ``--rate`` msg/s for ``--seconds``; each body carries its publish time. Prints publish ->
   delivered-to-consumer p50/p99.

    python -m bench.consume [--backlog 100000] [--rate 200] [--seconds 20]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.procs import (
    HOST,
    api_process,
    fanout_process,
    file_create_us,
    free_port,
    object_store,
    post,
    publish_timestamps,
    stop,
)


def _channel(port: int, topic: str, channel: str) -> dict[str, int]:
    conn = http.client.HTTPConnection(HOST, port)
    conn.request("GET", f"/stats?format=json&topic={topic}&channel={channel}")
    stats = json.loads(conn.getresponse().read())
    conn.close()
    result: dict[str, int] = stats["topics"][0]["channels"][0]
    return result


def _consumer(port: int, topic: str, channel: str, deadline: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """SUB max=100 then FIN them in one request, until two empty polls in a row."""
    conn = http.client.HTTPConnection(HOST, port)
    done = 0
    empty = 0
    while time.time() < deadline and empty < 2:
        conn.request("GET", f"/sub?topic={topic}&channel={channel}&max=100&wait_ms=300")
        messages = json.loads(conn.getresponse().read())["messages"]
        if not messages:
            empty += 1
            continue
        empty = 0
        body = "".join(f"{m['id']} {m['lease']}\n" for m in messages).encode()
        conn.request("POST", f"/fin?topic={topic}&channel={channel}", body=body)
        response = conn.getresponse()
        assert response.read() == b"OK", response.status
        done += len(messages)
    out.put(done)


def throughput(backlog: int, consumers: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wh = Path(tmp) / "wh"
        create_us = file_create_us(Path(tmp))
        port = free_port()
        api = api_process(wh, port)
        try:
            post(port, "/topic/create?topic=q")
            for n in consumers:
                post(port, f"/channel/create?topic=q&channel=c{n}")
            body = b"\n".join([b"x" * 200] * 1000)
            published = 0
            while published < backlog:
                post(port, "/mpub?topic=q", body)
                published += 1000
            fanout = fanout_process(wh, "--once")
            assert fanout.wait(1800) == 0, (wh.parent / "fanout.log").read_text()[-3000:]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if all(_channel(port, "q", f"c{n}")["depth"] >= published for n in consumers):
                    break
                time.sleep(0.2)
            process = psutil.Process(api.pid)
            for n in consumers:
                out: mp.Queue[int] = mp.Queue()
                started = time.perf_counter()
                procs = [
                    mp.Process(target=_consumer, args=(port, "q", f"c{n}", time.time() + 600, out))
                    for _ in range(n)
                ]
                for p in procs:
                    p.start()
                total = sum(out.get() for _ in procs)
                for p in procs:
                    p.join()
                elapsed = time.perf_counter() - started - 0.6  # two empty 300 ms polls at the end
                stats = _channel(port, "q", f"c{n}")
                print(
                    f"consume {published:,} msgs, {n} consumer(s), /sub max=100 + batch /fin: "
                    f"{total / elapsed:,.0f} msg/s ({total:,} FIN'd in {elapsed:.1f} s; depth "
                    f"{stats['depth']}, in flight {stats['in_flight_count']}); API RSS "
                    f"{process.memory_info().rss / 2**20:,.0f} MiB; file create {create_us:.0f} us"
                )
        finally:
            stop(api)


def latency(rate: int, seconds: float, warmup: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wh = Path(tmp) / "wh"
        create_us = file_create_us(Path(tmp))
        port = free_port()
        api = api_process(wh, port)
        fanout = fanout_process(wh)
        samples: list[float] = []
        stop_consumers = threading.Event()
        lock = threading.Lock()

        def consume() -> None:
            conn = http.client.HTTPConnection(HOST, port, timeout=60)
            while not stop_consumers.is_set():
                conn.request("GET", "/sub?topic=lat&channel=c&max=100&wait_ms=1000")
                messages = json.loads(conn.getresponse().read())["messages"]
                now = time.time_ns()
                if not messages:
                    continue
                with lock:
                    for m in messages:
                        body = base64.b64decode(m["body"])
                        if body.startswith(b"t "):
                            samples.append((now - int(body[2:])) / 1e6)
                fin = "".join(f"{m['id']} {m['lease']}\n" for m in messages).encode()
                conn.request("POST", "/fin?topic=lat&channel=c", body=fin)
                conn.getresponse().read()

        try:
            post(port, "/topic/create?topic=lat")
            post(port, "/channel/create?topic=lat&channel=c")
            threads = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
            for t in threads:
                t.start()
            # Wait until the fanout job delivers: warm-up messages until one comes back.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and _channel(port, "lat", "c")["message_count"] == 0:
                post(port, "/pub?topic=lat", b"warmup")
                time.sleep(0.5)
            time.sleep(2)
            publish_timestamps(port, "lat", rate, warmup, prefix="w")
            sent = publish_timestamps(port, "lat", rate, seconds)
            time.sleep(3)
            stop_consumers.set()
            with lock:
                ordered = sorted(samples)
            if not ordered:
                print("latency: no samples")
                return

            def p(q: float) -> float:
                return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

            print(
                f"publish -> delivered to a consumer, {rate} msg/s for {seconds:.0f} s: "
                f"p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, max {ordered[-1]:.0f} ms "
                f"({len(ordered)}/{sent} delivered; file create {create_us:.0f} us)"
            )
        finally:
            stop(fanout, group=True)
            stop(api)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--warmup", type=float, default=5, help="seconds of the same load before measuring"
    )
    parser.add_argument("--only", choices=["throughput", "latency"])
    parser.add_argument("--consumers", default="1,8", help="consumer counts to run, e.g. 1,8")
    parser.add_argument("--store", default="local", choices=["local", "s3"])
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        object_store(args.store, args.store_delay_ms, Path(tmp)) as where,
    ):
        print(f"warehouse on {where}")
        if args.only in (None, "throughput"):
            throughput(args.backlog, [int(n) for n in args.consumers.split(",")])
        if args.only in (None, "latency"):
            latency(args.rate, args.seconds, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
