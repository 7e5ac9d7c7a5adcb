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
from queue_engine.store.delta.commit_log import latest_version
from queue_engine.store.delta.open_table import open_or_create
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
    registry table has a new version: probing for the next commit file costs ~0.5 ms, reading
    and folding the table several ms."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._version = -1
        self._registry: Registry | None = None

    def get(self) -> Registry:
        latest = latest_version(self.path, self._version)
        if self._registry is None or latest != self._version:
            self._registry = Registry.fold(load_events(self.path))
            self._version = latest
        return self._registry
