"""Typed topics end to end: a schema declared in Spark DDL at /topic/create or
/topic/configure, bodies held to it on every publish path (HTTP and TCP, single and batch),
fitting bodies landing as typed columns of the topic, channel and dead-letter tables, the raw
body delivered byte for byte, schema evolution by Delta's rules, and filters over the fields."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable

from tests.conftest import Server, wait_until
from tests.consumers import answer, body, channel_stats, sub, sub_all
from tests.nsq_wire import Wire, identify

SCHEMA = "sku STRING NOT NULL, amount DOUBLE, qty INT, placed_at TIMESTAMP, day DATE, gift BOOLEAN"
UTC = dt.UTC


@pytest.fixture(scope="module")
def server(loop_served: Server) -> Server:
    return loop_served


_names = itertools.count()


def typed_topic(http: httpx.Client, prefix: str, schema: str = SCHEMA, **channel: str) -> str:
    """A new typed topic (created with its schema) with channel ``c``."""
    topic = f"{prefix}{next(_names)}"
    r = http.post("/topic/create", params={"topic": topic, "schema": schema})
    assert r.status_code == 200, r.text
    r = http.post("/channel/create", params={"topic": topic, "channel": "c", **channel})
    assert r.status_code == 200, r.text
    return topic


def order(sku: str, **fields: Any) -> bytes:
    return json.dumps({"sku": sku, **fields}).encode()


def error(r: httpx.Response) -> tuple[int, str, str]:
    doc = r.json()
    return r.status_code, doc["message"], doc.get("reason", "")


def rows(path: Path, *columns: str) -> list[dict[str, Any]]:
    table = DeltaTable(str(path)).to_pyarrow_table(columns=list(columns))
    return sorted(table.to_pylist(), key=lambda r: str(r[columns[0]]))


def test_fitting_bodies_land_as_typed_columns_and_consumers_get_the_body_as_sent(
    server: Server, http: httpx.Client
) -> None:
    topic = typed_topic(http, "orders")
    # Pretty-printed across lines, with a field the schema does not declare.
    first = (
        b'{"sku": "A-1", "amount": 12.5, "qty": 2, "placed_at": "2026-01-31T12:00:00Z",\n'
        b' "day": "2026-01-31", "gift": true, "note": [1, 2]}'
    )
    assert http.post("/pub", params={"topic": topic}, content=first).text == "OK"
    batch = [order("B-2", amount=3, qty=-1), order("C-3", placed_at="2026-02-01 00:00:00.5+01:00")]
    assert http.post("/mpub", params={"topic": topic}, content=b"\n".join(batch)).text == "OK"

    got = server.topic_table(topic).select(
        ["sku", "amount", "qty", "placed_at", "day", "gift", "body"]
    )
    assert sorted(got.to_pylist(), key=lambda r: r["sku"]) == [
        {
            "sku": "A-1",
            "amount": 12.5,
            "qty": 2,
            "placed_at": dt.datetime(2026, 1, 31, 12, tzinfo=UTC),
            "day": dt.date(2026, 1, 31),
            "gift": True,
            "body": first,
        },
        {
            "sku": "B-2",
            "amount": 3.0,
            "qty": -1,
            "placed_at": None,
            "day": None,
            "gift": None,
            "body": batch[0],
        },
        {
            "sku": "C-3",
            "amount": None,
            "qty": None,
            "placed_at": dt.datetime(2026, 1, 31, 23, 0, 0, 500000, tzinfo=UTC),
            "day": None,
            "gift": None,
            "body": batch[1],
        },
    ]
    delivered = sub_all(http, topic, "c", 3)
    assert sorted(body(m) for m in delivered) == sorted([first, *batch])
    channel = server.warehouse / "channels" / topic / "c" / "messages"
    assert [(r["sku"], r["qty"]) for r in rows(channel, "sku", "qty")] == [
        ("A-1", 2),
        ("B-2", -1),
        ("C-3", None),
    ]
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    assert stats["topics"][0]["schema"] == (
        "`sku` STRING NOT NULL, `amount` DOUBLE, `qty` INT, `placed_at` TIMESTAMP, "
        "`day` DATE, `gift` BOOLEAN"
    )


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"amount": 1}', "field sku: required (NOT NULL), absent or null"),
        (b'{"sku": null}', "field sku: required (NOT NULL), absent or null"),
        (b'{"sku": 5}', "field sku: expected STRING: a string; got an integer 5"),
        (b'{"sku": "a", "qty": 1.5}', "field qty: expected INT"),
        (b'{"sku": "a", "qty": 2147483648}', "field qty: expected INT"),
        (b'{"sku": "a", "amount": "12"}', "field amount: expected DOUBLE: a number"),
        (b'{"sku": "a", "gift": 1}', "field gift: expected BOOLEAN"),
        (b'{"sku": "a", "day": "2026-02-30"}', "field day: expected DATE"),
        (b'{"sku": "a", "placed_at": "2026-01-31"}', "field placed_at: expected TIMESTAMP"),
        (
            b'{"sku": "a", "placed_at": "2026-01-31T12:00:00"}',
            "field placed_at: expected TIMESTAMP: an RFC 3339 time with its zone",
        ),
        (b'["sku"]', "a typed topic takes a JSON object, not an array"),
        (b"sku=a", "not JSON"),
        (b'{"sku": "a"} {"sku": "b"}', "not JSON"),
    ],
)
def test_a_body_that_does_not_fit_is_refused_naming_field_and_reason(
    server: Server, http: httpx.Client, content: bytes, reason: str
) -> None:
    topic = typed_topic(http, "refused")
    r = http.post("/pub", params={"topic": topic}, content=content)
    assert error(r)[:2] == (400, "INVALID_BODY")
    assert error(r)[2].startswith(reason), error(r)
    stats = http.get("/stats", params={"format": "json", "topic": topic}).json()
    assert stats["topics"][0]["message_count"] == 0


def test_a_batch_names_its_first_unfit_line_and_writes_none_of_it(
    server: Server, http: httpx.Client
) -> None:
    topic = typed_topic(http, "batch")
    lines = [order("ok-1"), order("ok-2"), order("bad", qty="many"), order("ok-3", qty=[])]
    r = http.post("/mpub", params={"topic": topic}, content=b"\n".join(lines))
    assert error(r) == (
        400,
        "INVALID_BODY",
        "line 3: field qty: expected INT: an integer from -2147483648 to 2147483647; "
        'got a string "many"',
    )
    # Envelopes too: the body inside is what must fit.
    envelopes = [
        json.dumps({"body": {"sku": "e"}, "headers": {"h": "1"}}),
        json.dumps({"body": "x"}),
    ]
    r = http.post(
        "/mpub", params={"topic": topic, "envelope": "json"}, content="\n".join(envelopes)
    )
    assert error(r)[:2] == (400, "INVALID_BODY")
    assert error(r)[2].startswith("line 2: not JSON")
    r = http.post(
        "/pub",
        params={"topic": topic, "envelope": "json"},
        content=json.dumps({"body": {"sku": "env", "qty": 7}, "headers": {"h": "1"}}),
    )
    assert r.text == "OK"
    table = server.topic_table(topic)
    assert table.select(["sku", "qty", "headers"]).to_pylist() == [
        {"sku": "env", "qty": 7, "headers": [("h", "1")]}
    ]


def test_tcp_publishes_are_held_to_the_schema(server: Server, http: httpx.Client) -> None:
    topic = typed_topic(http, "tcp")
    wire = Wire(server.tcp_port)
    wire.send(identify(client_id="t"))
    assert wire.frame() == (0, b"OK")
    wire.send(
        b"PUB " + topic.encode() + b"\n" + len(order("t-1")).to_bytes(4, "big") + order("t-1")
    )
    assert wire.frame() == (0, b"OK")
    bad = b'{"qty": 1}'
    wire.send(b"PUB " + topic.encode() + b"\n" + len(bad).to_bytes(4, "big") + bad)
    kind, data = wire.frame()
    assert kind == 1
    assert data.startswith(b"E_BAD_MESSAGE PUB field sku: required"), data
    wire.close()
    assert server.topic_table(topic)["sku"].to_pylist() == ["t-1"]


def test_the_schema_evolves_by_deltas_rules(server: Server, http: httpx.Client) -> None:
    topic = typed_topic(http, "evolve", "sku STRING NOT NULL, qty INT")
    assert (
        http.post("/pub", params={"topic": topic}, content=order("old", qty=1, size=3)).text == "OK"
    )

    def configure(schema: str) -> httpx.Response:
        return http.post("/topic/configure", params={"topic": topic, "schema": schema})

    # A refused schema changes nothing, not even the TTL given with it.
    r = http.post(
        "/topic/configure", params={"topic": topic, "ttl_ms": "1000", "schema": "sku STRING"}
    )
    assert error(r)[:2] == (409, "SCHEMA_CHANGE_REFUSED")
    registry = DeltaTable(str(server.warehouse / "registry")).to_pyarrow_table()
    options = [
        o
        for t, o in zip(registry["topic"].to_pylist(), registry["options"].to_pylist(), strict=True)
        if t == topic
    ]
    assert not any("ttl_ms" in (o or "") for o in options), options
    for schema, reason in [
        ("sku STRING NOT NULL", "field qty is dropped"),
        ("sku STRING NOT NULL, qty BIGINT", "field qty: INT to BIGINT"),
        ("sku STRING NOT NULL, qty INT, size STRING NOT NULL", "field size: a field added later"),
        ("qty INT, sku STRING NOT NULL", "fields keep their order"),
        ("sku STRING NOT NULL, Qty INT", "field qty renamed to Qty"),
    ]:
        r = configure(schema)
        assert error(r)[:2] == (409, "SCHEMA_CHANGE_REFUSED"), r.text
        assert error(r)[2].startswith(reason), error(r)
    assert error(configure("sku STRING, qty INT, size MAP<STRING, INT>"))[:2] == (
        400,
        "INVALID_SCHEMA",
    )

    # Adding a nullable field (and relaxing NOT NULL) is taken; older rows read null.
    assert configure("sku STRING, qty INT, size STRING").status_code == 200
    assert http.post("/pub", params={"topic": topic}, content=b'{"size": "M"}').text == "OK"
    table = server.topic_table(topic)
    assert sorted(table.select(["sku", "qty", "size"]).to_pylist(), key=str) == sorted(
        [
            {"sku": "old", "qty": 1, "size": None},
            {"sku": None, "qty": None, "size": "M"},
        ],
        key=str,
    )
    # A field now declared that the older body carried with another type (size 3): refused
    # now, and nothing is lost of what was taken before, its body byte for byte.
    r = http.post("/pub", params={"topic": topic}, content=b'{"size": 3}')
    assert error(r)[:2] == (400, "INVALID_BODY")
    table = server.topic_table(topic)
    assert table.num_rows == 2
    assert order("old", qty=1, size=3) in table["body"].to_pylist()


def test_an_untyped_topic_can_be_typed_later(server: Server, http: httpx.Client) -> None:
    topic = f"later{next(_names)}"
    assert http.post("/pub", params={"topic": topic}, content=b"not json").text == "OK"
    r = http.post("/topic/configure", params={"topic": topic, "schema": "n BIGINT"})
    assert r.status_code == 200, r.text
    assert error(http.post("/pub", params={"topic": topic}, content=b"still not"))[1] == (
        "INVALID_BODY"
    )
    assert (
        http.post("/pub", params={"topic": topic}, content=b'{"n": 9007199254740993}').text == "OK"
    )
    table = server.topic_table(topic)
    assert sorted(table.select(["body", "n"]).to_pylist(), key=lambda r: r["body"]) == [
        {"body": b"not json", "n": None},
        {"body": b'{"n": 9007199254740993}', "n": 9007199254740993},
    ]


def test_dead_letters_carry_the_typed_columns(server: Server, http: httpx.Client) -> None:
    topic = typed_topic(http, "dead", max_attempts="1")
    assert http.post("/pub", params={"topic": topic}, content=order("D-1", qty=4)).text == "OK"
    [m] = sub_all(http, topic, "c", 1)
    assert answer(http, "req", topic, "c", m).text == "OK"
    assert sub(http, topic, "c", max=1, wait_ms=300) == []
    dead = server.warehouse / "channels" / topic / "c" / "dead"
    assert rows(dead, "sku", "qty", "id") == [{"sku": "D-1", "qty": 4, "id": m["id"]}]


def test_a_filter_over_typed_fields(server: Server, http: httpx.Client) -> None:
    topic = typed_topic(http, "filtered")
    r = http.post(
        "/channel/create",
        params={"topic": topic, "channel": "big", "filter": "amount >= 100 AND NOT gift"},
    )
    assert r.status_code == 200, r.text
    r = http.post(
        "/channel/create",
        params={"topic": topic, "channel": "bad", "filter": "weight > 1"},
    )
    assert error(r)[:2] == (400, "INVALID_FILTER")
    assert "no column 'weight'" in error(r)[2]
    r = http.post("/channel/create", params={"topic": topic, "channel": "bad", "filter": "sku > 1"})
    assert error(r)[:2] == (400, "INVALID_FILTER")
    lines = [
        order("big", amount=250, gift=False),
        order("gift", amount=500, gift=True),
        order("small", amount=5, gift=False),
        order("unknown", amount=1000),
    ]
    assert http.post("/mpub", params={"topic": topic}, content=b"\n".join(lines)).text == "OK"
    delivered = sub_all(http, topic, "big", 1)
    assert [body(m) for m in delivered] == [lines[0]]
    assert len(sub_all(http, topic, "c", 4)) == 4
    assert sub(http, topic, "big", max=10, wait_ms=300) == []


def test_what_a_filter_keeps_out_is_counted_and_the_channel_keeps_up(
    server: Server, http: httpx.Client
) -> None:
    topic = typed_topic(http, "counted")
    r = http.post(
        "/channel/create", params={"topic": topic, "channel": "big", "filter": "amount >= 100"}
    )
    assert r.status_code == 200, r.text
    # Every message kept out of "big": nothing enters it, and it is counted.
    lines = [order("s1", amount=1), order("s2", amount=2), order("s3")]
    assert http.post("/mpub", params={"topic": topic}, content=b"\n".join(lines)).text == "OK"
    assert len(sub_all(http, topic, "c", 3)) == 3  # the unfiltered channel has them

    wait_until(lambda: channel_stats(http, topic, "big")["filtered_count"] == 3, "the count of 3")
    big = channel_stats(http, topic, "big")
    assert (big["filtered_count"], big["depth"], big["message_count"]) == (3, 0, 0)
    metrics = http.get("/metrics").text
    labels = f'channel="big",topic="{topic}"'
    assert f"deltaq_channel_filtered_total{{{labels}}} 3.0" in metrics, metrics
    # The channel has taken its topic through the batch, though no row entered it.
    assert f"deltaq_channel_fanout_lag_versions{{{labels}}} 0.0" in metrics, metrics
    overview = http.get("/console/api/overview").json()
    [shown] = [
        c
        for t in overview["topics"]
        if t["name"] == topic
        for c in t["channels"]
        if c["name"] == "big"
    ]
    assert (shown["filter"], shown["filtered"]) == ("amount >= 100", 3)
    # A message the filter lets in arrives as ever.
    assert http.post("/pub", params={"topic": topic}, content=order("s4", amount=500)).text == "OK"
    [m] = sub_all(http, topic, "big", 1)
    assert body(m) == order("s4", amount=500)


def test_journaled_typed_publishes_survive_a_kill_9_with_their_columns(tmp_path: Path) -> None:
    """Publishes to a typed topic acknowledged from the journal and killed before their topic
    commit: the decoded rows they carried are gone with the process, and the next start
    decodes the journal's bodies again into the same columns."""
    wh = tmp_path / "wh"
    # Commits wait 10 s: the kill lands while the publishes are only in the journal.
    server = Server(wh, env={"DELTAQ_DRAIN_LINGER_MS": "10000"}).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/topic/create", params={"topic": "j", "schema": "sku STRING NOT NULL, n INT"})
        assert r.status_code == 200, r.text
        lines = [order(f"s{i}", n=i) for i in range(20)]
        assert c.post("/mpub", params={"topic": "j"}, content=b"\n".join(lines)).text == "OK"
        assert c.post("/pub", params={"topic": "j"}, content=order("one")).text == "OK"
    server.kill9()
    # At least the /pub is only in the journal: a commit of the /mpub (a loaded machine can
    # drain it first) is followed by none for 10 s.
    assert DeltaTable(str(wh / "topics" / "j")).to_pyarrow_table().num_rows in (0, 20)
    server = Server(wh).start()
    try:
        rows = server.topic_table("j").select(["sku", "n"]).to_pylist()
        want = [{"sku": f"s{i}", "n": i} for i in range(20)] + [{"sku": "one", "n": None}]
        assert sorted(rows, key=lambda r: r["sku"]) == sorted(want, key=lambda r: r["sku"])
    finally:
        server.stop()
