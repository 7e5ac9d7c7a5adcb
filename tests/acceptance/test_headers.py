"""Message headers end to end: published in HTTP envelopes, kept by the journal across a
kill -9, stored as a map column of the topic, channel and dead-letter tables, returned by
/sub, /channel/dead and replays; TCP consumers get the body alone."""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable

from queue_engine.headers import MAX_HEADERS, MAX_NAME_BYTES, MAX_VALUE_BYTES
from tests.conftest import Server, topic_rows, wait_until
from tests.consumers import answer, body, create_channel, sub, sub_all
from tests.nsq_wire import Wire, identify


@pytest.fixture(scope="module")
def server(loop_served: Server) -> Server:
    return loop_served


_names = itertools.count()


def own(prefix: str) -> str:
    """A topic name no other test of the module uses (they share the server)."""
    return f"{prefix}{next(_names)}"


def envelope(body: str, headers: dict[str, str] | None = None) -> bytes:
    return json.dumps({"body": body, **({"headers": headers} if headers else {})}).encode()


def publish_one(http: httpx.Client, topic: str, body: str, headers: dict[str, str]) -> None:
    """An envelope published to ``topic`` (created, with channel ``c``)."""
    create_channel(http, topic, "c")
    r = http.post(
        "/pub", params={"topic": topic, "envelope": "json"}, content=envelope(body, headers)
    )
    assert r.text == "OK", r.text


def topic_headers(server: Server, topic: str) -> dict[bytes, Any]:
    rows = server.topic_table(topic).select(["body", "headers"]).to_pylist()
    return {r["body"]: r["headers"] for r in rows}


def test_headers_published_in_envelopes_reach_the_tables_and_sub(
    server: Server, http: httpx.Client
) -> None:
    topic = own("orders")
    create_channel(http, topic, "c")
    r = http.post(
        "/pub",
        params={"topic": topic, "envelope": "json"},
        content=envelope("one", {"region": "eu", "trace": "t-1"}),
    )
    assert r.text == "OK", r.text
    lines = [
        envelope("two", {"region": "us"}),
        b"",  # blank lines are skipped, as in text /mpub
        json.dumps({"body_base64": base64.b64encode(b"\x00\xff").decode()}).encode(),
        json.dumps({"body": {"sku": "A-1", "amount": 3}, "headers": {"region": "eu"}}).encode(),
    ]
    r = http.post("/mpub", params={"topic": topic, "envelope": "json"}, content=b"\n".join(lines))
    assert r.text == "OK", r.text
    # A raw publish beside them has no headers.
    assert http.post("/pub", params={"topic": topic}, content=b"raw").text == "OK"

    want = {
        b"one": {"region": "eu", "trace": "t-1"},
        b"two": {"region": "us"},
        b"\x00\xff": None,
        b'{"sku":"A-1","amount":3}': {"region": "eu"},
        b"raw": None,
    }
    stored = topic_headers(server, topic)
    # Null where a message has none (not an empty map).
    assert {k: None if v is None else dict(v) for k, v in stored.items()} == want

    got = sub_all(http, topic, "c", 5)
    assert {body(m): m["headers"] for m in got} == {k: v or {} for k, v in want.items()}
    assert answer(http, "fin", topic, "c", *got).text == "OK"
    channel = DeltaTable(str(server.warehouse / "channels" / topic / "c" / "messages"))
    rows = channel.to_pyarrow_table(columns=["body", "headers"]).to_pylist()
    assert {r["body"]: None if r["headers"] is None else dict(r["headers"]) for r in rows} == want


def test_tcp_consumers_get_the_body_alone(server: Server, http: httpx.Client) -> None:
    topic = own("tcp")
    create_channel(http, topic, "c")
    r = http.post(
        "/pub",
        params={"topic": topic, "envelope": "json"},
        content=envelope("exact bytes", {"region": "eu"}),
    )
    assert r.text == "OK"
    wire = Wire(server.tcp_port)
    wire.send(identify(client_id="t"))
    wire.send(f"SUB {topic} c\nRDY 1\n".encode())
    assert wire.frame() == (0, b"OK")
    assert wire.frame() == (0, b"OK")
    assert wire.message(timeout_s=30).body == b"exact bytes"
    wire.close()


def test_dead_letters_and_redrives_keep_headers(server: Server, http: httpx.Client) -> None:
    topic = own("dead")
    assert http.post("/topic/create", params={"topic": topic}).is_success
    r = http.post("/channel/create", params={"topic": topic, "channel": "c", "max_attempts": "1"})
    assert r.status_code == 200
    r = http.post(
        "/pub", params={"topic": topic, "envelope": "json"}, content=envelope("d", {"k": "v"})
    )
    assert r.text == "OK"
    [m] = sub_all(http, topic, "c", 1)
    assert answer(http, "req", topic, "c", m).text == "OK"
    # Its one attempt is used: the next SUB dead-letters it.
    assert sub(http, topic, "c", max=1, wait_ms=300) == []
    dead = http.get("/channel/dead", params={"topic": topic, "channel": "c"}).json()
    assert [(d["id"], d["headers"]) for d in dead["messages"]] == [(m["id"], {"k": "v"})]
    table = DeltaTable(str(server.warehouse / "channels" / topic / "c" / "dead"))
    assert table.to_pyarrow_table(columns=["headers"])["headers"].to_pylist() == [[("k", "v")]]

    r = http.post("/channel/redrive", params={"topic": topic, "channel": "c"})
    assert r.status_code == 200, r.text
    [again] = sub_all(http, topic, "c", 1)
    assert (again["id"], again["headers"], body(again)) == (m["id"], {"k": "v"}, b"d")


def test_a_replays_copies_keep_their_headers(server: Server, http: httpx.Client) -> None:
    topic = own("replay")
    publish_one(http, topic, "r", {"k": "1"})
    [m] = sub_all(http, topic, "c", 1)
    assert answer(http, "fin", topic, "c", m).text == "OK"
    r = http.post("/channel/replay", params={"topic": topic, "channel": "c", "from": "0"})
    assert r.status_code == 200, r.text
    [copy] = sub_all(http, topic, "c", 1)
    assert copy["id"] != m["id"]
    assert (body(copy), copy["headers"]) == (b"r", {"k": "1"})


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "an envelope is a JSON object"),
        (b'{"body": "x", "extra": 1}', "unknown fields ['extra']"),
        (b'{"headers": {}}', "exactly one of body and body_base64"),
        (b'{"body_base64": "***"}', "not base64"),
    ],
)
def test_a_bad_envelope_is_named_and_publishes_nothing(
    server: Server, http: httpx.Client, content: bytes, reason: str
) -> None:
    topic = own("bad")
    r = http.post("/pub", params={"topic": topic, "envelope": "json"}, content=content)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "INVALID_ENVELOPE"
    assert reason in r.json()["reason"]
    # As nsqd checks a body before it creates the topic: no topic (null, as nsqd's /stats
    # answers for a topic it does not have), so no message either.
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    assert stats["topics"] is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({f"h{i}": "v" for i in range(MAX_HEADERS + 1)}, f"{MAX_HEADERS + 1} headers > 100"),
        ({"n" * (MAX_NAME_BYTES + 1): "v"}, f"over {MAX_NAME_BYTES} bytes"),
        (
            {"big": "v" * (MAX_VALUE_BYTES + 1)},
            f"header 'big': the value is over {MAX_VALUE_BYTES}",
        ),
        ({"": "v"}, "a header name is empty"),
        ({"n": 1}, "header 'n': the value must be a string"),
    ],
)
def test_headers_over_a_limit_are_refused_naming_it(
    server: Server, http: httpx.Client, headers: dict[str, Any], reason: str
) -> None:
    topic = own("limits")
    content = json.dumps({"body": "x", "headers": headers}).encode()
    r = http.post("/pub", params={"topic": topic, "envelope": "json"}, content=content)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "INVALID_HEADERS"
    assert reason in r.json()["reason"]
    # At the limits exactly, the same publish is taken.
    fits = {f"h{i}": "v" * MAX_VALUE_BYTES for i in range(MAX_HEADERS - 1)}
    fits["n" * MAX_NAME_BYTES] = "v"
    ok = json.dumps({"body": "x", "headers": fits}).encode()
    assert http.post("/pub", params={"topic": topic, "envelope": "json"}, content=ok).text == "OK"
    [row] = topic_headers(server, topic).values()
    assert dict(row) == fits


def test_a_bad_line_of_an_mpub_is_named_and_nothing_of_the_batch_is_published(
    server: Server, http: httpx.Client
) -> None:
    topic = own("batch")
    lines = [envelope("a"), envelope("b", {"k": "v"}), b'{"body": "c", "headers": {"k": 2}}']
    r = http.post("/mpub", params={"topic": topic, "envelope": "json"}, content=b"\n".join(lines))
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == "line 3: header 'k': the value must be a string"
    r = http.post(
        "/mpub",
        params={"topic": topic, "envelope": "json"},
        content=envelope("a") + b"\n" + envelope(""),
    )
    assert (r.status_code, r.json()["message"]) == (400, "MSG_EMPTY")
    r = http.post(
        "/mpub", params={"topic": topic, "envelope": "json", "binary": "true"}, content=b"x"
    )
    assert (r.status_code, r.json()["message"]) == (400, "INVALID_ENVELOPE")
    r = http.post("/pub", params={"topic": topic, "envelope": "xml"}, content=b"x")
    assert (r.status_code, r.json()["message"]) == (400, "INVALID_ENVELOPE")
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    assert [t["message_count"] for t in stats["topics"]] == [0]


def test_journaled_headers_survive_a_kill_9(warehouse: Path, tmp_path: Path) -> None:
    """A publish acknowledged from the journal and killed before its topic commit: the next
    start commits it from the journal, headers included."""
    wh = tmp_path / "wh"
    # A commit waits 5 s after the one before (the first, 5 s after the first publish: the
    # topic was idle): once the topic's first commit is made, the kill lands while the next
    # publishes are only in the journal.
    server = Server(wh, env={"DELTAQ_DRAIN_LINGER_MS": "5000"}).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/pub", params={"topic": "j"}, content=b"first").text == "OK"
        topic_rows(wh, "j", 1, timeout_s=30)
        lines = [envelope(f"m{i}", {"i": str(i)} if i % 2 else None) for i in range(4)]
        r = c.post("/mpub", params={"topic": "j", "envelope": "json"}, content=b"\n".join(lines))
        assert r.text == "OK"
    server.kill9()
    assert DeltaTable(str(wh / "topics" / "j")).to_pyarrow_table().num_rows == 1
    server = Server(wh).start()
    try:
        rows = server.topic_table("j").select(["body", "headers"])
        got = {r["body"]: r["headers"] for r in rows.to_pylist()}
        want = {b"m0": None, b"m1": [("i", "1")], b"m2": None, b"m3": [("i", "3")]}
        assert got == {b"first": None, **want}
    finally:
        server.stop()


def test_a_filtered_channel_gets_only_what_its_filter_holds_for_from_each_change_on(
    server: Server, http: httpx.Client
) -> None:
    topic = own("filtered")
    assert http.post("/topic/create", params={"topic": topic}).is_success
    eu = "headers['region'] = 'eu'"
    r = http.post("/channel/create", params={"topic": topic, "channel": "eu", "filter": eu})
    assert r.status_code == 200, r.text
    assert http.post("/channel/create", params={"topic": topic, "channel": "all"}).is_success

    def publish(*regions: str | None) -> None:
        lines = [envelope(f"{i}-{g}", {"region": g} if g else None) for i, g in enumerate(regions)]
        r = http.post(
            "/mpub", params={"topic": topic, "envelope": "json"}, content=b"\n".join(lines)
        )
        assert r.text == "OK", r.text

    def take(channel: str, n: int) -> list[bytes]:
        got = sub_all(http, topic, channel, n)
        assert answer(http, "fin", topic, channel, *got).text == "OK"
        # Nothing else reaches the channel.
        assert sub(http, topic, channel, max=10, wait_ms=300) == []
        return sorted(body(m) for m in got)

    publish("eu", "us", None, "eu")
    assert take("all", 4) == [b"0-eu", b"1-us", b"2-None", b"3-eu"]
    assert take("eu", 2) == [b"0-eu", b"3-eu"]
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    filters = {c["channel_name"]: c["filter"] for c in stats["topics"][0]["channels"]}
    assert filters == {"all": None, "eu": eu}

    # A change applies to what is published after it.
    us = "headers['region'] = 'us'"
    r = http.post("/channel/configure", params={"topic": topic, "channel": "eu", "filter": us})
    assert r.status_code == 200, r.text
    publish("eu", "us")
    assert take("eu", 1) == [b"1-us"]
    r = http.post(
        "/channel/configure", params={"topic": topic, "channel": "eu", "filter": "default"}
    )
    assert r.status_code == 200, r.text
    publish("eu", None)
    assert take("eu", 2) == [b"0-eu", b"1-None"]
    assert take("all", 4) == [b"0-eu", b"0-eu", b"1-None", b"1-us"]


def test_a_bad_filter_is_refused_and_creates_nothing(server: Server, http: httpx.Client) -> None:
    topic = own("badfilter")
    assert http.post("/topic/create", params={"topic": topic}).is_success
    params = {"topic": topic, "channel": "c", "filter": "headers['region'] = 7"}
    r = http.post("/channel/create", params=params)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "message": "INVALID_FILTER",
        "reason": "= compares a string with a number",
    }
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    assert stats["topics"][0]["channels"] == []


def test_the_consoles_peek_and_lookup_show_headers(server: Server, http: httpx.Client) -> None:
    topic = own("console")
    publish_one(http, topic, "p", {"k": "v"})
    params = {"topic": topic, "channel": "c"}

    def peeked() -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = http.get("/console/api/peek", params=params).json()["messages"]
        return got

    wait_until(lambda: bool(peeked()), "the message in the channel")
    [m] = peeked()
    assert (m["body"], m["headers"]) == ("p", {"k": "v"})
