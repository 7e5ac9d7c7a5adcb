"""Table upkeep: compaction, checkpoints and vacuum (in a worker process of their own) and
retention."""

from __future__ import annotations

from queue_engine.store.upkeep.compaction import (
    CHUNK_BYTES,
    CHUNK_ROWS,
    Compacted,
    CompactionConflict,
    SmallFile,
    compact_small_files,
    small_files,
)
from queue_engine.store.upkeep.maintenance import (
    QUIET_MAX_ROUNDS,
    Maintenance,
    MaintenancePolicy,
    MaintenanceProcessError,
    UpkeepDone,
    table_upkeep,
)
from queue_engine.store.upkeep.retention import (
    RetentionPolicy,
    RetentionReport,
    apply_retention,
)

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_ROWS",
    "QUIET_MAX_ROUNDS",
    "Compacted",
    "CompactionConflict",
    "Maintenance",
    "MaintenancePolicy",
    "MaintenanceProcessError",
    "RetentionPolicy",
    "RetentionReport",
    "SmallFile",
    "UpkeepDone",
    "apply_retention",
    "compact_small_files",
    "small_files",
    "table_upkeep",
]
