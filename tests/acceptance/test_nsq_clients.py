"""Existing NSQ HTTP clients work unchanged: gnsq's NsqdHTTPClient and NSQ's curl recipes."""

from __future__ import annotations

import shutil
import subprocess

import gnsq
import httpx
import pytest

from tests.conftest import Server


def test_gnsq_http_client(shared_server: Server) -> None:
    client = gnsq.NsqdHTTPClient("127.0.0.1", shared_server.port)
    assert client.ping() == b"OK"
    assert client.publish("gnsq_topic", b"one") == b"OK"
    assert client.publish("gnsq_topic", b"later", defer=5000) == b"OK"
    assert client.multipublish("gnsq_topic", [b"two", b"three"]) == b"OK"
    assert client.multipublish("gnsq_topic", [b"bin\n1", b"bin\x002"], binary=True) == b"OK"
    client.create_topic("gnsq_other")
    client.create_channel("gnsq_topic", "workers")

    def channel_paused() -> list[bool]:
        [topic] = client.stats(topic="gnsq_topic")["topics"]
        return [c["paused"] for c in topic["channels"]]

    client.pause_channel("gnsq_topic", "workers")
    assert channel_paused() == [True]
    client.unpause_channel("gnsq_topic", "workers")
    assert channel_paused() == [False]
    client.pause_topic("gnsq_other")
    assert [t["paused"] for t in client.stats(topic="gnsq_other")["topics"]] == [True]
    client.unpause_topic("gnsq_other")
    assert [t["paused"] for t in client.stats(topic="gnsq_other")["topics"]] == [False]
    client.empty_channel("gnsq_topic", "workers")
    client.delete_channel("gnsq_topic", "workers")
    assert client.stats(topic="gnsq_topic")["topics"][0]["channels"] == []
    client.empty_topic("gnsq_other")
    client.delete_topic("gnsq_other")
    assert "gnsq_other" not in {t["topic_name"] for t in client.stats()["topics"]}
    info = client.info()
    assert info["version"] == "1.3.0"
    stats = client.stats(topic="gnsq_topic")
    assert [t["topic_name"] for t in stats["topics"]] == ["gnsq_topic"]
    bodies = sorted(shared_server.topic_table("gnsq_topic")["body"].to_pylist())
    assert bodies == sorted([b"one", b"later", b"two", b"three", b"bin\n1", b"bin\x002"])
    with pytest.raises(gnsq.errors.NSQHttpError) as excinfo:
        client.delete_topic("gnsq_never_created")
    assert "404" in str(excinfo.value)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_nsq_documented_curl_recipes(shared_server: Server) -> None:
    url = shared_server.url

    def curl(*args: str) -> str:
        return subprocess.run(
            ["curl", "-s", *args], check=True, capture_output=True, text=True, timeout=30
        ).stdout

    # From nsqd's HTTP API documentation.
    assert curl("-d", "<message>", f"{url}/pub?topic=curl_topic") == "OK"
    assert curl("-d", "<message>", f"{url}/pub?topic=curl_topic&defer=1000") == "OK"
    assert curl("-d", "msg1\nmsg2\nmsg3", f"{url}/mpub?topic=curl_topic") == "OK"
    assert curl("-X", "POST", f"{url}/topic/create?topic=curl_made") == ""
    assert curl("-X", "POST", f"{url}/channel/create?topic=curl_made&channel=ch") == ""
    assert curl(f"{url}/ping") == "OK"
    rows = shared_server.topic_table("curl_topic")["body"].to_pylist()
    assert sorted(rows) == sorted([b"<message>", b"<message>", b"msg1", b"msg2", b"msg3"])
    topics = httpx.get(f"{url}/stats?format=json").json()["topics"]
    [made] = [t for t in topics if t["topic_name"] == "curl_made"]
    assert [c["channel_name"] for c in made["channels"]] == ["ch"]
