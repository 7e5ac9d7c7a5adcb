"""delta-spark, the engine users run, on every table deltaq writes, while deltaq runs: reading,
time travel, streaming a topic across retention, and maintaining or changing the tables
(OPTIMIZE, ZORDER, VACUUM, DELETE, property and protocol changes) without losing or
duplicating a message.

The tests need delta-spark's jars (Maven Central or Ivy's cache): without them the session
starts without delta-spark and they skip, saying so (under CI, which fetches them, they fail).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
from tests.conftest import Server, committed_topic, unavailable
from tests.consumers import answer, body, create_channel, sub
from tests.spark.test_fanout import run_once
from tests.spark.test_source import batch, make_topic


@pytest.fixture
def delta(spark: SparkSession) -> SparkSession:
    if engine(spark) is not Engine.DELTA_SPARK:
        unavailable(f"delta-spark's jars ({delta_spark_package()}) could not be fetched or found")
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


def committed(c: httpx.Client, wh: Path, *topics: str) -> None:
    """Each topic's table once it holds every message the API acknowledged: what a one-shot
    fanout then reads."""
    for topic in topics:
        committed_topic(str(c.base_url), wh, topic)


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
    # Published with headers (a map column of the topic, channel and dead-letter tables).
    lines = (
        b'{"body": "d1", "headers": {"region": "eu"}}\n{"body": "d2", "headers": {"region": "us"}}'
    )
    r = c.post("/mpub", params={"topic": "t", "envelope": "json"}, content=lines)
    assert r.text == "OK"
    publish_typed(c)
    committed(c, wh, "t", "orders")
    run_once(delta, wh)
    dying_orders = sub(c, "orders", "dl", max=4, wait_ms=5000)
    assert len(dying_orders) == 4
    assert answer(c, "req", "orders", "dl", *dying_orders).status_code == 200
    assert sub(c, "orders", "dl", max=4, wait_ms=500) == []
    messages = sub(c, "t", "c", max=10, wait_ms=5000)
    assert messages
    assert answer(c, "fin", "t", "c", *messages).status_code == 200
    dying = sub(c, "t", "dl", max=2, wait_ms=5000)
    assert answer(c, "req", "t", "dl", *dying).status_code == 200
    assert sub(c, "t", "dl", max=2, wait_ms=500) == []
    # A replay: copies in the topic, delivered to one channel again.
    replayed = c.post("/channel/replay", params={"topic": "t", "channel": "c", "from": "0"})
    assert replayed.status_code == 200, replayed.text
    committed(c, wh, "t")
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
    views = register_views(delta, str(wh), database="deltaq_conformance")
    assert "queue_stats" in views and "topic_orders" in views
    # A typed topic's fields, by name wherever its rows are.
    check_typed(delta, wh, "deltaq_conformance")
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
    # Headers by name in SQL: the originals and their replayed copies, and the dead letters.
    regions = delta.sql(
        "SELECT headers['region'] AS r FROM deltaq_conformance.topic_t WHERE headers IS NOT NULL"
    )
    assert sorted(row.r for row in regions.collect()) == ["eu", "eu", "us", "us"]
    dead = delta.sql("SELECT headers['region'] AS r FROM deltaq_conformance.channel_t__dl_dead")
    assert sorted(row.r for row in dead.collect()) == ["eu", "us"]
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


def publish_typed(c: httpx.Client) -> None:
    """A typed topic, orders, whose schema gains a field after three messages, with a channel
    c and a channel dl whose messages die after one attempt."""
    r = c.post("/topic/create", params={"topic": "orders", "schema": "sku STRING, amount DOUBLE"})
    assert r.status_code == 200, r.text
    for channel, extra in (("c", {}), ("dl", {"max_attempts": "1"})):
        params = {"topic": "orders", "channel": channel, **extra}
        assert c.post("/channel/create", params=params).is_success
    lines = b'{"sku": "a", "amount": 2.5}\n{"sku": "b", "amount": 4}\n{"sku": "a", "amount": 1}'
    assert c.post("/mpub", params={"topic": "orders"}, content=lines).text == "OK"
    # A field added later: the older rows read it as null.
    r = c.post(
        "/topic/configure",
        params={"topic": "orders", "schema": "sku STRING, amount DOUBLE, region STRING"},
    )
    assert r.status_code == 200, r.text
    later = b'{"sku": "b", "amount": 10, "region": "eu"}'
    assert c.post("/pub", params={"topic": "orders"}, content=later).text == "OK"


def check_typed(delta: SparkSession, wh: Path, database: str) -> None:
    """orders' fields as columns: by path, by the topic's view and catalog entry, in its
    channel's and dead-letter tables, and in a user's own stream of the topic."""
    w = Warehouse(str(wh))
    topic = delta.read.format("delta").load(w.topic_path("orders"))
    assert topic.schema["amount"].dataType.simpleString() == "double"
    query = "SELECT sku, sum(amount) AS total FROM {} WHERE amount > 1 GROUP BY sku ORDER BY sku"
    for table in ("topic_orders", f"{database}.topic_orders"):
        totals = [(row.sku, row.total) for row in delta.sql(query.format(table)).collect()]
        assert totals == [("a", 2.5), ("b", 14.0)], table
    regions = delta.sql(f"SELECT sku, region FROM {database}.topic_orders ORDER BY amount")
    assert [(row.sku, row.region) for row in regions.collect()] == [
        ("a", None),
        ("a", None),
        ("b", None),
        ("b", "eu"),
    ]
    for table in ("channel_orders__c_messages", "channel_orders__dl_dead"):
        rows_of = delta.sql(f"SELECT sum(amount) AS s, count(region) AS r FROM {database}.{table}")
        assert [(row.s, row.r) for row in rows_of.collect()] == [(17.5, 1)], table
    stream = (
        delta.readStream.format("delta")
        .load(w.topic_path("orders"))
        .select("sku", "amount")
        .writeStream.format("memory")
        .queryName("typed_orders")
        .trigger(availableNow=True)
        .start()
    )
    stream.awaitTermination(120)
    got = delta.sql("SELECT sku, amount FROM typed_orders ORDER BY amount").collect()
    assert [(row.sku, row.amount) for row in got] == [
        ("a", 1.0),
        ("a", 2.5),
        ("b", 4.0),
        ("b", 10.0),
    ]


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


class ClientLoop(threading.Thread):
    """Calls ``step`` with one HTTP client until stopped; the first error ends it, kept in
    ``error`` for the test's thread to raise."""

    def __init__(self, name: str, url: str) -> None:
        super().__init__(name=name, daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def step(self, c: httpx.Client) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=30) as c:
                while not self.stop.is_set():
                    self.step(c)
        except BaseException as exc:
            self.error = exc

    def end(self) -> None:
        self.stop.set()
        self.join(30)
        assert self.error is None, self.error


class Publisher(ClientLoop):
    """Publishes msg-NNNNN to topic t, one at a time, until stopped: deltaq's appends going on
    while another engine works on the table. ``acknowledged``: the bodies answered OK."""

    def __init__(self, url: str) -> None:
        super().__init__("publisher", url)
        self.next = 0
        self.acknowledged: list[bytes] = []

    def step(self, c: httpx.Client) -> None:
        body = f"msg-{self.next:05d}".encode()
        r = c.post("/pub", params={"topic": "t"}, content=body)
        assert r.text == "OK", r.text
        self.acknowledged.append(body)
        self.next += 1
        self.stop.wait(0.1)  # ~10 a second

    def during(self, action: Callable[[], object]) -> None:
        """``action``, with publishes acknowledged while it ran."""
        before = len(self.acknowledged)
        action()
        assert len(self.acknowledged) > before, "no publish went on during the operation"

    def finish(self) -> list[bytes]:
        self.end()
        return self.acknowledged


class Consumer(ClientLoop):
    """SUBs channel t/c and FINs what it gets until stopped; ``bodies``: every delivery."""

    def __init__(self, url: str) -> None:
        super().__init__("consumer", url)
        self.bodies: list[bytes] = []
        self.ids: list[str] = []

    def step(self, c: httpx.Client) -> None:
        got = sub(c, "t", "c", max=20, wait_ms=500)
        if got:
            assert answer(c, "fin", "t", "c", *got).status_code == 200
            self.ids += [m["id"] for m in got]
            self.bodies += [body(m) for m in got]

    def finish(self, expect: int) -> None:
        """Once ``expect`` deliveries came and then 1.5 s with nothing (room for a duplicate
        to show), stop."""
        deadline = time.monotonic() + 120
        while len(self.bodies) < expect and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.1)
        time.sleep(1.5)
        self.end()


def data_files(table: str) -> tuple[set[Path], set[Path]]:
    """The table's data files on disk, and those its latest version holds (``_``-prefixed
    directories, deltaq's spare files and the log, are no data of the table's)."""
    root = Path(table).resolve()
    on_disk = {
        p
        for p in root.rglob("*.parquet")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    }
    return on_disk, {Path(uri).resolve() for uri in DeltaTable(table).file_uris()}


# How long the API lets a topic's acknowledged publishes wait before their commit, here.
LINGER_MS = 10_000


@pytest.fixture
def lingering(server_factory: type[Server], tmp_path: Path) -> tuple[Path, httpx.Client]:
    """``served``, but the API commits to a topic at most every LINGER_MS (its publishes are
    acknowledged from its journal meanwhile): delta-spark aborts a DELETE during which any
    file was added (Delta's only isolation level outside Databricks, Serializable, blind
    append or not), so a DELETE amid publishes gets through only between two commits."""
    wh = tmp_path / "wh"
    server = server_factory(wh, env={"DELTAQ_DRAIN_LINGER_MS": str(LINGER_MS)}).start()
    c = httpx.Client(base_url=server.url, timeout=30)
    create_channel(c, "t", "c")
    return wh, c


@pytest.fixture
def publisher(lingering: tuple[Path, httpx.Client]) -> Iterator[Publisher]:
    p = Publisher(str(lingering[1].base_url))
    yield p
    p.stop.set()


@pytest.fixture
def consumer(lingering: tuple[Path, httpx.Client]) -> Iterator[Consumer]:
    c = Consumer(str(lingering[1].base_url))
    yield c
    c.stop.set()


def retried(action: Callable[[], object]) -> None:
    """``action``, again each time delta-spark aborts it for a file added meanwhile."""
    for _ in range(20):
        try:
            action()
            return
        except Exception as exc:
            if "DELTA_CONCURRENT_APPEND" not in str(exc):
                raise
    raise AssertionError("delta-spark aborted it 20 times for files added meanwhile")


def after_a_commit(table: str, action: Callable[[], object]) -> Callable[[], None]:
    """``action`` once the table's next commit landed (the API's next is LINGER_MS later)."""

    def run() -> None:
        log = Path(table) / "_delta_log"
        version = DeltaTable(table).version()
        deadline = time.monotonic() + 3 * LINGER_MS / 1000
        while not (log / f"{version + 1:020d}.json").exists():
            assert time.monotonic() < deadline, f"no commit after version {version}"
            time.sleep(0.01)
        action()

    return run


@pytest.mark.timeout(900)
def test_another_engine_maintains_a_topic_while_deltaq_publishes_and_consumes(
    delta: SparkSession,
    lingering: tuple[Path, httpx.Client],
    publisher: Publisher,
    consumer: Consumer,
) -> None:
    wh, c = lingering
    topic = Warehouse(str(wh)).topic_path("t")

    def ids_of(*bodies: bytes) -> list[str]:
        # Acknowledged means journaled: the row reaches the table a topic commit later. The
        # table is read again only once a newer version is in its log.
        deadline = time.monotonic() + 30
        log = Path(topic) / "_delta_log"
        while True:
            dt = DeltaTable(topic)
            table = dt.to_pyarrow_table(columns=["id", "body"]).to_pylist()
            found = [r["id"] for r in table if r["body"] in bodies]
            if len(found) >= len(bodies) or time.monotonic() > deadline:
                return found
            while not (log / f"{dt.version() + 1:020d}.json").exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)

    def sql(statement: str) -> None:
        delta.sql(statement).collect()

    def delete(message_id: str) -> Callable[[], None]:
        statement = f"DELETE FROM delta.`{topic}` WHERE id = '{message_id}'"
        return lambda: retried(after_a_commit(topic, lambda: sql(statement)))

    # From here to the VACUUM deltaq takes publishes all the time (and commits them to the
    # topic every LINGER_MS), and the channel's messages are consumed as the fanout delivers
    # them: every DELETE, OPTIMIZE and property change of the other engine's runs in the
    # middle of that, and deltaq's commits go on after each of its commits.
    publisher.start()
    consumer.start()
    while len(publisher.acknowledged) < 40:
        time.sleep(0.05)
    taken_body = b"msg-00003"
    [taken] = ids_of(taken_body)
    run_once(delta, wh)
    # An erasure request after the fanout took the message: the channel already has it.
    publisher.during(delete(taken))
    # An erasure before the fanout took it (none runs until the next run_once): it must never
    # be delivered.
    erased_body = publisher.acknowledged[-1]
    [erased] = ids_of(erased_body)
    publisher.during(delete(erased))
    publisher.during(lambda: retried(lambda: sql(f"OPTIMIZE delta.`{topic}`")))
    # The fanout reads those rewrites while deltaq goes on appending; the channel fills.
    publisher.during(lambda: run_once(delta, wh))
    publisher.during(lambda: retried(lambda: sql(f"OPTIMIZE delta.`{topic}` ZORDER BY (id)")))
    appendable = "('delta.appendOnly'='false')"
    publisher.during(
        lambda: retried(lambda: sql(f"ALTER TABLE delta.`{topic}` SET TBLPROPERTIES {appendable}"))
    )
    acknowledged = publisher.finish()
    history = delta.sql(f"DESCRIBE HISTORY delta.`{topic}`").collect()  # newest first
    theirs = [
        h["operation"]
        for h in history
        if h["operation"] in ("DELETE", "OPTIMIZE") and "Delta-Lake" in (h["engineInfo"] or "")
    ]
    assert theirs == ["OPTIMIZE", "OPTIMIZE", "DELETE", "DELETE"]

    # Every acknowledged row in the table (no commit of deltaq's to come) and the fanout
    # caught up: VACUUM with no retention then deletes every file the latest version does not
    # hold, the ones the DELETEs and OPTIMIZEs replaced.
    kept = [m for m in acknowledged if m not in (taken_body, erased_body)]
    assert len(ids_of(*kept)) == len(kept)
    run_once(delta, wh)
    on_disk, live = data_files(topic)
    assert on_disk - live, "the DELETEs and OPTIMIZEs left no file for VACUUM to remove"
    check = "spark.databricks.delta.retentionDurationCheck.enabled"
    previous = delta.conf.get(check, None)
    delta.conf.set(check, "false")
    try:
        sql(f"VACUUM delta.`{topic}` RETAIN 0 HOURS")
    finally:
        delta.conf.set(check, previous) if previous is not None else delta.conf.unset(check)
    assert data_files(topic) == (live, live)
    # Publishing and the fanout go on after it.
    after = [f"after-{i:02d}".encode() for i in range(20)]
    for message in after:
        assert c.post("/pub", params={"topic": "t"}, content=message).text == "OK"
    acknowledged += after
    assert len(ids_of(*after)) == len(after)
    run_once(delta, wh)

    # Every acknowledged message delivered exactly once, but the one erased before the fanout.
    expected = [m for m in acknowledged if m != erased_body]
    consumer.finish(expect=len(expected))
    delivered = Counter(consumer.bodies)
    assert max(delivered.values()) == 1, delivered.most_common(3)
    assert sorted(delivered) == sorted(expected)
    assert erased not in consumer.ids and taken in consumer.ids
    channel = DeltaTable(Warehouse(str(wh)).channel_messages_path("t", "c")).to_pyarrow_table()
    in_channel = Counter(channel["id"].to_pylist())
    assert max(in_channel.values()) == 1, "a channel row was written twice"
    assert erased not in in_channel
    assert taken in in_channel
    assert count(delta, topic) == rows(topic) == len(acknowledged) - 2


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
