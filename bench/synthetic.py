"""A channel with a large history written straight into its tables (no API, no fanout).

Benchmarks of the sweep and of the API's restart need a channel of 1,000,000 messages with
leases in flight; publishing and delivering them over HTTP would take minutes. The tables
written here are the ones the API and the fanout write (same schemas, real Delta commits).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
from deltalake import write_deltalake

from queue_engine.registry import Action, RegistryEvent
from queue_engine.store.delta import open_or_create
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    HEADERS_TYPE,
    LEDGER_SCHEMA,
    RegistryStore,
    Warehouse,
    hex_id_array,
)

_TS = pa.timestamp("us", tz="UTC")


def register(warehouse: Warehouse, topic: str, channel: str) -> None:
    store = RegistryStore(warehouse.registry_path)
    seq = max((e.seq for e in store.load()), default=-1) + 1
    now = time.time_ns() // 1000
    store.append(RegistryEvent(seq, now, Action.TOPIC_CREATE, topic))
    store.append(RegistryEvent(seq + 1, now, Action.CHANNEL_CREATE, topic, channel, -1, 0))


def write_messages(
    warehouse: Warehouse,
    topic: str,
    channel: str,
    count: int,
    *,
    first_id: int = 1,
    body_bytes: int = 200,
    rows_per_commit: int = 100_000,
    topic_version: int = 0,
) -> list[str]:
    """``count`` rows in the channel table, ``rows_per_commit`` per version; returns the ids."""
    path = warehouse.channel_messages_path(topic, channel)
    open_or_create(path, CHANNEL_MESSAGES_SCHEMA)
    ids: list[str] = []
    published = time.time_ns() // 1000 - 3_600_000_000
    body = b"x" * body_bytes
    for offset in range(0, count, rows_per_commit):
        n = min(rows_per_commit, count - offset)
        id_array = hex_id_array(first_id + offset, n)
        ids.extend(id_array.to_pylist())
        table = pa.Table.from_arrays(
            [
                id_array,
                pa.array([body] * n, pa.binary()),
                pa.array(np.full(n, published, dtype=np.int64)).cast(_TS),
                pa.nulls(n, _TS),
                pa.array(np.full(n, topic_version + offset // rows_per_commit, dtype=np.int64)),
                pa.nulls(n, _TS),
                pa.nulls(n, pa.string()),
                pa.nulls(n, HEADERS_TYPE),
            ],
            schema=CHANNEL_MESSAGES_SCHEMA,
        )
        write_deltalake(path, table, mode="append")
    return ids


def write_deliveries(
    warehouse: Warehouse,
    topic: str,
    channel: str,
    ids: list[str],
    *,
    expired_fraction: float,
    lease_s: float = 600.0,
    rows_per_commit: int = 100_000,
) -> int:
    """A DELIVER (attempt 1) of every id; ``expired_fraction`` of the leases ended a minute ago.
    Returns how many leases are expired."""
    path = warehouse.channel_ledger_path(topic, channel)
    open_or_create(path, LEDGER_SCHEMA)
    now = time.time_ns() // 1000
    every = max(1, round(1 / expired_fraction)) if expired_fraction > 0 else 0
    expired = 0
    for offset in range(0, len(ids), rows_per_commit):
        chunk = ids[offset : offset + rows_per_commit]
        n = len(chunk)
        index = np.arange(offset, offset + n)
        is_expired = (index % every == 0) if every else np.zeros(n, dtype=bool)
        expired += int(is_expired.sum())
        delivered_at = np.where(is_expired, now - 120_000_000, now - 1_000_000)
        expires = np.where(is_expired, now - 60_000_000, now + int(lease_s * 1_000_000))
        at = delivered_at + index  # strictly increasing event times
        table = pa.Table.from_arrays(
            [
                pa.array(chunk, pa.string()),
                pa.array(["DELIVER"] * n, pa.string()),
                pa.array(np.ones(n, dtype=np.int32)),
                pa.array([f"1-{i:012x}" for i in index], pa.string()),
                pa.array(expires.astype(np.int64)).cast(_TS),
                pa.nulls(n, _TS),
                pa.array(["bench"] * n, pa.string()),
                pa.array(at.astype(np.int64)).cast(_TS),
            ],
            schema=LEDGER_SCHEMA,
        )
        write_deltalake(path, table, mode="append")
    return expired
