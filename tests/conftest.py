"""Shared fixtures: a real deltaq server (uvicorn subprocess on 127.0.0.1) and table readers."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import httpx
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import settings
from pyspark.sql import SparkSession

# Property tests hold behaviour, not speed: no per-example deadline (on two loaded cores a
# slow example is the machine, not the code; speed is measured under bench/).
settings.register_profile("deltaq", deadline=None)
settings.load_profile("deltaq")

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent


# Ports free_port() gave this process: the kernel may hand a port out again as soon as the
# probing socket closes, so two calls in a row (a server's HTTP and TCP ports) could get the
# same one before either is bound.
_given_ports: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in _given_ports:
            _given_ports.add(port)
            return port


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Poll ``condition`` until it holds: the server's state, not a guess at how long it takes
    to get there on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


@dataclass
class Server:
    """A ``deltaq api`` process serving one warehouse."""

    warehouse: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    tcp_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    # "https": ``url`` is the HTTPS listener's (a certificate in env), not plain HTTP's.
    scheme: str = "http"
    https_port: int = 0
    # What HTTPS clients verify the server with (its CA), for tests that use it.
    verify: ssl.SSLContext | bool = True
    # An object-store URL to serve instead of ``warehouse`` (which then only holds the log).
    warehouse_url: str = ""

    @property
    def url(self) -> str:
        return self.https_url if self.scheme == "https" else self.http_url

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def https_url(self) -> str:
        return f"https://{HOST}:{self.https_port}"

    def start(self, timeout_s: float = 30.0) -> Server:
        self.port = self.port or free_port()
        self.tcp_port = self.tcp_port or free_port()
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        if self.log_path is None:
            self.log_path = self.warehouse.parent / f"server-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltaq",
                "api",
                "--warehouse",
                self.warehouse_url or str(self.warehouse),
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--tcp-port",
                str(self.tcp_port),
                *self._https_args(env),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                # Plain HTTP answers from the start (403 TLS_REQUIRED under tls_required).
                ping = httpx.get(f"{self.http_url}/ping", timeout=1)
                if ping.text == "OK" or ping.status_code == 403:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server did not start: {self.log()}")

    def _https_args(self, env: dict[str, str]) -> list[str]:
        """With a certificate, HTTPS on a free port of its own (nsqd's is 4152)."""
        if not env.get("DELTAQ_TLS_CERT"):
            return []
        self.https_port = self.https_port or free_port()
        return ["--https-address", f"{HOST}:{self.https_port}"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def topic_table(self, topic: str) -> pa.Table:
        return committed_topic(self.http_url, self.warehouse, topic)


def run_deltaq(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 240
) -> subprocess.CompletedProcess[str]:
    """``deltaq <args>`` as its own process, to its end (``env``: its whole environment)."""
    return subprocess.run(
        [sys.executable, "-m", "deltaq", *args],
        env=os.environ.copy() if env is None else env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def run_bash(
    script: str, cwd: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``script`` as a user's shell runs it, stopping at its first failing command. In a
    session of its own: past ``timeout_s`` the shell and whatever it started in the background
    are killed together (killing bash alone would skip its EXIT trap and leave them running)."""
    with subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as shell:
        try:
            out, err = shell.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            out, err = shell.communicate()
            raise AssertionError(f"timed out after {timeout_s} s:\n{out}{err}") from None
    assert shell.returncode == 0, out + err
    return subprocess.CompletedProcess(shell.args, shell.returncode, out, err)


def read_topic(warehouse: Path, topic: str) -> pa.Table:
    return DeltaTable(str(warehouse / "topics" / topic.replace("#", "@"))).to_pyarrow_table()


def topic_rows(warehouse: Path, topic: str, at_least: int, timeout_s: float = 10.0) -> pa.Table:
    """The topic's table once it holds ``at_least`` rows: an acknowledged publish is in the
    node journal first, in the table milliseconds later (ack = "journal")."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            table = read_topic(warehouse, topic)
        except Exception:  # not created yet
            table = None
        if table is not None and table.num_rows >= at_least:
            return table
        if time.monotonic() > deadline:
            rows = table.num_rows if table is not None else "no table"
            raise AssertionError(f"topic {topic}: {rows} rows after {timeout_s} s, not {at_least}")
        time.sleep(0.02)


def committed_topic(http_url: str, warehouse: Path, topic: str) -> pa.Table:
    """The topic's table once it holds every message the API at ``http_url`` acknowledged (its
    /stats message count: a journaled message reaches the table one topic commit later, up to
    drain_unwatched_linger_ms)."""
    stats = httpx.get(
        f"{http_url}/stats", params={"format": "json", "topic": topic}, timeout=10
    ).json()
    acknowledged = sum(t["message_count"] for t in stats["topics"] or [])
    return topic_rows(warehouse, topic, acknowledged)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession for the whole test session (Spark starts in ~6 s)."""
    from queue_engine.spark.session import build_session

    session = build_session("local[2]", "deltaq-tests")
    yield session
    session.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[type[Server]]:
    started: list[Server] = []

    class _Factory(Server):
        def start(self, timeout_s: float = 30.0) -> Server:
            started.append(self)
            return super().start(timeout_s)

    yield _Factory
    for server in started:
        server.stop()


@pytest.fixture(scope="module", params=["fast-path", "fastapi-routes"])
def shared_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One server per module and front door, with small limits so limit tests stay cheap."""
    warehouse = tmp_path_factory.mktemp("warehouse") / "wh"
    server = Server(
        warehouse,
        env={
            "DELTAQ_HTTP_FAST_PATH": "true" if request.param == "fast-path" else "false",
            "DELTAQ_MAX_MSG_SIZE_BYTES": "1024",
            "DELTAQ_MAX_BODY_SIZE_BYTES": "4096",
            "DELTAQ_MAX_REQ_TIMEOUT_MS": "60000",
        },
    ).start()
    yield server
    server.stop()


@pytest.fixture
def client(shared_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, timeout=30) as c:
        yield c


def unavailable(reason: str) -> NoReturn:
    """A test cannot run for want of something .ci/run installs (chromium, the test extras):
    it skips, saying ``reason``, except under CI (``DELTAQ_CI``, which .ci/run sets), where
    it fails: there the thing was to be installed, and a skip would hide that it was not."""
    if os.environ.get("DELTAQ_CI"):
        pytest.fail(f"{reason}; .ci/run installs it, so under CI this fails", pytrace=False)
    pytest.skip(reason)


# The files that take longest in all (1.5-5 minutes each on 2 cores), longest first.
LONGEST_FILES = [
    "test_spark_cluster.py",
    "test_delta_engines.py",
    "test_object_store.py",
    "test_nodes.py",
    "test_power_cut_up.py",
    "test_up.py",
    "test_fanout.py",
    "test_lifecycle.py",
    "test_power_cut.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that runs on Spark (the ``spark`` fixture, directly or through another) is
    slow too: ``pytest -m "not slow"`` is the part a developer runs in a few minutes."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    # The longest files first, then the other files with slow tests: run in parallel
    # (pytest-xdist, a file per worker at a time), the long ones then overlap each other and
    # the quick files fill the gaps at the end, instead of one long file running alone last.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def order(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.name
        first = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return first, item.path not in slow_files

    items.sort(key=order)
