"""The registry table across deltaq versions: an older registry (no ``options`` column) is
read as it is, and gains the column when an API opens it to write."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from queue_engine.registry import Action, Registry, RegistryEvent
from queue_engine.store.tables import (
    REGISTRY_SCHEMA,
    RegistryMovedError,
    RegistryReader,
    RegistryStore,
    load_events,
)

_OLD_SCHEMA = pa.schema([f for f in REGISTRY_SCHEMA if f.name != "options"])


def _old_registry(path: Path) -> None:
    rows = pa.Table.from_pylist(
        [
            {"seq": 0, "at": 1, "action": "topic_create", "topic": "t"},
            {"seq": 1, "at": 2, "action": "channel_create", "topic": "t", "channel": "c"},
        ],
        schema=_OLD_SCHEMA,
    )
    write_deltalake(str(path), rows)


def test_an_older_registry_is_read_then_migrated_by_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "registry"
    _old_registry(path)
    # Readers (the fanout, the views) change nothing.
    assert [e.action for e in load_events(str(path))] == [
        Action.TOPIC_CREATE,
        Action.CHANNEL_CREATE,
    ]
    assert "options" not in DeltaTable(str(path)).schema().to_arrow().names

    store = RegistryStore(str(path))
    store.append(
        RegistryEvent(2, 3, Action.CHANNEL_CONFIGURE, "t", "c", options={"max_attempts": 4})
    )
    store.append(RegistryEvent(3, 4, Action.TOPIC_CONFIGURE, "t", options={"ttl_ms": 500}))
    store.close()
    assert "options" in DeltaTable(str(path)).schema().to_arrow().names
    registry = Registry.fold(load_events(str(path)))
    assert registry.topics["t"].channels["c"].max_attempts == 4
    assert registry.topics["t"].ttl_ms == 500
    assert RegistryReader(str(path)).get().topics["t"].ttl_ms == 500

    # Back to the default: null in the options, None in the registry.
    again = RegistryStore(str(path))
    again.append(
        RegistryEvent(4, 5, Action.CHANNEL_CONFIGURE, "t", "c", options={"max_attempts": None})
    )
    again.close()
    assert Registry.fold(load_events(str(path))).topics["t"].channels["c"].max_attempts is None


def test_a_missing_registry_reads_as_empty(tmp_path: Path) -> None:
    assert load_events(str(tmp_path / "none")) == []


def test_two_writers_commit_registry_events_in_seq_order(tmp_path: Path) -> None:
    """Two nodes' registry stores: an append that follows a registry read before another
    node's event is refused (nothing written); after reading again it lands, next in seq."""
    path = str(tmp_path / "registry")
    first, second = RegistryStore(path), RegistryStore(path)
    assert first.load() == second.load() == []
    first.append(RegistryEvent(0, 1, Action.TOPIC_CREATE, "a"))
    assert second.moved()
    with pytest.raises(RegistryMovedError):
        second.append(RegistryEvent(0, 2, Action.TOPIC_CREATE, "b"))
    assert [e.topic for e in load_events(path)] == ["a"]
    seen = Registry.fold(second.load())
    assert not second.moved()
    second.append(RegistryEvent(seen.next_seq(), 2, Action.TOPIC_CREATE, "b"))
    assert [(e.seq, e.topic) for e in load_events(path)] == [(0, "a"), (1, "b")]
    first.close()
    second.close()


def test_a_reader_follows_appends_compaction_and_rewrites_as_a_fresh_read_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that read the registry once folds later appends from the files they added (the
    whole table is not read again for them), a compaction changes nothing, and a rewrite that
    removed events is read whole: at every step it agrees with a reader starting afresh."""
    from queue_engine.store.tables import registry as registry_module

    path = tmp_path / "registry"
    _old_registry(path)  # an older registry: files without the options column
    reader = RegistryReader(str(path))

    def state(r: Registry) -> dict[str, object]:
        return {
            name: (info.ttl_ms, info.paused, sorted(info.channels))
            for name, info in sorted(r.topics.items())
        }

    assert state(reader.get()) == {"t": (None, False, ["c"])}
    whole_reads: list[str] = []
    real_load = registry_module.load_events
    monkeypatch.setattr(
        registry_module, "load_events", lambda p: whole_reads.append(p) or real_load(p)
    )

    store = RegistryStore(str(path))
    for seq in range(2, 12):
        store.append(RegistryEvent(seq, seq, Action.TOPIC_CREATE, f"u{seq}"))
    store.append(RegistryEvent(12, 12, Action.TOPIC_CONFIGURE, "t", options={"ttl_ms": 9}))
    store.append(RegistryEvent(13, 13, Action.TOPIC_PAUSE, "u2"))
    assert state(reader.get()) == state(RegistryReader(str(path)).get())
    assert reader.get().topics["t"].ttl_ms == 9 and reader.get().topics["u2"].paused
    assert whole_reads == [str(path)]  # only the fresh reader's

    DeltaTable(str(path)).optimize.compact()
    assert state(reader.get()) == state(RegistryReader(str(path)).get())
    assert len(whole_reads) == 2

    # A rewrite (events removed): the whole table is read again.
    DeltaTable(str(path)).delete("topic = 'u3'")
    whole_reads.clear()
    assert "u3" not in reader.get().topics
    assert whole_reads == [str(path)]
    store.close()
