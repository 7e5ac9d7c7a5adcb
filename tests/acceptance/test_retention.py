"""Retention end to end: a topic configured over HTTP, the fanout and the API running, the
sweep removing what is past keeping; consumers, a restart, the views and time travel go on."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from deltaq.testing.s3 import S3Server, store_env
from queue_engine.message import SEQUENCE_BITS
from queue_engine.registry import Registry, TopicInfo
from queue_engine.settings import RetentionMode
from queue_engine.spark.sweep import sweep
from queue_engine.spark.views import register_views
from queue_engine.store.delta import ObjectStoreAppender, appender_for, conform, open_or_create
from queue_engine.store.storage import object_store
from queue_engine.store.tables import TOPIC_SCHEMA, Warehouse
from queue_engine.store.upkeep import RetentionPolicy, apply_retention
from tests.acceptance.conftest import BUCKET
from tests.conftest import Server, run_deltaq
from tests.consumers import answer, body, channel_stats, create_channel, sub, sub_all

_UTC_US = pa.timestamp("us", "UTC")
# 1.8 s: what is kept "for hours" in production is kept for seconds here.
HOURS = "0.0005"
FINISHED = RetentionPolicy(168.0, RetentionMode.TAKEN, float(HOURS))


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout: None) -> Iterator[Server]:
    s = Server(warehouse, env={"DELTAQ_MSG_TIMEOUT_MS": "600000"}).start()
    yield s
    s.stop()


def _ids(path: str) -> set[str]:
    return set(DeltaTable(path).to_pyarrow_table(columns=["id"])["id"].to_pylist())


def test_rows_past_keeping_go_and_nothing_live_is_touched(
    spark: SparkSession, server: Server, http: httpx.Client, warehouse: Path
) -> None:
    wh = Warehouse(str(warehouse))
    create_channel(http, "ret", "c")
    r = http.post("/topic/configure", params={"topic": "ret", "retention_hours": HOURS})
    assert r.status_code == 200, r.text
    assert http.post("/mpub", params={"topic": "ret"}, content=b"a\nb").text == "OK"
    done = sub_all(http, "ret", "c", 2)
    assert answer(http, "fin", "ret", "c", *done).text == "OK"
    assert http.post("/pub", params={"topic": "ret"}, content=b"held").text == "OK"
    [held] = sub_all(http, "ret", "c", 1)

    sweep(spark, wh, retention=FINISHED)  # the state retention will judge by, later
    before = datetime.now(UTC)
    # 2.5 s later by the sweep's clock (past the 1.8 s kept). Nothing changed on the channel
    # since: the sweep skips it, and retention still runs.
    later = time.time_ns() // 1000 + 2_500_000
    report = sweep(spark, wh, now=later, retention=FINISHED).retention
    assert report is not None and report.files_removed >= 3, report

    # Topic: everything is older than its retention and taken by the channel.
    assert _ids(wh.topic_path("ret")) == set()
    # Channel: the FIN'd rows and their events went; the message in flight kept its own.
    assert _ids(wh.channel_messages_path("ret", "c")) == {held["id"]}
    assert _ids(wh.channel_ledger_path("ret", "c")) == {held["id"]}

    stats = channel_stats(http, "ret", "c")
    assert (stats["depth"], stats["in_flight_count"]) == (0, 1)
    # A restart rebuilds the channel from what is left: the lease is still there.
    server.stop()
    server.start()
    with httpx.Client(base_url=server.url, timeout=70) as again:
        stats = channel_stats(again, "ret", "c")
        assert (stats["depth"], stats["in_flight_count"]) == (0, 1)
        topic = again.get("/stats", params={"format": "json", "topic": "ret"}).json()
        assert topic["topics"][0]["depth"] == 0
        assert answer(again, "fin", "ret", "c", held).text == "OK"
        assert again.post("/pub", params={"topic": "ret"}, content=b"after").text == "OK"
        [after] = sub_all(again, "ret", "c", 1)
        assert body(after) == b"after" and after["id"] > held["id"]
        assert answer(again, "fin", "ret", "c", after).text == "OK"

    register_views(spark, str(warehouse))
    now = spark.sql("SELECT count(*) AS n FROM messages WHERE topic = 'ret'").first()
    assert now is not None and now.n == 2  # held + after
    # Time travel still reads the removed rows (their files stay until vacuum).
    register_views(spark, str(warehouse), as_of=before)
    then = spark.sql("SELECT count(*) AS n FROM messages WHERE topic = 'ret'").first()
    assert then is not None and then.n == 3


def test_a_dead_letters_channel_row_goes_and_a_redrive_still_delivers_its_body(
    spark: SparkSession, server: Server, http: httpx.Client, warehouse: Path
) -> None:
    wh = Warehouse(str(warehouse))
    assert http.post("/topic/create", params={"topic": "dlret"}).is_success
    r = http.post("/channel/create", params={"topic": "dlret", "channel": "c", "max_attempts": "1"})
    assert r.is_success, r.text
    assert http.post("/pub", params={"topic": "dlret"}, content=b"dying").text == "OK"
    [m] = sub_all(http, "dlret", "c", 1)
    assert answer(http, "req", "dlret", "c", m).text == "OK"
    assert sub(http, "dlret", "c", max=1, wait_ms=500) == []  # its one attempt was had
    assert channel_stats(http, "dlret", "c")["dead_count"] == 1

    sweep(spark, wh, retention=FINISHED)
    later = time.time_ns() // 1000 + 2_500_000
    sweep(spark, wh, now=later, retention=FINISHED)
    # Dead in both sweeps' states: its row goes (the dead-letter table has the body), its
    # events stay (the dead_letters view proves it by its DEAD event).
    assert m["id"] not in _ids(wh.channel_messages_path("dlret", "c"))
    assert m["id"] in _ids(wh.channel_ledger_path("dlret", "c"))
    register_views(spark, str(warehouse))
    [row] = spark.sql("SELECT id FROM dead_letters WHERE topic = 'dlret'").collect()
    assert row.id == m["id"]

    # Redriven, then the API restarts before any sweep: the body comes from the dead letters.
    r = http.post("/channel/redrive", params={"topic": "dlret", "channel": "c"})
    assert r.json() == {"redriven": 1}
    server.kill9()
    server.start()
    with httpx.Client(base_url=server.url, timeout=70) as again:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = sub(again, "dlret", "c", max=1, wait_ms=1000)
        [back] = got
        assert (back["id"], body(back), back["attempts"]) == (m["id"], b"dying", 1)
        assert answer(again, "fin", "dlret", "c", back).text == "OK"


def test_the_sweep_command_runs_retention_with_the_settings(
    server: Server, http: httpx.Client, warehouse: Path
) -> None:
    # Two topics without a channel, as old: "taken" keeps rows no channel has taken yet (a
    # channel created later gets them), "fixed" removes them once old enough regardless.
    wh = Warehouse(str(warehouse))
    for topic, mode in (("cli", "fixed"), ("cli_taken", "taken")):
        assert http.post("/topic/create", params={"topic": topic}).status_code == 200
        params = {"topic": topic, "retention_hours": HOURS, "retention": mode}
        r = http.post("/topic/configure", params=params)
        assert r.status_code == 200, r.text
        assert http.post("/mpub", params={"topic": topic}, content=b"x\ny").text == "OK"
        assert server.topic_table(topic).num_rows == 2
    kept = _ids(wh.topic_path("cli_taken"))
    time.sleep(2.5)
    done = run_deltaq("sweep", "--warehouse", str(warehouse))
    assert done.returncode == 0, done.stderr
    assert re.search(r"retention removed [1-9]\d* files", done.stderr + done.stdout), done.stderr
    assert _ids(wh.topic_path("cli")) == set()
    assert _ids(wh.topic_path("cli_taken")) == kept and len(kept) == 2


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"retention_hours": "-1"}, "INVALID_RETENTION"),
        ({"retention_hours": "x"}, "INVALID_RETENTION"),
        ({"retention_hours": "87601"}, "INVALID_RETENTION"),
        ({"retention": "sometimes"}, "INVALID_RETENTION"),
        ({"retention_hours": "1", "ttl_ms": "0"}, "INVALID_TTL"),
    ],
)
def test_bad_retention_is_refused_and_changes_nothing(
    server: Server, http: httpx.Client, warehouse: Path, params: dict[str, str], code: str
) -> None:
    create_channel(http, "bad", "c")
    r = http.post("/topic/configure", params={"topic": "bad", **params})
    assert r.status_code == 400 and r.json()["message"] == code, r.text
    registry = DeltaTable(Warehouse(str(warehouse)).registry_path).to_pyarrow_table()
    actions = registry.filter(pc.equal(registry["topic"], "bad"))["action"].to_pylist()
    assert "topic_configure" not in actions
    # Naming no setting changes none (and records nothing), but the topic must exist.
    assert http.post("/topic/configure", params={"topic": "bad"}).status_code == 200
    assert http.post("/topic/configure", params={"topic": "nope"}).status_code == 404
    after = DeltaTable(Warehouse(str(warehouse)).registry_path).to_pyarrow_table()
    assert after.num_rows == registry.num_rows


def test_retention_on_the_s3_server(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The removal commit is put-if-absent on an object store too; appends go on after it."""
    for key, value in store_env(s3_server.endpoint).items():
        monkeypatch.setenv(key, value)
    # obstore clients are kept per bucket: none made for another test's server may be reused.
    monkeypatch.setattr(object_store, "_stores", {})
    wh = Warehouse(f"s3://{BUCKET}/retention")
    path = wh.topic_path("t")
    open_or_create(path, TOPIC_SCHEMA)
    appender = appender_for(path)
    assert isinstance(appender, ObjectStoreAppender)
    published = time.time_ns() // 1000 - 10 * 3_600_000_000
    for k in range(2):
        appender.append(_topic_rows(published, k))
    registry = Registry()
    registry.topics["t"] = TopicInfo("t", 0, retention="fixed", retention_hours=1.0)
    report = apply_retention(wh, registry, FINISHED, time.time_ns() // 1000)
    assert (report.files_removed, report.rows_removed) == (2, 2), report
    assert DeltaTable(path).to_pyarrow_table().num_rows == 0
    appender.append(_topic_rows(time.time_ns() // 1000, 2))
    dt = DeltaTable(path)
    assert (dt.version(), dt.to_pyarrow_table().num_rows) == (4, 1)
    assert DeltaTable(path, version=2).to_pyarrow_table().num_rows == 2


def _topic_rows(published_us: int, counter: int) -> pa.Table:
    message_id = ((published_us // 1000) << SEQUENCE_BITS) | counter
    return conform(
        pa.table(
            {
                "id": [f"{message_id:016x}"],
                "body": [b"m"],
                "published_at": pa.array([published_us], pa.int64()).cast(_UTC_US),
                "deliver_at": pa.nulls(1, _UTC_US),
            }
        ),
        TOPIC_SCHEMA,
    )
