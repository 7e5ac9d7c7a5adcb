"""Nodes sharing a warehouse: who is alive, who owns which lanes, and locks held in the
warehouse itself (a local file lock or an object-store lock object)."""

from __future__ import annotations

from queue_engine.store.coordination.hold import (
    Hold,
    hold_url,
)
from queue_engine.store.coordination.job_lock import (
    JOBS_DIR,
    JobBusyError,
    JobLock,
)
from queue_engine.store.coordination.nodes import (
    NODES_DIR,
    Node,
    NodeDirectory,
    NodeRecord,
    WarehouseBusyError,
    describe_nodes,
    live_nodes,
)
from queue_engine.store.coordination.ownership import (
    OWNERS_DIR,
    Claim,
    Ownership,
)
from queue_engine.store.coordination.store_lock import (
    StoreLock,
    describe,
)

__all__ = [
    "JOBS_DIR",
    "NODES_DIR",
    "OWNERS_DIR",
    "Claim",
    "Hold",
    "JobBusyError",
    "JobLock",
    "Node",
    "NodeDirectory",
    "NodeRecord",
    "Ownership",
    "StoreLock",
    "WarehouseBusyError",
    "describe",
    "describe_nodes",
    "hold_url",
    "live_nodes",
]
