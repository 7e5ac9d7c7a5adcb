"""A message's life end to end: max_attempts and dead letters (the dead-letter table,
/channel/dead, redrive), and the message TTL."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from queue_engine.lease import EventKind, fold
from queue_engine.spark.sweep import sweep
from queue_engine.spark.views import register_views
from queue_engine.store.tables import Warehouse, read_ledger
from tests.conftest import Server, run_deltaq, wait_until
from tests.consumers import answer, body, channel_stats, create_channel, sub, sub_all


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout_loop: None) -> Iterator[Server]:
    s = Server(warehouse, env={"DELTAQ_MSG_TIMEOUT_MS": "60000"}).start()
    # A message through the fanout first: its first micro-batches take seconds, longer than
    # the TTLs some tests give theirs, whichever test runs first.
    with httpx.Client(base_url=s.url, timeout=30) as http:
        create_channel(http, "warmup", "c")
        assert http.post("/pub", params={"topic": "warmup"}, content=b"w").text == "OK"
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline:
            got = sub(http, "warmup", "c", max=1, wait_ms=2000)
        assert got and answer(http, "fin", "warmup", "c", *got).text == "OK"
    yield s
    s.stop()


_names = itertools.count()


def own(prefix: str) -> str:
    """A topic name no other test of the module uses: they share the server and warehouse,
    and each may run alone or in any order."""
    return f"{prefix}{next(_names)}"


def _dead_lettered(http: httpx.Client, topic: str) -> list[dict[str, Any]]:
    """``topic``'s channel ``c`` (max_attempts 2) with a, b and c dead-lettered after two
    deliveries each (worker-1's, then worker-2's, both REQ'd); the first deliveries."""
    assert http.post("/topic/create", params={"topic": topic}).is_success
    r = http.post("/channel/create", params={"topic": topic, "channel": "c", "max_attempts": "2"})
    assert r.status_code == 200, r.text
    assert http.post("/mpub", params={"topic": topic}, content=b"a\nb\nc").text == "OK"

    first = sub_all(http, topic, "c", 3, consumer="worker-1")
    assert {m["attempts"] for m in first} == {1}
    assert answer(http, "req", topic, "c", *first).text == "OK"
    second = sub_all(http, topic, "c", 3, consumer="worker-2")
    assert {m["attempts"] for m in second} == {2}
    assert answer(http, "req", topic, "c", *second).text == "OK"

    # Each had its two deliveries: the next SUB dead-letters them and delivers nothing.
    assert sub(http, topic, "c", max=10, wait_ms=500) == []
    return first


def _timed_out_dead_letter(http: httpx.Client, topic: str) -> dict[str, Any]:
    """``topic``'s channel ``c`` (max_attempts 1) with one message whose lease timed out:
    dead-lettered; its delivery."""
    r = http.post("/channel/create", params={"topic": topic, "channel": "c", "max_attempts": "1"})
    assert r.status_code == 404  # nsqd: the topic must exist
    assert http.post("/topic/create", params={"topic": topic}).is_success
    r = http.post("/channel/create", params={"topic": topic, "channel": "c", "max_attempts": "1"})
    assert r.status_code == 200
    assert http.post("/pub", params={"topic": topic}, content=b"slow").text == "OK"
    [m] = sub_all(http, topic, "c", 1, msg_timeout_ms=1000, consumer="sleepy")
    time.sleep(1.5)
    assert sub(http, topic, "c", wait_ms=1000) == []
    return m


def _channel_with_ttl(http: httpx.Client, topic: str, ttl_ms: int) -> None:
    """Channel ``c`` of ``topic``, whose messages expire ``ttl_ms`` after publishing."""
    create_channel(http, topic, "c")
    r = http.post("/topic/configure", params={"topic": topic, "ttl_ms": str(ttl_ms)})
    assert r.status_code == 200, r.text


def _dead(http: httpx.Client, topic: str, channel: str) -> dict[str, Any]:
    r = http.get("/channel/dead", params={"topic": topic, "channel": channel})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def _never_delivered_until_dead(http: httpx.Client, topic: str, bodies: list[bytes]) -> None:
    """SUBs of ``topic``'s channel ``c`` get nothing, until its dead letters are ``bodies``
    (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        assert sub(http, topic, "c", max=5, wait_ms=500) == []
        if sorted(body(m) for m in _dead(http, topic, "c")["messages"]) == bodies:
            return
        assert time.monotonic() < deadline, _dead(http, topic, "c")


def _redrive(http: httpx.Client, topic: str, channel: str, *ids: str) -> httpx.Response:
    params: list[tuple[str, str]] = [("topic", topic), ("channel", channel)]
    params += [("id", i) for i in ids]
    return http.post("/channel/redrive", params=params)


def test_a_message_past_max_attempts_is_dead_lettered_not_delivered(
    http: httpx.Client, server: Server, warehouse: Path
) -> None:
    dl = own("dl")
    first = _dead_lettered(http, dl)
    stats = channel_stats(http, dl, "c")
    assert stats["dead_count"] == 3 and stats["max_attempts"] == 2 and stats["depth"] == 0
    dead = _dead(http, dl, "c")
    assert dead["dead_count"] == 3
    assert sorted(body(m) for m in dead["messages"]) == [b"a", b"b", b"c"]
    for m in dead["messages"]:
        assert m["attempts"] == 2 and m["last_event"] == "REQ"
        assert m["last_consumer"] == "worker-2"

    # The ledger says so, and the dead-letter table holds one row per DEAD event.
    wh = Warehouse(str(warehouse))
    events, _ = read_ledger(wh.channel_ledger_path(dl, "c"))
    deaths = [e for e in events if e.kind is EventKind.DEAD]
    assert sorted(e.id for e in deaths) == sorted(m["id"] for m in first)
    assert all(s.dead for s in fold(events).values())
    rows = DeltaTable(wh.channel_dead_path(dl, "c")).to_pyarrow_table()
    assert sorted(rows["id"].to_pylist()) == sorted(e.id for e in deaths)

    text = http.get("/stats", params={"topic": dl}).text
    assert "dead: 3" in text
    metrics = http.get("/metrics").text
    assert f'deltaq_channel_dead{{channel="c",topic="{dl}"}} 3.0' in metrics


def test_dead_letters_stay_dead_across_a_restart_and_a_kill(
    http: httpx.Client, server: Server
) -> None:
    dl = own("dl")
    _dead_lettered(http, dl)
    assert _dead(http, dl, "c")["dead_count"] == 3
    server.stop()
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert channel_stats(c, dl, "c")["dead_count"] == 3
        assert sub(c, dl, "c", max=10, wait_ms=300) == []
        # Dead-lettered right before a kill: the SUB that buries them answers once that is
        # committed.
        killed = own("dl")
        _dead_lettered(c, killed)
    server.kill9()
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert channel_stats(c, dl, "c")["dead_count"] == 3
        assert channel_stats(c, dl, "c")["max_attempts"] == 2
        assert channel_stats(c, killed, "c")["dead_count"] == 3
        assert sub(c, killed, "c", max=10, wait_ms=300) == []


def test_redrive_named_then_all_resets_attempts_once(server: Server) -> None:
    dl = own("dl")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        _dead_lettered(http, dl)
        ids = [m["id"] for m in _dead(http, dl, "c")["messages"]]
        one = _redrive(http, dl, "c", ids[0])
        assert one.status_code == 200 and one.json() == {"redriven": 1}
        [again] = sub_all(http, dl, "c", 1)
        assert again["id"] == ids[0] and again["attempts"] == 1
        # Not dead any more: naming it again redrives nothing at all, not even the others.
        refused = _redrive(http, dl, "c", ids[0], ids[1])
        assert refused.status_code == 409, refused.text
        assert refused.json()["message"] == "E_REDRIVE_FAILED"
        assert channel_stats(http, dl, "c")["dead_count"] == 2

        # deltaq redrive asks the API: a named id that is not dead fails the whole call.
        refused_cli = run_deltaq(
            "redrive", "--api", server.url, "--topic", dl, "--channel", "c", "--id", ids[0]
        )
        assert refused_cli.returncode == 1 and "E_REDRIVE_FAILED" in refused_cli.stderr
        assert channel_stats(http, dl, "c")["dead_count"] == 2
        done = run_deltaq("redrive", "--api", server.url, "--topic", dl, "--channel", "c")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"2 dead letters of {dl}/c redriven"
        assert _redrive(http, dl, "c").json() == {"redriven": 0}
        rest = sub_all(http, dl, "c", 2)
        assert sorted(m["id"] for m in rest) == sorted(ids[1:])
        assert {m["attempts"] for m in rest} == {1}
        assert answer(http, "fin", dl, "c", again, *rest).text == "OK"
        assert channel_stats(http, dl, "c")["dead_count"] == 0


def test_a_lease_that_times_out_on_its_last_attempt_dies_with_timeout(server: Server) -> None:
    dlt = own("dlt")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        m = _timed_out_dead_letter(http, dlt)
        [dead] = _dead(http, dlt, "c")["messages"]
        assert dead["id"] == m["id"] and dead["last_event"] == "TIMEOUT"
        assert dead["last_consumer"] == "sleepy" and dead["attempts"] == 1
        # The late FIN of a dead message's lease is refused.
        assert answer(http, "fin", dlt, "c", m).status_code == 409


@pytest.mark.parametrize("value", ["0", "-1", "65536", "abc", ""])
def test_bad_max_attempts_is_refused_and_changes_nothing(server: Server, value: str) -> None:
    topic = own("attempts")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/topic/create", params={"topic": topic}).is_success
        r = http.post(
            "/channel/create", params={"topic": topic, "channel": "c", "max_attempts": "2"}
        )
        assert r.status_code == 200, r.text
        for path in ("/channel/configure", "/channel/create"):
            r = http.post(path, params={"topic": topic, "channel": "c", "max_attempts": value})
            assert r.status_code == 400, r.text
            assert r.json()["message"] == "INVALID_MAX_ATTEMPTS"
        r = http.post(
            "/channel/create", params={"topic": topic, "channel": "new", "max_attempts": value}
        )
        assert r.status_code == 400
        [stats] = http.get("/stats", params={"format": "json", "topic": topic}).json()["topics"]
        assert "new" not in [c["channel_name"] for c in stats["channels"]]
        assert channel_stats(http, topic, "c")["max_attempts"] == 2


def test_configure_changes_the_limit_and_default_restores_the_setting(server: Server) -> None:
    topic = own("configure")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        create_channel(http, topic, "c")
        params = {"topic": topic, "channel": "c"}
        assert channel_stats(http, topic, "c")["max_attempts"] == 0
        assert http.post("/channel/configure", params={**params, "max_attempts": "7"}).is_success
        assert channel_stats(http, topic, "c")["max_attempts"] == 7
        r = http.post("/channel/configure", params={**params, "max_attempts": "default"})
        assert r.is_success
        assert channel_stats(http, topic, "c")["max_attempts"] == 0
        missing = http.post(
            "/channel/configure", params={"topic": topic, "channel": "nope", "max_attempts": "3"}
        )
        assert missing.status_code == 404
        bad_id = _redrive(http, topic, "c", "not-an-id")
        assert bad_id.status_code == 400 and bad_id.json()["message"] == "E_INVALID"


def test_the_sweep_keeps_dead_letters_and_the_views_show_them(
    spark: SparkSession, server: Server, warehouse: Path
) -> None:
    dl, dlt = own("dl"), own("dlt")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        # Three dead letters redriven and finished, then one that is dead still.
        _dead_lettered(http, dl)
        assert _redrive(http, dl, "c").json() == {"redriven": 3}
        redriven = sub_all(http, dl, "c", 3)
        assert answer(http, "fin", dl, "c", *redriven).text == "OK"
        _timed_out_dead_letter(http, dlt)
    wh = Warehouse(str(warehouse))
    sweep(spark, wh)
    state = DeltaTable(wh.channel_state_path(dlt, "c")).to_pyarrow_table()
    assert state["status"].to_pylist() == ["dead"]
    # A restart from the swept state still knows the dead letter.
    server.stop()
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert channel_stats(http, dlt, "c")["dead_count"] == 1
        assert channel_stats(http, dl, "c")["dead_count"] == 0

    register_views(spark, str(warehouse))
    rows = spark.sql(
        "SELECT topic, id, attempts, last_event, redriven_at FROM dead_letters "
        f"WHERE topic IN ('{dl}', '{dlt}') ORDER BY dead_at"
    ).collect()
    assert [(r.topic, r.attempts, r.last_event) for r in rows] == [(dl, 2, "REQ")] * 3 + [
        (dlt, 1, "TIMEOUT")
    ]
    assert all(r.redriven_at is not None for r in rows[:3]) and rows[3].redriven_at is None
    [stats] = spark.sql(f"SELECT dead, depth FROM queue_stats WHERE topic = '{dlt}'").collect()
    assert (stats.dead, stats.depth) == (1, 0)


def test_messages_past_their_topics_ttl_are_expired_not_delivered(
    spark: SparkSession, server: Server, warehouse: Path
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        _channel_with_ttl(http, "ttl", 1500)
        assert http.post("/mpub", params={"topic": "ttl"}, content=b"old1\nold2").text == "OK"
        # One is taken and given back in time; then nobody comes until both are too old.
        [m] = sub_all(http, "ttl", "c", 1)
        assert answer(http, "req", "ttl", "c", m).text == "OK"
        time.sleep(2.0)
        assert http.post("/pub", params={"topic": "ttl"}, content=b"fresh").text == "OK"
        [fresh] = sub_all(http, "ttl", "c", 1)
        assert body(fresh) == b"fresh"
        assert answer(http, "fin", "ttl", "c", fresh).text == "OK"
        stats = channel_stats(http, "ttl", "c")
        assert stats["expired_count"] == 2 and stats["depth"] == 0
        assert (
            'deltaq_channel_expired_total{channel="c",topic="ttl"} 2.0' in http.get("/metrics").text
        )

        # Back to the default (no TTL): an old message is delivered.
        r = http.post("/topic/configure", params={"topic": "ttl", "ttl_ms": "default"})
        assert r.status_code == 200
        assert http.post("/pub", params={"topic": "ttl"}, content=b"patient").text == "OK"
        time.sleep(2.0)
        [late] = sub_all(http, "ttl", "c", 1)
        assert body(late) == b"patient"
        assert answer(http, "fin", "ttl", "c", late).text == "OK"

    wh = Warehouse(str(warehouse))
    events, _ = read_ledger(wh.channel_ledger_path("ttl", "c"))
    expired = [e for e in events if e.kind is EventKind.EXPIRE]
    assert len(expired) == 2
    states = fold(events)
    assert all(states[e.id].expired and states[e.id].finished for e in expired)
    sweep(spark, wh)
    register_views(spark, str(warehouse))
    [row] = spark.sql("SELECT expired, depth FROM queue_stats WHERE topic = 'ttl'").collect()
    assert (row.expired, row.depth) == (2, 0)


def test_a_messages_own_ttl_replaces_the_topics_and_outlives_a_restart(
    spark: SparkSession, server: Server, warehouse: Path
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        _channel_with_ttl(http, "own", 1500)
        # Longer than the topic's TTL, the topic's TTL, and shorter ones (one request each).
        r = http.post("/pub", params={"topic": "own", "ttl_ms": "600000"}, content=b"long")
        assert r.text == "OK"
        assert http.post("/pub", params={"topic": "own"}, content=b"topic's").text == "OK"
        r = http.post("/mpub", params={"topic": "own", "ttl_ms": "1000"}, content=b"s1\ns2")
        assert r.text == "OK"
        r = http.post(
            "/pub", params={"topic": "own", "ttl_ms": "1000", "defer": "5000"}, content=b"d"
        )
        assert r.text == "OK"
        wait_until(lambda: channel_stats(http, "own", "c")["depth"] == 5, "five in the channel")
    # The expiries are in the rows, not in the API's memory.
    server.stop()
    time.sleep(2.0)
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        [m] = sub_all(http, "own", "c", 1)
        assert body(m) == b"long"
        assert answer(http, "fin", "own", "c", m).text == "OK"
        # The deferred one comes due after its TTL: it is expired then, never delivered.
        time.sleep(3.5)
        assert sub(http, "own", "c", max=5, wait_ms=500) == []
        stats = channel_stats(http, "own", "c")
        assert (stats["expired_count"], stats["depth"], stats["in_flight_count"]) == (4, 0, 0)

    wh = Warehouse(str(warehouse))
    events, _ = read_ledger(wh.channel_ledger_path("own", "c"))
    assert sorted(e.kind.value for e in events) == ["DELIVER", *["EXPIRE"] * 4, "FIN"]
    register_views(spark, str(warehouse))
    rows = spark.sql(
        "SELECT body, (unix_micros(expires_at) - unix_micros(published_at)) DIV 1000 AS ttl "
        "FROM messages WHERE topic = 'own'"
    ).collect()
    assert {bytes(r.body): r.ttl for r in rows} == {
        b"long": 600000,
        b"topic's": None,
        b"s1": 1000,
        b"s2": 1000,
        b"d": 1000,
    }


def test_expired_messages_leave_the_depth_with_no_consumer(server: Server) -> None:
    """Expiry does not wait for a SUB: the pump expires the head of the ready queue."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        _channel_with_ttl(http, "idle", 1000)
        assert http.post("/mpub", params={"topic": "idle"}, content=b"a\nb\nc").text == "OK"
        r = http.post("/pub", params={"topic": "idle", "ttl_ms": "600000"}, content=b"kept")
        assert r.text == "OK"
        deadline = time.monotonic() + 20
        stats = channel_stats(http, "idle", "c")
        while stats["expired_count"] < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = channel_stats(http, "idle", "c")
        assert (stats["expired_count"], stats["depth"]) == (3, 1), stats
        [m] = sub_all(http, "idle", "c", 1)
        assert body(m) == b"kept"
        assert answer(http, "fin", "idle", "c", m).text == "OK"


@pytest.mark.parametrize("value", ["0", "-5", "x", "31536000001", "", "1.5"])
def test_a_bad_ttl_on_publish_is_refused_and_publishes_nothing(server: Server, value: str) -> None:
    badttl = own("badttl")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        create_channel(http, badttl, "c")
        for path in ("/pub", "/mpub"):
            r = http.post(path, params={"topic": badttl, "ttl_ms": value}, content=b"m")
            assert r.status_code == 400 and r.json()["message"] == "INVALID_TTL", r.text
        [topic] = [
            t for t in http.get("/stats?format=json").json()["topics"] if t["topic_name"] == badttl
        ]
        assert topic["message_count"] == 0


@pytest.mark.parametrize("value", ["0", "-5", "x", "31536000001", ""])
def test_bad_ttl_is_refused_and_changes_nothing(server: Server, value: str) -> None:
    topic = own("nottl")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        create_channel(http, topic, "c")
        r = http.post("/topic/configure", params={"topic": topic, "ttl_ms": value})
        assert r.status_code == 400 and r.json()["message"] == "INVALID_TTL", r.text
        missing = http.post("/topic/configure", params={"topic": "nope", "ttl_ms": "10"})
        assert missing.status_code == 404
        # The topic has no TTL still: a message published now is delivered whenever it is
        # asked for.
        assert http.post("/pub", params={"topic": topic}, content=b"kept").text == "OK"
        [m] = sub_all(http, topic, "c", 1)
        assert body(m) == b"kept"
        assert answer(http, "fin", topic, "c", m).text == "OK"


def test_with_expired_to_dead_letters_an_expired_message_is_dead_lettered(
    server: Server, warehouse: Path
) -> None:
    server.stop()
    server.env["DELTAQ_EXPIRED_TO_DEAD_LETTERS"] = "true"
    try:
        server.start()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            _channel_with_ttl(http, "ttl2dl", 1000)
            assert http.post("/pub", params={"topic": "ttl2dl"}, content=b"late").text == "OK"
            time.sleep(1.5)
            # Never delivered, whenever the fanout brings it.
            _never_delivered_until_dead(http, "ttl2dl", [b"late"])
            stats = channel_stats(http, "ttl2dl", "c")
            assert (stats["dead_count"], stats["expired_count"], stats["depth"]) == (1, 1, 0)
            [letter] = _dead(http, "ttl2dl", "c")["messages"]
            assert body(letter) == b"late" and letter["last_event"] == "EXPIRE"
            assert letter["attempts"] == 0
            # Its TTL raised, a redriven message is delivered.
            r = http.post("/topic/configure", params={"topic": "ttl2dl", "ttl_ms": "default"})
            assert r.status_code == 200
            assert _redrive(http, "ttl2dl", "c").json() == {"redriven": 1}
            [m] = sub_all(http, "ttl2dl", "c", 1)
            assert body(m) == b"late" and m["attempts"] == 1
            assert answer(http, "fin", "ttl2dl", "c", m).text == "OK"

            # A message's own TTL goes to the dead-letter table with it: redriven, it is
            # past it still and dies again (the topic has no TTL now).
            r = http.post("/pub", params={"topic": "ttl2dl", "ttl_ms": "500"}, content=b"own")
            assert r.text == "OK"
            time.sleep(1.0)
            _never_delivered_until_dead(http, "ttl2dl", [b"own"])
            [letter] = _dead(http, "ttl2dl", "c")["messages"]
            assert body(letter) == b"own" and letter["last_event"] == "EXPIRE"
            assert _redrive(http, "ttl2dl", "c").json() == {"redriven": 1}
            assert sub(http, "ttl2dl", "c", max=5, wait_ms=500) == []
            assert channel_stats(http, "ttl2dl", "c")["dead_count"] == 1
        events, _ = read_ledger(Warehouse(str(warehouse)).channel_ledger_path("ttl2dl", "c"))
        kinds = [e.kind for e in sorted(events, key=lambda e: e.sort_key())]
        assert kinds == [
            EventKind.DEAD,
            EventKind.REDRIVE,
            EventKind.DELIVER,
            EventKind.FIN,
            EventKind.DEAD,
            EventKind.REDRIVE,
            EventKind.DEAD,
        ]
    finally:
        server.stop()
        del server.env["DELTAQ_EXPIRED_TO_DEAD_LETTERS"]
        server.start()
