"""The fanout job: NSQ's rules for which channel gets what, and exactly once across crashes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from queue_engine.spark.fanout_loop import FanoutLoop
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
    try:
        table = DeltaTable(str(path))
    except TableNotFoundError:  # a channel being deleted or created has a log with no commit yet
        return []
    return sorted(table.to_pyarrow_table()["body"].to_pylist())


def batch_notes(warehouse: Path, topic: str, channel: str) -> list[dict[str, int]]:
    """What the fanout recorded with each commit of a filtered channel's table, oldest first."""
    path = warehouse / "channels" / topic / channel / "messages"
    history = reversed(DeltaTable(str(path)).history())
    return [json.loads(h["userMetadata"]) for h in history if h.get("userMetadata")]


def channel_frame(
    spark: SparkSession, warehouse: Path, topic: str, channel: str, *, typed: bool = False
) -> DataFrame:
    """A channel table's rows as a Spark DataFrame (read by delta-rs); ``typed``: a typed
    topic's channel, its fields as columns and no headers (Spark cannot compare maps)."""
    path = warehouse / "channels" / topic / channel / "messages"
    table = DeltaTable(str(path)).to_pyarrow_table()
    if typed:
        table = table.drop_columns(["headers"])
        return spark.createDataFrame(table.to_pylist(), from_arrow_schema(table.schema))
    rows = table.to_pylist()
    for row in rows:
        row["headers"] = None if row["headers"] is None else dict(row["headers"])
    return spark.createDataFrame(rows, from_arrow_schema(CHANNEL_MESSAGES_SCHEMA))


def loop_once(warehouse: Path) -> Moved:
    """One one-shot fanout without Spark (what a local ``deltaq fanout`` and ``deltaq up``
    run), in this process."""
    loop = FanoutLoop(Warehouse(str(warehouse)), once=True).start()
    assert loop.awaitTermination(300)
    assert loop.exception() is None, loop.exception()
    return loop.moved


def run_once(spark: SparkSession, warehouse: Path, channel_format: str | None = None) -> Moved:
    """One one-shot fanout: ``channel_format`` "loop" is ``loop_once``, else Spark's query
    writing with that format."""
    if channel_format == "loop":
        return loop_once(warehouse)
    query = start_fanout(spark, Warehouse(str(warehouse)), once=True, channel_format=channel_format)
    assert query.awaitTermination(300), "the one-shot fanout did not end within 300 s"
    assert query.exception() is None
    return moved_by(query)


# "loop": the fanout without Spark, in the process (a local master's); None: Spark's query,
# its driver reading each batch's rows and appending them through delta-rs; "deltaq": Spark's
# writer with delta-spark's txnAppId/txnVersion options (the path "delta" takes where
# delta-spark's jars load).
WRITE_PATHS = ["loop", None, "deltaq"]


@pytest.mark.parametrize("channel_format", WRITE_PATHS, ids=["loop", "driver", "spark-writer"])
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
    # Topic o: typed; its fields are columns of the channel rows, and a filter reads them.
    post("/topic/create", topic="o", schema="sku STRING, amount DOUBLE, qty INT")
    post("/channel/create", topic="o", channel="all")
    big = "amount >= 10 AND sku LIKE 'A%' OR qty IN (1, 2)"
    post("/channel/create", topic="o", channel="big", filter=big)
    orders = [
        {"sku": "A-1", "amount": 12.5},
        {"sku": "A-2", "amount": 9.99, "qty": 3},
        {"sku": "B-1", "amount": 100, "qty": 2},
        {"sku": "A-3"},
        {"amount": 10},
        {"sku": "A-4", "amount": 1e6, "qty": 1},
    ]
    lines = b"\n".join(json.dumps(o).encode() for o in orders)
    assert c.post("/mpub", params={"topic": "o"}, content=lines).text == "OK"

    # Acknowledged once journaled: the fanout reads them once their topics' commits follow.
    for topic in ("a", "e", "o"):
        server.topic_table(topic)
    moved = run_once(spark, wh, channel_format)
    assert channel_bodies(wh, "a", "c1") == [b"a0", b"a1", b"a1b", b"a2"]
    # The one-shot run's progress counts the rows it read: a's four, e's two (its emptied row
    # is read too, and routed nowhere) and o's six; b (paused) and n (no channel) wait.
    assert moved.batches >= 1 and moved.rows == 12, moved
    # Each Spark trigger that ran a batch is logged whole, from Spark's progress event (which
    # reaches the listener shortly after the query ends).
    trigger = re.compile(r"fanout trigger \d+: \d+ ms \(latestOffset \d+, addBatch \d+, ")
    deadline = time.monotonic() + 10
    while channel_format != "loop" and not any(
        trigger.match(r.getMessage()) for r in caplog.records
    ):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.1)
    assert channel_bodies(wh, "a", "c2") == [b"a2"]
    assert channel_bodies(wh, "b", "b1") == []
    assert channel_bodies(wh, "e", "first") == [b"e1"]
    assert not (wh / "channels" / "n").exists()
    typed = DeltaTable(str(wh / "channels" / "o" / "all" / "messages")).to_pyarrow_table()
    assert sorted(typed.select(["sku", "amount", "qty"]).to_pylist(), key=str) == sorted(
        [{"sku": None, "amount": None, "qty": None} | o for o in orders], key=str
    )
    assert_df_equality(
        channel_frame(spark, wh, "o", "big", typed=True),
        channel_frame(spark, wh, "o", "all", typed=True).filter(F.expr(big)),
        ignore_row_order=True,
    )
    assert channel_bodies(wh, "o", "big") == sorted(
        json.dumps(o).encode() for o in (orders[0], orders[2], orders[5])
    )
    # What the filter kept out is recorded with the channel's commits: three of six.
    assert sum(n["deltaq.kept_out"] for n in batch_notes(wh, "o", "big")) == 3

    # A batch the filter keeps wholly out of a channel is still committed there: no rows, its
    # count, and the topic version it reached.
    small = json.dumps({"sku": "Z-1", "amount": 1}).encode()
    assert c.post("/pub", params={"topic": "o"}, content=small).text == "OK"
    post("/topic/unpause", topic="b")
    post("/channel/delete", topic="a", channel="c2")
    pub("a", "a3")
    post("/channel/create", topic="n", channel="late")  # first channel: gets the buffered n0
    post("/channel/create", topic="a", channel="c3")
    pub("a", "a4")
    # A filtered channel gets the rows its filter holds for, as Spark's own filter.
    eu = "headers['region'] = 'eu'"
    post("/channel/create", topic="e", channel="eu", filter=eu)
    # Headers go along with their message on every path.
    for body, region in (("e2", "eu"), ("e3", "us")):
        r = c.post(
            "/pub",
            params={"topic": "e", "envelope": "json"},
            content=json.dumps({"body": body, "headers": {"region": region}}).encode(),
        )
        assert r.text == "OK"
    pub("e", "e4")
    for topic in ("a", "b", "e", "n", "o"):
        server.topic_table(topic)
    run_once(spark, wh, channel_format)
    start = RegistryReader(Warehouse(str(wh)).registry_path).get().topics["e"].channels["eu"]
    everything = channel_frame(spark, wh, "e", "first")
    # In id order (Spark cannot sort by a map column, as chispa's ignore_row_order would).
    assert_df_equality(
        channel_frame(spark, wh, "e", "eu").orderBy("id"),
        everything.filter(F.expr(f"topic_version > {start.start_version} AND ({eu})")).orderBy(
            "id"
        ),
    )
    assert everything.count() == 4
    rows = DeltaTable(str(wh / "channels" / "e" / "first" / "messages")).to_pyarrow_table()
    assert sorted(zip(rows["body"].to_pylist(), rows["headers"].to_pylist(), strict=True)) == [
        (b"e1", None),
        (b"e2", [("region", "eu")]),
        (b"e3", [("region", "us")]),
        (b"e4", None),
    ]
    assert channel_bodies(wh, "b", "b1") == [b"b0"]
    assert channel_bodies(wh, "a", "c1") == [b"a0", b"a1", b"a1b", b"a2", b"a3", b"a4"]
    assert not (wh / "channels" / "a" / "c2").exists()  # deleted channels receive nothing
    assert channel_bodies(wh, "a", "c3") == [b"a4"]
    assert channel_bodies(wh, "n", "late") == [b"n0"]
    assert len(channel_bodies(wh, "o", "big")) == 3
    last = batch_notes(wh, "o", "big")[-1]
    assert last == {
        "deltaq.kept_out": 1,
        "deltaq.topic_version": DeltaTable(str(wh / "topics" / "o")).version(),
    }

    # Running again with nothing new writes nothing twice.
    assert run_once(spark, wh, channel_format).rows == 0
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
    created: set[tuple[str, int, int]] = set()
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


# ``python -m jobs.fanout`` as a user runs it, but its first append of rows to channel y
# writes the file argv[1] names and waits to be killed: a SIGKILL then lands in a batch whose
# other channels may have committed and y has not. Everything else is the real run.
STOPPED_FANOUT = """
import runpy, sys, time
from queue_engine.spark.fanout_stream import ChannelSinks
marker, append = sys.argv[1], ChannelSinks.append
def stopped(self, topic, channel, rows, *args, **kwargs):
    if channel.name == "y" and rows.num_rows:
        open(marker, "w").close()
        time.sleep(3600)
    return append(self, topic, channel, rows, *args, **kwargs)
ChannelSinks.append = stopped
sys.argv = ["fanout", *sys.argv[2:]]
runpy.run_module("jobs.fanout", run_name="__main__")
"""


def _fanout_process(
    warehouse: Path, *extra: str, stopped_at: Path | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(warehouse.parent / "fanout.log", "ab")  # noqa: SIM115 - owned by the child
    command = [sys.executable, "-m", "jobs.fanout"]
    if stopped_at is not None:
        command = [sys.executable, "-c", STOPPED_FANOUT, str(stopped_at)]
    return subprocess.Popen(
        [*command, "--warehouse", str(warehouse), *extra],
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
    # A filtered channel: the even messages, each once, across the kill.
    even = {"topic": "t", "channel": "even", "filter": "headers['parity'] = 'even'"}
    assert client.post("/channel/create", params=even).status_code == 200

    published: list[bytes] = []
    stop = threading.Event()

    def publish() -> None:
        n = 0
        while not stop.is_set() and n < 400:
            batch = [f"m{n + i}".encode() for i in range(25)]
            lines = [
                json.dumps(
                    {"body": body.decode(), "headers": {"parity": ("even", "odd")[(n + i) % 2]}}
                ).encode()
                for i, body in enumerate(batch)
            ]
            r = client.post(
                "/mpub", params={"topic": "t", "envelope": "json"}, content=b"\n".join(lines)
            )
            assert r.text == "OK"
            published.extend(batch)
            n += 25
            time.sleep(0.02)

    stopped_at = tmp_path / "stopped"
    fanout = _fanout_process(wh, stopped_at=stopped_at)
    publisher = threading.Thread(target=publish)
    publisher.start()
    # Killed in a batch: channel y's append reached (and held), channel x's committed.
    deadline = time.monotonic() + 120
    while not (stopped_at.exists() and channel_bodies(wh, "t", "x")):
        assert fanout.poll() is None, (wh.parent / "fanout.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (wh.parent / "fanout.log").read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(fanout.pid, signal.SIGKILL)
    fanout.wait(30)
    assert len(channel_bodies(wh, "t", "y")) < len(channel_bodies(wh, "t", "x"))
    publisher.join(60)
    stop.set()
    assert len(published) == 400
    server.topic_table("t")  # every acknowledged publish committed to the topic

    rerun = _fanout_process(wh, "--once")
    assert rerun.wait(300) == 0, (wh.parent / "fanout.log").read_text()[-3000:]
    # A one-shot run ends with its progress line: it moved the rest.
    done = re.search(
        r"fanout: done, \d+ batches, ([\d,]+) messages", (wh.parent / "fanout.log").read_text()
    )
    assert done and int(done.group(1).replace(",", "")) > 0
    for ch in ("x", "y"):
        counts = Counter(channel_bodies(wh, "t", ch))
        assert set(counts) == set(published)
        assert max(counts.values()) == 1
    counts = Counter(channel_bodies(wh, "t", "even"))
    assert set(counts) == {b for b in published if int(b[1:]) % 2 == 0}
    assert max(counts.values()) == 1
    client.close()


def test_a_fanout_killed_before_its_first_commit_entry_runs_that_batch_again_once(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """A kill -9 after the first batch's offsets and channel rows, before Spark's commit log
    had an entry (or a directory): the restart runs batch 0 again, which the channel skips by
    its txn, and goes on."""
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/topic/create", params={"topic": "t"}).is_success
        assert c.post("/channel/create", params={"topic": "t", "channel": "x"}).is_success
        assert c.post("/mpub", params={"topic": "t"}, content=b"a\nb\nc").text == "OK"
        server.topic_table("t")
        loop_once(wh)
        assert channel_bodies(wh, "t", "x") == [b"a", b"b", b"c"]
        checkpoint = wh / "_checkpoints" / "fanout"
        assert (checkpoint / "offsets" / "0").exists()
        shutil.rmtree(checkpoint / "commits")  # what the kill left: no commit log yet
        loop_once(wh)
        assert channel_bodies(wh, "t", "x") == [b"a", b"b", b"c"]
        assert (checkpoint / "commits" / "0").exists()
        assert c.post("/pub", params={"topic": "t"}, content=b"d").text == "OK"
        server.topic_table("t")
        loop_once(wh)
        assert channel_bodies(wh, "t", "x") == [b"a", b"b", b"c", b"d"]


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
        server.topic_table("t")  # committed, not only acknowledged
        run_once(spark, wh)
        assert c.post("/pub", params={"topic": "t"}, content=b"second").text == "OK"
        server.topic_table("t")
    with pytest.raises(ForeignCheckpointError, match="channel t/c holds fanout batches up to 0"):
        start_fanout(spark, Warehouse(str(wh)), once=True, checkpoint=str(tmp_path / "new"))
    assert channel_bodies(wh, "t", "c") == [b"first"]
    run_once(spark, wh)  # the checkpoint it ran with goes on where it stopped
    assert channel_bodies(wh, "t", "c") == [b"first", b"second"]


def test_spark_and_the_loop_resume_each_others_checkpoint_exactly_once(
    spark: SparkSession, server_factory: type[Server], tmp_path: Path
) -> None:
    """The loop keeps Spark's checkpoint format: a warehouse moved between a local fanout and a
    cluster's resumes where the other stopped, including a batch logged and not committed
    (left by a crash), which the resuming side runs again and every channel skips."""
    wh = tmp_path / "wh"
    server = server_factory(wh).start()
    client = httpx.Client(base_url=server.url, timeout=30)
    for path in ("/topic/create", "/channel/create"):
        assert client.post(path, params={"topic": "t", "channel": "c"}).status_code == 200
    published: list[bytes] = []

    def publish(n: int) -> None:
        bodies = [f"m{len(published) + i}".encode() for i in range(n)]
        assert client.post("/mpub", params={"topic": "t"}, content=b"\n".join(bodies)).text == "OK"
        published.extend(bodies)
        server.topic_table("t")  # committed, not only acknowledged

    checkpoint = wh / "_checkpoints" / "fanout"

    def last(log: str) -> int:
        return max(int(p.name) for p in (checkpoint / log).iterdir() if p.name.isdigit())

    def crash_before_commit() -> int:
        """Batch N's rows are in the channel; its commit never made it. Returns N."""
        n = last("commits")
        (checkpoint / "commits" / str(n)).unlink()
        (checkpoint / "commits" / f".{n}.crc").unlink(missing_ok=True)
        return n

    def crash_after_logging_offsets() -> None:
        """Batch N+1's offsets are logged (up to the topic's newest version); no channel has
        its rows yet: whoever resumes must run exactly that batch."""
        n = last("offsets")
        lines = (checkpoint / "offsets" / str(n)).read_text().split("\n")
        offset = json.loads(lines[2])
        offset["t"][1] = DeltaTable(str(wh / "topics" / "t")).version()
        body = "\n".join([lines[0], lines[1], json.dumps(offset)])
        (checkpoint / "offsets" / str(n + 1)).write_text(body)

    # Spark's uncommitted batch is run again by the loop, the loop's by Spark; then each
    # runs the batch the other logged and never began.
    steps = ["spark", "loop", "spark", "loop", "spark"]
    rerun: int | None = None
    for i, path in enumerate(steps):
        publish(3)
        if i >= 3:
            crash_after_logging_offsets()
        run_once(spark, wh, None if path == "spark" else "loop")
        assert Counter(channel_bodies(wh, "t", "c")) == Counter(published), (i, path)
        if rerun is not None:
            assert (checkpoint / "commits" / str(rerun)).exists(), (i, path, rerun)
            rerun = None
        if i < 2:
            rerun = crash_before_commit()
    # Every batch logged was committed in the end, none twice over.
    committed = sorted(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    assert committed == list(range(last("offsets") + 1))
    assert len(committed) >= len(steps)
    client.close()
