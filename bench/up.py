"""Publishing and consuming as users run deltaq: ``deltaq up`` (the API with the fanout, the
sweep and Spark Connect beside it on the same cores) and the reference nsqd 1.3.0, in turn,
in the same run, driven by the same clients.

1. NSQ's own ``bench_writer --batch-size 1`` (go-nsq's ``Publish``: each connection waits
   for each answer) on a quiet server, to a topic with a channel; then ``--batch-size 200``;
   then ``--batch-size 1`` again right after it (what the background work of a burst costs
   the foreground); then ``bench_reader`` (RDY 2500, FIN each) on that channel, with the
   serving process's peak RSS.
2. HTTP ``/pub`` acknowledgement latency at a steady 200 and 1,000 msg/s (16 keep-alive
   connections, each request sent when due and timed from then).
3. Publish -> delivered at 1,000 msg/s pipelined on one connection to a topic with one TCP
   consumer: with nothing else publishing, and right after 16 connections published to
   1,000 other topics at random for ``--burst-seconds``.
4. ``PUB`` over 16 connections each waiting for its ``OK`` (``bench.tcp``'s load
   generator), to one topic and to 1,000 topics at random.

deltaq up runs as ``deltaq up --warehouse <tmp>``; its figures are the ones a user of the
embedded default gets. nsqd's and NSQ's load tools come from ``../shared/tools/nsq-1.3.0``.

    python -m bench.up [--seconds 10] [--burst-seconds 10] [--only CASE,...] [--no-nsqd]
        [--ack-client python|go]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from bench import tcp
from bench.procs import HOST, ROOT, file_create_us, free_port, nsqd_process, post, stop


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}") as answer:
        return str(answer.read().decode())


TOOLS = ROOT.parent / "shared" / "tools" / "nsq-1.3.0"
WRITER_TOPIC = "sub_bench"  # bench_writer's and bench_reader's default topic
READER_CHANNEL = "ch"  # bench_reader's default channel
CASES = ("writer", "ack", "pub", "delivered")
# Connections sending the steady /pub load (see ack_latency).
ACK_CONNECTIONS = 16


def up_process(workdir: Path) -> tuple[subprocess.Popen[bytes], int, int] | None:
    """``deltaq up`` on loopback ports in ``workdir``, with its HTTP and TCP ports, once it
    says it is ready (the API, and
    the fanout and the sweep running)."""
    http_port, tcp_port = free_port(), free_port()
    log_path = workdir / "up.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYSPARK_PYTHON": sys.executable,
        "DELTAQ_SPARK_CONNECT_PORT": str(free_port()),
    }
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "deltaq", "up", "--warehouse", str(workdir / "wh")),
                *("--port", str(http_port), "--tcp-port", str(tcp_port)),
            ],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while "deltaq ready: " not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(log_path.read_text(errors="replace")[-3000:])
            stop(proc)
            return None
        time.sleep(0.2)
    return proc, http_port, tcp_port


def settle(
    pid: int, *, idle_cpu_s: float = 0.2, window_s: float = 2.0, most_s: float = 90
) -> float:
    """Seconds until ``pid`` and its children used less than ``idle_cpu_s`` of CPU in a
    ``window_s`` window (at most ``most_s``): after "ready" Spark's JVM and its Python daemon
    warm up for ~15 s (~6 s of CPU), which the first, quiet, case must not measure."""
    started = time.monotonic()

    def used() -> float:
        root = psutil.Process(pid)
        total = 0.0
        for process in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
        return total

    before = used()
    while time.monotonic() - started < most_s:
        time.sleep(window_s)
        now = used()
        if now - before < idle_cpu_s:
            break
        before = now
    return time.monotonic() - started


def stop_up(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it; then whatever is left of its children."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


_RATE = re.compile(r"([\d.]+)ops/s - ([\d.]+)us/op")


def nsq_tool(tool: str, target: tcp.Target, seconds: float, *args: str) -> tuple[float, float]:
    """Run NSQ's ``bench_writer`` or ``bench_reader`` against ``target``: (msg/s, µs/op)."""
    done = subprocess.run(
        [
            str(TOOLS / tool),
            f"--nsqd-tcp-address={HOST}:{target.tcp_port}",
            f"--runfor={seconds:g}s",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=False,
    )
    found = _RATE.search(done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"{tool} printed no figure:\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)), float(found.group(2))


def _peak_rss(pid: int, until: threading.Event, out: list[int]) -> None:
    process = psutil.Process(pid)
    peak = 0
    while not until.wait(0.01):
        try:
            peak = max(peak, process.memory_info().rss)
        except psutil.Error:
            break
    out.append(peak)


def writer_cases(target: tcp.Target, seconds: float, figures: dict[str, float]) -> None:
    post(target.http_port, f"/topic/create?topic={WRITER_TOPIC}")
    post(target.http_port, f"/channel/create?topic={WRITER_TOPIC}&channel={READER_CHANNEL}")
    for key, batch, when in (
        ("writer1", "1", "quiet"),
        ("writer200", "200", ""),
        ("writer1_after", "1", "right after the batch-size 200 run"),
    ):
        rate, per_op = nsq_tool("bench_writer", target, seconds, f"--batch-size={batch}")
        figures[key] = rate
        print(
            f"  {target.name}: bench_writer --batch-size {batch}{', ' + when if when else ''}: "
            f"{rate:,.0f} msg/s ({per_op:.1f} us/op)",
            flush=True,
        )
    waited = _fanned_out(target)
    print(f"  {target.name}: the channel held every message {waited:.1f} s later", flush=True)
    figures["fanned_out_s"] = waited
    stop_rss = threading.Event()
    peak: list[int] = []
    watcher = threading.Thread(target=_peak_rss, args=(target.pid, stop_rss, peak))
    watcher.start()
    rate, _ = nsq_tool("bench_reader", target, seconds, "--rdy=2500")
    stop_rss.set()
    watcher.join()
    figures["reader"] = rate
    figures["reader_rss_mib"] = peak[0] / 2**20
    print(
        f"  {target.name}: bench_reader RDY 2500, FIN each: {rate:,.0f} msg/s (serving "
        f"process peak RSS {peak[0] / 2**20:,.0f} MiB)",
        flush=True,
    )


def _fanned_out(target: tcp.Target, timeout_s: float = 900) -> float:
    """Seconds until the reader's channel holds every message of its topic (deltaq: the
    fanout caught up with the writers; nsqd: at once)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        url = f"/stats?format=json&topic={WRITER_TOPIC}&channel={READER_CHANNEL}"
        stats = json.loads(get(target.http_port, url))
        topic = (stats.get("topics") or [{}])[0]
        channels = topic.get("channels") or [{}]
        if channels[0].get("depth", -1) >= topic.get("message_count", 0) > 0:
            break
        time.sleep(0.5)
    return time.monotonic() - started


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return at(0.5), at(0.95), at(0.99)


ACK_CLIENT = Path(__file__).parent / "ack_client"


def _ack_topic(target: tcp.Target) -> str:
    """The ack case's topic, with a channel (its messages are fanned out meanwhile)."""
    topic = "bench_ack"
    post(target.http_port, f"/topic/create?topic={topic}")
    post(target.http_port, f"/channel/create?topic={topic}&channel=c")
    return topic


def build_ack_client(workdir: Path) -> Path:
    """The Go load generator of the ack case (``bench/ack_client``, the standard library only),
    built into ``workdir``."""
    binary = workdir / "ack_client"
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=ACK_CLIENT, check=True)
    return binary


def ack_latency_go(
    target: tcp.Target, rate: int, seconds: float, binary: Path
) -> tuple[float, float, float]:
    """``ack_latency`` with the load sent by the Go client: the same schedule, without the
    Python client's own thread switches in the figures."""
    url = f"http://{HOST}:{target.http_port}/pub?topic={_ack_topic(target)}"
    done = subprocess.run(
        [
            str(binary),
            "-url",
            url,
            "-rate",
            str(rate),
            "-c",
            str(ACK_CONNECTIONS),
            "-s",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = dict(part.split("=") for part in done.stdout.split())
    p50, p95, p99 = (float(figures[k]) for k in ("p50", "p95", "p99"))
    print(
        f"  {target.name}: HTTP /pub ack at {rate:,} msg/s over {ACK_CONNECTIONS} connections "
        f"(Go client): p50 {p50:.2f} / p95 {p95:.2f} / p99 {p99:.2f} ms "
        f"({int(figures['n']):,} answers in {seconds:.0f} s)",
        flush=True,
    )
    return p50, p95, p99


def ack_latency(target: tcp.Target, rate: int, seconds: float) -> tuple[float, float, float]:
    """p50, p95, p99 ms of HTTP ``/pub`` answers at a steady ``rate`` (after 2 s unmeasured).

    ACK_CONNECTIONS keep-alive connections each send ``rate / ACK_CONNECTIONS`` a second when
    due, as many producers would, so the rate holds while an answer takes longer than the
    interval (one connection waiting for each answer sent ~590 a second, not 1,000, once
    answers took ~1 ms). A request sent late is timed from when it was due: the wait behind a
    slow answer counts."""
    topic = _ack_topic(target)
    body = b"x" * 200
    samples: list[float] = []
    sent_count = [0]
    lock = threading.Lock()
    started = time.monotonic()
    end = started + 2 + seconds

    def sender(offset: float) -> None:
        conn = http.client.HTTPConnection(HOST, target.http_port, timeout=30)
        interval = ACK_CONNECTIONS / rate
        due = started + offset * interval
        mine: list[float] = []
        while due < end:
            time.sleep(max(0.0, due - time.monotonic()))
            conn.request("POST", f"/pub?topic={topic}", body=body)
            answer = conn.getresponse()
            assert answer.read() == b"OK" and answer.status == 200
            if due - started >= 2:
                mine.append((time.monotonic() - due) * 1000)
            due += interval
        conn.close()
        with lock:
            samples.extend(mine)
            sent_count[0] += len(mine)

    threads = [
        threading.Thread(target=sender, args=(i / ACK_CONNECTIONS,)) for i in range(ACK_CONNECTIONS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    p50, p95, p99 = _percentiles(samples)
    print(
        f"  {target.name}: HTTP /pub ack at {rate:,} msg/s over {ACK_CONNECTIONS} connections: "
        f"p50 {p50:.2f} / p95 {p95:.2f} / p99 {p99:.2f} ms "
        f"({sent_count[0]:,} answers in {seconds:.0f} s)",
        flush=True,
    )
    return p50, p95, p99


def run_target(
    target: tcp.Target, args: argparse.Namespace, cases: set[str], ack_client: Path | None
) -> dict[str, float]:
    """The chosen cases on ``target``; the ack case's load from the Go ``ack_client`` if built."""
    figures: dict[str, float] = {}
    if "writer" in cases:
        writer_cases(target, args.seconds, figures)
    if "ack" in cases:
        for rate in (200, 1000):
            if ack_client is not None:
                measured = ack_latency_go(target, rate, args.seconds, ack_client)
            else:
                measured = ack_latency(target, rate, args.seconds)
            figures[f"ack{rate}_p50"], _, figures[f"ack{rate}_p99"] = measured
    # Delivery before the PUB cases: its quiet case must not follow their 1,000-topic load.
    if "delivered" in cases:
        figures["quiet_p50"], figures["quiet_p99"] = tcp.latency(
            target, 1000, args.seconds, topic="bench_quiet"
        )
        burst: Callable[[], object] = lambda: tcp.publish(  # noqa: E731
            target, 1, args.burst_seconds, topics=1000
        )
        figures["burst_p50"], figures["burst_p99"] = tcp.latency(
            target, 1000, args.seconds, topic="bench_after_burst", before=burst
        )
    if "pub" in cases:
        figures["pub16"] = tcp.publish(target, 1, args.seconds)
        figures["pub16_1000"] = tcp.publish(target, 1, args.seconds, topics=1000)
    return figures


ROWS = (
    ("writer1", "bench_writer --batch-size 1, quiet (msg/s)", "ratio"),
    ("writer200", "bench_writer --batch-size 200 (msg/s)", "ratio"),
    ("writer1_after", "bench_writer --batch-size 1 right after it (msg/s)", "ratio"),
    ("fanned_out_s", "then until the channel held every message (s)", ""),
    ("reader", "bench_reader RDY 2500, once it did (msg/s)", "ratio"),
    ("reader_rss_mib", "serving process peak RSS while reading (MiB)", ""),
    ("ack200_p50", "HTTP /pub ack p50 at 200 msg/s (ms)", ""),
    ("ack200_p99", "HTTP /pub ack p99 at 200 msg/s (ms)", ""),
    ("ack1000_p50", "HTTP /pub ack p50 at 1,000 msg/s (ms)", ""),
    ("ack1000_p99", "HTTP /pub ack p99 at 1,000 msg/s (ms)", ""),
    ("pub16", "TCP PUB, 16 connections (msg/s)", "ratio"),
    ("pub16_1000", "TCP PUB, 16 connections, 1,000 topics at random (msg/s)", "ratio"),
    ("quiet_p50", "publish -> delivered p50, quiet (ms)", ""),
    ("quiet_p99", "publish -> delivered p99, quiet (ms)", ""),
    ("burst_p50", "publish -> delivered p50, after a 1,000-topic burst (ms)", ""),
    ("burst_p99", "publish -> delivered p99, after a 1,000-topic burst (ms)", ""),
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--burst-seconds", type=float, default=10)
    parser.add_argument("--only", default=",".join(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument("--no-nsqd", action="store_true")
    parser.add_argument(
        "--ack-client",
        choices=("python", "go"),
        default="python",
        help="what sends the ack case's load: Python threads, or bench/ack_client (needs Go)",
    )
    args = parser.parse_args()
    cases = set(args.only.split(","))
    if cases - set(CASES):
        parser.error(f"unknown cases: {sorted(cases - set(CASES))}")
    if "writer" in cases and not (TOOLS / "bench_writer").is_file():
        print(f"NSQ's load tools are absent ({TOOLS}): the writer case is left out")
        cases.discard("writer")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"file create: {file_create_us(Path(tmp)):.0f} us", flush=True)
        ack_client = None
        if "ack" in cases and args.ack_client == "go":
            ack_client = build_ack_client(Path(tmp))
        for name in ("nsqd", "deltaq up"):
            workdir = Path(tmp) / name.replace(" ", "_")
            workdir.mkdir()
            if name == "nsqd":
                if args.no_nsqd:
                    continue
                tcp_port, http_port = free_port(), free_port()
                nsqd = nsqd_process(workdir / "data", tcp_port, http_port)
                if nsqd is None:
                    print(f"nsqd is absent ({TOOLS}): deltaq only")
                    continue
                try:
                    target = tcp.Target(name, tcp_port, http_port, nsqd.pid)
                    results[name] = run_target(target, args, cases, ack_client)
                finally:
                    stop(nsqd)
            else:
                started = time.monotonic()
                started_up = up_process(workdir)
                if started_up is None:
                    print("deltaq up did not get ready (its log's tail is above)")
                    return 1
                print(f"deltaq up ready in {time.monotonic() - started:.1f} s", flush=True)
                up, http_port, tcp_port = started_up
                waited = settle(up.pid)
                print(f"deltaq up settled {waited:.1f} s after that", flush=True)
                try:
                    target = tcp.Target(name, tcp_port, http_port, up.pid)
                    results[name] = run_target(target, args, cases, ack_client)
                finally:
                    stop_up(up)
    ours, theirs = results.get("deltaq up", {}), results.get("nsqd", {})
    print("\n| measure | deltaq up | nsqd 1.3.0 | deltaq / nsqd |\n| --- | --- | --- | --- |")
    for key, label, ratio in ROWS:
        if key not in ours:
            continue
        mine, other = ours[key], theirs.get(key)
        shown = f"{other:,.1f}" if other is not None else "-"
        quotient = f"{mine / other:.2f}x" if ratio and other else ""
        print(f"| {label} | {mine:,.1f} | {shown} | {quotient} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
