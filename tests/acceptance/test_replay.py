"""Replay end to end: /channel/replay and `deltaq replay` over a running API and the fanout,
FIN'd messages delivered again to one channel only, once per replay id across a kill -9."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from queue_engine.spark.views import register_views
from queue_engine.store.tables import Warehouse
from tests.conftest import Server, run_deltaq
from tests.consumers import answer, body, channel_stats, create_channel, sub, sub_all


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout: None) -> Iterator[Server]:
    s = Server(warehouse).start()
    yield s
    s.stop()


def _take(http: httpx.Client, channel: str, n: int) -> list[dict[str, Any]]:
    """``n`` messages of topic rp on ``channel``, each FIN'd."""
    got = sub_all(http, "rp", channel, n)
    for m in got:
        assert answer(http, "fin", "rp", channel, m).text == "OK"
    return got


def _replay(http: httpx.Client, channel: str, **params: str) -> httpx.Response:
    return http.post("/channel/replay", params={"topic": "rp", "channel": channel, **params})


def test_a_replay_delivers_finished_messages_again_to_one_channel_once(
    spark: SparkSession, server: Server, warehouse: Path
) -> None:
    topic_path = Warehouse(str(warehouse)).topic_path("rp")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        create_channel(http, "rp", "a")
        create_channel(http, "rp", "b")
        versions = []
        times = []
        for i in range(5):
            times.append(datetime.now(UTC))
            assert http.post("/pub", params={"topic": "rp"}, content=f"m{i}".encode()).text == "OK"
            server.topic_table("rp")  # in the table (acknowledged: in the node journal)
            versions.append(DeltaTable(topic_path).version())
            time.sleep(0.02)
        originals = {body(m): m["id"] for m in _take(http, "a", 5)}
        _take(http, "b", 5)

        r = _replay(http, "a", **{"from": str(versions[1]), "to": str(versions[3])})
        assert r.status_code == 200, r.text
        assert r.json()["messages"] == 3 and r.json()["repeated"] is False
        replay_id = r.json()["replay_id"]
        copies = _take(http, "a", 3)
        assert sorted(body(m) for m in copies) == [b"m1", b"m2", b"m3"]
        assert all(m["attempts"] == 1 and m["id"] not in originals.values() for m in copies)
        # Channel b gets nothing of it.
        assert sub(http, "rp", "b", max=10, wait_ms=1500) == []

    # A kill -9 after the answer: the same replay id again copies nothing.
    server.kill9()
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        again = _replay(
            http, "a", **{"from": str(versions[1]), "to": str(versions[3]), "replay_id": replay_id}
        )
        assert again.json()["repeated"] is True and again.json()["messages"] == 0
        assert sub(http, "rp", "a", max=10, wait_ms=1500) == []
        assert channel_stats(http, "rp", "a")["depth"] == 0

        # By time, through the command: m3 and m4 were published from times[3] on.
        done = run_deltaq(
            "replay", "--api", server.url, "--topic", "rp", "--channel", "b",
            "--from", times[3].isoformat(), "--replay-id", "by-time",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "by-time: 2 messages" in done.stdout
        assert sorted(body(m) for m in _take(http, "b", 2)) == [b"m3", b"m4"]
        done = run_deltaq(
            "replay", "--api", server.url, "--topic", "rp", "--channel", "b",
            "--from", times[3].isoformat(), "--replay-id", "by-time",
        )  # fmt: skip
        assert done.returncode == 0 and "done before" in done.stdout

    register_views(spark, str(warehouse))
    rows = spark.sql(
        "SELECT channel, body, replay_of FROM messages WHERE topic = 'rp' AND replay_of IS NOT NULL"
    ).collect()
    assert sorted((r.channel, bytes(r.body), r.replay_of) for r in rows) == sorted(
        [("a", f"m{i}".encode(), originals[f"m{i}".encode()]) for i in (1, 2, 3)]
        + [("b", f"m{i}".encode(), originals[f"m{i}".encode()]) for i in (3, 4)]
    )


@pytest.mark.parametrize(
    ("params", "status", "code"),
    [
        ({}, 400, "INVALID_RANGE"),
        ({"from": "soon"}, 400, "INVALID_RANGE"),
        ({"from": "2026-11-23T10:00:00"}, 400, "INVALID_RANGE"),  # no offset
        ({"from": "3", "to": "1"}, 400, "INVALID_RANGE"),
        ({"from": "999999"}, 400, "INVALID_RANGE"),
        ({"from": "1", "replay_id": "no spaces"}, 400, "INVALID_REQUEST"),
        ({"from": "1", "channel": "nope"}, 404, "CHANNEL_NOT_FOUND"),
        ({"from": "1", "channel": "bad name!"}, 400, "INVALID_ARG_CHANNEL"),
    ],
)
def test_bad_replays_are_refused_and_write_nothing(
    server: Server, warehouse: Path, params: dict[str, str], status: int, code: str
) -> None:
    topic_path = Warehouse(str(warehouse)).topic_path("rp")
    before = DeltaTable(topic_path).version()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/channel/replay", params={"topic": "rp", "channel": "a", **params})
        assert (r.status_code, r.json()["message"]) == (status, code), r.text
        # deltaq's own checks say why; nsqd's codes keep nsqd's bare body.
        if code in ("INVALID_RANGE", "INVALID_REQUEST"):
            assert r.json()["reason"], r.text
        if code == "INVALID_REQUEST":
            assert r.json()["param"] == "replay_id"
        if not params:
            assert r.json()["param"] == "from"
        if code.endswith("NOT_FOUND") or code.startswith("INVALID_ARG"):
            assert set(r.json()) == {"message"}
    assert DeltaTable(topic_path).version() == before
