"""deltaq up as an operator, a supervisor and a test harness treat it: killed at any moment,
started twice by mistake, started where another process holds one of its ports. Nothing it
started outlives it, and a refusal is one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import HOST, free_port

pytestmark = pytest.mark.slow


def up(tmp_path: Path, config: Path, log_name: str) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DELTAQ_CONFIG", None)
    log_path = tmp_path / log_name
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "deltaq", "up", "--config", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, log_path


def config_with_free_ports(tmp_path: Path) -> tuple[Path, int, int]:
    port, tcp_port, connect_port = free_port(), free_port(), free_port()
    config = tmp_path / "deltaq.toml"
    config.write_text(
        f"port = {port}\ntcp_port = {tcp_port}\nspark_connect_port = {connect_port}\n"
    )
    return config, port, connect_port


def in_session(session: int) -> list[int]:
    """The pids of every process in ``session`` (the jobs process runs in one of its own,
    with its JVM and Spark's Python workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session:
            found.append(int(entry))
    return found


def wait_for_ping(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            if httpx.get(f"{url}/ping", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(log_path.read_text(errors="replace")[-3000:])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_nothing_up_started_outlives_it_killed_before_it_was_ready(
    tmp_path: Path, sig: signal.Signals
) -> None:
    config, port, _ = config_with_free_ports(tmp_path)
    url = f"http://{HOST}:{port}"
    process, log_path = up(tmp_path, config, "up.log")
    jobs_pid = None
    try:
        wait_for_ping(url, process, log_path)
        jobs_pid = httpx.get(f"{url}/info", timeout=5).json()["jobs"]["pid"]
        assert jobs_pid is not None
        if sig == signal.SIGKILL:
            # A second deltaq up in the same directory by mistake: one line naming the busy
            # port and the running up, before it joins or starts anything.
            second, second_log = up(tmp_path, config, "second.log")
            assert second.wait(60) == 1
            lines = second_log.read_text().strip().splitlines()
            assert len(lines) == 1, lines
            assert lines[0].startswith(f"deltaq up: error: port {port} (HTTP) is in use by ")
            assert f"deltaq up (pid {process.pid})" in lines[0] and "DELTAQ_PORT" in lines[0]
            assert httpx.get(f"{url}/ping", timeout=5).status_code == 200
        # Half a second after /ping first answered: Spark is still starting in the child.
        time.sleep(0.5)
        assert "deltaq ready" not in log_path.read_text(errors="replace")
        # The jobs process leads a session of its own: what this test watches.
        assert jobs_pid in in_session(jobs_pid), "the jobs session is not the one watched"
        process.send_signal(sig)
        process.wait(60)
        deadline = time.monotonic() + 15
        while in_session(jobs_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = in_session(jobs_pid)
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left]
    finally:
        if process.poll() is None:
            process.kill()
        if jobs_pid is not None:
            for pid in in_session(jobs_pid):
                os.kill(pid, signal.SIGKILL)


def test_a_busy_spark_connect_port_is_one_line_naming_its_setting(tmp_path: Path) -> None:
    config, port, connect_port = config_with_free_ports(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", connect_port))
        holder.listen()
        process, log_path = up(tmp_path, config, "up.log")
        assert process.wait(60) == 1
    lines = log_path.read_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"deltaq up: error: port {connect_port} (Spark Connect) is in use by "
    )
    assert lines[0].endswith(
        f"(pid {os.getpid()}): stop it, or set spark_connect_port "
        "(DELTAQ_SPARK_CONNECT_PORT) to another port"
    )
    # Nothing was joined or started: the API's port is free again.
    with socket.socket() as probe:
        probe.bind((HOST, port))
