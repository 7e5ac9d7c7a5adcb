"""The sweep end to end: a real server that leaves lease expiry to the sweep, the fanout
stream, the sweep job and the SQL views on local Spark, real HTTP clients."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pyspark.sql import SparkSession

from queue_engine.spark.sweep import sweep
from queue_engine.spark.views import register_views
from queue_engine.store.tables import Warehouse
from tests.conftest import Server, run_deltaq
from tests.consumers import answer, body, channel_stats, create_channel, sub


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout: None) -> Iterator[Server]:
    # Leases end only through the sweep here, so what the sweep does is what is tested.
    s = Server(
        warehouse,
        env={"DELTAQ_SCAN_LEASES": "false", "DELTAQ_MAX_REQ_TIMEOUT_MS": "60000"},
    ).start()
    yield s
    s.stop()


def publish(c: httpx.Client, topic: str, *bodies: bytes, **params: Any) -> None:
    for b in bodies:
        assert c.post("/pub", params={"topic": topic, **params}, content=b).text == "OK"


def take(c: httpx.Client, topic: str, channel: str, n: int, **params: Any) -> list[dict[str, Any]]:
    """Exactly ``n`` messages (waiting for the fanout), leased with ``params``."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        got += sub(c, topic, channel, max=n - len(got), wait_ms=2000, **params)
    assert len(got) == n
    return got


def test_an_unanswered_lease_comes_back_after_the_sweep_with_attempts_2(
    spark: SparkSession, http: httpx.Client, warehouse: Path
) -> None:
    create_channel(http, "exp", "c")
    publish(http, "exp", b"a", b"b", b"c")
    leased = take(http, "exp", "c", 3, msg_timeout_ms=1000)
    assert {m["attempts"] for m in leased} == {1}
    first, *silent = leased
    assert answer(http, "fin", "exp", "c", first).text == "OK"
    time.sleep(1.3)
    # The leases have ended but nobody has swept: nothing is handed out twice.
    assert sub(http, "exp", "c", wait_ms=300) == []
    report = sweep(spark, Warehouse(str(warehouse)))
    assert report.timeouts == 2
    again = take(http, "exp", "c", 2, msg_timeout_ms=60000)
    assert sorted(body(m) for m in again) == sorted(body(m) for m in silent)
    assert {m["attempts"] for m in again} == {2}
    # A consumer answering with the expired lease is told so.
    assert answer(http, "fin", "exp", "c", silent[0]).status_code == 409
    stats = channel_stats(http, "exp", "c")
    assert stats["timeout_count"] == 2 and stats["in_flight_count"] == 2


def test_sql_views_say_what_stats_says(
    spark: SparkSession, http: httpx.Client, warehouse: Path
) -> None:
    create_channel(http, "views", "c")
    publish(http, "views", *[f"m{i}".encode() for i in range(6)])
    leased = take(http, "views", "c", 4, msg_timeout_ms=60000)
    assert answer(http, "fin", "views", "c", leased[0]).text == "OK"
    assert answer(http, "req", "views", "c", leased[1], delay_ms=60000).text == "OK"
    assert answer(http, "req", "views", "c", leased[2]).text == "OK"
    sweep(spark, Warehouse(str(warehouse)))
    stats = channel_stats(http, "views", "c")
    register_views(spark, str(warehouse))
    [row] = spark.sql("SELECT * FROM queue_stats WHERE topic = 'views' AND channel = 'c'").collect()
    assert (
        (row.depth, row.in_flight, row.deferred, row.requeues, row.timeouts)
        == (
            stats["depth"],
            stats["in_flight_count"],
            stats["deferred_count"],
            stats["requeue_count"],
            stats["timeout_count"],
        )
        == (3, 1, 1, 2, 0)
    )
    assert row.fin_per_s == 0.017  # one FIN in the minute before the query, rounded
    # Two minutes on, with nothing answered since: the rate has fallen to 0.
    register_views(spark, str(warehouse), as_of=datetime.now(UTC) + timedelta(minutes=2))
    [later] = spark.sql(
        "SELECT * FROM queue_stats WHERE topic = 'views' AND channel = 'c'"
    ).collect()
    assert later.fin_per_s == 0 and later.depth == row.depth
    register_views(spark, str(warehouse))
    [count] = spark.sql(
        "SELECT count(*) AS n FROM messages WHERE topic = 'views' AND channel = 'c'"
    ).collect()
    assert count.n == stats["message_count"] == 6
    events = {
        r.event: r.n
        for r in spark.sql(
            "SELECT event, count(*) AS n FROM ledger WHERE topic = 'views' GROUP BY event"
        ).collect()
    }
    assert events == {"DELIVER": 4, "FIN": 1, "REQ": 2}
    [deferred] = spark.sql(
        "SELECT id, attempts, deliver_at FROM state WHERE topic = 'views' AND status = 'deferred'"
    ).collect()
    assert deferred.id == leased[1]["id"] and deferred.attempts == 1
    names = {r.channel for r in spark.sql("SELECT * FROM channels").collect()}
    assert {"c"} <= names


# Longer than a kill -9, a restart and a sweep take on a loaded machine: the deferrals must
# still be pending after them.
DEFER_MS = 20_000


def test_deferred_messages_are_honoured_across_an_api_restart(
    spark: SparkSession, http: httpx.Client, server: Server, warehouse: Path
) -> None:
    create_channel(http, "later", "c")
    publish(http, "later", b"now")
    [first] = take(http, "later", "c", 1)
    sweep(spark, Warehouse(str(warehouse)))  # the restart below starts from this state
    assert answer(http, "req", "later", "c", first, delay_ms=str(DEFER_MS)).text == "OK"
    requeued_at = time.time()
    publish(http, "later", b"dpub", defer=DEFER_MS)
    published_at = time.time()
    deadline = time.monotonic() + 30
    while channel_stats(http, "later", "c")["deferred_count"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.kill9()
    server.start()
    sweep(spark, Warehouse(str(warehouse)))
    due = {b"now": requeued_at + DEFER_MS / 1000, b"dpub": published_at + DEFER_MS / 1000}
    with httpx.Client(base_url=server.url, timeout=70) as c:
        assert channel_stats(c, "later", "c")["deferred_count"] == 2
        # Still deferred after the restart: nothing is handed out before its time.
        assert time.time() < min(due.values()) - 1, "the restart outlasted the deferral"
        assert sub(c, "later", "c", max=2, wait_ms=0) == []
        # Each when it comes due (the API promotes due deferrals itself: no sweep runs).
        got, received = [], {}
        for _ in range(2):
            [message] = take(c, "later", "c", 1)
            got.append(message)
            received[body(message)] = time.time()
    by_body = {body(m): m for m in got}
    assert by_body[b"now"]["attempts"] == 2 and by_body[b"dpub"]["attempts"] == 1
    for name, at in received.items():
        assert at >= due[name] - 0.05, (name, at - due[name])


def _topic_depth(c: httpx.Client, topic: str) -> int:
    [t] = c.get("/stats", params={"format": "json", "topic": topic}).json()["topics"]
    return int(t["depth"])


def _await_depth(c: httpx.Client, topic: str, expected: int) -> None:
    deadline = time.monotonic() + 30
    while _topic_depth(c, topic) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _topic_depth(c, topic) == expected


def test_topic_depth_counts_what_no_channel_has_taken(http: httpx.Client) -> None:
    """nsqd's topic depth is the topic's backlog: what the fanout has not taken yet. It falls
    to 0 once the fanout has put the messages in the channel, whatever the consumers do."""
    create_channel(http, "tdepth", "c")
    publish(http, "tdepth", *[f"m{i}".encode() for i in range(5)])
    for m in take(http, "tdepth", "c", 5):
        assert answer(http, "fin", "tdepth", "c", m).text == "OK"
    _await_depth(http, "tdepth", 0)
    # A paused topic is not fanned out: its new messages stay in its depth.
    assert http.post("/topic/pause", params={"topic": "tdepth"}).status_code == 200
    publish(http, "tdepth", b"x", b"y", b"z")
    # A topic beside it, published to afterwards, is fanned out: a fanout batch ran since.
    create_channel(http, "tdepth_beside", "c")
    publish(http, "tdepth_beside", b"after")
    deadline = time.monotonic() + 30
    while channel_stats(http, "tdepth_beside", "c")["depth"] < 1:
        assert time.monotonic() < deadline, "the fanout took nothing from the topic beside"
        time.sleep(0.1)
    assert _topic_depth(http, "tdepth") == 3
    assert http.post("/topic/unpause", params={"topic": "tdepth"}).status_code == 200
    _await_depth(http, "tdepth", 0)
    assert channel_stats(http, "tdepth", "c")["depth"] == 3


def _deltaq(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAQ_")}
    return run_deltaq(*args, env=env)


@pytest.mark.slow
def test_sweep_once_and_sql_from_the_command_line(http: httpx.Client, warehouse: Path) -> None:
    """The commands a cron job or an analyst runs: a one-shot sweep ends with its summary
    line; deltaq sql with its own local Spark prints the answer and nothing else."""
    create_channel(http, "cli", "c")
    publish(http, "cli", b"one", b"two")
    take(http, "cli", "c", 2)
    # Two messages fold on the driver: the sweep starts no Spark, so it runs even where Java
    # is missing (a Spark command there exits 4: tests/integration/test_java.py).
    no_java = {k: v for k, v in os.environ.items() if not k.startswith("DELTAQ_")}
    no_java["JAVA_HOME"] = str(warehouse.parent / "no-java")
    swept = run_deltaq("sweep", "--warehouse", str(warehouse), "--once", env=no_java)
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert re.search(r"swept \d+ channels \(\d+ unchanged\)", swept.stderr), swept.stderr[-3000:]

    answer = _deltaq(
        "sql",
        "--local",
        "--warehouse",
        str(warehouse),
        "SELECT channel, status, count(*) AS n FROM state WHERE topic = 'cli' "
        "GROUP BY channel, status",
    )
    assert answer.returncode == 0, answer.stderr[-3000:]
    assert re.search(r"\|\s*c\s*\|\s*in_flight\s*\|\s*2\s*\|", answer.stdout), answer.stdout
    # No Spark banners, log4j warnings or Python logging: the JVM's stderr went to a file.
    assert answer.stderr.strip() == "", answer.stderr[-3000:]
