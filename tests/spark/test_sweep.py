"""The sweep job on local Spark: the same fold as Python, incremental, and safe to kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from bench.synthetic import register, write_deliveries, write_messages
from queue_engine.spark import sweep as sweep_module
from queue_engine.spark.sweep import (
    BACKLOG_PACE_FACTOR,
    FOLD_PEAK_BYTES_PER_ROW,
    LOCAL_FOLD_MAX_ROWS,
    LOCAL_MASTER_FOLD_MAX_ROWS,
    driver_fold_rows,
    plan,
    sweep,
)
from queue_engine.spark.views import register_views
from queue_engine.state_fold import FINISHED
from queue_engine.store.tables import LEDGER_SCHEMA, Warehouse, read_meta
from queue_engine.store.upkeep import Maintenance, MaintenancePolicy
from tests.conftest import ROOT
from tests.ledgers import BASE_US, Channel, channels, comparable, python_fold, rows_as_states


def write_channel(wh: Warehouse, topic: str, name: str, channel: Channel) -> None:
    register(wh, topic, name)
    write_deltalake(wh.channel_messages_path(topic, name), channel.messages(), mode="append")
    write_deltalake(
        wh.channel_ledger_path(topic, name), channel.ledger().cast(LEDGER_SCHEMA), mode="append"
    )


def state_rows(wh: Warehouse, topic: str, name: str) -> pa.Table:
    table = DeltaTable(wh.channel_state_path(topic, name)).to_pyarrow_table()
    return table.append_column("swept_timeout", pa.array([False] * table.num_rows))


def ledger_rows(
    ids: pa.ChunkedArray, event: str, attempts: pa.ChunkedArray, at: int, leases: object = None
) -> pa.Table:
    """Ledger rows of one kind, as the API or a sweep would append them (at, at+1, ...)."""
    n = len(ids)
    ts = pa.timestamp("us", tz="UTC")
    return pa.Table.from_pydict(
        {
            "id": ids,
            "event": [event] * n,
            "attempt": attempts,
            "lease": leases if leases is not None else pa.nulls(n, pa.string()),
            "lease_expires_at": pa.nulls(n, ts),
            "deliver_at": pa.nulls(n, ts),
            "consumer": pa.nulls(n, pa.string()),
            "at": pa.array([at + i for i in range(n)]).cast(ts),
        },
        schema=LEDGER_SCHEMA,
    )


def status_counts(state: pa.Table) -> dict[str, int]:
    return dict(Counter(state["status"].to_pylist()))


def timeouts_written(wh: Warehouse, topic: str, name: str) -> list[str]:
    ledger = DeltaTable(wh.channel_ledger_path(topic, name)).to_pyarrow_table()
    swept = ledger.filter(pc.equal(ledger["event"], "TIMEOUT"))
    return sorted(swept["id"].to_pylist())


@given(st.lists(channels(max_events=50), min_size=1, max_size=3), st.integers(0, 600))
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_spark_sweep_agrees_with_the_python_fold(
    spark: SparkSession, chans: list[Channel], later: int
) -> None:
    """One Spark job over several random channels: every channel's state is the Python fold."""
    wh = Warehouse(tempfile.mkdtemp(prefix="sweep-prop-"))
    # Only TIMEOUT-free histories, so the ledger's own TIMEOUTs and the sweep's can be told
    # apart when checking what the sweep appended.
    for i, chan in enumerate(chans):
        chan.events = [e for e in chan.events if e.kind != "TIMEOUT"]
        write_channel(wh, "t", f"c{i}", chan)
    now = BASE_US + later
    report = sweep(spark, wh, now=now, local_max_rows=0)  # a Spark job, however small
    assert report.channels_swept == len(chans) and report.folded_on == "spark"
    for i, chan in enumerate(chans):
        expected = comparable(python_fold(chan, now))
        live = {k: v for k, v in expected.items() if v[0] != FINISHED}
        got = comparable(rows_as_states(state_rows(wh, "t", f"c{i}")))
        # swept_timeout is not stored: compare it through the TIMEOUT events appended.
        assert {k: v[:-1] for k, v in got.items()} == {k: v[:-1] for k, v in live.items()}
        swept = sorted(k for k, v in expected.items() if v[-1])
        assert timeouts_written(wh, "t", f"c{i}") == swept


# 0: folded by a Spark job; the default: these few rows are folded on the driver.
FOLD_PATHS = pytest.mark.parametrize(
    ("local_max_rows", "folded_on"), [(0, "spark"), (LOCAL_FOLD_MAX_ROWS, "driver")]
)


def test_the_driver_folds_what_half_the_available_memory_holds_on_a_local_master() -> None:
    gib = 2**30
    assert driver_fold_rows(False, available_bytes=64 * gib) == LOCAL_FOLD_MAX_ROWS
    assert driver_fold_rows(True, available_bytes=64 * gib) == LOCAL_MASTER_FOLD_MAX_ROWS
    assert driver_fold_rows(True, available_bytes=gib) == gib // (2 * FOLD_PEAK_BYTES_PER_ROW)
    assert driver_fold_rows(True, available_bytes=0) == LOCAL_FOLD_MAX_ROWS


def test_a_local_master_folds_a_consumed_backlog_on_the_driver_as_spark_would(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Past LOCAL_FOLD_MAX_ROWS rows, a sweep on a local master still folds on the driver (a
    Spark job would run on the same cores at several times the cost), and its state and
    TIMEOUTs are the Spark job's for the same warehouse at the same time."""
    wh = Warehouse(str(tmp_path / "driver"))
    register(wh, "t", "c")
    n = LOCAL_FOLD_MAX_ROWS + 5_000
    ids = write_messages(wh, "t", "c", n, rows_per_commit=10_000)
    write_deliveries(wh, "t", "c", ids[: n // 2], expired_fraction=0.1, rows_per_commit=10_000)
    # A consumed tail: FINs of the first 10,000 deliveries whose leases are live.
    ledger = DeltaTable(wh.channel_ledger_path("t", "c")).to_pyarrow_table()
    live = ledger.filter(pc.greater(ledger["lease_expires_at"], pa.scalar(datetime.now(UTC))))
    live = live.slice(0, 10_000)
    now = time.time_ns() // 1000
    fins = ledger_rows(live["id"], "FIN", live["attempt"], now, live["lease"])
    write_deltalake(wh.channel_ledger_path("t", "c"), fins, mode="append")
    by_spark = Warehouse(str(tmp_path / "spark"))
    shutil.copytree(wh.root, by_spark.root)
    at = now + 1_000
    driver = sweep(spark, wh, now=at)
    assert driver.folded_on == "driver"
    job = sweep(spark, by_spark, now=at, local_max_rows=0)
    assert job.folded_on == "spark"
    expired = (n // 2 + 9) // 10
    assert (driver.live, driver.timeouts, driver.finished) == (n - 10_000, expired, 10_000)
    assert (job.live, job.timeouts, job.finished) == (driver.live, driver.timeouts, driver.finished)
    order = [("id", "ascending")]
    assert (
        state_rows(wh, "t", "c").sort_by(order).to_pylist()
        == state_rows(by_spark, "t", "c").sort_by(order).to_pylist()
    )
    assert timeouts_written(wh, "t", "c") == timeouts_written(by_spark, "t", "c")


@FOLD_PATHS
def test_sweep_is_incremental_and_skips_unchanged_channels(
    spark: SparkSession, tmp_path: Path, local_max_rows: int, folded_on: str
) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    ids = write_messages(wh, "t", "c", 40, rows_per_commit=10)
    write_deliveries(wh, "t", "c", ids[:20], expired_fraction=0.25, rows_per_commit=10)
    first = sweep(spark, wh, local_max_rows=local_max_rows)
    assert (first.live, first.timeouts, first.finished) == (40, 5, 0)
    assert first.folded_on == folded_on
    # Nothing new, nothing due: skipped without a Spark job.
    assert plan(wh, time.time_ns() // 1000)[0] == []
    assert sweep(spark, wh).channels_skipped == 1
    # FIN five of the delivered messages whose leases are live, add ten rows.
    state = DeltaTable(wh.channel_state_path("t", "c")).to_pyarrow_table()
    in_flight = state.filter(pc.equal(state["status"], "in_flight")).slice(0, 5)
    now = time.time_ns() // 1000
    fins = ledger_rows(in_flight["id"], "FIN", in_flight["attempts"], now, in_flight["lease"])
    write_deltalake(wh.channel_ledger_path("t", "c"), fins, mode="append")
    write_messages(wh, "t", "c", 10, first_id=1000, rows_per_commit=10, topic_version=4)
    second = sweep(spark, wh, local_max_rows=local_max_rows)
    assert (second.live, second.timeouts, second.finished) == (45, 0, 5)
    assert second.folded_on == folded_on
    state = DeltaTable(wh.channel_state_path("t", "c")).to_pyarrow_table()
    assert not set(in_flight["id"].to_pylist()) & set(state["id"].to_pylist())
    # 20 never delivered + 5 timed out + 10 new are ready; 15 leases live, 5 of them FIN'd.
    assert status_counts(state) == {"ready": 35, "in_flight": 10}
    meta = read_meta(wh.channel_state_path("t", "c"))
    assert meta is not None and meta.finished_timeouts == 0 and meta.topic_version == 4
    assert sum(state["timeouts"].to_pylist()) == 5


def test_a_repeating_sweep_refolds_a_growing_backlog_only_as_often_as_its_cost_allows(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pace_backlog``: new messages alone (no ledger event, nothing due) wait for a refold
    until the channel's last sweep is BACKLOG_PACE_FACTOR times that sweep's duration old, when
    it took at least BACKLOG_PACE_MIN_S; a ledger event, or a one-shot sweep, folds at once."""
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    write_messages(wh, "t", "c", 40, rows_per_commit=10)
    assert sweep(spark, wh).live == 40
    meta = read_meta(wh.channel_state_path("t", "c"))
    assert meta is not None and meta.sweep_seconds > 0
    write_messages(wh, "t", "c", 10, first_id=1000, rows_per_commit=10, topic_version=4)
    soon = meta.swept_at_us + 1
    waited = BACKLOG_PACE_FACTOR * meta.sweep_seconds * 1e6
    almost, later = meta.swept_at_us + int(waited * 5 / 6), meta.swept_at_us + int(waited) + 1
    # A fast sweep (below BACKLOG_PACE_MIN_S) is never paced.
    monkeypatch.setattr(sweep_module, "BACKLOG_PACE_MIN_S", meta.sweep_seconds + 0.001)
    assert len(plan(wh, soon, pace_backlog=True)[0]) == 1
    monkeypatch.setattr(sweep_module, "BACKLOG_PACE_MIN_S", 0.0)
    assert plan(wh, soon, pace_backlog=True) == ([], 1)
    assert plan(wh, almost, pace_backlog=True) == ([], 1)
    assert len(plan(wh, soon)[0]) == 1
    assert len(plan(wh, later, pace_backlog=True)[0]) == 1
    # A state stamped ahead of the sweep's clock paces nothing.
    assert len(plan(wh, meta.swept_at_us - 1, pace_backlog=True)[0]) == 1
    paced = sweep(spark, wh, now=soon, pace_backlog=True)
    assert (paced.channels_swept, paced.channels_skipped) == (0, 1)
    # A delivery is a ledger event: folded at once, with the new messages.
    [delivered] = write_messages(wh, "t", "c", 1, first_id=2000, rows_per_commit=1)
    write_deliveries(wh, "t", "c", [delivered], expired_fraction=0.0, rows_per_commit=1)
    folded = sweep(spark, wh, now=soon, pace_backlog=True)
    assert (folded.channels_swept, folded.live) == (1, 51)


# ``deltaq sweep`` as a user runs it, but stopped where the sweep calls one function of
# queue_engine.spark.sweep (argv[1]): the call writes the file argv[2] names and waits to be
# killed, so a SIGKILL lands at a point the test knows. Everything before it is the real run.
STOPPED_SWEEP = """
import runpy, sys, time
import queue_engine.spark.sweep as sweep
function, marker = sys.argv[1], sys.argv[2]
def stopped(*args, **kwargs):
    open(marker, "w").close()
    time.sleep(3600)
setattr(sweep, function, stopped)
sys.argv = ["deltaq", *sys.argv[3:]]
runpy.run_module("deltaq", run_name="__main__")
"""


def kill_sweep_at(wh: Warehouse, function: str, tmp_path: Path) -> None:
    """``deltaq sweep --once``, SIGKILLed once it reached ``function``."""
    marker, log = tmp_path / f"reached-{function}", tmp_path / f"sweep-{function}.log"
    command = [sys.executable, "-c", STOPPED_SWEEP, function, str(marker)]
    command += ["sweep", "--once", "--warehouse", wh.root]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, f"ended before {function}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {function} in 240 s: {log.read_text()}"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
def test_sweep_killed_mid_run_then_rerun_applies_each_timeout_once(tmp_path: Path) -> None:
    """`deltaq sweep --once` SIGKILLed with the fold done and nothing committed, then between
    its TIMEOUT commit and its state commit; then a full run: the state is the fold of the
    ledger and no expired lease is timed out or counted twice."""
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    ids = write_messages(wh, "t", "c", 3000, rows_per_commit=500)
    expired = write_deliveries(wh, "t", "c", ids, expired_fraction=0.2, rows_per_commit=500)
    ledger, state_path = wh.channel_ledger_path("t", "c"), wh.channel_state_path("t", "c")
    before = DeltaTable(ledger).version()

    # Killed with every channel folded, as the commits begin: nothing written.
    kill_sweep_at(wh, "_commit_channel", tmp_path)
    assert DeltaTable(ledger).version() == before
    assert not DeltaTable.is_deltatable(state_path)
    # Killed after the ledger's TIMEOUT commit, before the state's: the TIMEOUTs alone.
    kill_sweep_at(wh, "write_state", tmp_path)
    assert DeltaTable(ledger).version() == before + 1
    swept = timeouts_written(wh, "t", "c")
    assert len(swept) == len(set(swept)) == expired
    assert not DeltaTable.is_deltatable(state_path)

    command = [sys.executable, "-m", "deltaq", "sweep", "--once", "--warehouse", wh.root]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    state = DeltaTable(state_path).to_pyarrow_table()
    assert state.num_rows == 3000
    assert sum(state["timeouts"].to_pylist()) == expired
    assert status_counts(state) == {"ready": expired, "in_flight": 3000 - expired}
    timed_out = state.filter(pc.equal(state["status"], "ready"))
    assert set(timed_out["timeouts"].to_pylist()) == {1}
    assert set(timed_out["attempts"].to_pylist()) == {1}
    assert sorted(timed_out["id"].to_pylist()) == swept
    # The killed run's TIMEOUTs were folded as they were: the full run appended none.
    assert timeouts_written(wh, "t", "c") == swept


def test_a_sweep_that_died_between_its_two_commits_is_completed_by_the_next(
    spark: SparkSession, tmp_path: Path
) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    ids = write_messages(wh, "t", "c", 100, rows_per_commit=100)
    write_deliveries(wh, "t", "c", ids, expired_fraction=0.5, rows_per_commit=100)
    # The TIMEOUT commit of a sweep that then died: the same events, no state written.
    ledger = DeltaTable(wh.channel_ledger_path("t", "c")).to_pyarrow_table()
    now = time.time_ns() // 1000
    expired = ledger.filter(pc.less(ledger["lease_expires_at"].cast(pa.int64()), now))
    n = expired.num_rows
    orphan = ledger_rows(expired["id"], "TIMEOUT", expired["attempt"], now)
    write_deltalake(wh.channel_ledger_path("t", "c"), orphan, mode="append")
    report = sweep(spark, wh)
    assert report.timeouts == 0  # already timed out by the orphaned commit
    state = DeltaTable(wh.channel_state_path("t", "c")).to_pyarrow_table()
    assert sum(state["timeouts"].to_pylist()) == n == 50


def test_the_sweep_compacts_small_files_without_changing_what_is_read(
    spark: SparkSession, tmp_path: Path
) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    ids = write_messages(wh, "t", "c", 60, rows_per_commit=5)  # 12 small files
    write_deliveries(wh, "t", "c", ids[:30], expired_fraction=0.1, rows_per_commit=5)
    policy = MaintenancePolicy(
        checkpoint_interval_commits=1,
        compact_min_small_files=5,
        compact_target_file_bytes=64 * 1024 * 1024,
        compact_interval_s=0,
        vacuum_retention_hours=168,
        vacuum_interval_s=3600,
        interval_ms=1000,
        checkpoint_min_interval_s=0.0,
    )
    report = sweep(spark, wh, maintenance=Maintenance(policy))
    for path in (wh.channel_messages_path("t", "c"), wh.channel_ledger_path("t", "c")):
        assert len(DeltaTable(path).file_uris()) == 1
    assert (
        sorted(DeltaTable(wh.channel_messages_path("t", "c")).to_pyarrow_table()["id"].to_pylist())
        == ids
    )
    # Compaction commits are not data changes: the next sweep has nothing to read but them.
    again = sweep(spark, wh, force=True)
    assert (again.live, again.timeouts) == (report.live, 0) == (60, 0)
    state = DeltaTable(wh.channel_state_path("t", "c")).to_pyarrow_table()
    assert status_counts(state) == {"ready": 33, "in_flight": 27}


def test_views_time_travel_to_an_earlier_sweep(spark: SparkSession, tmp_path: Path) -> None:
    wh = Warehouse(str(tmp_path / "wh"))
    register(wh, "t", "c")
    ids = write_messages(wh, "t", "c", 20, rows_per_commit=10)
    write_deliveries(wh, "t", "c", ids[:8], expired_fraction=0.5, rows_per_commit=10)
    sweep(spark, wh)
    # Delta commit timestamps are wall-clock milliseconds: step past this one.
    time.sleep(0.05)
    between = datetime.now(UTC)
    time.sleep(0.05)
    write_messages(wh, "t", "c", 5, first_id=100, rows_per_commit=5, topic_version=2)
    sweep(spark, wh)

    def stats(as_of: datetime | None) -> tuple[int, int, int, int]:
        register_views(spark, wh, as_of=as_of)
        [row] = spark.sql("SELECT * FROM queue_stats").collect()
        [n] = spark.sql("SELECT count(*) AS n FROM messages").collect()
        return row.depth, row.in_flight, row.timeouts, n.n

    # Then: 12 never delivered + 4 timed out ready, 4 in flight, 20 rows.
    assert stats(between) == (16, 4, 4, 20)
    assert stats(None) == (21, 4, 4, 25)
