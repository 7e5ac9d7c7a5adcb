"""Publish throughput and latency over HTTP: /pub with 1 and 16 connections, /pub to 1,000
topics at random, /mpub with 100 per request; beside the reference nsqd 1.3.0 in the same run.
The ``*json`` and ``*typed`` cases publish the same 200-byte JSON objects to an untyped and a
typed topic (six declared fields), and print typed / untyped.

Each case starts a fresh ``deltaq api`` on 127.0.0.1 (a new warehouse) and then a fresh nsqd
(``../shared/tools``; skipped where absent or with ``--no-nsqd``), drives each with
bench/loadgen.py from a separate process, and prints msg/s, latency p50/p99, messages per Delta
commit and the server's peak RSS, then deltaq's ratio. A fresh server per case: what one case
leaves behind (1,000 topics' lingering commits and first upkeep passes) does not slow the next.
Nothing is asserted: the figures go in docs/benchmarks.md.

    python -m bench.publish [--seconds 10] [--ack journal|commit|buffer]
                            [--only pub1,pub16,topics1000,mpub16]
    python -m bench.publish --no-nsqd --only pub16json,pub16typed,mpub16json,mpub16typed
    python -m bench.publish --store s3 --only pub64,mpub16   # moto's S3, 20 ms per request

``--store s3`` puts the warehouse on moto's S3 server behind a loopback proxy that adds
``--store-delay-ms`` (default 20) to every store request, as an object store's latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import random
import tempfile
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

from bench.loadgen import LoadResult, run
from bench.procs import api_process, file_create_us, free_port, nsqd_process, object_store, stop

HOST = "127.0.0.1"
BODY = b"x" * 200
# A typed topic's bodies: six declared fields and one the schema leaves in the body, 200 bytes.
SCHEMA = "sku STRING NOT NULL, amount DOUBLE, qty INT, placed_at TIMESTAMP, day DATE, gift BOOLEAN"
_FIELDS = (
    b'{"sku":"A-12345","amount":12.5,"qty":3,"placed_at":"2026-11-27T09:30:00Z",'
    b'"day":"2026-11-27","gift":false,"note":"'
)
JSON_BODY = _FIELDS + b"n" * (200 - len(_FIELDS) - 2) + b'"}'


def _stats(port: int, topic: str) -> dict[str, int]:
    if topic.endswith("*"):
        return {"messages": 0, "commits": 0}
    with urllib.request.urlopen(f"http://{HOST}:{port}/stats?format=json&topic={topic}") as r:
        data = json.load(r)
    for t in data["topics"] or []:
        if t["topic_name"] == topic:
            return {"messages": t["message_count"], "commits": t.get("delta_commits", 0)}
    return {"messages": 0, "commits": 0}


def _random_topic_path() -> str:
    return f"/pub?topic=bench_many_{random.randrange(1000)}"


def _load(args: tuple[int, str, bytes, int, float], out: mp.Queue) -> None:  # type: ignore[type-arg]
    port, path, body, conns, seconds = args
    # "topic=bench_many_*": each request to one of 1,000 topics at random.
    target = _random_topic_path if path.endswith("*") else path
    r = run(HOST, port, target, body, conns, seconds)
    out.put((r.requests, r.errors, r.elapsed_s, r.latencies_s))


def _case(
    port: int,
    name: str,
    path: str,
    body: bytes,
    per_request: int,
    conns: int,
    seconds: float,
    server: psutil.Process,
    peak: list[int],
) -> dict[str, object]:
    topic = path.split("topic=")[1].split("&", maxsplit=1)[0]
    before = _stats(port, topic)
    out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    proc = mp.Process(target=_load, args=((port, path, body, conns, seconds), out))
    proc.start()
    requests, errors, elapsed, lat = out.get()
    proc.join()
    result = LoadResult(requests, errors, lat, elapsed)
    after = _stats(port, topic)
    commits = after["commits"] - before["commits"]
    msgs = after["messages"] - before["messages"]
    return {
        "case": name,
        "connections": conns,
        "msg_per_s": round(requests * per_request / elapsed),
        "p50_ms": round(result.percentile_ms(0.50), 2),
        "p99_ms": round(result.percentile_ms(0.99), 2),
        "errors": errors,
        "msgs_per_commit": round(msgs / commits, 1) if commits else 0,
        "committed": msgs,
        "server_peak_rss_mb": round(peak[0] / 2**20),
    }


CASES = {
    "pub1": ("/pub", "/pub?topic=bench_pub1", BODY, 1, 1),
    "pub16": ("/pub", "/pub?topic=bench_pub16", BODY, 1, 16),
    "topics1000": ("/pub 1k topics", "/pub?topic=bench_many_*", BODY, 1, 16),
    "pub64": ("/pub", "/pub?topic=bench_pub64", BODY, 1, 64),
    "mpub16": ("/mpub x100", "/mpub?topic=bench_mpub", b"\n".join([BODY] * 100), 100, 16),
    "pub16json": ("/pub untyped", "/pub?topic=bench_json16", JSON_BODY, 1, 16),
    "pub16typed": ("/pub typed", "/pub?topic=bench_typed16", JSON_BODY, 1, 16),
    "mpub16json": (
        "/mpub x100 untyp",
        "/mpub?topic=bench_json_mpub",
        b"\n".join([JSON_BODY] * 100),
        100,
        16,
    ),
    "mpub16typed": (
        "/mpub x100 typed",
        "/mpub?topic=bench_typed_mpub",
        b"\n".join([JSON_BODY] * 100),
        100,
        16,
    ),
}
ROW = "{:<12}{:<16}{:>6}{:>10}{:>9}{:>9}{:>8}{:>12}{:>13}"


def _run_case(name: str, key: str, port: int, pid: int, seconds: float) -> dict[str, object]:
    """One case against a server that has seen nothing else (its peak RSS is this case's)."""
    proc = psutil.Process(pid)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], proc.memory_info().rss)

    threading.Thread(target=sample, daemon=True).start()
    label, path, body, per, conns = CASES[key]
    try:
        if key.endswith("typed"):
            topic = path.split("topic=")[1]
            query = urllib.parse.urlencode({"topic": topic, "schema": SCHEMA})
            urllib.request.urlopen(f"http://{HOST}:{port}/topic/create?{query}", data=b"").read()
        if path.endswith("*"):
            # 1,000 active topics: created and published to once first (creating a topic is
            # an admin change, and its first publish opens its writer: once per topic and
            # node, not what this case measures), then published to at random.
            for n in range(1000):
                urllib.request.urlopen(
                    f"http://{HOST}:{port}/topic/create?topic=bench_many_{n}", data=b""
                ).read()
                urllib.request.urlopen(
                    f"http://{HOST}:{port}/pub?topic=bench_many_{n}", data=b"warm"
                ).read()
        r = _case(port, label, path, body, per, conns, seconds, proc, peak)
    finally:
        stop.set()
    print(
        ROW.format(
            name,
            str(r["case"]),
            r["connections"],
            r["msg_per_s"],
            r["p50_ms"],
            r["p99_ms"],
            r["errors"],
            r["msgs_per_commit"],
            r["server_peak_rss_mb"],
        ),
        flush=True,
    )
    return r


@contextlib.contextmanager
def _deltaq(root: Path, ack: str) -> Iterator[tuple[int, int]]:
    """``deltaq api`` over a fresh warehouse under ``root``: (port, pid)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = api_process(root / "wh", port, env={"DELTAQ_ACK": ack})
    try:
        yield port, server.pid
    finally:
        stop(server)


@contextlib.contextmanager
def _nsqd(root: Path) -> Iterator[tuple[int, int] | None]:
    port = free_port()
    nsqd = nsqd_process(root / "nsqd-data", free_port(), port)
    if nsqd is None:
        yield None
        return
    try:
        yield port, nsqd.pid
    finally:
        stop(nsqd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ack", default="journal", choices=["journal", "commit", "buffer"])
    parser.add_argument("--only", default="pub1,pub16,topics1000,mpub16")
    parser.add_argument("--store", default="local", choices=["local", "s3"])
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    parser.add_argument("--no-nsqd", action="store_true", help="deltaq alone")
    args = parser.parse_args()
    only = args.only.split(",")
    ours: dict[str, dict[str, object]] = {}
    theirs: dict[str, dict[str, object]] = {}
    with (
        tempfile.TemporaryDirectory() as local,
        object_store(args.store, args.store_delay_ms, Path(local)) as where,
    ):
        print(
            f"ack={args.ack}, {where}, {args.seconds:.0f} s per case, 200-byte messages; "
            "each case on a fresh server, deltaq then nsqd"
        )
        header = ("server", "case", "conns", "msg/s", "p50 ms", "p99 ms", "errors")
        print(ROW.format(*header, "msg/commit", "peak RSS MB"))
        for n, key in enumerate(only):
            with _deltaq(Path(local) / f"deltaq-{n}", args.ack) as (port, pid):
                ours[key] = _run_case("deltaq", key, port, pid, args.seconds)
            # Each topic commit creates two files: where creating one is slow, commits of
            # many topics are too (the 1,000-topic case follows this cost).
            create_us = file_create_us(Path(local) / f"deltaq-{n}")
            print(f"{'':12}file create {create_us:.0f} us", flush=True)
            if args.no_nsqd:
                continue
            with _nsqd(Path(local) / f"nsqd-{n}") as reference:
                if reference is None:
                    print("nsqd: not found (../shared/tools/nsq-1.3.0/nsqd); deltaq alone")
                    args.no_nsqd = True
                    continue
                theirs[key] = _run_case("nsqd 1.3.0", key, *reference, args.seconds)
    if theirs:
        print("deltaq / nsqd:")
        for key in only:
            a, b = ours[key]["msg_per_s"], theirs[key]["msg_per_s"]
            assert isinstance(a, int) and isinstance(b, int)
            print(f"  {CASES[key][0]:<16} {a:>9,} vs {b:>9,} msg/s = {a / max(b, 1):.2f}x")
    for case in ("pub16", "mpub16"):
        plain = ours.get(f"{case}json", {}).get("msg_per_s")
        typed = ours.get(f"{case}typed", {}).get("msg_per_s")
        if isinstance(plain, int) and isinstance(typed, int):
            print(f"  deltaq: {CASES[case][0]} typed / untyped = {typed / max(plain, 1):.2f}x")
    one = ours.get("pub16", {}).get("msg_per_s")
    many = ours.get("topics1000", {}).get("msg_per_s")
    if isinstance(one, int) and isinstance(many, int):
        print(f"  deltaq: 1,000 topics / one topic at 16 connections = {many / max(one, 1):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
