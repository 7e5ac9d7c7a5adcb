"""Where each table lives in the warehouse, its schema, and how it is opened."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.schema import Field as DeltaField

from queue_engine.names import path_segment
from queue_engine.store.fs_sync import sync_commits, sync_created
from queue_engine.store.object_store import is_remote
from queue_engine.store.table_features import TableRefusedError
from queue_engine.store.torn_tail import repair_once

log = logging.getLogger(__name__)

_TS = pa.timestamp("us", tz="UTC")

_ID = pa.field("id", pa.string(), nullable=False)
_BODY = pa.field("body", pa.binary(), nullable=False)
_PUBLISHED_AT = pa.field("published_at", _TS, nullable=False)
_DELIVER_AT = pa.field("deliver_at", _TS, nullable=True)
# The message's own TTL (``/pub?ttl_ms=``): not delivered from then on (null: the topic's TTL).
# Added after the first release: ``open_or_create`` adds it to older tables, whose files read
# it as null. Columns added later go last, so an evolved table and a new one look the same.
_EXPIRES_AT = pa.field("expires_at", _TS, nullable=True)
# A replay's copy of a message (/channel/replay): the id it copies.
_REPLAY_OF = pa.field("replay_of", pa.string(), nullable=True)
# A replay's copy goes to one channel only (null: every channel, as any published message).
_TO_CHANNEL = pa.field("to_channel", pa.string(), nullable=True)

# topics/<t>: one row per published message (and per replayed copy), append-only.
TOPIC_SCHEMA = pa.schema(
    [_ID, _BODY, _PUBLISHED_AT, _DELIVER_AT, _EXPIRES_AT, _TO_CHANNEL, _REPLAY_OF]
)

# channels/<t>/<c>/messages: the topic's rows each channel receives, with the topic version
# each came from (append-only; written by the fanout job).
CHANNEL_MESSAGES_SCHEMA = pa.schema(
    [
        _ID,
        _BODY,
        _PUBLISHED_AT,
        _DELIVER_AT,
        pa.field("topic_version", pa.int64(), nullable=False),
        _EXPIRES_AT,
        _REPLAY_OF,
    ]
)

# channels/<t>/<c>/ledger: one row per lease event (queue_engine.lease), append-only. Written by
# the API (and the sweep job); its fold is every message's delivery state.
LEDGER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("lease", pa.string(), nullable=True),
        pa.field("lease_expires_at", _TS, nullable=True),
        pa.field("deliver_at", _TS, nullable=True),
        pa.field("consumer", pa.string(), nullable=True),
        pa.field("at", _TS, nullable=False),
    ]
)

# channels/<t>/<c>/dead: one row per message the channel dead-lettered (its max_attempts
# reached), append-only. Written before the ledger's DEAD event (at = dead_at), so every DEAD
# event has its row; a row without its event (a crash in between) is not a dead letter.
DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("published_at", _TS, nullable=False),
        pa.field("attempts", pa.int32(), nullable=False),
        pa.field("last_consumer", pa.string(), nullable=True),
        pa.field("last_event", pa.string(), nullable=False),
        pa.field("dead_at", _TS, nullable=False),
        # The message's own expiry, kept so a redriven message keeps it.
        _EXPIRES_AT,
    ]
)

# registry: one row per create/delete/pause/unpause/empty of a topic or channel, append-only.
REGISTRY_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("at", _TS, nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("channel", pa.string(), nullable=True),
        pa.field("topic_version", pa.int64(), nullable=True),
        pa.field("topic_messages", pa.int64(), nullable=True),
        # Settings a configure event sets, as a JSON object (e.g. {"max_attempts": 5}).
        pa.field("options", pa.string(), nullable=True),
    ]
)


@dataclass(frozen=True)
class Warehouse:
    """Paths of deltaq's tables under one root (a local path or an object-store URL)."""

    root: str

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def registry_path(self) -> str:
        return self._join("registry")

    @property
    def topics_root(self) -> str:
        return self._join("topics")

    def topic_path(self, topic: str) -> str:
        return self._join("topics", path_segment(topic))

    @property
    def channels_root_all(self) -> str:
        return self._join("channels")

    def channels_root(self, topic: str) -> str:
        return self._join("channels", path_segment(topic))

    def channel_root(self, topic: str, channel: str) -> str:
        return self._join("channels", path_segment(topic), path_segment(channel))

    def channel_messages_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/messages"

    def channel_ledger_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/ledger"

    def channel_dead_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/dead"

    def channel_state_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/state"

    @property
    def checkpoints_root(self) -> str:
        return self._join("_checkpoints")

    def exists(self) -> bool:
        """Whether a deltaq API has ever opened this warehouse (its registry table exists)."""
        try:
            DeltaTable(self.registry_path)
        except Exception:
            return False
        return True


def open_or_create(path: str, schema: pa.Schema) -> DeltaTable:
    """Open the Delta table at ``path``, creating it (empty, with ``schema``) if absent, and
    adding the nullable columns of ``schema`` an older table lacks.

    Created tables use reader 1 / writer 2, which delta-spark reads and writes as well.
    """
    repair_once(path)
    try:
        return add_missing_columns(_open_sound(path), schema)
    except TableNotFoundError:
        pass
    try:
        created = DeltaTable.create(path, schema=schema, mode="error")
    except Exception:
        # Another process may have created it between the two calls; opening decides.
        return add_missing_columns(_open_sound(path), schema)
    sync_created(path)
    return created


def _open_sound(path: str) -> DeltaTable:
    """``DeltaTable(path)``; a log no reader can follow (after ``repair_once`` set aside what a
    power cut leaves) is refused by name: TableDamagedError."""
    try:
        return DeltaTable(path)
    except TableNotFoundError:
        raise
    except DeltaError as exc:
        if is_remote(path):
            raise
        raise TableDamagedError(path, str(exc)) from exc


class TableDamagedError(TableRefusedError):
    """A local table whose log cannot be read: damage other than what a power cut leaves at its
    tail (which is set aside when the table is opened). The other tables keep serving."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(path, "a damaged log", f"its log cannot be read ({detail})")


def add_missing_columns(dt: DeltaTable, schema: pa.Schema) -> DeltaTable:
    """Evolve ``dt`` to ``schema``: add (at the end) the nullable fields it does not have.

    A metadata commit; done by a writer when it opens a table, before it appends, so its own
    appends never race it (another writer's append that does fails its commit and retries).
    """
    have = set(pa.schema(dt.schema().to_arrow()).names)
    missing = [f for f in schema if f.name not in have]
    if not missing:
        return dt
    if any(not f.nullable for f in missing):
        raise ValueError(f"{dt.table_uri}: cannot add required columns {missing}")
    before = int(dt.version())
    try:
        dt.alter.add_columns([DeltaField.from_arrow(f) for f in missing])
        sync_commits(dt.table_uri, before + 1, int(dt.version()))
    except Exception:
        # Another writer may have added them first: re-read and check.
        dt.update_incremental()
        if any(f.name not in set(pa.schema(dt.schema().to_arrow()).names) for f in missing):
            raise
    log.info("%s: added columns %s", dt.table_uri, [f.name for f in missing])
    return dt


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` as ``schema``: its columns in that order, cast, and the nullable ones a file
    written before they were added lacks filled with nulls."""
    if table.schema.equals(schema):
        return table  # what every file written since the last column was added reads as
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(schema.names).cast(schema)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
    return fs, str(path)


def parquet_dataset(paths: list[str], schema: pa.Schema | None = None) -> ds.Dataset:
    """One pyarrow dataset over data files of one table (one scan reads them in parallel)."""
    fs, _ = filesystem(paths[0])
    return ds.dataset(
        [filesystem(p)[1] for p in paths], format="parquet", filesystem=fs, schema=schema
    )


def delete_tree(uri: str) -> None:
    """Remove a directory (local or object store) and everything under it, if it exists."""
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return
    fs.delete_dir(path)
    log.info("deleted %s", uri)


def list_dirs(uri: str) -> list[str]:
    """Names of the directories directly under ``uri`` (none if it does not exist)."""
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(info.base_name for info in infos if info.type == pafs.FileType.Directory)
