"""delta-spark, the engine users run, on every table deltaq writes, while deltaq runs: reading,
time travel, streaming a topic across retention, and maintaining or changing the tables
(OPTIMIZE, ZORDER, VACUUM, DELETE, property and protocol changes) without losing or
duplicating a message.

The tests need delta-spark's jars (Maven Central or Ivy's cache): without them the session
starts without delta-spark and they skip, saying so.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from queue_engine.spark.catalog import catalog_name, register_tables
from queue_engine.spark.session import Engine, delta_spark_package, engine
from queue_engine.spark.sweep import sweep
from queue_engine.spark.views import register_views
from queue_engine.store.delta import commit_actions, open_or_create, remove_files
from queue_engine.store.tables import TOPIC_SCHEMA, Warehouse
from queue_engine.store.upkeep import compact_small_files
from tests.conftest import Server
from tests.consumers import answer, create_channel, sub
from tests.spark.test_fanout import run_once
from tests.spark.test_source import batch, make_topic


@pytest.fixture
def delta(spark: SparkSession) -> SparkSession:
    if engine(spark) is not Engine.DELTA_SPARK:
        pytest.skip(f"delta-spark's jars ({delta_spark_package()}) could not be fetched or found")
    return spark


@pytest.fixture
def served(server_factory: type[Server], tmp_path: Path) -> tuple[Path, httpx.Client]:
    """A deltaq API on a fresh warehouse, and a client of it with topic t's channel c."""
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    c = httpx.Client(base_url=server.url, timeout=30)
    create_channel(c, "t", "c")
    return wh, c


def count(spark: SparkSession, path: Path | str, **options: str) -> int:
    reader = spark.read.format("delta")
    for key, value in options.items():
        reader = reader.option(key, value)
    return int(reader.load(str(path)).count())


def rows(path: Path | str) -> int:
    return int(DeltaTable(str(path)).to_pyarrow_table().num_rows)


def consume_all(c: httpx.Client, topic: str, channel: str, expect: int) -> list[str]:
    """Every message the channel delivers until ``expect`` came and a while passed with
    nothing more, each FIN'd; the ids in delivery order."""
    got: list[str] = []
    deadline = time.monotonic() + 60
    idle_since: float | None = None
    while time.monotonic() < deadline:
        batch_ = sub(c, topic, channel, max=100, wait_ms=500)
        if batch_:
            idle_since = None
            got += [m["id"] for m in batch_]
            assert answer(c, "fin", topic, channel, *batch_).status_code == 200
        elif len(got) >= expect:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 1.5:
                break
    return got


def test_delta_spark_reads_every_table_deltaq_writes(
    delta: SparkSession, served: tuple[Path, httpx.Client]
) -> None:
    wh, c = served
    for i in range(6):
        body = "\n".join(f"m{i}-{j}" for j in range(5)).encode()
        assert c.post("/mpub", params={"topic": "t"}, content=body).text == "OK"
    # A channel whose messages die after one attempt: its dead-letter table.
    params = {"topic": "t", "channel": "dl", "max_attempts": "1"}
    assert c.post("/channel/create", params=params).is_success
    assert c.post("/mpub", params={"topic": "t"}, content=b"d1\nd2").text == "OK"
    run_once(delta, wh)
    messages = sub(c, "t", "c", max=10, wait_ms=5000)
    assert messages
    assert answer(c, "fin", "t", "c", *messages).status_code == 200
    dying = sub(c, "t", "dl", max=2, wait_ms=5000)
    assert answer(c, "req", "t", "dl", *dying).status_code == 200
    assert sub(c, "t", "dl", max=2, wait_ms=500) == []
    # A replay: copies in the topic, delivered to one channel again.
    replayed = c.post("/channel/replay", params={"topic": "t", "channel": "c", "from": "0"})
    assert replayed.status_code == 200, replayed.text
    run_once(delta, wh)
    sweep(delta, Warehouse(str(wh)))

    w = Warehouse(str(wh))
    topic, channel = w.topic_path("t"), w.channel_messages_path("t", "c")
    ledger = w.channel_ledger_path("t", "c")
    tables = [
        topic,
        channel,
        ledger,
        w.channel_state_path("t", "c"),
        w.channel_dead_path("t", "dl"),
        w.registry_path,
    ]
    # Counts through delta-spark equal deltaq's own (delta-rs), table by table.
    for path in tables:
        assert count(delta, path) == rows(path), path
    assert count(delta, w.channel_dead_path("t", "dl")) == len(dying) > 0
    assert count(delta, topic) == 64  # 32 published, 32 replayed copies

    # The same tables by name in the session's catalog, in one call with the views.
    assert "queue_stats" in register_views(delta, str(wh), database="deltaq_conformance")
    named = {
        name: path
        for name, path in register_tables(delta, str(wh), "deltaq_conformance").items()
        if path in tables
    }
    assert len(named) == len(tables)
    for name, path in named.items():
        assert delta.table(name).count() == rows(path), name
    assert "deltaq_conformance.topic_t" in named
    assert "deltaq_conformance.channel_t__dl_dead" in named
    topic_t = delta.table("deltaq_conformance.topic_t")
    assert topic_t.filter("replay_of IS NOT NULL").count() == 32
    # History and time travel by version and by timestamp.
    history = delta.sql(f"DESCRIBE HISTORY delta.`{topic}`").collect()
    assert len(history) == DeltaTable(topic).version() + 1
    assert {h["operation"] for h in history} >= {"WRITE"}
    assert count(delta, topic, versionAsOf="1") == rows_at(topic, 1)
    [first] = [h for h in history if h["version"] == 1]
    at = first["timestamp"].strftime("%Y-%m-%d %H:%M:%S.%f")
    assert count(delta, topic, timestampAsOf=at) == rows_at(topic, 1)
    newest = history[0]["timestamp"].strftime("%Y-%m-%d %H:%M:%S.%f")
    assert count(delta, topic, timestampAsOf=newest) == 64

    # After deltaq's checkpoint, compaction and retention, the same.
    DeltaTable(topic).create_checkpoint()
    compacted = compact_small_files(topic, DeltaTable(topic), 1 << 20)
    assert compacted is not None
    assert count(delta, topic) == 64
    dt = DeltaTable(topic)
    add = dt.get_add_actions(flatten=True)
    remove_files(topic, dt, [(add["path"][0].as_py(), add["size_bytes"][0].as_py())], "test")
    assert count(delta, topic) == rows(topic) == 0
    history = delta.sql(f"DESCRIBE HISTORY delta.`{topic}`").collect()
    assert history[0]["operation"] == "DELETE"
    assert count(delta, topic, versionAsOf=str(compacted.version)) == 64


def rows_at(path: str, version: int) -> int:
    return int(DeltaTable(path, version=version).to_pyarrow_table().num_rows)


def test_a_users_delta_stream_of_a_topic_keeps_running_across_retention(
    delta: SparkSession, tmp_path: Path
) -> None:
    topic = tmp_path / "topic"
    appender = make_topic(topic, commits=4)  # 12 messages

    def stream(name: str, **options: str) -> int:
        reader = delta.readStream.format("delta")
        for key, value in options.items():
            reader = reader.option(key, value)
        query = (
            reader.load(str(topic))
            .writeStream.format("delta")
            .option("checkpointLocation", str(tmp_path / f"{name}-checkpoint"))
            .trigger(availableNow=True)
            .start(str(tmp_path / name))
        )
        query.awaitTermination(120)
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        return rows(tmp_path / name)

    assert stream("sink", skipChangeCommits="true") == 12
    assert stream("strict") == 12
    # Retention removes a file every stream already read (dataChange=true), compaction moves
    # the rest (dataChange=false), and publishing goes on.
    dt = DeltaTable(str(topic))
    add = dt.get_add_actions(flatten=True)
    remove_files(str(topic), dt, [(add["path"][0].as_py(), add["size_bytes"][0].as_py())], "old")
    compact_small_files(str(topic), DeltaTable(str(topic)), 1 << 20)
    for i in range(2):
        appender.reopen()
        appender.append(batch(3, 100 + i * 3))
    # With skipChangeCommits the stream reads every new message and nothing twice ...
    assert stream("sink", skipChangeCommits="true") == 18
    sink = DeltaTable(str(tmp_path / "sink")).to_pyarrow_table()
    assert len(set(sink["id"].to_pylist())) == 18
    # ... without it, delta-spark stops at the deletion, as its documentation says.
    with pytest.raises(Exception, match=r"DELTA_SOURCE_IGNORE_DELETE|skipChangeCommits"):
        stream("strict")


def test_another_engine_maintains_a_topic_while_deltaq_publishes_and_consumes(
    delta: SparkSession, served: tuple[Path, httpx.Client]
) -> None:
    wh, c = served
    topic = Warehouse(str(wh)).topic_path("t")
    acknowledged: list[bytes] = []

    def publish(first: int, n: int) -> None:
        for i in range(first, first + n):
            body = f"msg-{i:04d}".encode()
            assert c.post("/pub", params={"topic": "t"}, content=body).text == "OK"
            acknowledged.append(body)

    def ids_of(*bodies: bytes) -> list[str]:
        # Acknowledged means journaled: the row reaches the table a topic commit later.
        deadline = time.monotonic() + 10
        while True:
            table = DeltaTable(topic).to_pyarrow_table(columns=["id", "body"]).to_pylist()
            found = [r["id"] for r in table if r["body"] in bodies]
            if len(found) >= len(bodies) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    publish(0, 40)
    run_once(delta, wh)
    # An erasure request after the fanout took the message: the channel already has it.
    [taken] = ids_of(b"msg-0003")
    delta.sql(f"DELETE FROM delta.`{topic}` WHERE id = '{taken}'")
    publish(40, 40)
    # An erasure before the fanout took it: it must never be delivered.
    [erased] = ids_of(b"msg-0050")
    delta.sql(f"DELETE FROM delta.`{topic}` WHERE id = '{erased}'")
    delta.sql(f"OPTIMIZE delta.`{topic}`")
    publish(80, 20)
    delta.sql(f"OPTIMIZE delta.`{topic}` ZORDER BY (id)")
    delta.sql(f"VACUUM delta.`{topic}`")
    delta.sql(f"ALTER TABLE delta.`{topic}` SET TBLPROPERTIES ('delta.appendOnly'='false')")
    publish(100, 20)
    run_once(delta, wh)

    got = consume_all(c, "t", "c", expect=119)
    channel = DeltaTable(Warehouse(str(wh)).channel_messages_path("t", "c")).to_pyarrow_table()
    in_channel = Counter(channel["id"].to_pylist())
    assert max(in_channel.values()) == 1, "a channel row was written twice"
    assert erased not in in_channel and erased not in got
    assert taken in in_channel
    assert len(got) == len(set(got)) == 119, Counter(got).most_common(3)
    assert count(delta, topic) == rows(topic) == 118


def test_a_feature_deltaq_cannot_keep_working_with_refuses_that_topic_only(
    delta: SparkSession, server_factory: type[Server], tmp_path: Path
) -> None:
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    c = httpx.Client(base_url=server.url, timeout=30)
    w = Warehouse(str(wh))
    for name in ("ict", "dv", "mapped", "plain"):
        assert c.post("/pub", params={"topic": name}, content=b"first").text == "OK"

    def alter(name: str, properties: str) -> None:
        delta.sql(f"ALTER TABLE delta.`{w.topic_path(name)}` SET TBLPROPERTIES ({properties})")

    alter("ict", "'delta.enableInCommitTimestamps'='true'")
    alter("dv", "'delta.enableDeletionVectors'='true'")
    alter(
        "mapped",
        "'delta.columnMapping.mode'='name', 'delta.minReaderVersion'='2', "
        "'delta.minWriterVersion'='5'",
    )

    def pub(name: str) -> httpx.Response:
        return c.post("/pub", params={"topic": name}, content=b"next")

    for name, feature in (("ict", "inCommitTimestamp"), ("dv", "deletionVectors")):
        # The writer learns of the feature at its next commit: what the node journal
        # acknowledged before that stays in the journal (not in the table) until the table
        # takes appends again; every publish after it is refused.
        answered = pub(name)
        deadline = time.monotonic() + 10
        while answered.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
            answered = pub(name)
        assert answered.status_code == 409, answered.text
        reply: dict[str, Any] = answered.json()
        assert reply["message"] == "E_TABLE_REFUSED" and feature in reply["reason"]
        # At once, and the table is untouched by deltaq.
        assert pub(name).json()["message"] == "E_TABLE_REFUSED"
    assert pub("mapped").text == "OK" and pub("plain").text == "OK"
    server.topic_table("mapped")
    assert count(delta, w.topic_path("mapped")) == 2
    stats = c.get("/stats", params={"format": "json"}).json()
    refused = {t["topic_name"]: t["refused"] for t in stats["topics"]}
    assert "inCommitTimestamp" in refused["ict"] and "deletionVectors" in refused["dv"]
    assert refused["plain"] is None and refused["mapped"] is None
    info = c.get("/info").json()
    assert set(info["refused_topics"]) == {"ict", "dv"}
    overview = c.get("/console/api/overview").json()
    assert {t["name"] for t in overview["topics"] if t["refused"]} == {"ict", "dv"}
    # delta-spark keeps reading the refused tables: deltaq wrote nothing they forbid.
    assert count(delta, w.topic_path("ict")) == 1
    assert count(delta, w.topic_path("dv")) == 1


# Table properties another engine may set, and the protocol feature each brings.
FEATURES = {
    "appendOnly": "'delta.appendOnly'='true'",
    "changeDataFeed": "'delta.enableChangeDataFeed'='true'",
    "v2Checkpoint": "'delta.checkpointPolicy'='v2'",
    "columnMapping": "'delta.columnMapping.mode'='name', 'delta.minReaderVersion'='2', "
    "'delta.minWriterVersion'='5'",
    "inCommitTimestamp": "'delta.enableInCommitTimestamps'='true'",
    "deletionVectors": "'delta.enableDeletionVectors'='true'",
}
REFUSED = {"inCommitTimestamp", "deletionVectors"}


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(chosen=st.sets(st.sampled_from(sorted(FEATURES)), min_size=1, max_size=3))
def test_every_commit_deltaq_writes_stays_valid_for_the_tables_protocol(
    delta: SparkSession, tmp_path_factory: pytest.TempPathFactory, chosen: set[str]
) -> None:
    from queue_engine.store.delta import TableRefusedError
    from queue_engine.store.tables import TopicWriter
    from tests.integration.test_topic_writer import Results, now_us

    path = str(tmp_path_factory.mktemp("features") / "t")
    open_or_create(path, TOPIC_SCHEMA)
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    writer.submit_publish([b"m0"], now_us(), None, 0)
    results.wait(1)
    first = DeltaTable(path).version()
    properties = ", ".join(FEATURES[f] for f in sorted(chosen))
    delta.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({properties})")
    delta.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT named_body CHECK (body IS NOT NULL)")
    for i in range(1, 4):
        writer.submit_publish([f"m{i}".encode()], now_us(), None, i)
        results.wait(i + 1)
    DeltaTable(path).create_checkpoint() if not chosen & REFUSED else None
    writer.request_reopen()
    writer.submit_publish([b"last"], now_us(), None, 4)
    results.wait(5)
    writer.close()
    errors = [e for e in results.done.values() if e is not None]
    if chosen & REFUSED:
        # Refused by name, and nothing written after the change.
        assert errors and all(isinstance(e, TableRefusedError) for e in errors), errors
        assert {e.feature for e in errors if isinstance(e, TableRefusedError)} <= REFUSED
        assert count(delta, path) == 1
        return
    assert not errors, errors
    # Every commit deltaq made after the change honours the table: delta-spark reads each
    # version, the rows are all there with their values, no remove of data in an appendOnly
    # table, and a commit's own engine can write on top.
    assert count(delta, path) == 5
    latest = DeltaTable(path).version()
    for version in (first, latest):
        delta.read.format("delta").option("versionAsOf", str(version)).load(path).count()
    bodies = {r["body"] for r in delta.read.format("delta").load(path).collect()}
    assert bodies == {b"m0", b"m1", b"m2", b"m3", b"last"}
    if "appendOnly" in chosen:
        for version in range(first + 1, latest + 1):
            for action in commit_actions(path, [version]).get(version, []):
                assert not (action.get("remove") or {}).get("dataChange"), action
    delta.sql(f"INSERT INTO delta.`{path}` SELECT * FROM delta.`{path}` LIMIT 1")
    assert count(delta, path) == 6


def test_catalog_names_are_what_spark_accepts_and_never_clash() -> None:
    assert catalog_name("topic", "events") == "topic_events"
    dotted, dashed = catalog_name("topic", "a.b"), catalog_name("topic", "a-b")
    assert dotted != dashed
    assert dotted.startswith("topic_a_b_") and all(ch.isalnum() or ch == "_" for ch in dotted)
    assert catalog_name("channel", "t", "c#ephemeral").startswith("channel_t__c_ephemeral_")
