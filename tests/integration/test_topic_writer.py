"""The group-commit writer and both append paths, on real Delta tables in tmp_path."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.json_columns import MIN_ROWS
from queue_engine.store.delta import (
    DeltaRsAppender,
    LocalAppender,
    WriterClosedError,
    appender_for,
    conform,
    open_or_create,
)
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    COLUMNS,
    TOPIC_SCHEMA,
    ChannelReader,
    TopicWriter,
)
from queue_engine.store.upkeep import (
    Maintenance,
    MaintenancePolicy,
    MaintenanceProcessError,
    maintenance,
)
from queue_engine.topic_schema import TopicSchema, parse_schema


class Results:
    """Collects writer notifications; lets a test wait for a number of tokens."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: dict[Any, BaseException | None] = {}

    def __call__(self, tokens: list[Any], error: BaseException | None) -> None:
        with self.cond:
            for t in tokens:
                self.done[t] = error
            self.cond.notify_all()

    def wait(self, count: int, timeout: float = 30) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= count, timeout)


def now_us() -> int:
    return time.time_ns() // 1000


@pytest.mark.parametrize("fast", [True, False], ids=["local-fast-path", "delta-rs"])
def test_group_commit_batches_and_keeps_everything(tmp_path: Path, fast: bool) -> None:
    results = Results()
    path = str(tmp_path / "t")
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20, fast_appends=fast)
    for i in range(200):
        writer.submit_publish([f"m{i}-a".encode(), f"m{i}-b".encode()], now_us(), None, i)
    results.wait(200)
    writer.close()
    assert all(e is None for e in results.done.values())
    table = DeltaTable(path).to_pyarrow_table()
    assert table.num_rows == 400
    ids = table["id"].to_pylist()
    assert len(set(ids)) == 400
    stats = writer.stats()
    assert stats.message_count == 400 and stats.committed_bytes == sum(
        len(b) for b in table["body"].to_pylist()
    )
    # Submissions that arrive during a commit share the next one.
    assert stats.commits < 200
    # Ids increase in publish order within the table: by id, the bodies as published.
    in_id_order = table.sort_by("id")["body"].to_pylist()
    assert in_id_order == [f"m{i}-{s}".encode() for i in range(200) for s in "ab"]


def test_stats_count_every_message_while_it_moves_from_the_queue_to_the_table(
    tmp_path: Path,
) -> None:
    """Topic depth is committed + queued messages: a message leaving the queue for its commit
    must be counted on one side or the other at every moment."""
    results = Results()
    writer = TopicWriter(str(tmp_path / "t"), results, commit_max_bytes=64)
    total = 40
    for i in range(total):
        writer.submit_publish([f"m{i:04}".encode() * 8], now_us(), None, i)
    seen: list[int] = []
    while len(results.done) < total:
        stats = writer.stats()
        seen.append(stats.message_count + stats.queued)
    writer.close()
    assert writer.stats().message_count == total
    assert len(seen) > 100 and set(seen) == {total}, sorted(set(seen))[:5]


def test_deliver_at_and_mixed_batches(tmp_path: Path) -> None:
    results = Results()
    path = str(tmp_path / "t")
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    t0 = now_us()
    writer.submit_publish([b"now"], t0, None, "a")
    writer.submit_publish([b"later1", b"later2"], t0, t0 + 5_000_000, "b")
    results.wait(2)
    writer.close()
    rows = {r["body"]: r for r in DeltaTable(path).to_pyarrow_table().to_pylist()}
    assert rows[b"now"]["deliver_at"] is None
    for key in (b"later1", b"later2"):
        assert (rows[key]["deliver_at"] - rows[key]["published_at"]).total_seconds() == 5.0


@pytest.mark.parametrize("fast", [True, False], ids=["local-fast-path", "delta-rs"])
def test_a_table_from_before_the_later_columns_gains_them_and_old_rows_read_null(
    tmp_path: Path, fast: bool
) -> None:
    """Tables written before expires_at, to_channel, replay_of and headers: the writers add
    them when they open them; old files read them as null through every reader (Delta, the
    channel reader, the Spark source's file reads)."""
    ts = pa.timestamp("us", "UTC")
    # The first release's columns; the later ones (expires_at, to_channel, replay_of) come last.
    old_topic = pa.schema(list(TOPIC_SCHEMA)[:4])
    old_channel = pa.schema(list(CHANNEL_MESSAGES_SCHEMA)[:5])
    topic, channel = str(tmp_path / "topic"), str(tmp_path / "channel")
    old_row = {
        "id": ["0000000000000001"],
        "body": [b"old"],
        "published_at": pa.array([1], pa.int64()).cast(ts),
        "deliver_at": pa.nulls(1, ts),
    }
    write_deltalake(topic, pa.table(old_row).cast(old_topic))
    write_deltalake(channel, pa.table({**old_row, "topic_version": [0]}).cast(old_channel))

    results = Results()
    writer = TopicWriter(topic, results, commit_max_bytes=1 << 20, fast_appends=fast)
    t0 = now_us()
    writer.submit_publish([b"new"], t0, None, "a", t0 + 2_000_000, headers=[{"k": "v"}])
    results.wait(1)
    writer.close()
    assert results.done["a"] is None
    dt = DeltaTable(topic)
    assert pa.schema(dt.schema().to_arrow()).names == TOPIC_SCHEMA.names
    rows = {r["body"]: r for r in dt.to_pyarrow_table().to_pylist()}
    assert rows[b"old"]["expires_at"] is None
    assert (rows[b"old"]["headers"], rows[b"new"]["headers"]) == (None, [("k", "v")])
    assert (rows[b"new"]["expires_at"] - rows[b"new"]["published_at"]).total_seconds() == 2.0

    new = conform(
        DeltaTable(topic)
        .to_pyarrow_table(filters=[("body", "=", b"new")])
        .append_column("topic_version", pa.array([1], pa.int64())),
        CHANNEL_MESSAGES_SCHEMA,
    )
    open_or_create(channel, CHANNEL_MESSAGES_SCHEMA)
    appender_for(channel).append(new)
    reader = ChannelReader(channel)
    paths = reader.snapshot()
    tables = []
    while (part := reader.read(10)) is not None:
        assert part.column_names == COLUMNS
        tables.append(part)
    read = pa.concat_tables(tables)
    expiries = dict(zip(read["body"].to_pylist(), read["expires_at"].to_pylist(), strict=True))
    assert expiries[b"old"] is None and expiries[b"new"] == rows[b"new"]["expires_at"]
    headers = dict(zip(read["body"].to_pylist(), read["headers"].to_pylist(), strict=True))
    assert headers == {b"old": None, b"new": [("k", "v")]}
    both = ChannelReader.read_ids(paths, ["0000000000000001", new["id"][0].as_py()])
    assert sorted(both["expires_at"].to_pylist(), key=str) == sorted(
        [None, rows[b"new"]["expires_at"]], key=str
    )


def test_reopened_writer_continues_ids_above_existing(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    results = Results()
    w1 = TopicWriter(path, results, commit_max_bytes=1 << 20)
    w1.submit_publish([b"x"] * 10, now_us(), None, 1)
    results.wait(1)
    w1.close()
    first_max = max(DeltaTable(path).to_pyarrow_table()["id"].to_pylist())
    w2 = TopicWriter(path, results, commit_max_bytes=1 << 20)
    assert w2.stats().message_count == 10
    w2.submit_publish([b"y"], now_us(), None, 2)
    results.wait(2)
    w2.close()
    table = DeltaTable(path).to_pyarrow_table()
    new_id = next(r["id"] for r in table.to_pylist() if r["body"] == b"y")
    assert new_id > first_max


def test_a_failing_batch_commits_nothing_and_later_batches_succeed(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    writer.submit_publish([b"ok1"], now_us(), None, "ok1")
    results.wait(1)
    version = DeltaTable(path).version()
    blocker = Path(path) / "_delta_log" / f"{version + 1:020d}.json"
    blocker.mkdir()
    writer.submit_publish([b"lost1", b"lost2"], now_us(), None, "bad")
    results.wait(2)
    assert results.done["bad"] is not None
    blocker.rmdir()
    writer.submit_publish([b"ok2"], now_us(), None, "ok2")
    results.wait(3)
    writer.close()
    assert results.done["ok2"] is None
    assert sorted(DeltaTable(path).to_pyarrow_table()["body"].to_pylist()) == [b"ok1", b"ok2"]
    with pytest.raises(WriterClosedError):
        writer.submit_publish([b"z"], now_us(), None, "z")


def test_commit_max_bytes_splits_batches(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=100)
    for i in range(10):
        writer.submit_publish([b"x" * 60], now_us(), None, i)
    results.wait(10)
    writer.close()
    # No commit carries more than max bytes unless a single publish alone exceeds it.
    assert writer.stats().commits == 10


def _batch(n: int, first: int = 0) -> pa.Table:
    from queue_engine.message import LANES
    from queue_engine.store.tables.topic_writer import _Publish, _to_arrow

    # Ids of one lane are LANES apart: the n-th block of ids starts at first * LANES.
    return _to_arrow([_Publish([b"b"] * n, n, now_us(), None)], first * LANES, n)


def test_local_appender_races_with_delta_rs_writers_and_compaction(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    errors: list[BaseException] = []
    # delta-rs gives up after 15 lost races by default; 60 appends in a tight loop can win 15
    # in a row on a loaded machine. What is tested is that every writer's rows land intact.
    retries = CommitProperties(max_commit_retries=1_000)

    def other_writer() -> None:
        try:
            dt = DeltaTable(path)
            for i in range(30):
                batch = _batch(3, 1_000_000 + i * 3)
                write_deltalake(dt, batch, mode="append", commit_properties=retries)
        except BaseException as exc:
            errors.append(exc)

    def compactor() -> None:
        # delta-rs's optimize gives up after 15 lost races whatever the commit properties
        # say: a compaction that lost is tried again, as deltaq's upkeep does.
        done = 0
        try:
            for _ in range(100):
                try:
                    DeltaTable(path).optimize.compact(commit_properties=retries)
                except CommitFailedError:
                    continue
                done += 1
                if done == 5:
                    return
                time.sleep(0.05)
            raise AssertionError(f"only {done} of 5 compactions committed in 100 tries")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=other_writer), threading.Thread(target=compactor)]
    for t in threads:
        t.start()
    versions = [fast.append(_batch(2, i * 2)) for i in range(60)]
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(versions)) == 60
    table = DeltaTable(path).to_pyarrow_table()
    assert table.num_rows == 60 * 2 + 30 * 3
    assert len(set(table["id"].to_pylist())) == table.num_rows


def test_local_appender_output_has_exact_stats(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    LocalAppender(path).append(_batch(5, 0x10))  # ids 0x100, 0x110, ... 0x140
    actions = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    assert len(actions) == 1
    a = actions[0]
    assert a["num_records"] == 5
    assert (a["min.id"], a["max.id"]) == ("0000000000000100", "0000000000000140")
    # Stats are used for skipping: a filter must see exactly the matching rows.
    import pyarrow.dataset as ds

    dataset = DeltaTable(path).to_pyarrow_dataset()
    assert dataset.to_table(filter=ds.field("id") >= "0000000000000130").num_rows == 2


def test_appenders_record_the_app_transaction_in_the_same_commit(tmp_path: Path) -> None:
    from deltalake.transaction import Transaction

    from queue_engine.store.delta import IdempotentAppender

    for kind, make in (("fast", LocalAppender), ("delta-rs", DeltaRsAppender)):
        path = str(tmp_path / kind)
        open_or_create(path, CHANNEL_MESSAGES_SCHEMA)
        rows = _batch(3, 0x20).append_column("topic_version", pa.array([7, 8, 9], pa.int64()))
        version = make(path).append(conform(rows, CHANNEL_MESSAGES_SCHEMA), Transaction("app", 41))
        dt = DeltaTable(path)
        assert dt.version() == version
        assert dt.transaction_version("app") == 41
        add = pa.table(dt.get_add_actions(flatten=True)).to_pylist()[0]
        # The restart skips channel files by their topic_version bounds.
        assert (add["min.topic_version"], add["max.topic_version"]) == (7, 9)
        # A new appender reads the recorded batch and skips it and anything older.
        again = IdempotentAppender(path, "app")
        assert again.append(conform(rows, CHANNEL_MESSAGES_SCHEMA), 41) is False
        assert again.append(conform(rows, CHANNEL_MESSAGES_SCHEMA), 40) is False
        assert again.append(conform(rows, CHANNEL_MESSAGES_SCHEMA), 42) is True
        assert DeltaTable(path).to_pyarrow_table().num_rows == 6


def test_fast_path_only_for_plain_local_tables(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    assert isinstance(appender_for(path), LocalAppender)
    assert isinstance(appender_for(path, allow_fast=False), DeltaRsAppender)
    cdf = str(tmp_path / "cdf")
    DeltaTable.create(
        cdf, schema=TOPIC_SCHEMA, configuration={"delta.enableChangeDataFeed": "true"}
    )
    assert isinstance(appender_for(cdf), DeltaRsAppender)


def _policy(**changes: Any) -> MaintenancePolicy:
    """Upkeep that is due after 5 commits; compaction only past 1,000 small files unless
    ``changes`` say otherwise."""
    base = MaintenancePolicy(
        checkpoint_interval_commits=5,
        compact_min_small_files=1_000,
        compact_target_file_bytes=1 << 20,
        compact_interval_s=0,
        vacuum_retention_hours=168,
        vacuum_interval_s=3600,
        interval_ms=10,
        checkpoint_min_interval_s=0.0,  # due on commit count alone
    )
    return dataclasses.replace(base, **changes)


def test_maintenance_checkpoints_compacts_and_keeps_old_versions_readable(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    for i in range(30):
        fast.append(_batch(2, i * 2))
    old_version = 10
    old_rows = DeltaTable(path, version=old_version).to_pyarrow_table().num_rows
    reopened: list[str] = []
    m = Maintenance(
        _policy(compact_min_small_files=10, vacuum_interval_s=0), on_checkpoint=reopened.append
    )
    m.upkeep(path)
    assert m.compactions == 1 and m.checkpoints == 1 and m.vacuums == 1 and reopened == [path]
    dt = DeltaTable(path)
    assert len(dt.file_uris()) == 1
    assert dt.to_pyarrow_table().num_rows == 60
    assert (Path(path) / "_delta_log" / "_last_checkpoint").exists()
    # Vacuum ran (interval 0) but kept the compacted-away files: a lagging reader still reads.
    assert DeltaTable(path, version=old_version).to_pyarrow_table().num_rows == old_rows
    # Appends go on after compaction and checkpoint.
    fast.reopen()
    fast.append(_batch(1, 1000))
    assert DeltaTable(path).to_pyarrow_table().num_rows == 61


def test_an_unchanged_table_is_vacuumed_again_only_once_its_removals_matured(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    fast.append(_batch(1, 0))
    kept = Maintenance(_policy(vacuum_interval_s=0))
    for _ in range(3):
        kept.upkeep(path)
    # Vacuumed once for the change; then nothing new until a week after it.
    assert kept.vacuums == 1
    fast.append(_batch(1, 1))
    kept.upkeep(path)
    assert kept.vacuums == 2

    matured = Maintenance(_policy(vacuum_interval_s=0, vacuum_retention_hours=0))
    for _ in range(4):
        matured.upkeep(path)
    # Once for the change, once when its removals passed the (zero) retention, then no more.
    assert matured.vacuums == 2


def test_live_files_replayed_from_the_log_are_delta_rs_own(tmp_path: Path) -> None:
    from queue_engine.store.delta import live_files

    def same() -> None:
        replayed = live_files(path)
        assert replayed is not None
        assert sorted(replayed) == sorted(DeltaTable(path).file_uris())

    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    same()  # no data file yet
    fast = LocalAppender(path)
    for i in range(12):
        fast.append(_batch(2, i * 2))
    write_deltalake(path, _batch(1, 100), mode="append")
    same()
    # Compaction removes the small files for one; the checkpoint then holds the adds.
    m = Maintenance(_policy(compact_min_small_files=10))
    m.upkeep(path)
    assert m.compactions == 1 and m.checkpoints == 1
    same()
    fast.reopen()
    for i in range(3):
        fast.append(_batch(1, 200 + i))
    DeltaTable(path).delete("id = '" + DeltaTable(path).to_pyarrow_table()["id"][0].as_py() + "'")
    same()
    assert live_files("s3://bucket/t") is None
    assert live_files(str(tmp_path / "missing")) is None


def test_checkpoints_wait_for_the_minimum_interval(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    m = Maintenance(_policy(checkpoint_min_interval_s=3600))
    for round_ in range(3):
        for i in range(10):
            fast.append(_batch(1, round_ * 10 + i))
        m.upkeep(path)
    # Due by commits every round, but only the first round is past the minimum interval.
    assert m.checkpoints == 1
    assert DeltaTable(path).to_pyarrow_table().num_rows == 30


def test_a_commit_missing_from_a_listing_for_a_moment_is_listed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory listed while commit files are renamed into it can show version n+1 and not
    n: opening the table for upkeep lists again rather than failing the round; a gap that
    stays is still an error."""
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    for i in range(3):
        fast.append(_batch(1, i))
    commit = Path(path) / "_delta_log" / f"{2:020d}.json"
    aside = tmp_path / "aside.json"
    commit.rename(aside)
    # Back 60 ms later; listings 50 ms apart, as many as a slow machine needs to see it.
    monkeypatch.setattr(maintenance, "_GAP_RETRIES", 200)
    threading.Timer(0.06, aside.rename, args=(commit,)).start()
    assert maintenance._open(path).version() == 3
    commit.rename(aside)
    monkeypatch.setattr(maintenance, "_GAP_RETRIES", 3)
    with pytest.raises(DeltaError, match="gap"):
        maintenance._open(path)


def test_messages_through_a_version_before_and_after_reopening(tmp_path: Path) -> None:
    """The count behind the topic depth: messages in the table as of a version, for versions
    this writer committed and for older ones (read from the commit log after a restart)."""
    path = str(tmp_path / "t")
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    sizes = [3, 1, 4, 1, 5]
    for i, n in enumerate(sizes):
        writer.submit_publish([b"x"] * n, now_us(), None, i)
        results.wait(i + 1)  # one commit each
    versions = [writer.stats().version - len(sizes) + 1 + i for i in range(len(sizes))]
    writer.close()
    cumulative = [sum(sizes[: i + 1]) for i in range(len(sizes))]

    done = Results()
    again = TopicWriter(path, done, commit_max_bytes=1 << 20)
    try:
        assert again.messages_through(-1) == 0
        assert [again.messages_through(v) for v in versions] == cumulative
        assert again.messages_through(versions[0] - 1) == 0  # the table's creation
        again.submit_publish([b"y"] * 7, now_us(), None, "late")
        # The writer counts a commit before it notifies: its stats hold the seven now.
        done.wait(1)
        assert done.done == {"late": None}
        assert again.stats().message_count == 21
        newest = again.stats().version
        assert again.messages_through(newest) == 21
        assert again.messages_through(newest - 1) == 14
    finally:
        again.close()


def test_maintenance_in_a_child_process_does_the_same_and_outlives_its_child(
    tmp_path: Path,
) -> None:
    """Upkeep done by the maintenance process: the same checkpoint and compaction, reported
    back (the table handle is reopened); a child killed mid-life is replaced (at most one
    round fails), and stopping ends it."""
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    fast = LocalAppender(path)
    for i in range(30):
        fast.append(_batch(2, i * 2))
    reopened: list[str] = []
    m = Maintenance(
        _policy(compact_min_small_files=10), on_checkpoint=reopened.append, in_process=False
    )
    try:
        m.upkeep(path)
        child = m.last_upkeep_pid
        assert child is not None and child != os.getpid()
        assert m.compactions == 1 and m.checkpoints == 1 and m.vacuums == 1 and reopened == [path]
        dt = DeltaTable(path)
        assert len(dt.file_uris()) == 1 and dt.to_pyarrow_table().num_rows == 60
        assert (Path(path) / "_delta_log" / "_last_checkpoint").exists()
        # Set up as the serving process is: pandas and numpy left out (it compacted meanwhile).
        mapped = Path(f"/proc/{child}/maps").read_text()
        assert "pandas" not in mapped and "numpy" not in mapped
        resident = m.process_resident_bytes()
        assert resident is not None and 10 * 2**20 < resident < 1024 * 2**20

        os.kill(child, signal.SIGKILL)
        fast.reopen()
        for i in range(10):
            fast.append(_batch(1, 100 + i))
        try:
            m.upkeep(path)  # a new child if the dead one was seen gone, else this round fails
        except MaintenanceProcessError:
            m.upkeep(path)  # ... and the next starts one
        assert m.last_upkeep_pid not in (None, child, os.getpid())
        assert m.checkpoints == 2
    finally:
        m.stop()
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(m.last_upkeep_pid, 0)
    assert m.process_resident_bytes() is None


@pytest.mark.parametrize("fast", [True, False], ids=["local-fast-path", "delta-rs"])
def test_typed_columns_and_a_column_left_by_a_schema_never_recorded(
    tmp_path: Path, fast: bool
) -> None:
    """A declare adds its fields' columns before the schema is recorded: if the record never
    happens, the column stays. Appends without that field fill it with nulls (delta-rs refuses
    an append lacking a column), and a later declare giving it another type is refused."""
    results = Results()
    path = str(tmp_path / "t")
    schema: list[TopicSchema | None] = [None]
    writer = TopicWriter(
        path, results, commit_max_bytes=1 << 20, fast_appends=fast, schema_of=lambda: schema[0]
    )
    writer.declare(parse_schema("sku STRING, qty INT"))  # its record "never happened"
    writer.submit_publish([b'{"sku": "a", "qty": 1}'], now_us(), None, "untyped")
    results.wait(1)
    schema[0] = parse_schema("sku STRING")
    writer.submit_publish([b'{"sku": "b", "qty": 2}'], now_us(), None, "typed")
    results.wait(2)
    assert results.done == {"untyped": None, "typed": None}
    with pytest.raises(QueueError) as refused:
        writer.declare(parse_schema("sku STRING, qty BIGINT"))
    assert refused.value.code is ErrorCode.SCHEMA_CHANGE_REFUSED
    assert refused.value.detail.startswith("field qty: the topic's table has a column qty")
    writer.declare(parse_schema("sku STRING, qty INT, size STRING"))  # as the table has it
    writer.close()
    rows = DeltaTable(path).to_pyarrow_table(columns=["body", "sku", "qty", "size"]).to_pylist()
    assert sorted(rows, key=lambda r: r["body"]) == [
        {"body": b'{"sku": "a", "qty": 1}', "sku": None, "qty": None, "size": None},
        {"body": b'{"sku": "b", "qty": 2}', "sku": "b", "qty": None, "size": None},
    ]


@pytest.mark.parametrize("rows_each", [3, 100])
def test_publishes_checked_and_others_share_one_commits_columns_in_order(
    tmp_path: Path, rows_each: int
) -> None:
    """A commit's columns, in row order, whether every publish was checked against the
    schema (Arrow's JSON reader converts them: 600 rows) or only some were (a recovered
    journal's, a replay's: all converted by msgspec)."""
    results = Results()
    path = str(tmp_path / "t")
    schema = parse_schema("n BIGINT, s STRING")
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20, schema_of=lambda: schema)
    publishes = [
        [b'{"n": %d, "s": "%d"}' % (i * 1000 + j, i) for j in range(rows_each)] for i in range(6)
    ]
    # Every publish waits for the same commit: the first drain lingers a minute, and closing
    # the writer drains what is pending at once, in one commit.
    writer.linger = lambda idle: 60.0
    for i, bodies in enumerate(publishes):
        checked = schema if i % 2 or rows_each >= MIN_ROWS / 6 else None
        writer.submit_publish(bodies, now_us(), None, i, checked=checked)
    assert results.done == {}
    writer.close()
    results.wait(6)
    assert writer.stats().commits == 1
    table = DeltaTable(path).to_pyarrow_table().sort_by("id")
    want = [(i * 1000 + j, str(i)) for i in range(6) for j in range(rows_each)]
    assert list(zip(table["n"].to_pylist(), table["s"].to_pylist(), strict=True)) == want
