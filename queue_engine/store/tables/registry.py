"""The durable registry: an append-only Delta table of registry events."""

from __future__ import annotations

import json
import logging
import threading

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from queue_engine.registry import Action, Registry, RegistryEvent
from queue_engine.store.delta.append import (
    Appender,
    VersionTakenError,
    append_or_fall_back,
    appender_for,
    refuse_any_winner,
)
from queue_engine.store.delta.commit_log import latest_version, parse_commits
from queue_engine.store.delta.open_table import open_or_create
from queue_engine.store.storage import parquet_dataset
from queue_engine.store.tables.schemas import REGISTRY_SCHEMA

log = logging.getLogger(__name__)


class RegistryMovedError(RuntimeError):
    """Another node committed a registry event since this one last read the registry: read
    it again (``load``) and decide anew."""


class RegistryStore:
    """Reads all registry events and appends new ones, one commit per event.

    Several API nodes write one registry. An event's ``seq`` must follow every event its
    writer folded, so an append lands on exactly the version after the one ``load`` read, or
    not at all (``RegistryMovedError``): seq order is commit order on every node.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # Also adds the columns a registry written by an older deltaq lacks.
        self._dt = open_or_create(path, REGISTRY_SCHEMA)
        # The same appender as the topics' (a local warehouse: one file + a put-if-absent log
        # entry, ~1 ms; delta-rs's append replays a log that grows with every topic created).
        # Checkpoints come from the API's maintenance, which watches this table.
        self._appender: Appender = appender_for(path, check_winner=refuse_any_winner)
        self._lock = threading.Lock()
        self.version = self._dt.version()
        self._appender.reopen(self.version)

    def load(self) -> list[RegistryEvent]:
        """Every event, as of the newest version (the next append must follow it)."""
        with self._lock:
            self._dt.update_incremental()
            self.version = self._dt.version()
            table = self._dt.to_pyarrow_table()
            self._appender.reopen(self.version)
        return events_from_table(table)

    def moved(self) -> bool:
        """Whether a newer version than the one last read exists (a cheap probe)."""
        return latest_version(self.path, self.version) > self.version

    def append(self, event: RegistryEvent) -> None:
        """Commit ``event``; when this returns, it survives any crash."""
        row = pa.Table.from_pylist(
            [
                {
                    "seq": event.seq,
                    "at": event.at_us,
                    "action": str(event.action),
                    "topic": event.topic,
                    "channel": event.channel,
                    "topic_version": event.topic_version,
                    "topic_messages": event.topic_messages,
                    "options": json.dumps(event.options, sort_keys=True) if event.options else None,
                }
            ],
            schema=REGISTRY_SCHEMA,
        )
        with self._lock:
            try:
                self._appender, self.version = append_or_fall_back(
                    self._appender, self.path, row, check_winner=refuse_any_winner
                )
            except VersionTakenError as exc:
                raise RegistryMovedError(self.path) from exc

    def close(self) -> None:
        self._appender.close()


def load_events(path: str) -> list[RegistryEvent]:
    """Every registry event at ``path`` (for readers: nothing is created or changed; none
    before the API has created the registry)."""
    try:
        dt = DeltaTable(path)
    except TableNotFoundError:
        return []
    return events_from_table(dt.to_pyarrow_table())


def events_from_table(table: pa.Table) -> list[RegistryEvent]:
    """Registry rows as events, in seq order (rows of older registries lack ``options``)."""
    return [
        RegistryEvent(
            seq=row["seq"],
            at_us=_to_us(row["at"]),
            action=Action(row["action"]),
            topic=row["topic"],
            channel=row["channel"],
            topic_version=row["topic_version"],
            topic_messages=row["topic_messages"],
            options=json.loads(row["options"]) if row.get("options") else None,
        )
        for row in table.sort_by("seq").to_pylist()
    ]


def _to_us(value: object) -> int:
    import datetime as dt

    if isinstance(value, dt.datetime):
        delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, int):
        return value
    raise TypeError(f"unexpected timestamp {value!r}")


class RegistryReader:
    """The current registry for readers in other processes (the fanout), refolded only when the
    registry table has a new version: probing for the next commit file costs ~0.5 ms.

    New versions that only appended events (every registry commit but a rewrite) are read
    from the files they added; anything else reads the whole table again. Reading the whole
    table on every change made a burst creating 1,000 topics cost the fanout seconds: each of
    the 1,000 versions read all the events before it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._version = -1
        self._registry: Registry | None = None

    def get(self) -> Registry:
        """The registry as of the newest version. The same object is brought up to date in
        place when later versions only appended events: use it, do not keep it."""
        latest = latest_version(self.path, self._version)
        if self._registry is not None and latest == self._version:
            return self._registry
        added = self._appended(latest) if self._registry is not None else None
        if self._registry is not None and added is not None:
            added.sort(key=lambda e: e.seq)
            if not added or added[0].seq > self._registry.last_seq:
                for event in added:
                    self._registry.apply(event)
                self._version = latest
                return self._registry
        self._registry = Registry.fold(load_events(self.path))
        self._version = latest
        return self._registry

    def _appended(self, latest: int) -> list[RegistryEvent] | None:
        """The events versions after the last read added, or None where one of them did
        more than append (a rewrite, a feature) or is gone (read the whole table)."""
        if latest < self._version:
            return None
        try:
            commits = parse_commits(self.path, list(range(self._version + 1, latest + 1)))
        except FileNotFoundError:
            return None
        if any(c.removes or c.refusal is not None for c in commits.values()):
            return None
        paths = [f.path for c in commits.values() for f in c.adds]
        if not paths:
            return []
        return events_from_table(parquet_dataset(paths, REGISTRY_SCHEMA).to_table())
