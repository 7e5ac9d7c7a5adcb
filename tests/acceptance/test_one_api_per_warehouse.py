"""A second API process on a warehouse another one serves refuses to start, with one line
naming the holder: two would lease the same message to two consumers. A killed holder
(kill -9) leaves nothing behind: the next API starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import HOST, ROOT, Server, free_port


def test_a_second_api_on_one_warehouse_refuses(
    server_factory: type[Server], tmp_path: Path
) -> None:
    warehouse = tmp_path / "wh"
    first = server_factory(warehouse).start()
    assert httpx.post(f"{first.url}/pub?topic=t", content=b"kept").text == "OK"
    assert first.process is not None

    second = subprocess.run(
        [
            *(sys.executable, "-m", "deltaq", "api", "--warehouse", str(warehouse)),
            *("--host", HOST, "--port", str(free_port()), "--tcp-port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert second.returncode == 1
    [line] = second.stderr.strip().splitlines()
    assert line.startswith("deltaq api: error: warehouse ")
    assert f"already served by another deltaq API (pid {first.process.pid} " in line
    # The first one is untouched.
    assert httpx.get(f"{first.url}/stats?format=json").json()["topics"][0]["message_count"] == 1

    first.kill9()
    again = server_factory(warehouse).start()
    assert httpx.get(f"{again.url}/stats?format=json").json()["topics"][0]["message_count"] == 1
