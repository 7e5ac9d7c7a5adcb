"""The sweep's marks: planning trusts them only while they describe the state tables."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from deltalake import DeltaTable, write_deltalake
from pyspark.sql import SparkSession

from bench.synthetic import register, write_messages
from queue_engine.spark.sweep import plan, sweep
from queue_engine.store.tables import Mark, Warehouse, load_marks, marks_url, read_meta


def test_planning_trusts_a_mark_only_while_its_state_version_is_the_newest(
    spark: SparkSession, tmp_path: Path
) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    for topic in ("t1", "t2"):
        register(wh, topic, "c")
        write_messages(wh, topic, "c", 10)
    sweep(spark, wh)
    states = {t: wh.channel_state_path(t, "c") for t in ("t1", "t2")}
    marks = load_marks(wh.root)
    assert {k: m.meta for k, m in marks.items()} == {
        (t, "c"): read_meta(path) for t, path in states.items()
    }
    # Marks altered behind the sweep's back: planning takes them as they are (no table read).
    url = Path(marks_url(wh.root))
    body = json.loads(url.read_text())
    for row in body["channels"]:
        row[4]["deltaq.finished_requeues"] = "99"
    url.write_text(json.dumps(body))
    now = time.time_ns() // 1000
    plans, _ = plan(wh, now, force=True, marks=load_marks(wh.root))
    assert {p.topic: p.meta.finished_requeues for p in plans if p.meta} == {"t1": 99, "t2": 99}
    # Another commit on t2's state table: its mark no longer describes it, the table is read.
    rows = DeltaTable(states["t2"]).to_pyarrow_table()
    write_deltalake(states["t2"], rows.slice(0, 0), mode="append")
    plans, _ = plan(wh, now, force=True, marks=load_marks(wh.root))
    assert {p.topic: p.meta.finished_requeues for p in plans if p.meta} == {"t1": 99, "t2": 0}


def test_a_channel_created_again_is_not_planned_from_the_old_ones_mark(
    spark: SparkSession, tmp_path: Path
) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    write_messages(wh, "t", "c", 10)
    sweep(spark, wh)
    marks = load_marks(wh.root)
    mark = marks[("t", "c")]
    # The same name, created later (the marks say an older channel of that name).
    marks[("t", "c")] = Mark(
        mark.created_at_us - 1, dataclasses.replace(mark.meta, finished_requeues=7)
    )
    plans, _ = plan(wh, time.time_ns() // 1000, force=True, marks=marks)
    assert [p.meta.finished_requeues for p in plans if p.meta] == [0]
    assert marks[("t", "c")].created_at_us == mark.created_at_us
