"""Upstream nsqadmin 1.3.0 pointed at deltaq (--nsqd-http-address): it lists topics and
channels with their counts, and its pause / empty / delete actions act on deltaq."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pyspark.sql import SparkSession

from tests.conftest import HOST, Server, free_port
from tests.consumers import sub
from tests.nsq_wire import tool
from tests.spark.test_fanout import run_once


@pytest.fixture
def admin(server_factory: type[Server], tmp_path: Path) -> Iterator[tuple[httpx.Client, Server]]:
    binary = tool("nsqadmin")
    server = server_factory(tmp_path / "wh", env={"DELTAQ_BROADCAST_ADDRESS": HOST}).start()
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            f"--http-address={HOST}:{port}",
            f"--nsqd-http-address={HOST}:{server.port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.get("/ping").status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield client, server
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def test_nsqadmin_lists_and_acts_on_deltaq(
    admin: tuple[httpx.Client, Server], spark: SparkSession
) -> None:
    nsqadmin, server = admin
    with httpx.Client(base_url=server.url, timeout=30) as api:
        assert api.post("/topic/create?topic=orders").is_success
        assert api.post("/channel/create?topic=orders&channel=billing").is_success
        assert api.post("/mpub?topic=orders", content=b"a\nb\nc").text == "OK"

        assert nsqadmin.get("/api/topics").json()["topics"] == ["orders"]
        topic = nsqadmin.get("/api/topics/orders").json()
        assert topic["message_count"] == 3
        [node] = topic["nodes"]
        assert node["node"] == f"{HOST}:{server.port}"
        assert [c["channel_name"] for c in node["channels"]] == ["billing"]
        nodes = nsqadmin.get("/api/nodes").json()["nodes"]
        assert nodes[0]["version"] == "1.3.0" and nodes[0]["tcp_port"] == server.tcp_port

        def channel() -> dict[str, object]:
            stats = api.get("/stats?format=json&topic=orders").json()
            return dict(stats["topics"][0]["channels"][0])

        assert nsqadmin.post("/api/topics/orders/billing", json={"action": "pause"}).is_success
        assert channel()["paused"] is True
        assert nsqadmin.get("/api/topics/orders/billing").json()["paused"] is True
        assert nsqadmin.post("/api/topics/orders/billing", json={"action": "unpause"}).is_success
        assert channel()["paused"] is False
        # The fanout puts the three in the channel; two more stay in the topic (none runs
        # after this one).
        server.topic_table("orders")
        run_once(spark, server.warehouse)
        deadline = time.monotonic() + 30
        while channel()["depth"] != 3:
            assert time.monotonic() < deadline, channel()
            time.sleep(0.1)
        assert api.post("/mpub?topic=orders", content=b"d\ne").text == "OK"

        assert nsqadmin.post("/api/topics/orders", json={"action": "pause"}).is_success
        assert api.get("/stats?format=json").json()["topics"][0]["paused"] is True

        assert api.get("/stats?format=json").json()["topics"][0]["depth"] == 2
        assert nsqadmin.post("/api/topics/orders", json={"action": "empty"}).is_success
        assert api.get("/stats?format=json").json()["topics"][0]["depth"] == 0
        assert nsqadmin.post("/api/topics/orders/billing", json={"action": "empty"}).is_success
        assert channel()["depth"] == 0
        # Gone, not only uncounted: a consumer gets none of the three.
        assert sub(api, "orders", "billing", max=10, wait_ms=1000) == []
        assert nsqadmin.delete("/api/topics/orders/billing").is_success
        assert api.get("/stats?format=json").json()["topics"][0]["channels"] == []
        assert nsqadmin.delete("/api/topics/orders").is_success
        assert api.get("/stats?format=json").json()["topics"] == []
