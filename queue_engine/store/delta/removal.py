"""A commit that only removes whole data files: how retention drops rows without rewriting.

Why whole files and no rewrite: a Delta ``DELETE`` rewrites the files holding matching rows
and conflicts with appends that land meanwhile; a commit of ``remove`` actions alone does not
(appends add files, they never read the removed ones), so publishers, the fanout and the
ledger writers go on undisturbed. The removes carry ``dataChange=true``, as the protocol says
of data that is gone: a change-data or stream reader learns that rows were deleted.
delta-spark's ``readStream`` stops on such a commit unless told ``skipChangeCommits`` (the
option for tables whose deletes a stream should not follow); deltaq's own tailers read a
commit of removes alone as "nothing new". The files themselves stay until vacuum, so time
travel to before the commit keeps working within the vacuum window. A table whose properties
say ``delta.appendOnly`` is never given such a commit (``removal_supported``).

The commit is put-if-absent like the fast append (``move_if_absent`` locally, ``If-None-Match``
on an object store). For each version another writer took first: a commit that removed one of
the same files (compaction) or changed the metadata or protocol aborts this one; appends are
simply followed.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote

from deltalake import DeltaTable

from queue_engine import __version__
from queue_engine.store.delta.append import blind_appends_honoured, log_entry, put_log_entry
from queue_engine.store.delta.spare_files import SPARE_DIR
from queue_engine.store.delta.table_features import append_only
from queue_engine.store.storage.object_store import store_and_key
from queue_engine.store.storage.paths import is_remote

_MAX_COMMIT_RACES = 1000


class RemovalConflict(RuntimeError):
    """Another writer removed one of the files, or changed the table's metadata or protocol."""


def removal_supported(dt: DeltaTable) -> str | None:
    """Why rows of this table may not be removed (None: they may): deltaq writes only
    protocols it honours (reader 1, writer <= 2, no features), and an appendOnly table takes
    no removes."""
    if not blind_appends_honoured(dt):
        return "protocol with table features (left to the engine that enabled them)"
    if append_only(dt):
        return "delta.appendOnly is set (nothing is removed)"
    return None


def remove_files(
    path: str, dt: DeltaTable, files: Sequence[tuple[str, int]], reason: str
) -> int | None:
    """Commit the removal of ``files`` ((path as ``get_add_actions`` gives it, size)) from the
    table at ``path`` as loaded in ``dt``; returns the version, None when there is nothing to
    remove. Raises RemovalConflict (nothing committed) when another writer got in the way."""
    if not files:
        return None
    doomed = {p for p, _ in files}
    now_ms = int(time.time() * 1000)
    info = {
        "timestamp": now_ms,
        "operation": "DELETE",
        "operationParameters": {"predicate": json.dumps(reason)},
        "readVersion": dt.version(),
        "isBlindAppend": False,
        "operationMetrics": {"numRemovedFiles": str(len(files))},
        "engineInfo": f"deltaq/{__version__}",
    }
    actions: list[dict[str, object]] = [{"commitInfo": info}]
    actions += [remove_action(p, size, now_ms, data_change=True) for p, size in files]
    entry = log_entry(actions)
    check_winner = winner_check(doomed, RemovalConflict)

    if is_remote(path):
        return put_remote(path, dt.version() + 1, entry, check_winner, RemovalConflict)
    root = os.path.abspath(path)
    staging_dir = os.path.join(root, SPARE_DIR)
    os.makedirs(staging_dir, exist_ok=True)
    staging = os.path.join(staging_dir, f"{uuid.uuid4().hex}.commit")
    with open(staging, "wb") as f:
        f.write(entry)
    try:
        log_dir = os.path.join(root, "_delta_log")
        return put_log_entry(log_dir, dt.version() + 1, staging, check_winner)
    except BaseException:
        if os.path.exists(staging):
            os.unlink(staging)
        raise


def remove_action(path: str, size: int, now_ms: int, *, data_change: bool) -> dict[str, object]:
    """The ``remove`` action of data file ``path`` (as ``get_add_actions`` gives it):
    ``data_change`` True when its rows leave the table, False when they move (compaction)."""
    return {
        "remove": {
            "path": quote(path),
            "deletionTimestamp": now_ms,
            "dataChange": data_change,
            "extendedFileMetadata": True,
            "partitionValues": {},
            "size": size,
        }
    }


def winner_check(doomed: set[str], conflict: type[Exception]) -> Callable[[list[Any]], None]:
    """For a commit removing the files ``doomed``: what to do about a version another writer
    took first. A commit that removed one of them, or changed the metadata or protocol, raises
    ``conflict``; anything else (appends) the commit simply follows."""

    def check(winner: list[Any]) -> None:
        for action in winner:
            if "metaData" in action or "protocol" in action:
                raise conflict("metadata or protocol changed")
            removed = action.get("remove")
            if removed is not None and unquote(removed["path"]) in doomed:
                raise conflict(f"{removed['path']} was removed by another writer")

    return check


def put_remote(
    path: str, version: int, entry: bytes, check_winner: Any, conflict: type[Exception]
) -> int:
    """Commit ``entry`` as the first free version from ``version`` on, on an object store
    (put-if-absent PUT), ``check_winner`` judging each version taken first."""
    import obstore
    from obstore.exceptions import AlreadyExistsError

    store, key = store_and_key(path.rstrip("/"))
    prefix = f"{key}/" if key else ""
    for _ in range(_MAX_COMMIT_RACES):
        log_key = f"{prefix}_delta_log/{version:020d}.json"
        try:
            obstore.put(store, log_key, entry, mode="create")
            return version
        except AlreadyExistsError:
            winner = bytes(obstore.get(store, log_key).bytes())
            check_winner([json.loads(line) for line in winner.splitlines() if line.strip()])
            version += 1
    raise conflict(f"no free version in {path}/_delta_log")
