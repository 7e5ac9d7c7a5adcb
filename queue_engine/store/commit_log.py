"""Reading what Delta versions added, straight from ``_delta_log`` (no table scan).

Tailing readers (the fanout's stream source) need "which data files did versions (s, e] add".
Parsing those commits' JSON is under a millisecond per small commit; diffing snapshots is far
slower. Compaction commits add files with ``dataChange=false``: their rows were already
delivered by earlier versions, so they are skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable

from queue_engine.store.object_store import (
    is_remote,
    newest_commit_after,
    read_object,
    read_objects,
)
from queue_engine.store.tables import filesystem


@dataclass(frozen=True)
class AddedFile:
    version: int
    path: str  # absolute path or URL of the data file
    size: int
    num_records: int | None
    # The file's largest ``topic_version`` (channel tables), from its statistics.
    max_topic_version: int | None = None
    # Its smallest and largest message ``id`` (topic and channel tables).
    min_id: str | None = None
    max_id: str | None = None


def commit_file(version: int) -> str:
    return f"_delta_log/{version:020d}.json"


def latest_version(root: str, known: int = -1) -> int:
    """The table's latest version; probes for the next commit files when ``known`` is given.

    Probing (~0.5 ms per file on local disk) avoids opening the table, which replays the log.
    Returns -1 if the table does not exist.
    """
    if known < 0:
        if "://" not in root and not os.path.isdir(f"{root}/_delta_log"):
            return -1  # no table (yet): not worth asking delta-rs
        try:
            return int(DeltaTable(root).version())
        except Exception:
            return -1
    version = known
    if "://" not in root:
        base = os.path.abspath(root)
        while os.path.exists(f"{base}/{commit_file(version + 1)}"):
            version += 1
        return version
    if is_remote(root):
        return newest_commit_after(root, version)
    fs, base = filesystem(root)
    while fs.get_file_info(f"{base}/{commit_file(version + 1)}").type == pafs.FileType.File:
        version += 1
    return version


def messages_added(root: str, start_exclusive: int, end_inclusive: int) -> dict[int, int]:
    """Rows each version in ``(start_exclusive, end_inclusive]`` added (versions whose commit
    file is gone, after log cleanup, are left out)."""
    versions = range(start_exclusive + 1, end_inclusive + 1)
    added = versions_added_files(root, list(versions), missing_ok=True)
    return {v: sum(f.num_records or 0 for f in files) for v, files in added.items()}


def added_files(root: str, start_exclusive: int, end_inclusive: int) -> list[AddedFile]:
    """Data files that versions ``(start_exclusive, end_inclusive]`` added with dataChange."""
    versions = list(range(start_exclusive + 1, end_inclusive + 1))
    added = versions_added_files(root, versions)
    return [f for v in versions for f in added[v]]


def versions_added_files(
    root: str, versions: list[int], *, missing_ok: bool = False
) -> dict[int, list[AddedFile]]:
    """``version_added_files`` of each version; on an object store the commit files are read
    concurrently. A missing commit file raises, or with ``missing_ok`` is left out."""
    if not is_remote(root):
        found: dict[int, list[AddedFile]] = {}
        for version in versions:
            try:
                found[version] = version_added_files(root, version)
            except FileNotFoundError:
                if not missing_ok:
                    raise
        return found
    base = root.rstrip("/")
    texts = read_objects([f"{base}/{commit_file(v)}" for v in versions])
    result: dict[int, list[AddedFile]] = {}
    for version, data in zip(versions, texts, strict=True):
        if data is None:
            if missing_ok:
                continue
            raise FileNotFoundError(f"{base}/{commit_file(version)}")
        result[version] = _parse_added(root, version, data.decode())
    return result


def commit_info(root: str, version: int) -> dict[str, object] | None:
    """The ``commitInfo`` of one version (None: its commit file is gone, or has none)."""
    if is_remote(root):
        data = read_object(f"{root.rstrip('/')}/{commit_file(version)}")
        if data is None:
            return None
        text = data.decode()
    else:
        try:
            with open(f"{os.path.abspath(root)}/{commit_file(version)}", "rb") as f:
                text = f.read().decode()
        except FileNotFoundError:
            return None
    for line in text.splitlines():
        if '"commitInfo"' in line:
            info = json.loads(line).get("commitInfo")
            if isinstance(info, dict):
                return info
    return None


def version_added_files(root: str, version: int) -> list[AddedFile]:
    """Data files that one version added with dataChange."""
    if is_remote(root):
        data = read_object(f"{root.rstrip('/')}/{commit_file(version)}")
        if data is None:
            raise FileNotFoundError(f"{root}/{commit_file(version)}")
        return _parse_added(root, version, data.decode())
    with open(f"{os.path.abspath(root)}/{commit_file(version)}", "rb") as f:
        return _parse_added(root, version, f.read().decode())


def _parse_added(root: str, version: int, text: str) -> list[AddedFile]:
    files: list[AddedFile] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        add = action.get("add")
        if add is None or not add.get("dataChange", True):
            continue
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        highest, lowest = stats.get("maxValues", {}), stats.get("minValues", {})
        top = highest.get("topic_version")
        files.append(
            AddedFile(
                version,
                absolute_path(root, unquote(add["path"])),
                int(add["size"]),
                stats.get("numRecords"),
                None if top is None else int(top),
                lowest.get("id"),
                highest.get("id"),
            )
        )
    return files


class AddedFilesCache:
    """``added_files`` with each version parsed once: a stream reader reads the same commits
    when it sizes a micro-batch and again when it plans it."""

    def __init__(self) -> None:
        self._versions: dict[str, dict[int, list[AddedFile]]] = {}

    def added(self, root: str, start_exclusive: int, end_inclusive: int) -> list[AddedFile]:
        known = self._versions.setdefault(root, {})
        wanted = range(start_exclusive + 1, end_inclusive + 1)
        missing = [v for v in wanted if v not in known]
        if len(missing) > 1:
            known.update(versions_added_files(root, missing))
        files: list[AddedFile] = []
        for version in wanted:
            added = known.get(version)
            if added is None:
                added = known[version] = version_added_files(root, version)
            files.extend(added)
        return files

    def forget_through(self, root: str, version: int) -> None:
        """Drop what versions <= ``version`` of ``root`` added (processed, never asked again)."""
        known = self._versions.get(root)
        if known:
            for v in [v for v in known if v <= version]:
                del known[v]

    def forget_all_but(self, roots: set[str]) -> None:
        for root in [r for r in self._versions if r not in roots]:
            del self._versions[root]


def absolute_path(root: str, relative: str) -> str:
    """A data file's path from the table root and the path its add action records."""
    if "://" in relative or relative.startswith("/"):
        return relative
    prefix = root if "://" in root else os.path.abspath(root)
    return f"{prefix.rstrip('/')}/{relative}"


def recent_writes(root: str, since_s: float, limit: int = 5000) -> list[tuple[float, int]]:
    """(commit time s, rows written) of the table's data-writing commits since ``since_s``,
    oldest first, from its commit log (the newest ``limit`` commits at most); upkeep commits
    (compaction, checkpoints) add no messages and are left out."""
    try:
        entries = DeltaTable(root).history(limit)
    except Exception:
        return []
    writes = []
    for entry in entries:
        at = float(entry.get("timestamp", 0)) / 1000
        if at < since_s or entry.get("operation") not in ("WRITE", "STREAMING UPDATE"):
            continue
        metrics = entry.get("operationMetrics") or {}
        rows = metrics.get("numOutputRows") or metrics.get("num_added_rows") or 0
        writes.append((at, int(rows)))
    writes.sort()
    return writes


def live_files(root: str) -> list[str] | None:
    """The data files of a local table's latest version, replayed from its log (the last
    checkpoint, then the commits after it): ``DeltaTable(root).file_uris()`` at a tenth of the
    cost for small tables (opening one with delta-rs costs ~1.2 ms; ten thousand channel
    tables per SQL view took seconds). None: not a local table, or a log this replay does not
    read (a multi-part or v2 checkpoint, deletion vectors, a log cleaned up without a
    checkpoint): ask delta-rs.
    """
    if "://" in root:
        return None
    log = f"{os.path.abspath(root)}/_delta_log"
    files: dict[str, None] = {}
    version = 0
    try:
        with open(f"{log}/_last_checkpoint", "rb") as f:
            last = json.loads(f.read())
    except FileNotFoundError:
        last = None
    if last is not None:
        if last.get("parts") or last.get("v2Checkpoint"):
            return None
        checkpoint = int(last["version"])
        try:
            adds = pq.read_table(
                f"{log}/{checkpoint:020d}.checkpoint.parquet", columns=["add"]
            ).column("add")
        except FileNotFoundError:
            return None
        for add in adds.to_pylist():
            if add is not None:
                if add.get("deletionVector"):
                    return None
                files[add["path"]] = None
        version = checkpoint + 1
    elif not os.path.exists(f"{log}/{0:020d}.json"):
        return None
    while True:
        try:
            with open(f"{log}/{version:020d}.json", "rb") as f:
                text = f.read().decode()
        except FileNotFoundError:
            break
        for line in text.splitlines():
            if '"add"' not in line and '"remove"' not in line:
                continue
            action = json.loads(line)
            if (add := action.get("add")) is not None:
                if add.get("deletionVector"):
                    return None
                files[add["path"]] = None
            elif (remove := action.get("remove")) is not None:
                files.pop(remove["path"], None)
        version += 1
    return [absolute_path(root, unquote(path)) for path in files]
