"""Publish throughput and latency: /pub with 1 and 16 connections, /mpub with 100 per request.

Starts ``deltaq api`` on 127.0.0.1 with a fresh warehouse, drives it with bench/loadgen.py
from a separate process, and prints msg/s, latency p50/p99, messages per Delta commit and the
server's peak RSS. Nothing is asserted: the figures go in the README.

    python bench/publish.py [--seconds 10] [--ack commit|buffer] [--only pub1,pub16,mpub16]
    python bench/publish.py --store s3 --only pub64,mpub16   # moto's S3, 20 ms per request

``--store s3`` puts the warehouse on moto's S3 server behind a loopback proxy that adds
``--store-delay-ms`` (default 20) to every store request, as an object store's latency.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import LoadResult, run
from procs import object_store, store_env, warehouse_arg

HOST = "127.0.0.1"
BODY = b"x" * 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _stats(port: int, topic: str) -> dict[str, int]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/stats?format=json&topic={topic}") as r:
        data = json.load(r)
    for t in data["topics"]:
        if t["topic_name"] == topic:
            return {"messages": t["message_count"], "commits": t["delta_commits"]}
    return {"messages": 0, "commits": 0}


def _load(args: tuple[int, str, bytes, int, float], out: mp.Queue) -> None:  # type: ignore[type-arg]
    port, path, body, conns, seconds = args
    r = run(HOST, port, path, body, conns, seconds)
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ack", default="commit", choices=["commit", "buffer"])
    parser.add_argument("--only", default="pub1,pub16,mpub16")
    parser.add_argument("--store", default="local", choices=["local", "s3"])
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    port = _free_port()
    with (
        tempfile.TemporaryDirectory() as local,
        object_store(args.store, args.store_delay_ms, Path(local)) as where,
    ):
        env = {**os.environ, **store_env(), "DELTAQ_ACK": args.ack}
        warehouse = warehouse_arg(Path(local) / "wh")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltaq",
                "api",
                "--warehouse",
                warehouse,
                "--port",
                str(port),
                "--tcp-port",
                "0",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://{HOST}:{port}/ping").read()
                    break
                except OSError:
                    time.sleep(0.1)
            proc = psutil.Process(server.pid)
            peak = [0]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.05):
                    peak[0] = max(peak[0], proc.memory_info().rss)

            threading.Thread(target=sample, daemon=True).start()
            mpub_body = b"\n".join([BODY] * 100)
            cases = {
                "pub1": ("/pub", "/pub?topic=bench_pub1", BODY, 1, 1),
                "pub16": ("/pub", "/pub?topic=bench_pub16", BODY, 1, 16),
                "pub64": ("/pub", "/pub?topic=bench_pub64", BODY, 1, 64),
                "mpub16": ("/mpub x100", "/mpub?topic=bench_mpub", mpub_body, 100, 16),
            }
            print(f"ack={args.ack}, {where}, {args.seconds:.0f} s per case, 200-byte messages")
            header = (
                "case",
                "conns",
                "msg/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "msg/commit",
                "peak RSS MB",
            )
            print("{:<12}{:>6}{:>10}{:>9}{:>9}{:>8}{:>12}{:>13}".format(*header))
            for key in args.only.split(","):
                name, path, body, per, conns = cases[key]
                r = _case(port, name, path, body, per, conns, args.seconds, proc, peak)
                print(
                    "{:<12}{:>6}{:>10}{:>9}{:>9}{:>8}{:>12}{:>13}".format(
                        r["case"],
                        r["connections"],
                        r["msg_per_s"],
                        r["p50_ms"],
                        r["p99_ms"],
                        r["errors"],
                        r["msgs_per_commit"],
                        r["server_peak_rss_mb"],
                    )
                )
            stop.set()
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
