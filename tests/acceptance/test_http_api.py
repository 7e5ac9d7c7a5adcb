"""Every producer endpoint and error code, against a real server, through both front doors.

The shared server runs with max_msg_size 1024, max_body_size 4096, max_req_timeout 60000.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import time

import httpx
import pytest
from pyspark.sql import SparkSession

from queue_engine.mpub import encode_binary
from tests.conftest import Server
from tests.consumers import sub
from tests.spark.test_fanout import run_once

_names = itertools.count()


def topic_name(prefix: str = "t") -> str:
    return f"{prefix}{next(_names)}_{time.monotonic_ns() % 10**9}"


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json() == {"message": code}
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert response.headers["x-nsq-content-type"] == "nsq; version=1.0"


def stats(client: httpx.Client, **params: str) -> dict:  # type: ignore[type-arg]
    r = client.get("/stats", params={"format": "json", **params})
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def topic_stats(client: httpx.Client, topic: str) -> dict:  # type: ignore[type-arg]
    found = [t for t in stats(client, topic=topic)["topics"] if t["topic_name"] == topic]
    assert len(found) == 1
    return found[0]  # type: ignore[no-any-return]


# -- ping / info / stats -------------------------------------------------------------------


def test_ping(client: httpx.Client) -> None:
    r = client.get("/ping")
    assert (r.status_code, r.text) == (200, "OK")


def test_info(client: httpx.Client, shared_server: Server) -> None:
    r = client.get("/info")
    assert r.status_code == 200
    info = r.json()
    assert info["version"] == "1.3.0"
    assert info["http_port"] == shared_server.port
    assert {"broadcast_address", "hostname", "tcp_port", "start_time"} <= info.keys()
    # The address NSQ's clients connect to: this server's, not nsqd's default.
    assert info["tcp_port"] == shared_server.tcp_port != 4150
    assert r.headers["x-nsq-content-type"] == "nsq; version=1.0"


def test_stats_json_shape_and_filters(client: httpx.Client) -> None:
    a, b = topic_name("sa"), topic_name("sb")
    assert client.post("/pub", params={"topic": a}, content=b"x").status_code == 200
    assert client.post("/topic/create", params={"topic": b}).status_code == 200
    assert client.post("/channel/create", params={"topic": a, "channel": "c1"}).status_code == 200
    assert client.post("/channel/create", params={"topic": a, "channel": "c2"}).status_code == 200
    body = stats(client)
    assert {"version", "health", "start_time", "topics", "producers", "memory"} <= body.keys()
    names = {t["topic_name"] for t in body["topics"]}
    assert {a, b} <= names
    only_a = stats(client, topic=a)["topics"]
    assert [t["topic_name"] for t in only_a] == [a]
    t = only_a[0]
    for key in (
        "depth",
        "backend_depth",
        "message_count",
        "message_bytes",
        "paused",
        "e2e_processing_latency",
        "channels",
    ):
        assert key in t
    assert t["message_count"] == 1 and t["depth"] == 1 and t["message_bytes"] == 1
    assert [c["channel_name"] for c in t["channels"]] == ["c1", "c2"]
    for key in (
        "depth",
        "in_flight_count",
        "deferred_count",
        "message_count",
        "requeue_count",
        "timeout_count",
        "client_count",
        "paused",
        "clients",
    ):
        assert key in t["channels"][0]
    one = stats(client, topic=a, channel="c2")["topics"][0]["channels"]
    assert [c["channel_name"] for c in one] == ["c2"]
    assert "memory" not in stats(client, include_mem="false")


def test_stats_text(client: httpx.Client) -> None:
    topic = topic_name("text")
    client.post("/pub", params={"topic": topic}, content=b"x")
    client.post("/topic/pause", params={"topic": topic})
    r = client.get("/stats")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert f"*P [{topic}" in r.text
    assert "Health: OK" in r.text


# -- /pub ----------------------------------------------------------------------------------


def test_pub_appends_one_row(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("pub")
    r = client.post("/pub", params={"topic": topic}, content=b"hello \x00 world")
    assert (r.status_code, r.text) == (200, "OK")
    assert r.headers["x-nsq-content-type"] == "nsq; version=1.0"
    table = shared_server.topic_table(topic).to_pylist()
    assert len(table) == 1
    row = table[0]
    assert row["body"] == b"hello \x00 world"
    assert len(row["id"]) == 16 and int(row["id"], 16) > 0
    assert row["deliver_at"] is None


def test_a_node_tells_the_fanout_which_topics_it_committed_to(
    client: httpx.Client, shared_server: Server
) -> None:
    topic = topic_name("noticed")
    assert client.post("/pub", params={"topic": topic}, content=b"x").text == "OK"
    notice = shared_server.warehouse / "_deltaq" / "notices" / "api-0.json"  # the node's lane
    deadline = time.monotonic() + 5
    named: set[str] = set()
    while topic not in named and time.monotonic() < deadline:
        time.sleep(0.05)
        if notice.exists():
            batches = json.loads(notice.read_bytes())["batches"]
            named = {t for _, tables in batches for t, channel in tables if channel == ""}
    assert topic in named


def test_pub_defer_stores_deliver_at(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("defer")
    assert (
        client.post("/pub", params={"topic": topic, "defer": "30000"}, content=b"later").status_code
        == 200
    )
    assert (
        client.post("/pub", params={"topic": topic, "defer": "0"}, content=b"now").status_code
        == 200
    )
    rows = {r["body"]: r for r in shared_server.topic_table(topic).to_pylist()}
    later = rows[b"later"]
    delta = later["deliver_at"] - later["published_at"]
    assert delta.total_seconds() == pytest.approx(30.0, abs=0.001)
    assert rows[b"now"]["deliver_at"] is None


@pytest.mark.parametrize("value", ["abc", "1.5", "", "-1", "60001", " 5"])
def test_pub_invalid_defer(client: httpx.Client, value: str) -> None:
    r = client.post("/pub", params={"topic": topic_name(), "defer": value}, content=b"x")
    assert_error(r, 400, "INVALID_DEFER")


def test_pub_max_defer_is_allowed(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name()
    r = client.post("/pub", params={"topic": topic, "defer": "60000"}, content=b"x")
    assert r.status_code == 200
    [row] = shared_server.topic_table(topic).to_pylist()
    delta = row["deliver_at"] - row["published_at"]
    assert delta.total_seconds() == pytest.approx(60.0, abs=0.001)


def test_pub_errors(client: httpx.Client, shared_server: Server) -> None:
    assert_error(client.post("/pub", content=b"x"), 400, "MISSING_ARG_TOPIC")
    assert_error(client.post("/pub", params={"topic": ""}, content=b"x"), 400, "INVALID_TOPIC")
    assert_error(
        client.post("/pub", params={"topic": "a" * 65}, content=b"x"), 400, "INVALID_TOPIC"
    )
    assert_error(
        client.post("/pub", params={"topic": "bad/name"}, content=b"x"), 400, "INVALID_TOPIC"
    )
    assert_error(client.post("/pub", params={"topic": ".."}, content=b"x"), 400, "INVALID_TOPIC")
    assert_error(client.post("/pub", params={"topic": "ok"}, content=b""), 400, "MSG_EMPTY")
    # Body checks come before topic checks, as in nsqd.
    assert_error(client.post("/pub", content=b""), 400, "MSG_EMPTY")
    topic = topic_name("big")
    assert_error(
        client.post("/pub", params={"topic": topic}, content=b"x" * 1025), 413, "MSG_TOO_BIG"
    )
    assert client.post("/pub", params={"topic": topic}, content=b"x" * 1024).status_code == 200
    assert shared_server.topic_table(topic).num_rows == 1


def test_pub_chunked_body_too_big(client: httpx.Client) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(5):
            yield b"x" * 300

    r = client.post("/pub", params={"topic": topic_name()}, content=chunks())
    assert_error(r, 413, "MSG_TOO_BIG")


def test_pub_chunked_body_within_limit(client: httpx.Client, shared_server: Server) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b"ab"
        yield b"cd"

    topic = topic_name("chunk")
    assert client.post("/pub", params={"topic": topic}, content=chunks()).status_code == 200
    assert shared_server.topic_table(topic)["body"].to_pylist() == [b"abcd"]


def test_ephemeral_topic_name_is_accepted(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("eph") + "#ephemeral"
    assert client.post("/pub", params={"topic": topic}, content=b"x").status_code == 200
    assert shared_server.topic_table(topic).num_rows == 1


# -- /mpub ---------------------------------------------------------------------------------


def test_mpub_text_skips_empty_lines(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("mt")
    r = client.post("/mpub", params={"topic": topic}, content=b"one\n\ntwo\nthree\n")
    assert (r.status_code, r.text) == (200, "OK")
    table = shared_server.topic_table(topic)
    assert sorted(table["body"].to_pylist()) == [b"one", b"three", b"two"]
    ids = table["id"].to_pylist()
    assert len(set(ids)) == 3
    # One request is one commit: all its messages share one Delta version.
    assert topic_stats(client, topic)["delta_commits"] == 1


def test_mpub_only_empty_lines_creates_topic(client: httpx.Client) -> None:
    topic = topic_name("empty")
    assert client.post("/mpub", params={"topic": topic}, content=b"\n\n").status_code == 200
    assert topic_stats(client, topic)["message_count"] == 0


def test_mpub_binary(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("mb")
    messages = [b"a\nb", b"\x00\x01", b"x" * 1024]
    r = client.post(
        "/mpub", params={"topic": topic, "binary": "true"}, content=encode_binary(messages)
    )
    assert r.status_code == 200, r.text
    assert sorted(shared_server.topic_table(topic)["body"].to_pylist()) == sorted(messages)


def test_mpub_binary_trailing_bytes_ignored(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("trail")
    body = encode_binary([b"one"]) + b"junk"
    assert (
        client.post("/mpub", params={"topic": topic, "binary": "1"}, content=body).status_code
        == 200
    )
    assert shared_server.topic_table(topic)["body"].to_pylist() == [b"one"]


def test_mpub_binary_false_means_text(client: httpx.Client, shared_server: Server) -> None:
    topic = topic_name("bf")
    assert (
        client.post(
            "/mpub", params={"topic": topic, "binary": "false"}, content=b"a\nb"
        ).status_code
        == 200
    )
    assert shared_server.topic_table(topic).num_rows == 2


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "BAD_BODY"),
        (b"\x00\x00", "BAD_BODY"),
        (struct.pack(">i", 0), "BAD_BODY"),
        (struct.pack(">i", -1), "BAD_BODY"),
        (struct.pack(">i", 100000), "BAD_BODY"),
        (struct.pack(">i", 2), "BAD_MESSAGE"),
        (struct.pack(">ii", 1, 0), "BAD_MESSAGE"),
        (struct.pack(">ii", 1, -5), "BAD_MESSAGE"),
        (struct.pack(">ii", 1, 1025) + b"x" * 1025, "BAD_MESSAGE"),
        (struct.pack(">ii", 1, 10) + b"short", "BAD_MESSAGE"),
        (struct.pack(">ii", 2, 1) + b"a" + struct.pack(">i", 3) + b"b", "BAD_MESSAGE"),
    ],
)
def test_mpub_binary_errors(
    client: httpx.Client, shared_server: Server, body: bytes, code: str
) -> None:
    topic = topic_name("be")
    r = client.post("/mpub", params={"topic": topic, "binary": "true"}, content=body)
    assert_error(r, 413, code)
    # Nothing of a rejected request is committed.
    assert topic_stats(client, topic)["message_count"] == 0


def test_mpub_errors(client: httpx.Client) -> None:
    assert_error(client.post("/mpub", content=b"a"), 400, "MISSING_ARG_TOPIC")
    assert_error(
        client.post("/mpub", params={"topic": "no spaces"}, content=b"a"), 400, "INVALID_TOPIC"
    )
    topic = topic_name("me")
    assert_error(
        client.post("/mpub", params={"topic": topic}, content=b"x" * 4097), 413, "BODY_TOO_BIG"
    )
    # BODY_TOO_BIG is decided on Content-Length before the topic is looked at, as nsqd does.
    assert_error(client.post("/mpub", content=b"x" * 4097), 413, "BODY_TOO_BIG")
    too_long_line = b"ok\n" + b"y" * 1025
    assert_error(
        client.post("/mpub", params={"topic": topic}, content=too_long_line), 413, "MSG_TOO_BIG"
    )
    assert_error(
        client.post("/mpub", params={"topic": topic, "binary": "true"}, content=b"x" * 4097),
        413,
        "BODY_TOO_BIG",
    )
    assert topic_stats(client, topic)["message_count"] == 0


# -- routing errors ------------------------------------------------------------------------


def test_method_not_allowed_and_not_found(client: httpx.Client) -> None:
    r = client.get("/pub", params={"topic": "x"})
    assert_error(r, 405, "METHOD_NOT_ALLOWED")
    assert "POST" in r.headers["allow"]
    r = client.post("/ping")
    assert_error(r, 405, "METHOD_NOT_ALLOWED")
    assert "GET" in r.headers["allow"]
    assert_error(client.get("/nope"), 404, "NOT_FOUND")
    assert_error(client.post("/topic/nope", params={"topic": "x"}), 404, "NOT_FOUND")


def test_openapi_lists_the_api(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/pub", "/mpub", "/topic/create", "/channel/create", "/stats", "/ping", "/info"):
        assert path in spec["paths"]
    pub = spec["paths"]["/pub"]["post"]
    assert "application/octet-stream" in pub["requestBody"]["content"]
    assert "413" in pub["responses"] and "400" in pub["responses"]


# -- topics --------------------------------------------------------------------------------


def test_topic_create_pause_unpause_empty_delete(
    client: httpx.Client, shared_server: Server
) -> None:
    topic = topic_name("adm")
    r = client.post("/topic/create", params={"topic": topic})
    assert (r.status_code, r.text) == (200, "")
    assert r.headers["x-nsq-content-type"] == "nsq; version=1.0"
    assert client.post("/topic/create", params={"topic": topic}).status_code == 200  # idempotent
    client.post("/mpub", params={"topic": topic}, content=b"a\nb\nc")
    assert topic_stats(client, topic)["depth"] == 3

    assert client.post("/topic/pause", params={"topic": topic}).status_code == 200
    assert topic_stats(client, topic)["paused"] is True
    # A paused topic still accepts publishes (nsqd: pause stops delivery, not publishing).
    assert client.post("/pub", params={"topic": topic}, content=b"d").status_code == 200
    assert client.post("/topic/unpause", params={"topic": topic}).status_code == 200
    assert topic_stats(client, topic)["paused"] is False

    assert client.post("/topic/empty", params={"topic": topic}).status_code == 200
    t = topic_stats(client, topic)
    assert (t["depth"], t["message_count"]) == (0, 4)
    client.post("/pub", params={"topic": topic}, content=b"e")
    assert topic_stats(client, topic)["depth"] == 1

    path = shared_server.warehouse / "topics" / topic
    assert path.exists()
    assert client.post("/topic/delete", params={"topic": topic}).status_code == 200
    assert not path.exists()
    assert all(t["topic_name"] != topic for t in stats(client)["topics"])
    assert_error(client.post("/topic/delete", params={"topic": topic}), 404, "TOPIC_NOT_FOUND")
    # Re-creating a deleted topic starts empty.
    client.post("/pub", params={"topic": topic}, content=b"again")
    assert shared_server.topic_table(topic)["body"].to_pylist() == [b"again"]


@pytest.mark.parametrize("op", ["delete", "pause", "unpause", "empty"])
def test_topic_ops_on_missing_topic(client: httpx.Client, op: str) -> None:
    assert_error(client.post(f"/topic/{op}"), 400, "MISSING_ARG_TOPIC")
    assert_error(
        client.post(f"/topic/{op}", params={"topic": topic_name("missing")}), 404, "TOPIC_NOT_FOUND"
    )


def test_topic_create_and_empty_validate_names(client: httpx.Client) -> None:
    assert_error(client.post("/topic/create"), 400, "MISSING_ARG_TOPIC")
    assert_error(client.post("/topic/create", params={"topic": "bad name"}), 400, "INVALID_TOPIC")
    assert_error(client.post("/topic/empty", params={"topic": "bad name"}), 400, "INVALID_TOPIC")


# -- channels ------------------------------------------------------------------------------


def test_channel_lifecycle(
    client: httpx.Client, shared_server: Server, spark: SparkSession
) -> None:
    topic = topic_name("ch")
    assert_error(
        client.post("/channel/create", params={"topic": topic, "channel": "c"}),
        404,
        "TOPIC_NOT_FOUND",
    )
    client.post("/topic/create", params={"topic": topic})
    r = client.post("/channel/create", params={"topic": topic, "channel": "c"})
    assert (r.status_code, r.text) == (200, "")
    assert (
        client.post("/channel/create", params={"topic": topic, "channel": "c"}).status_code == 200
    )
    assert (
        client.post(
            "/channel/create", params={"topic": topic, "channel": "e#ephemeral"}
        ).status_code
        == 200
    )

    def channel(name: str) -> dict:  # type: ignore[type-arg]
        return next(c for c in topic_stats(client, topic)["channels"] if c["channel_name"] == name)

    assert client.post("/channel/pause", params={"topic": topic, "channel": "c"}).status_code == 200
    assert channel("c")["paused"] is True
    assert (
        client.post("/channel/unpause", params={"topic": topic, "channel": "c"}).status_code == 200
    )
    assert channel("c")["paused"] is False
    # Three messages in both channels (the fanout runs once, over the module's warehouse).
    assert client.post("/mpub", params={"topic": topic}, content=b"a\nb\nc").text == "OK"
    shared_server.topic_table(topic)
    run_once(spark, shared_server.warehouse)
    deadline = time.monotonic() + 30
    while [channel(name)["depth"] for name in ("c", "e#ephemeral")] != [3, 3]:
        assert time.monotonic() < deadline, topic_stats(client, topic)["channels"]
        time.sleep(0.1)
    assert client.post("/channel/empty", params={"topic": topic, "channel": "c"}).status_code == 200
    # Gone from that channel, not only uncounted; the other channel keeps its copies.
    assert channel("c")["depth"] == 0
    assert sub(client, topic, "c", max=10, wait_ms=1000) == []
    assert channel("e#ephemeral")["depth"] == 3
    assert (
        client.post("/channel/delete", params={"topic": topic, "channel": "c"}).status_code == 200
    )
    assert [c["channel_name"] for c in topic_stats(client, topic)["channels"]] == ["e#ephemeral"]
    for op in ("delete", "pause", "unpause", "empty"):
        assert_error(
            client.post(f"/channel/{op}", params={"topic": topic, "channel": "c"}),
            404,
            "CHANNEL_NOT_FOUND",
        )
        assert_error(
            client.post(f"/channel/{op}", params={"topic": topic_name("x"), "channel": "c"}),
            404,
            "TOPIC_NOT_FOUND",
        )


@pytest.mark.parametrize("op", ["create", "delete", "pause", "unpause", "empty"])
def test_channel_ops_validate_args(client: httpx.Client, op: str) -> None:
    path = f"/channel/{op}"
    assert_error(client.post(path, params={"channel": "c"}), 400, "MISSING_ARG_TOPIC")
    assert_error(
        client.post(path, params={"topic": "bad name", "channel": "c"}), 400, "INVALID_ARG_TOPIC"
    )
    assert_error(client.post(path, params={"topic": "t"}), 400, "MISSING_ARG_CHANNEL")
    assert_error(
        client.post(path, params={"topic": "t", "channel": "bad/c"}), 400, "INVALID_ARG_CHANNEL"
    )
    assert_error(
        client.post(path, params={"topic": "t", "channel": "c" * 65}),
        400,
        "INVALID_ARG_CHANNEL",
    )


def test_docs_page_needs_no_network(client: httpx.Client) -> None:
    """/docs loads Swagger UI from the API itself: every script and stylesheet it names is
    served here, and nothing points at another host."""
    page = client.get("/docs")
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets), assets
    for asset in assets:
        assert asset.startswith("/"), f"/docs loads {asset} from elsewhere"
        r = client.get(asset)
        assert r.status_code == 200 and len(r.content) > 0, asset
    assert "/openapi.json" in page.text
