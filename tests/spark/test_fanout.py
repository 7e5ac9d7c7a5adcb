"""The fanout job: NSQ's rules for which channel gets what, and exactly once across crashes."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from queue_engine.spark.fanout_stream import (
    ForeignCheckpointError,
    Moved,
    fanout_batch_by_spark,
    moved_by,
    start_fanout,
)
from queue_engine.store.tables import CHANNEL_MESSAGES_SCHEMA, RegistryReader, Warehouse
from tests.conftest import ROOT, Server


def channel_bodies(warehouse: Path, topic: str, channel: str) -> list[bytes]:
    path = warehouse / "channels" / topic / channel / "messages"
    if not path.exists():
        return []
    return sorted(DeltaTable(str(path)).to_pyarrow_table()["body"].to_pylist())


def run_once(spark: SparkSession, warehouse: Path, channel_format: str | None = None) -> Moved:
    query = start_fanout(spark, Warehouse(str(warehouse)), once=True, channel_format=channel_format)
    query.awaitTermination(300)
    assert query.exception() is None
    return moved_by(query)


# None: rows collected on the driver and appended through delta-rs (the default here);
# "deltaq": Spark's writer with delta-spark's txnAppId/txnVersion options (the path "delta"
# takes where delta-spark's jars load).
WRITE_PATHS = [None, "deltaq"]


@pytest.mark.parametrize("channel_format", WRITE_PATHS, ids=["driver", "spark-writer"])
def test_fanout_rules(
    spark: SparkSession,
    server_factory: type[Server],
    tmp_path: Path,
    channel_format: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="queue_engine.spark.trigger_log")
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    c = httpx.Client(base_url=server.url, timeout=30)

    def pub(topic: str, body: str) -> None:
        assert c.post("/pub", params={"topic": topic}, content=body.encode()).text == "OK"

    def post(path: str, **params: str) -> None:
        assert c.post(path, params=params).status_code == 200

    # Topic a: a message buffered before any channel goes to the first channel only.
    pub("a", "a0")
    post("/channel/create", topic="a", channel="c1")
    c.post("/mpub", params={"topic": "a"}, content=b"a1\na1b")
    post("/channel/create", topic="a", channel="c2")
    pub("a", "a2")
    # Topic b: paused, nothing flows until unpaused.
    post("/topic/create", topic="b")
    post("/channel/create", topic="b", channel="b1")
    post("/topic/pause", topic="b")
    pub("b", "b0")
    # Topic e: emptied while it had no channel; only later messages reach the first channel.
    pub("e", "e0")
    post("/topic/empty", topic="e")
    pub("e", "e1")
    post("/channel/create", topic="e", channel="first")
    # Topic n: no channel at all yet.
    pub("n", "n0")

    moved = run_once(spark, wh, channel_format)
    assert channel_bodies(wh, "a", "c1") == [b"a0", b"a1", b"a1b", b"a2"]
    # The one-shot run's progress counts the rows it read: a's four and e's after the empty
    # at least (e's emptied row is read too, and routed nowhere).
    assert moved.batches >= 1 and moved.rows >= 5, moved
    # Each trigger that moved rows is logged whole, from Spark's progress event (which
    # reaches the listener shortly after the query ends).
    trigger = re.compile(r"fanout trigger \d+: \d+ ms \(latestOffset \d+, addBatch \d+, ")
    deadline = time.monotonic() + 10
    while not any(trigger.match(r.getMessage()) for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.1)
    assert channel_bodies(wh, "a", "c2") == [b"a2"]
    assert channel_bodies(wh, "b", "b1") == []
    assert channel_bodies(wh, "e", "first") == [b"e1"]
    assert not (wh / "channels" / "n").exists()

    post("/topic/unpause", topic="b")
    post("/channel/delete", topic="a", channel="c2")
    pub("a", "a3")
    post("/channel/create", topic="n", channel="late")  # first channel: gets the buffered n0
    post("/channel/create", topic="a", channel="c3")
    pub("a", "a4")
    run_once(spark, wh, channel_format)
    assert channel_bodies(wh, "b", "b1") == [b"b0"]
    assert channel_bodies(wh, "a", "c1") == [b"a0", b"a1", b"a1b", b"a2", b"a3", b"a4"]
    assert not (wh / "channels" / "a" / "c2").exists()  # deleted channels receive nothing
    assert channel_bodies(wh, "a", "c3") == [b"a4"]
    assert channel_bodies(wh, "n", "late") == [b"n0"]

    # Running again with nothing new writes nothing twice.
    run_once(spark, wh, channel_format)
    assert channel_bodies(wh, "a", "c1") == [b"a0", b"a1", b"a1b", b"a2", b"a3", b"a4"]
    rows = DeltaTable(str(wh / "channels" / "a" / "c1" / "messages")).to_pyarrow_table()
    assert rows.column_names == CHANNEL_MESSAGES_SCHEMA.names
    c.close()


def test_spark_writer_skips_a_replayed_batch(
    spark: SparkSession, server_factory: type[Server], tmp_path: Path
) -> None:
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for topic, channel in (("t", "x"), ("t", "y"), ("u", "z")):
            assert c.post("/topic/create", params={"topic": topic}).status_code == 200
            params = {"topic": topic, "channel": channel}
            assert c.post("/channel/create", params=params).status_code == 200
        assert c.post("/mpub", params={"topic": "t"}, content=b"m0\nm1\nm2").text == "OK"
        assert c.post("/pub", params={"topic": "u"}, content=b"u0").text == "OK"
    server.topic_table("t"), server.topic_table("u")  # acknowledged; now in the tables too
    warehouse = Warehouse(str(wh))

    def rows_of(topic: str) -> DataFrame:
        # As the topics stream gives them: the topic's name and the version that added a row.
        path = warehouse.topic_path(topic)
        version = F.lit(DeltaTable(path).version()).cast("long").alias("topic_version")
        return (
            spark.read.format("deltaq").load(path).select(F.lit(topic).alias("topic"), "*", version)
        )

    batch = rows_of("t").union(rows_of("u"))
    reader = RegistryReader(warehouse.registry_path)
    created: set[tuple[str, int]] = set()
    # It answers with the batch's topic rows: three of t, one of u.
    assert fanout_batch_by_spark(batch, 5, reader, warehouse, "deltaq", created) == 4
    # Spark replays batch 5 after a crash: every channel already recorded it.
    assert fanout_batch_by_spark(batch, 5, reader, warehouse, "deltaq", created) == 4
    assert channel_bodies(wh, "t", "x") == channel_bodies(wh, "t", "y") == [b"m0", b"m1", b"m2"]
    assert channel_bodies(wh, "u", "z") == [b"u0"]
    assert (
        DeltaTable(warehouse.channel_messages_path("t", "x")).transaction_version("deltaq-fanout")
        == 5
    )


def test_channel_deleted_and_recreated_while_streaming(
    spark: SparkSession, server_factory: type[Server], tmp_path: Path
) -> None:
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    c = httpx.Client(base_url=server.url, timeout=30)
    path = wh / "channels" / "r" / "c" / "messages"

    def post(path: str, **params: str) -> None:
        assert c.post(path, params=params).status_code == 200

    def wait_for(expected: list[bytes]) -> None:
        deadline = time.monotonic() + 60
        while channel_bodies(wh, "r", "c") != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        assert channel_bodies(wh, "r", "c") == expected

    post("/topic/create", topic="r")
    post("/channel/create", topic="r", channel="c")
    query = start_fanout(spark, Warehouse(str(wh)), once=False, checkpoint=str(tmp_path / "cp"))
    try:
        for i in range(3):
            assert c.post("/pub", params={"topic": "r"}, content=f"old{i}".encode()).text == "OK"
            wait_for([f"old{j}".encode() for j in range(i + 1)])
        post("/channel/delete", topic="r", channel="c")
        post("/channel/create", topic="r", channel="c")
        assert c.post("/pub", params={"topic": "r"}, content=b"new").text == "OK"
        # The new table holds the new message only, in version 1: the old channel's appender
        # (next version 4) must not have written into it.
        wait_for([b"new"])
        assert sorted(os.listdir(path / "_delta_log")) == [f"{v:020d}.json" for v in range(2)]
    finally:
        query.stop()
        c.close()


def _fanout_process(warehouse: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(warehouse.parent / "fanout.log", "ab")  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.fanout", "--warehouse", str(warehouse), *extra],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # SIGKILL of the group takes the JVM down with the driver
    )


@pytest.mark.slow
def test_fanout_killed_mid_stream_then_restarted_is_exactly_once(
    server_factory: type[Server], tmp_path: Path
) -> None:
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    client = httpx.Client(base_url=server.url, timeout=30)
    assert client.post("/topic/create", params={"topic": "t"}).status_code == 200
    for ch in ("x", "y"):
        assert (
            client.post("/channel/create", params={"topic": "t", "channel": ch}).status_code == 200
        )

    published: list[bytes] = []
    stop = threading.Event()

    def publish() -> None:
        n = 0
        while not stop.is_set() and n < 400:
            batch = [f"m{n + i}".encode() for i in range(25)]
            r = client.post("/mpub", params={"topic": "t"}, content=b"\n".join(batch))
            assert r.text == "OK"
            published.extend(batch)
            n += 25
            time.sleep(0.02)

    fanout = _fanout_process(wh)
    publisher = threading.Thread(target=publish)
    publisher.start()
    deadline = time.monotonic() + 120
    while not channel_bodies(wh, "t", "x") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert channel_bodies(wh, "t", "x"), (wh.parent / "fanout.log").read_text()[-3000:]
    os.killpg(fanout.pid, signal.SIGKILL)
    fanout.wait(30)
    publisher.join(60)
    stop.set()

    rerun = _fanout_process(wh, "--once")
    assert rerun.wait(300) == 0, (wh.parent / "fanout.log").read_text()[-3000:]
    # A one-shot run ends with its progress line.
    assert re.search(
        r"fanout: done, \d+ batches, [\d,]+ messages", (wh.parent / "fanout.log").read_text()
    )
    for ch in ("x", "y"):
        counts = Counter(channel_bodies(wh, "t", ch))
        assert set(counts) == set(published)
        assert max(counts.values()) == 1
    client.close()


def test_an_empty_checkpoint_over_fanned_out_channels_is_refused(
    spark: SparkSession, server_factory: type[Server], tmp_path: Path
) -> None:
    """A new checkpoint numbers micro-batches from 0 again, and channels skip batch ids they
    already recorded: starting one over channels another run fed would drop new messages."""
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/topic/create", params={"topic": "t"}).status_code == 200
        assert c.post("/channel/create", params={"topic": "t", "channel": "c"}).status_code == 200
        assert c.post("/pub", params={"topic": "t"}, content=b"first").text == "OK"
        run_once(spark, wh)
        assert c.post("/pub", params={"topic": "t"}, content=b"second").text == "OK"
    with pytest.raises(ForeignCheckpointError, match="channel t/c holds fanout batches up to 0"):
        start_fanout(spark, Warehouse(str(wh)), once=True, checkpoint=str(tmp_path / "new"))
    assert channel_bodies(wh, "t", "c") == [b"first"]
    run_once(spark, wh)  # the checkpoint it ran with goes on where it stopped
    assert channel_bodies(wh, "t", "c") == [b"first", b"second"]
