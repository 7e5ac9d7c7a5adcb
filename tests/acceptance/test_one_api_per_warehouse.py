"""A second API process on a warehouse another one serves refuses to start, with one line
naming the holder: two would lease the same message to two consumers. A killed holder
(kill -9) leaves nothing behind: the next API starts. On an object store the same holds
through a renewed lease."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.acceptance.conftest import BUCKET
from tests.conftest import HOST, ROOT, Server, free_port
from tests.s3 import S3Server, client_arguments, store_env


def _api(warehouse: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``deltaq api`` on ``warehouse``, to its end (a refused start ends at once)."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "deltaq", "api", "--warehouse", warehouse),
            *("--host", HOST, "--port", str(free_port()), "--tcp-port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_a_second_api_on_one_warehouse_refuses(
    server_factory: type[Server], tmp_path: Path
) -> None:
    warehouse = tmp_path / "wh"
    first = server_factory(warehouse).start()
    assert httpx.post(f"{first.url}/pub?topic=t", content=b"kept").text == "OK"
    assert first.process is not None

    second = _api(str(warehouse))
    assert second.returncode == 1
    [line] = second.stderr.strip().splitlines()
    assert line.startswith("deltaq api: error: warehouse ")
    assert f"already served by another deltaq API (pid {first.process.pid} " in line
    # The first one is untouched.
    assert httpx.get(f"{first.url}/stats?format=json").json()["topics"][0]["message_count"] == 1

    first.kill9()
    again = server_factory(warehouse).start()
    assert httpx.get(f"{again.url}/stats?format=json").json()["topics"][0]["message_count"] == 1


def test_on_an_object_store_a_lease_keeps_one_api_and_a_takeover_stops_the_holder(
    server_factory: type[Server], tmp_path: Path, s3_server: S3Server
) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    env = {**store_env(s3_server.endpoint), "DELTAQ_STORE_LEASE_S": "2"}
    first = server_factory(tmp_path / "first", env=env, warehouse_url=root).start()
    assert httpx.post(f"{first.url}/pub?topic=t", content=b"kept").text == "OK"
    assert first.process is not None

    # The second waits for the lease to lapse; the holder renews it: refused, one line.
    second = _api(root, env)
    assert second.returncode == 1, second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f"deltaq api: error: warehouse {root} is already served")
    assert f"(pid {first.process.pid} " in line
    assert httpx.get(f"{first.url}/stats?format=json").json()["topics"][0]["message_count"] == 1

    # kill -9: the lease lapses and the next API takes it over.
    first.kill9()
    started = time.monotonic()
    again = server_factory(tmp_path / "again", env=env, warehouse_url=root).start()
    assert time.monotonic() - started < 20
    assert httpx.get(f"{again.url}/stats?format=json").json()["topics"][0]["message_count"] == 1
    assert "took over the lapsed lease" in again.log()

    # Someone else writes the lease (as a takeover would): the holder stops serving.
    import boto3

    s3 = boto3.client("s3", **client_arguments(s3_server.endpoint))
    key = f"{root.split('/', 3)[3]}/_deltaq/api.lock"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b'{"pid": 1, "host": "elsewhere"}')
    assert again.process is not None
    again.process.wait(20)
    assert "another API took the lease; stopping" in again.log()
