"""Fanout latency and backlog throughput, with the API and the fanout job running locally.

1. Latency: a steady publish load (``--rate`` msg/s for ``--seconds``, after ``--warmup``
   seconds of the same load) while ``deltaq fanout``
   runs; each body carries its publish time; a tailer reads the channel table's new commits and
   prints publish -> row visible in the channel table, p50/p99.
2. Backlog: ``--backlog`` 200-byte messages published first, then ``deltaq fanout --once``;
   prints msg/s over the run, and the same run's fixed cost (the process's start and stop,
   Spark's where it runs as Spark's query) measured on an empty warehouse; and the CPU
   seconds and peak RSS of the fanout's Python driver, its JVM and
   Spark's Python workers (run it with --backlog N and 10 N to see what grows with the
   backlog).
3. Typed (``--only typed``): the same JSON backlog from an untyped and a typed topic.
4. Filter (``--only filter``): the backlog twice, published as envelopes whose headers say
   ``region`` eu or us in turn, into a channel without a filter and then into one with
   ``headers['region'] = 'eu'``; prints topic rows read per second of each and their ratio.

With ``--store s3`` (latency only) the warehouse is on moto's S3 server behind a loopback proxy
adding ``--store-delay-ms`` to every request the API and the fanout make; the tailer reads
the store directly, without the delay.

    python -m bench.fanout [--rate 200] [--seconds 20] [--backlog 1000000]
                           [--channel-writes auto|driver|deltaq|delta] [--embedded]
                           [--without-delta-spark]
                           [--store local|s3] [--store-delay-ms 20] [--only filter|typed]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import psutil
import pyarrow.parquet as pq

from bench import procs
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
    warehouse_arg,
)
from bench.publish import JSON_BODY, SCHEMA
from queue_engine.store.delta import added_files, latest_version


def latency(rate: int, seconds: float, warmup: float, job_args: list[str], embedded: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wh = Path(tmp) / "wh"
        create_us = file_create_us(Path(tmp))
        port = free_port()
        api = api_process(wh, port)
        fanout = None
        try:
            post(port, "/topic/create?topic=lat")
            post(port, "/channel/create?topic=lat&channel=c")
            if embedded:
                fanout = fanout_process(wh, "--every", "10", module="jobs.embedded")
            else:
                fanout = fanout_process(wh, "--log-batches", *job_args)
            remote = bool(procs.direct_store_env)
            channel = wh / "channels" / "lat" / "c" / "messages"
            channel_url = f"{warehouse_arg(wh)}/channels/lat/c/messages"
            if remote:
                os.environ.update(procs.direct_store_env)
            # Wait for the job to be up: publish probes until one shows up in the channel.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and (
                _remote_version(channel_url, -1) < 0
                if remote
                else not (channel / "_delta_log").exists()
            ):
                post(port, "/pub?topic=lat", b"warmup 0")
                time.sleep(0.5)
            known = _remote_version(channel_url, -1) if remote else latest_version(str(channel))
            samples: list[float] = []
            # Publish -> the topic commit's file time: the API's share of each sample.
            topic_log = wh / "topics" / "lat" / "_delta_log"
            api_share: list[float] = []
            done = threading.Event()

            def tail_remote() -> None:
                nonlocal known
                while not done.is_set():
                    latest = _remote_version(channel_url, known)
                    if latest > known:
                        now = time.time_ns()
                        for body in _remote_bodies(channel_url, known, latest):
                            if body.startswith(b"t "):
                                samples.append((now - int(body[2:])) / 1e6)
                        known = latest
                    time.sleep(0.002)

            def tail() -> None:
                nonlocal known
                while not done.is_set():
                    latest = latest_version(str(channel), known)
                    if latest > known:
                        now = time.time_ns()
                        for f in added_files(str(channel), known, latest):
                            rows = pq.read_table(f.path, columns=["body", "topic_version"])
                            for body, version in zip(
                                rows["body"].to_pylist(),
                                rows["topic_version"].to_pylist(),
                                strict=True,
                            ):
                                if body.startswith(b"t "):
                                    sent_ns = int(body[2:])
                                    samples.append((now - sent_ns) / 1e6)
                                    committed = (topic_log / f"{version:020d}.json").stat()
                                    api_share.append((committed.st_mtime_ns - sent_ns) / 1e6)
                        known = latest
                    time.sleep(0.002)

            tailer = threading.Thread(target=tail_remote if remote else tail, daemon=True)
            tailer.start()
            publish_timestamps(port, "lat", rate, warmup, prefix="w")
            sent = publish_timestamps(port, "lat", rate, seconds)
            time.sleep(3)
            done.set()
            batches = [
                line
                for line in (wh.parent / "fanout.log").read_text().splitlines()
                if "fanout batch" in line or "fanout trigger" in line
            ]
            print("\n".join(batches[-int(os.environ.get("SHOW_BATCHES", "5")) :]))
            tailer.join(5)
            samples.sort()
            api_share.sort()
            if not samples:
                print("latency: no samples")
                return

            def p(values: list[float], q: float) -> float:
                return values[min(len(values) - 1, int(q * len(values)))]

            print(
                f"publish -> channel row visible, {rate} msg/s for {seconds:.0f} s: "
                f"p50 {p(samples, 0.5):.0f} ms, p99 {p(samples, 0.99):.0f} ms, "
                f"max {samples[-1]:.0f} ms ({len(samples)}/{sent} seen; "
                + (
                    "the store read directly)"
                    if remote
                    else f"file create {create_us:.0f} us); of which publish -> topic commit "
                    f"p50 {p(api_share, 0.5):.0f} ms, p99 {p(api_share, 0.99):.0f} ms "
                    "(file times: ~4 ms resolution)"
                )
            )
        finally:
            if fanout is not None:
                stop(fanout, group=True)
            stop(api)


def _remote_version(table_url: str, known: int) -> int:
    """The newest version of a table on the store (-1: none yet)."""
    from queue_engine.store.storage import newest_commit_after

    return newest_commit_after(table_url, known)


def _remote_bodies(table_url: str, after: int, through: int) -> list[bytes]:
    """The bodies the commits (after, through] of a table on the store added."""
    import io
    import json

    from queue_engine.store.storage import read_object

    bodies: list[bytes] = []
    for version in range(after + 1, through + 1):
        commit = read_object(f"{table_url}/_delta_log/{version:020d}.json") or b""
        for line in commit.splitlines():
            add = json.loads(line).get("add")
            if add:
                data = read_object(f"{table_url}/{add['path']}") or b""
                bodies += pq.read_table(io.BytesIO(data), columns=["body"])["body"].to_pylist()
    return bodies


def backlog(
    count: int, job_args: list[str], filter_text: str | None = None, schema: str | None = None
) -> float:
    """The backlog run; returns topic rows read per second of the fanout's wall time. With
    ``filter_text`` (None: plain text bodies), the messages are envelopes with a region header
    and the channel has the filter ("" for none). With ``schema`` ("" for an untyped topic),
    the messages are bench.publish's JSON objects and the topic is typed with it."""
    channel = "/channel/create?topic=b&channel=c"
    create = "/topic/create?topic=b"
    if schema:
        create += "&" + urllib.parse.urlencode({"schema": schema})
    if filter_text:
        channel += "&" + urllib.parse.urlencode({"filter": filter_text})
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty"
        port = free_port()
        api = api_process(empty, port)
        post(port, create)
        post(port, channel)
        stop(api)
        t = time.perf_counter()
        assert fanout_process(empty, "--once", *job_args).wait(600) == 0
        fixed = time.perf_counter() - t

        wh = Path(tmp) / "wh"
        port = free_port()
        api = api_process(wh, port)
        post(port, create)
        post(port, channel)
        body = b"\n".join([b"x" * 200] * 1000)
        if schema is not None:
            body = b"\n".join([JSON_BODY] * 1000)
        url = f"http://{HOST}:{port}/mpub?topic=b"
        if filter_text is not None:
            lines = [
                orjson.dumps({"body": "x" * 200, "headers": {"region": ("eu", "us")[i % 2]}})
                for i in range(1000)
            ]
            body = b"\n".join(lines)
            url += "&envelope=json"
        published = 0
        t = time.perf_counter()
        # Exactly ``count`` (in 1,000-message MPUBs, 8 at a time): the backlog is what grows.
        with ThreadPoolExecutor(8) as pool, httpx.Client(timeout=60) as client:
            answers = pool.map(lambda _: client.post(url, content=body).text, range(count // 1000))
            published = 1000 * sum(1 for a in answers if a == "OK")
        fill = time.perf_counter() - t
        stop(api)
        t = time.perf_counter()
        fanout = fanout_process(wh, "--once", *job_args)
        usage = DriverUsage(fanout.pid)
        code = fanout.wait(1800)
        usage.stop()
        if code != 0:
            print((Path(tmp) / "fanout.log").read_text()[-4000:])
            raise SystemExit(f"fanout --once failed with {code}")
        wall = time.perf_counter() - t
        from deltalake import DeltaTable

        rows = DeltaTable(str(wh / "channels" / "b" / "c" / "messages")).count()
        print(
            f"backlog: {published} msgs published in {fill:.1f} s; fanout --once moved "
            f"{rows} rows in {wall:.1f} s wall = {rows / wall:,.0f} msg/s; excluding the "
            f"{fixed:.1f} s fixed start/stop (an empty run's): "
            f"{rows / max(wall - fixed, 1e-9):,.0f} msg/s"
        )
        print(
            f"backlog {rows:,}: Python driver {usage.cpu['driver']:.1f} CPU-s, peak RSS "
            f"{usage.peak['driver'] / 2**20:,.0f} MiB; JVM (driver + local executors) "
            f"{usage.cpu['jvm']:.1f} CPU-s, peak RSS {usage.peak['jvm'] / 2**20:,.0f} MiB; "
            f"Python workers {usage.cpu['workers']:.1f} CPU-s"
        )
        return published / wall


def typed_cost(count: int, job_args: list[str]) -> None:
    """The same JSON backlog from an untyped topic, then from a typed one (the fanout decodes
    the fields into the channel's columns)."""
    plain = backlog(count, job_args, schema="")
    typed = backlog(count, job_args, schema=SCHEMA)
    print(
        f"typed: topic rows read {plain:,.0f} msg/s untyped, {typed:,.0f} msg/s typed "
        f"(six fields): {typed / plain:.2f}x"
    )


def filter_cost(count: int, job_args: list[str]) -> None:
    """The same backlog into an unfiltered channel, then into a filtered one."""
    plain = backlog(count, job_args, "")
    filtered = backlog(count, job_args, "headers['region'] = 'eu'")
    print(
        f"filter: topic rows read {plain:,.0f} msg/s unfiltered, {filtered:,.0f} msg/s with "
        f"headers['region'] = 'eu' (half kept): {filtered / plain:.2f}x"
    )


class DriverUsage:
    """CPU seconds and peak RSS of a fanout's Python driver, its JVM and Spark's Python
    workers (the JVM's children), sampled every 0.2 s until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.cpu = {"driver": 0.0, "jvm": 0.0, "workers": 0.0}
        self.peak = {"driver": 0, "jvm": 0, "workers": 0}
        self._workers: dict[int, float] = {}
        self._done = threading.Event()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            with contextlib.suppress(psutil.Error):  # a process that just ended
                self._once()

    def _once(self) -> None:
        with self._root.oneshot():
            t = self._root.cpu_times()
            self.cpu["driver"] = t.user + t.system
            self.peak["driver"] = max(self.peak["driver"], self._root.memory_info().rss)
        for jvm in self._root.children():
            t = jvm.cpu_times()
            self.cpu["jvm"] = t.user + t.system
            self.peak["jvm"] = max(self.peak["jvm"], jvm.memory_info().rss)
            for worker in jvm.children(recursive=True):
                t = worker.cpu_times()
                self._workers[worker.pid] = t.user + t.system
        self.cpu["workers"] = sum(self._workers.values())

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--warmup", type=float, default=5, help="seconds of the same load before measuring"
    )
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--only", choices=["latency", "backlog", "filter", "typed"])
    parser.add_argument(
        "--channel-writes", default="auto", help="passed to deltaq fanout (driver, deltaq, ...)"
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="latency with the fanout and the sweep (every 10 s) on one Spark, as deltaq up",
    )
    parser.add_argument(
        "--without-delta-spark",
        action="store_true",
        help="the jobs' Spark without delta-spark's jars (DELTAQ_DELTA_SPARK=false), to compare",
    )
    parser.add_argument("--store", default="local", choices=["local", "s3"])
    parser.add_argument("--store-delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    job_args = ["--channel-writes", args.channel_writes]
    if args.without_delta_spark:
        os.environ["DELTAQ_DELTA_SPARK"] = "false"
    if args.store == "s3":
        if args.only != "latency":
            parser.error("--store s3 measures latency only (--only latency)")
        with (
            tempfile.TemporaryDirectory() as tmp,
            object_store("s3", args.store_delay_ms, Path(tmp)),
        ):
            latency(args.rate, args.seconds, args.warmup, job_args, args.embedded)
        return 0
    if args.only == "filter":
        filter_cost(args.backlog, job_args)
    if args.only == "typed":
        typed_cost(args.backlog, job_args)
        return 0
    if args.only in (None, "latency"):
        latency(args.rate, args.seconds, args.warmup, job_args, args.embedded)
    if args.only in (None, "backlog"):
        backlog(args.backlog, job_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
