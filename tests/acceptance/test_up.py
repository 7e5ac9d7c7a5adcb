"""``deltaq up``, the README's first command: API, fanout stream and sweep from one command, a
message through all of them, and Ctrl-C stopping everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.conftest import HOST, ROOT, free_port
from tests.consumers import answer, body, create_channel, sub


def test_up_serves_fans_out_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltaq",
                "up",
                "--warehouse",
                str(tmp_path / "wh"),
                "--host",
                HOST,
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ping", timeout=1).text == "OK":
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=130) as http:
            create_channel(http, "up", "c")
            assert http.post("/pub", params={"topic": "up"}, content=b"through it all").text == "OK"
            # The fanout stream starts with its own Spark: the first delivery waits for it.
            [m] = sub(http, "up", "c", wait_ms=60000) or sub(http, "up", "c", wait_ms=60000)
            assert body(m) == b"through it all" and m["attempts"] == 1
            assert answer(http, "fin", "up", "c", m).text == "OK"
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the jobs process (fanout + sweep) was not started"
        process.send_signal(signal.SIGINT)
        assert process.wait(150) == 0, log_path.read_text(errors="replace")[-3000:]
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}"
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait(10)
