"""Storage plumbing under the tables: local or object-store paths, objects, put-if-absent,
and the syncs that make local files durable. Nothing here knows Delta."""

from __future__ import annotations

from queue_engine.store.storage.files import (
    delete_tree,
    filesystem,
    list_dirs,
    parquet_dataset,
)
from queue_engine.store.storage.fs_sync import (
    replace_synced,
    sync_checkpoint,
    sync_commits,
    sync_created,
    sync_directory,
    sync_file,
    write_synced,
)
from queue_engine.store.storage.object_store import (
    PROBE_PREFIX,
    UNREADABLE_SCHEMES,
    StoreError,
    check_store,
    client_options,
    delete_objects,
    executor_environment,
    export_storage_options,
    list_objects,
    newest_commit_after,
    put_objects,
    read_object,
    read_objects,
    read_whole,
    replace_whole,
    store_and_key,
)
from queue_engine.store.storage.paths import (
    is_local,
    is_remote,
    local_path,
)
from queue_engine.store.storage.put_if_absent import (
    move_if_absent,
)

__all__ = [
    "PROBE_PREFIX",
    "UNREADABLE_SCHEMES",
    "StoreError",
    "check_store",
    "client_options",
    "delete_objects",
    "delete_tree",
    "executor_environment",
    "export_storage_options",
    "filesystem",
    "is_local",
    "is_remote",
    "list_dirs",
    "list_objects",
    "local_path",
    "move_if_absent",
    "newest_commit_after",
    "parquet_dataset",
    "put_objects",
    "read_object",
    "read_objects",
    "read_whole",
    "replace_synced",
    "replace_whole",
    "store_and_key",
    "sync_checkpoint",
    "sync_commits",
    "sync_created",
    "sync_directory",
    "sync_file",
    "write_synced",
]
