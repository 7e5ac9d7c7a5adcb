"""The deltaq Python Data Source against direct delta-rs reads, on real tables in tmp_path."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from queue_engine.message import LANES
from queue_engine.spark.fanout_stream import channel_format_for
from queue_engine.spark.session import Engine, engine, read_format
from queue_engine.store.delta import LocalAppender, append_once, open_or_create
from queue_engine.store.tables import TOPIC_SCHEMA, Warehouse
from queue_engine.store.tables.topic_writer import _Publish, _to_arrow


def batch(n: int, first: int, body: bytes = b"b") -> pa.Table:
    """``n`` messages, the ``first``-th to the ``first + n - 1``-th of lane 0 (ids LANES apart)."""
    return _to_arrow(
        [
            _Publish(
                [body + str(first + i).encode() for i in range(n)],
                n,
                time.time_ns() // 1000,
                None,
                # Every other message with headers: the map column is read as written.
                headers=[{"i": str(first + i)} if i % 2 else None for i in range(n)],
            )
        ],
        first * LANES,
        n,
    )


def make_topic(path: Path, commits: int, per_commit: int = 3) -> LocalAppender:
    open_or_create(str(path), TOPIC_SCHEMA)
    appender = LocalAppender(str(path))
    for i in range(commits):
        appender.append(batch(per_commit, i * per_commit))
    return appender


def expected(spark: SparkSession, table: pa.Table) -> DataFrame:
    rows = table.to_pylist()
    for row in rows:
        row["headers"] = None if row["headers"] is None else dict(row["headers"])
    return spark.createDataFrame(rows, schema=from_arrow_schema(TOPIC_SCHEMA)).orderBy("id")


def topics_with_a_channel(wh: Warehouse, names: list[str]) -> dict[str, LocalAppender]:
    """Topics ``names``, each with channel ``c`` and one commit of 3 rows: their appenders."""
    from queue_engine.registry import Action, RegistryEvent
    from queue_engine.store.tables import RegistryStore

    registry = RegistryStore(wh.registry_path)
    appenders = {}
    for seq, name in enumerate(names):
        registry.append(RegistryEvent(2 * seq + 1, 0, Action.TOPIC_CREATE, name))
        registry.append(
            RegistryEvent(2 * seq + 2, 0, Action.CHANNEL_CREATE, name, "c", topic_version=-1)
        )
        appenders[name] = make_topic(Path(wh.topic_path(name)), commits=1)
    return appenders


def test_delta_spark_is_on_the_sessions_classpath(spark: SparkSession) -> None:
    # delta-spark's jars come from Maven Central (Ivy's cache) like any user's session.
    assert engine(spark) is Engine.DELTA_SPARK
    assert read_format(spark) == "delta"
    assert spark.conf.get("spark.sql.extensions") == "io.delta.sql.DeltaSparkSessionExtension"
    # On a local master the fanout appends channel rows from the driver unless told otherwise
    # (on a cluster the executors write them: tests/acceptance/test_spark_cluster.py).
    assert channel_format_for(spark) is None
    assert channel_format_for(spark, "delta") == "delta"
    assert channel_format_for(spark, "deltaq") == "deltaq"
    with pytest.raises(ValueError, match="one of auto, driver, delta, deltaq"):
        channel_format_for(spark, "parquet")
    # Sized for two local cores: Delta's snapshots and VACUUM's listing (10,000 tasks by
    # default: a VACUUM of a small table took over a minute).
    assert spark.conf.get("spark.databricks.delta.snapshotPartitions") == "2"
    assert spark.conf.get("spark.sql.sources.parallelPartitionDiscovery.parallelism") == "2"


def test_local_jvm_runs_with_the_quick_compiler_and_the_serial_collector(
    spark: SparkSession,
) -> None:
    # The C2-off option is what brought the fanout's p99 under 1 s on two cores, the serial
    # collector what saves G1's threads: they must reach the JVM that PySpark launches, not
    # just sit in the SparkConf.
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    management = jvm.java.lang.management.ManagementFactory
    arguments = list(management.getRuntimeMXBean().getInputArguments())
    assert "-XX:TieredStopAtLevel=1" in arguments
    collectors = {bean.getName() for bean in management.getGarbageCollectorMXBeans()}
    assert collectors == {"Copy", "MarkSweepCompact"}, collectors  # the serial collector's


def test_batch_read_equals_delta_rs(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    make_topic(path, commits=10)
    df = spark.read.format("deltaq").option("filesPerPartition", "3").load(str(path))
    assert df.rdd.getNumPartitions() == 4  # 10 files, 3 per partition
    direct = DeltaTable(str(path)).to_pyarrow_table()
    # In id order: Spark cannot sort by a map column, as chispa's ignore_row_order would.
    assert_df_equality(df.orderBy("id"), expected(spark, direct), ignore_nullable=True)


def test_a_filtered_read_gives_exact_rows(spark: SparkSession, tmp_path: Path) -> None:
    """The source pushes no filter down (source.py): Spark filters the rows it reads."""
    path = tmp_path / "t"
    make_topic(path, commits=10)
    cut = f"{0x11 * LANES:016x}"  # the 18th message on
    df = spark.read.format("deltaq").load(str(path)).where(F.col("id") >= cut)
    direct = DeltaTable(str(path)).to_pyarrow_dataset().to_table(filter=ds.field("id") >= cut)
    assert direct.num_rows == 13
    # In id order: Spark cannot sort by a map column, as chispa's ignore_row_order would.
    assert_df_equality(df.orderBy("id"), expected(spark, direct), ignore_nullable=True)


def test_a_filtered_query_does_not_narrow_later_queries_of_the_same_frame(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark 4.2 reuses a reader that had filters pushed into it; the source pushes none."""
    path = tmp_path / "t"
    make_topic(path, commits=4)
    ids = sorted(DeltaTable(str(path)).to_pyarrow_table()["id"].to_pylist())
    df = spark.read.format("deltaq").load(str(path))
    assert df.where(F.col("id") >= ids[10]).count() == 2
    assert df.count() == 12
    df.createOrReplaceTempView("narrowing")
    narrowed = spark.sql(f"SELECT count(*) AS n FROM narrowing WHERE id < '{ids[3]}'").first()
    assert narrowed is not None and narrowed["n"] == 3
    everything = spark.sql("SELECT count(*) AS n FROM narrowing").first()
    assert everything is not None and everything["n"] == 12


def test_sql_view_over_the_source(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    make_topic(path, commits=4)
    spark.sql(f"CREATE OR REPLACE TEMP VIEW topic_t USING deltaq OPTIONS (path '{path}')")
    assert spark.sql("SELECT count(*) AS n FROM topic_t").first()["n"] == 12  # type: ignore[index]


def _stream_collect(spark: SparkSession, path: Path, checkpoint: Path) -> list[str]:
    """Run the stream once (availableNow); return the ids it delivered."""
    seen: list[str] = []

    def collect(df: DataFrame, batch_id: int) -> None:
        seen.extend(r["id"] for r in df.select("id").collect())

    q = (
        spark.readStream.format("deltaq")
        .option("maxFilesPerTrigger", "4")
        .load(str(path))
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    return seen


def test_stream_reads_only_new_rows_through_compaction_and_checkpoints(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = tmp_path / "t"
    appender = make_topic(path, commits=10)
    checkpoint = tmp_path / "cp"
    first = _stream_collect(spark, path, checkpoint)
    assert len(first) == 30
    # Compaction rewrites the same rows (dataChange=false) and a checkpoint folds the log:
    # neither may be delivered again.
    DeltaTable(str(path)).optimize.compact()
    DeltaTable(str(path)).create_checkpoint()
    appender.reopen()
    for i in range(10, 15):
        appender.append(batch(3, i * 3))
    DeltaTable(str(path)).optimize.compact()
    second = _stream_collect(spark, path, checkpoint)
    assert sorted(second) == [f"{i * LANES:016x}" for i in range(30, 45)]
    assert len(set(first) | set(second)) == 45
    assert _stream_collect(spark, path, checkpoint) == []


def test_batch_writer_appends(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    open_or_create(str(path), TOPIC_SCHEMA)
    df = expected(spark, batch(5, 0))
    df.write.format("deltaq").mode("append").save(str(path))
    df.write.format("deltaq").mode("append").save(str(path))
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 10
    df.write.format("deltaq").mode("overwrite").save(str(path))
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 5
    # Tasks write data files into the table itself; nothing is staged beside it.
    assert not list(path.glob("_staged*")) and not list(path.glob(".*.tmp"))


def test_batch_writer_takes_delta_sparks_idempotent_write_options(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = tmp_path / "t"
    open_or_create(str(path), TOPIC_SCHEMA)
    rows = expected(spark, batch(4, 0))

    def write(df: DataFrame, version: int) -> None:
        (
            df.write.format("deltaq")
            .mode("append")
            .option("txnAppId", "app")
            .option("txnVersion", str(version))
            .save(str(path))
        )

    write(rows, 7)
    write(rows, 7)  # a replay: skipped
    write(rows, 3)  # older: skipped
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 4
    # The skipped writes' data files are removed again: only the table's own files remain.
    on_disk = {p.name for p in path.glob("*.parquet")}
    assert on_disk == {Path(f).name for f in DeltaTable(str(path)).file_uris()}
    write(rows.limit(0), 8)  # no rows: still recorded
    assert DeltaTable(str(path)).transaction_version("app") == 8
    write(rows, 9)
    assert sorted(DeltaTable(str(path)).to_pyarrow_table()["id"].to_pylist()) == sorted(
        batch(4, 0)["id"].to_pylist() * 2
    )
    # delta-spark's session extension checks the pair first, for every format, with its words.
    with pytest.raises(Exception, match=r"txnAppId and txnVersion go together|Both txnVersion"):
        rows.write.format("deltaq").mode("append").option("txnAppId", "app").save(str(path))


def test_stream_writer_is_idempotent_per_batch(spark: SparkSession, tmp_path: Path) -> None:
    source = tmp_path / "src"
    make_topic(source, commits=6)
    sink = tmp_path / "sink"
    open_or_create(str(sink), TOPIC_SCHEMA)
    q = (
        spark.readStream.format("deltaq")
        .option("maxFilesPerTrigger", "2")
        .load(str(source))
        .writeStream.format("deltaq")
        .option("path", str(sink))
        .option("appId", "copy")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    table = DeltaTable(str(sink))
    assert table.to_pyarrow_table().num_rows == 18
    last = table.transaction_version("copy")
    # Versions 0 (the table's creation, no file) to 6 (one append, one file, each), at most
    # two versions a micro-batch: batches 0 to 3.
    assert last == 3
    # A replayed batch (same app id and batch id) is not written again.
    assert append_once(str(sink), batch(3, 999), "copy", last) is False
    assert DeltaTable(str(sink)).to_pyarrow_table().num_rows == 18
    assert append_once(str(sink), batch(3, 999), "copy", last + 1) is True
    assert DeltaTable(str(sink)).to_pyarrow_table().num_rows == 21


def test_delta_rs_and_fast_path_tables_read_alike(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    open_or_create(str(path), TOPIC_SCHEMA)
    write_deltalake(str(path), batch(4, 0), mode="append")
    LocalAppender(str(path)).append(batch(4, 4))
    df = spark.read.format("deltaq").load(str(path))
    direct = DeltaTable(str(path)).to_pyarrow_table()
    assert direct.num_rows == 8
    # In id order: Spark cannot sort by a map column, as chispa's ignore_row_order would.
    assert_df_equality(df.orderBy("id"), expected(spark, direct), ignore_nullable=True)


def test_the_driver_reads_a_batch_from_its_offsets_as_the_stream_tasks_do(tmp_path: Path) -> None:
    """The fanout's driver reads a micro-batch from the offsets Spark logged; the rows are the
    ones Spark's tasks would read for the same offsets, in the same order, and a later batch
    starts where the earlier one ended."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from queue_engine.registry import Action, RegistryEvent
    from queue_engine.spark.source import TopicsBatchReader, TopicsStreamReader
    from queue_engine.store.tables import RegistryStore, Warehouse

    wh = Warehouse(str(tmp_path / "wh"))
    registry = RegistryStore(wh.registry_path)
    registry.append(RegistryEvent(1, 0, Action.TOPIC_CREATE, "t"))
    registry.append(RegistryEvent(2, 0, Action.CHANNEL_CREATE, "t", "c", topic_version=-1))
    topic = make_topic(Path(wh.topic_path("t")), commits=4, per_commit=3)  # 12 rows
    stream = TopicsStreamReader(wh.root, 256, 200, 200_000, min_partitions=2)
    driver = TopicsBatchReader(wh.root)

    def by_tasks(start: dict[str, list[int]], end: dict[str, list[int]]) -> pa.Table:
        batches = [b for p in stream.partitions(start, end) for b in stream.read(p)]
        return pa.Table.from_batches(batches)

    start = stream.initialOffset()
    first = stream.latestOffset(start, ReadAllAvailable())
    rows = driver.rows(start, first)
    assert rows.num_rows == 12
    assert rows.equals(by_tasks(start, first))
    assert set(rows["topic"].to_pylist()) == {"t"}

    topic.append(batch(3, 100))
    second = stream.latestOffset(first, ReadAllAvailable())
    later = driver.rows(first, second)
    assert later["id"].to_pylist() == batch(3, 100)["id"].to_pylist()
    assert later.equals(by_tasks(first, second))
    # An empty batch (a replay of nothing new) reads nothing.
    assert driver.rows(second, second).num_rows == 0


def test_over_many_topics_a_trigger_probes_the_noticed_ones_and_a_slice_of_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from queue_engine.spark import source
    from queue_engine.store.tables import (
        NoticeWriter,
        Warehouse,
        topic_notice_writer,
    )

    # 5 topics count as many here; new notice writers are looked for on every trigger.
    monkeypatch.setattr(source, "PROBE_ALL_TOPICS", 2)
    monkeypatch.setattr(source, "NOTICE_WRITERS_S", 0.0)
    wh = Warehouse(str(tmp_path / "wh"))
    names = [f"t{i}" for i in range(5)]
    appenders = topics_with_a_channel(wh, names)
    reader = source.TopicsStreamReader(wh.root, 256, 200, 200_000)

    def versions(end: dict[str, list[int]]) -> dict[str, int]:
        return {name: version for name, (_, version) in end.items()}

    first = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
    assert versions(first) == dict.fromkeys(names, 1)  # the first trigger probes every topic

    appenders["t3"].append(batch(3, 100))  # version 2, and no API node says so
    second = reader.latestOffset(first, ReadAllAvailable())
    assert versions(second)["t3"] == 1  # not probed: this trigger's slice was t0

    NoticeWriter(wh.root, topic_notice_writer(None)).post([("t3", "")])
    third = reader.latestOffset(second, ReadAllAvailable())
    assert versions(third)["t3"] == 2  # named in a notice: probed

    appenders["t4"].append(batch(3, 200))
    later = third
    for _ in range(len(names)):  # the slices come round to every topic
        later = reader.latestOffset(later, ReadAllAvailable())
    assert versions(later) == {**dict.fromkeys(names, 1), "t3": 2, "t4": 2}


def test_a_trigger_file_budget_goes_round_the_topics(tmp_path: Path) -> None:
    """Busy topics early in name order cannot keep a later one's rows waiting: once a
    trigger's budget runs out, the next begins after the last topic it reached."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

    from queue_engine.spark.source import TopicsStreamReader
    from queue_engine.store.tables import Warehouse

    wh = Warehouse(str(tmp_path / "wh"))
    names = ["a", "b", "c"]
    appenders = topics_with_a_channel(wh, names)
    reader = TopicsStreamReader(wh.root, 256, 2, 200_000)
    end = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
    reached: dict[str, list[int]] = {name: [] for name in names}
    for trigger in range(6):
        for name in ("a", "b"):  # always more than a trigger's budget of 2 files
            for _ in range(3):
                appenders[name].append(batch(1, 100 * trigger))
        if trigger == 0:
            appenders["c"].append(batch(1, 1000))
        begin, end = end, reader.latestOffset(end, ReadMaxFiles(2))
        for name in names:
            if end[name][1] > begin[name][1]:
                reached[name].append(trigger)
        assert sum(end[n][1] - begin[n][1] for n in names) <= 2
    # Each topic gets its turn: "c", last in name order, within the first three triggers.
    assert reached["c"] and reached["c"][0] <= 2, reached
    assert reached["a"] and reached["b"], reached
