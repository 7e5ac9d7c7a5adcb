"""Tables shared with another writer (delta-rs here; delta-spark in tests/spark): deltaq's
writers read every commit they skipped, its tailer tells rewrites from appends, retention and
compaction follow the protocol, and a table deltaq cannot keep working with is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from queue_engine.spark.source import _read_files
from queue_engine.store.delta import (
    AddedFilesCache,
    ConstraintViolation,
    DeltaRsAppender,
    LocalAppender,
    ProtocolChangedError,
    RefusedCommit,
    RemovalConflict,
    TableRefusedError,
    added_files,
    append_or_fall_back,
    commit_refusal,
    group_commit,
    open_or_create,
    protocol_refusal,
    removal_supported,
    remove_files,
    schema_refusal,
    unsupported_features,
)
from queue_engine.store.tables import TOPIC_SCHEMA, TopicWriter
from queue_engine.store.upkeep import RetentionReport, compact_small_files
from tests.integration.test_topic_writer import Results, now_us
from tests.spark.test_source import batch


def topic(tmp_path: Path, commits: int, per_commit: int = 3) -> tuple[str, LocalAppender]:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    appender = LocalAppender(path)
    for i in range(commits):
        appender.append(batch(per_commit, i * per_commit))
    return path, appender


def ids_of(files: list[str]) -> list[str]:
    return sorted(
        i for f in files for i in pa.parquet.read_table(f, columns=["id"])["id"].to_pylist()
    )


def read_ids(files: list[tuple[str, str | None, int, tuple[str, ...]]]) -> list[str]:
    batches = list(_read_files(files, TOPIC_SCHEMA, with_topic=False))
    return sorted(i for b in batches for i in b.column("id").to_pylist())


def commit_json(path: str, version: int) -> list[dict[str, object]]:
    with open(f"{path}/_delta_log/{version:020d}.json") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the writer reads every commit it skipped ----------------------------------------------


def test_a_constraint_added_before_a_checkpoint_is_honoured_after_it(tmp_path: Path) -> None:
    # Another writer adds a CHECK constraint, then a checkpoint: the fast appender reopens past
    # both, and must not go on writing blind appends that break the constraint.
    path, _ = topic(tmp_path, 2)
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    writer.submit_publish([b"before"], now_us(), None, "before")
    results.wait(1)
    # Every row so far passes it; every later publish breaks it.
    # (The later publishes say they were published two minutes from now.)
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 60))
    DeltaTable(path).alter.add_constraint({"published_before": f"published_at < '{now}'"})
    DeltaTable(path).create_checkpoint()
    writer.request_reopen()
    for i in range(5):
        later = now_us() + 120_000_000
        writer.submit_publish([f"after{i}".encode()], later, None, f"after{i}")
    results.wait(6)
    writer.close()
    assert results.done["before"] is None
    errors = [results.done[f"after{i}"] for i in range(5)]
    assert all(isinstance(e, ConstraintViolation) for e in errors), errors
    assert "published_before" in str(errors[0]) and now in str(errors[0])
    bodies = DeltaTable(path).to_pyarrow_table()["body"].to_pylist()
    assert b"before" in bodies and not any(b.startswith(b"after") for b in bodies)


def test_one_publish_breaking_a_constraint_does_not_fail_the_others(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    DeltaTable(path).alter.add_constraint({"not_x": "body <> 'x'"})
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    with writer.exclusive():  # all three land in one group commit
        for i, body in enumerate([b"ok1", b"x", b"ok2"]):
            writer.submit_publish([body], now_us(), None, i)
        time.sleep(0.05)
    results.wait(3)
    writer.close()
    assert results.done[0] is None and results.done[2] is None
    assert isinstance(results.done[1], ConstraintViolation)
    assert sorted(DeltaTable(path).to_pyarrow_table()["body"].to_pylist()) == [b"ok1", b"ok2"]


def test_a_reopen_past_a_property_change_judges_the_table_again(tmp_path: Path) -> None:
    path, appender = topic(tmp_path, 2)
    # A property change with no feature: still the fast appender, after reading it.
    DeltaTable(path).alter.set_table_properties({"delta.logRetentionDuration": "interval 2 days"})
    write_deltalake(path, batch(1, 100), mode="append")
    appender.reopen()
    chosen, version = append_or_fall_back(appender, path, batch(1, 200))
    assert isinstance(chosen, LocalAppender) and chosen is not appender
    assert version == DeltaTable(path).version()
    # A reopen to a version the caller read (the registry's way) reads the skipped commits too.
    DeltaTable(path).alter.set_table_properties({"delta.appendOnly": "true"})
    chosen.reopen(DeltaTable(path).version())
    again, _ = append_or_fall_back(chosen, path, batch(1, 300))
    assert again is not chosen
    assert DeltaTable(path).to_pyarrow_table().num_rows == 6 + 3


def test_a_log_cleaned_up_under_the_appender_makes_it_judge_again(tmp_path: Path) -> None:
    path, appender = topic(tmp_path, 2)
    write_deltalake(path, batch(1, 100), mode="append")  # version 3, unseen by the appender
    DeltaTable(path).create_checkpoint()
    Path(f"{path}/_delta_log/{3:020d}.json").unlink()  # as log cleanup would, past a checkpoint
    appender.reopen(3)
    with pytest.raises(ProtocolChangedError, match="gone from the log"):
        appender.append(batch(1, 200))
    # Judged again from the table as it is: a new appender takes the append.
    chosen, version = append_or_fall_back(appender, path, batch(1, 200))
    assert chosen is not appender and isinstance(chosen, LocalAppender)
    assert version == 4 == DeltaTable(path).version()


def test_features_delta_rs_cannot_write_refuse_the_table_by_name() -> None:
    assert protocol_refusal(None, ["inCommitTimestamp", "appendOnly"], 7) == "inCommitTimestamp"
    assert protocol_refusal(["deletionVectors"], ["deletionVectors"], 7) == "deletionVectors"
    assert protocol_refusal(None, ["appendOnly", "checkConstraints", "changeDataFeed"], 7) is None
    assert protocol_refusal(None, None, 2) is None
    assert unsupported_features(
        "Unsupported table features required: [DomainMetadata, RowTracking]"
    ) == ["domainMetadata", "rowTracking"]
    renamed = {"fields": [{"name": "body", "metadata": {"delta.columnMapping.physicalName": "c"}}]}
    same = {"fields": [{"name": "body", "metadata": {"delta.columnMapping.physicalName": "body"}}]}
    assert schema_refusal(renamed, "name") == "columnMapping"
    assert schema_refusal(same, "name") is None
    assert commit_refusal([{"add": {"path": "x", "deletionVector": {"storageType": "i"}}}]) == (
        "deletionVectors"
    )


def _protocol(path: str, version: int, writer_features: list[str]) -> None:
    """Commit ``version`` as another engine changing the table's protocol would."""
    protocol: dict[str, object] = {"minReaderVersion": 1, "minWriterVersion": 2}
    if writer_features:
        protocol = {"minReaderVersion": 1, "minWriterVersion": 7, "writerFeatures": writer_features}
    entry = [
        {"commitInfo": {"timestamp": 1, "operation": "SET TBLPROPERTIES"}},
        {"protocol": protocol},
    ]
    with open(f"{path}/_delta_log/{version:020d}.json", "x") as f:
        f.write("".join(json.dumps(a) + "\n" for a in entry))


def test_a_refused_table_answers_at_once_and_is_judged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another engine gives the table a feature delta-rs cannot write: the writer's next
    commit is refused naming it, the ones after it at once without touching the table, and
    once the table is judged again (every REJUDGE_REFUSED_S) without it, appends go on."""
    path, _ = topic(tmp_path, 1)
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    writer.submit_publish([b"a"], now_us(), None, "a")
    results.wait(1)
    assert results.done["a"] is None and DeltaTable(path).version() == 2
    _protocol(path, 3, ["inCommitTimestamp"])
    for n, token in enumerate(("b", "c"), start=2):
        writer.submit_publish([token.encode()], now_us(), None, token)
        results.wait(n)
        assert isinstance(results.done[token], TableRefusedError), results.done[token]
        assert "inCommitTimestamp" in str(results.done[token])
    assert DeltaTable(path).version() == 3  # nothing written
    assert writer.refusal() is not None  # judged again only REJUDGE_REFUSED_S later
    _protocol(path, 4, [])  # the feature dropped again
    assert writer.refusal() is not None
    monkeypatch.setattr(group_commit, "REJUDGE_REFUSED_S", 0.0)
    assert writer.refusal() is None
    writer.submit_publish([b"d"], now_us(), None, "d")
    results.wait(4)
    writer.close()
    assert results.done["d"] is None and DeltaTable(path).version() == 5
    bodies = DeltaTable(path).to_pyarrow_table(columns=["body"])["body"].to_pylist()
    assert b"a" in bodies and b"d" in bodies and b"b" not in bodies and b"c" not in bodies


# -- the tailer tells rewrites from appends --------------------------------------------------


def test_a_delete_after_the_reader_took_the_rows_adds_nothing_new(tmp_path: Path) -> None:
    path, _ = topic(tmp_path, 3)  # versions 1..3, three messages each
    taken = ids_of([f.path for f in added_files(path, 0, 3)])
    doomed = taken[4]
    DeltaTable(path).delete(f"id = '{doomed}'")  # rewrites version 2's file: version 4
    actions = commit_json(path, 4)
    assert any("remove" in a for a in actions) and any("add" in a for a in actions)
    assert added_files(path, 3, 4) == []
    LocalAppender(path).append(batch(2, 50))
    assert len(ids_of([f.path for f in added_files(path, 3, 5)])) == 2


def test_a_delete_before_the_reader_took_the_rows_is_never_read(tmp_path: Path) -> None:
    path, _ = topic(tmp_path, 3)
    everything = ids_of([f.path for f in added_files(path, 0, 3)])
    doomed = everything[4]
    DeltaTable(path).delete(f"id = '{doomed}'")
    files = added_files(path, 0, 4)
    assert ids_of([f.path for f in files]) == [i for i in everything if i != doomed]
    # A DELETE of a whole file (no survivors): that file is simply not read.
    whole = ids_of([f.path for f in added_files(path, 2, 3)])
    DeltaTable(path).delete(f"id >= '{whole[0]}' AND id <= '{whole[-1]}'")
    left = ids_of([f.path for f in added_files(path, 0, 5)])
    assert left == [i for i in everything if i != doomed and i not in whole]


def test_a_rewrite_of_read_and_unread_files_reads_only_the_unread_survivors(
    tmp_path: Path,
) -> None:
    path, _ = topic(tmp_path, 2)
    first = ids_of([f.path for f in added_files(path, 0, 1)])
    second = ids_of([f.path for f in added_files(path, 1, 2)])
    LocalAppender(path).append(batch(3, 10))  # version 3, the reader's next
    third = ids_of([f.path for f in added_files(path, 2, 3)])
    # One DELETE touching a file the reader took (version 1's) and one it has not (version 3's),
    # rewritten into one file by delta-rs.
    DeltaTable(path).delete(f"id = '{first[0]}' OR id = '{third[0]}'")
    files = added_files(path, 2, 4)  # the reader has read through version 2
    assert files and all(f.exclude_ids_of for f in files)
    got = read_ids([(f.path, None, f.version, f.exclude_ids_of) for f in files])
    assert got == third[1:]
    # Version 2's file, read before and untouched by the DELETE, is not read again.
    assert second and all(f.version != 2 for f in files)


def test_a_deletion_vector_stops_the_reader_right_before_it(tmp_path: Path) -> None:
    path, _ = topic(tmp_path, 2)
    # What delta-spark writes for a DELETE on a table with deletion vectors.
    file = DeltaTable(path).file_uris()[0].rsplit("/", 1)[1]
    entry = [
        {"commitInfo": {"timestamp": 1, "operation": "DELETE"}},
        {"remove": {"path": file, "dataChange": True, "deletionTimestamp": 1}},
        {
            "add": {
                "path": file,
                "size": 1,
                "partitionValues": {},
                "modificationTime": 1,
                "dataChange": True,
                "deletionVector": {"storageType": "i", "pathOrInlineDv": "x", "cardinality": 1},
            }
        },
    ]
    with open(f"{path}/_delta_log/{3:020d}.json", "w") as f:
        f.write("".join(json.dumps(a) + "\n" for a in entry))
    cache = AddedFilesCache()
    assert len(cache.added(path, 0, 2)) == 2
    with pytest.raises(RefusedCommit, match="deletionVectors") as refused:
        cache.added(path, 0, 3)
    assert refused.value.version == 3


# -- retention and compaction follow the protocol -------------------------------------------


def test_retention_removes_with_data_change_and_leaves_append_only_tables(tmp_path: Path) -> None:
    path, _ = topic(tmp_path, 3)
    dt = DeltaTable(path)
    first = dt.get_add_actions(flatten=True).column("path").to_pylist()[0]
    size = dt.get_add_actions(flatten=True).column("size_bytes").to_pylist()[0]
    version = remove_files(path, dt, [(first, size)], "old")
    assert version is not None
    removes = [a["remove"] for a in commit_json(path, version) if "remove" in a]
    assert removes and all(r["dataChange"] is True for r in removes)
    # Removes alone are nothing new for the tailer.
    assert added_files(path, version - 1, version) == []
    DeltaTable(path).alter.set_table_properties({"delta.appendOnly": "true"})
    reason = removal_supported(DeltaTable(path))
    assert reason is not None and "appendOnly" in reason
    report = RetentionReport()
    from queue_engine.store.upkeep.retention import _open

    assert _open(path, report) is None
    assert any("appendOnly" in s for s in report.skipped)


def test_compaction_moves_rows_and_aborts_when_another_writer_removed_an_input(
    tmp_path: Path,
) -> None:
    path, _ = topic(tmp_path, 4)
    before = sorted(DeltaTable(path).to_pyarrow_table()["id"].to_pylist())
    stale = DeltaTable(path)
    # Another engine removed one of the files compaction is about to rewrite (its own OPTIMIZE
    # or a DELETE): compaction from the older snapshot must not resurrect those rows.
    DeltaTable(path).delete(f"id = '{before[0]}'")
    from queue_engine.store.upkeep import CompactionConflict

    with pytest.raises(CompactionConflict):
        compact_small_files(path, stale, 1 << 20)
    done = compact_small_files(path, DeltaTable(path), 1 << 20)
    assert done is not None
    after = DeltaTable(path).to_pyarrow_table()["id"].to_pylist()
    assert sorted(after) == before[1:]
    with pytest.raises(RemovalConflict):
        first = stale.get_add_actions(flatten=True).column("path").to_pylist()[0]
        remove_files(path, stale, [(first, 1)], "old")


def test_delta_rs_appends_go_on_where_the_fast_path_stops(tmp_path: Path) -> None:
    path, appender = topic(tmp_path, 1)
    DeltaTable(path).alter.add_constraint({"below_z": "id < 'z'"})
    write_deltalake(path, batch(1, 50), mode="append")
    appender.reopen()
    chosen, _ = append_or_fall_back(appender, path, batch(1, 60))
    assert isinstance(chosen, DeltaRsAppender)
    assert DeltaTable(path).to_pyarrow_table().num_rows == 5
