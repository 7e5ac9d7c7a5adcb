"""Starting and stopping the processes a benchmark measures (API, fanout), on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

# Where warehouses go when a benchmark runs on object storage (``object_store``): the URL
# prefix and the store's variables; None: local disk.
_store: tuple[str, dict[str, str]] | None = None
# The store's variables without the added delay (``object_store``).
direct_store_env: dict[str, str] = {}


@contextlib.contextmanager
def object_store(kind: str, delay_ms: float, workdir: Path) -> Iterator[str]:
    """With ``kind`` "s3", the processes started here keep their warehouses on moto's S3 server
    behind a proxy adding ``delay_ms`` to every request; yields what to print about it."""
    global _store
    if kind == "local":
        yield "local disk"
        return
    from deltaq.testing.s3 import S3Server, StoreProxy, store_env

    s3 = S3Server(free_port(), workdir / "moto.log").start()
    proxy = StoreProxy(s3.port, delay_s=delay_ms / 1000).start()
    try:
        s3.create_bucket("deltaq-bench")
        _store = ("s3://deltaq-bench", store_env(proxy.endpoint))
        # Measurements read the store directly: what they see, not the added delay.
        global direct_store_env
        direct_store_env = store_env(s3.endpoint)
        yield f"moto's S3 + {delay_ms:.0f} ms per request (loopback proxy)"
    finally:
        _store = None
        proxy.stop()
        s3.stop()


def warehouse_arg(warehouse: Path) -> str:
    """``--warehouse`` for a benchmark's warehouse directory (a URL on object storage)."""
    if _store is None:
        return str(warehouse)
    return f"{_store[0]}/{warehouse.parent.name}-{warehouse.name}"


def store_env() -> dict[str, str]:
    return {} if _store is None else dict(_store[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def file_create_us(directory: Path, count: int = 200) -> float:
    """Mean µs to create an empty file in a new subdirectory of ``directory``. Printed next to
    latency figures because it moves them: on ext4 without a journal (this machine) every create
    skips inodes freed in the last 60-360 s, so right after another run deleted its warehouse
    nearby a create can cost ~1 ms of CPU instead of ~20 µs. The files are left in place (they
    go with the directory)."""
    probe = directory / "_create_probe"
    probe.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i in range(count):
        os.close(os.open(probe / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    return (time.perf_counter() - started) / count * 1e6


def post(port: int, path: str, body: bytes = b"") -> str:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=body, method="POST")
    with urllib.request.urlopen(req) as r:
        return str(r.read().decode())


def api_process(
    warehouse: Path, port: int, env: dict[str, str] | None = None, tcp_port: int = 0
) -> subprocess.Popen[bytes]:
    """``deltaq api`` on ``port`` (and the TCP protocol on ``tcp_port``; 0: off)."""
    log = open(warehouse.parent / "api.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltaq",
            "api",
            "--warehouse",
            warehouse_arg(warehouse),
            "--port",
            str(port),
            "--tcp-port",
            str(tcp_port),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **store_env(), **(env or {})},
    )
    return _answering(proc, port, "API", 30)


def _answering(
    proc: subprocess.Popen[bytes], port: int, name: str, timeout_s: float
) -> subprocess.Popen[bytes]:
    """``proc`` once its HTTP ``/ping`` answers on ``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/ping").read()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not start")


def fanout_process(
    warehouse: Path, *extra: str, module: str = "jobs.fanout"
) -> subprocess.Popen[bytes]:
    """``deltaq fanout`` (or, with ``module="jobs.embedded"``, the fanout and the sweep on one
    Spark as ``deltaq up`` runs them), logging to ``fanout.log`` beside the warehouse."""
    log = open(warehouse.parent / "fanout.log", "ab")  # noqa: SIM115 - owned by the child
    # On a store the checkpoint is the default, in the warehouse: this Spark has no S3A
    # connector, so the fanout mirrors it there (queue_engine.spark.checkpoint_mirror).
    env = store_env()
    return subprocess.Popen(
        [sys.executable, "-m", module, "--warehouse", warehouse_arg(warehouse), *extra],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,  # SIGTERM/SIGKILL of the group reaches the JVM too
    )


def stop(proc: subprocess.Popen[bytes], group: bool = False) -> None:
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()


def create_topics(port: int, count: int, clients: int = 8) -> None:
    """Topics ``t0``.. with one channel ``c`` each, through the API, ``clients`` at once (as a
    fleet of producers creating their topics would)."""

    def create(i: int) -> None:
        post(port, f"/topic/create?topic=t{i}")
        post(port, f"/channel/create?topic=t{i}&channel=c")

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(create, range(count)))


def wait_all_open(warehouse: Path) -> bool:
    """After a restart over many topics: wait until the API opened every topic and channel
    (its log says so); False if the start had opened them all before answering."""
    log = warehouse.parent / "api.log"
    # The log is appended to across starts over the same warehouse: the newest lines count.
    text = log.read_text(errors="replace")
    if text.rfind("still being opened") < text.rfind("after the start in"):
        return False
    while text.rfind("still being opened") > text.rfind("after the start in"):
        time.sleep(1)
        text = log.read_text(errors="replace")
    return True


def publish_timestamps(port: int, topic: str, rate: int, seconds: float, prefix: str = "t") -> int:
    """``/pub`` at ``rate`` msg/s for ``seconds``, each body ``<prefix> <publish time ns>``;
    return how many were sent. Measurements count the ``t`` bodies: another prefix is a
    warm-up at the same rate (JIT, caches, the first compaction), not measured."""
    interval = 1.0 / rate
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    sent = 0
    while time.monotonic() < end:
        post(port, f"/pub?topic={topic}", f"{prefix} {time.time_ns()}".encode())
        sent += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    return sent


NSQD = ROOT.parent / "shared" / "tools" / "nsq-1.3.0" / "nsqd"


def nsqd_process(data_path: Path, tcp_port: int, http_port: int) -> subprocess.Popen[bytes] | None:
    """The reference nsqd 1.3.0 on loopback, or None where its binary is absent."""
    if not NSQD.is_file():
        return None
    data_path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            str(NSQD),
            f"--tcp-address={HOST}:{tcp_port}",
            f"--http-address={HOST}:{http_port}",
            f"--data-path={data_path}",
            "--log-level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return _answering(proc, http_port, "nsqd", 15)
