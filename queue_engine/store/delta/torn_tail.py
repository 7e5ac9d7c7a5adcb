"""Recognising what a power cut leaves at a local Delta table's tail, and setting it aside.

deltaq's writers sync a commit's data and content before its name appears, so a cut can only
leave, at a table's newest versions: a commit file that is empty or ends in a torn line (delta-rs
writes a commit first and deltaq syncs it right after), a commit whose data files are missing or
shorter than the commit says (their names never reached the disk), or a checkpoint (and its
``_last_checkpoint`` pointer) that is empty or torn. None of these is a commit any engine
writes on purpose: an engine's commit is whole JSON naming files that exist at their sizes.
Only the newest versions are looked at, newest first: missing data files count up to the first
sound commit (an older commit may name files a vacuum deleted since), an empty or torn commit
file among the newest 50 versions. Other damage is not a cut's: the table is refused by name.

A torn version ``N > 0`` is replaced by a commit that holds only ``commitInfo`` (operation
``REPAIR``): version numbers stay, so a reader that had passed ``N`` (the fanout's source) and
one that had not agree it added nothing, and what it would have held comes back from the node's
journal as a new version. A torn version 0 (the table's creation) is removed: the table was
never used, and its opener creates it again. The originals are kept in ``_deltaq_set_aside/``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import unquote

from queue_engine import __version__
from queue_engine.store.storage.fs_sync import replace_synced, sync_directory
from queue_engine.store.storage.paths import is_remote, local_path

log = logging.getLogger(__name__)

SET_ASIDE_DIR = "_deltaq_set_aside"
_COMMIT = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.\d+\.\d+)?\.parquet$")
_PARQUET_MAGIC = b"PAR1"
# Versions looked at, newest first: a writer that opened a table holding an empty commit (which
# delta-rs reads as an empty version) may have committed after it before the table was repaired.
_LOOK_BACK = 50

_checked: set[str] = set()
_checked_lock = threading.Lock()


@dataclass(frozen=True)
class Repair:
    """What was set aside in one table."""

    table: str
    versions: tuple[int, ...]
    checkpoints: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.versions or self.checkpoints)


def repair_once(table: str) -> Repair | None:
    """``repair`` the first time this process opens ``table`` (a cut ends every process, so
    later opens find nothing new); None when already checked or not local."""
    key = os.path.abspath(local_path(table)) if not is_remote(table) else table
    with _checked_lock:
        if key in _checked:
            return None
        _checked.add(key)
    return repair(table)


def repair(table: str) -> Repair | None:
    """Set aside what a power cut left at the tail of the local table ``table``; None for an
    object store (a PUT is whole) or a directory that is not a table."""
    if is_remote(table):
        return None
    root = os.path.abspath(local_path(table))
    log_dir = os.path.join(root, "_delta_log")
    try:
        names = os.listdir(log_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None
    checkpoints = _repair_checkpoints(root, log_dir, names)
    versions = sorted(
        (int(m.group(1)) for m in map(_COMMIT.match, names) if m is not None), reverse=True
    )
    set_aside: list[int] = []
    tail = True
    for version in versions[:_LOOK_BACK]:
        # Past the tail only empty or torn commits count: an older commit may name files that
        # a later one removed and a vacuum deleted.
        why = _torn(root, log_dir, version, check_files=tail)
        if why is None:
            tail = False
            continue
        log.warning("%s: version %d %s (left by a power cut); set aside", root, version, why)
        _set_aside(root, log_dir, version, why)
        set_aside.append(version)
    if set_aside:
        sync_directory(log_dir)
    return Repair(root, tuple(sorted(set_aside)), checkpoints)


def _torn(root: str, log_dir: str, version: int, *, check_files: bool) -> str | None:
    """Why version ``version``'s commit is one a cut left (None: it is sound)."""
    try:
        with open(os.path.join(log_dir, f"{version:020d}.json"), "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    if not text.strip(b"\0 \n"):
        return "is an empty commit file"
    actions = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            actions.append(json.loads(line))
        except ValueError:
            return "ends in a torn line"
    for action in actions if check_files else []:
        add = action.get("add") if isinstance(action, dict) else None
        if not isinstance(add, dict) or "path" not in add:
            continue
        relative = unquote(str(add["path"]))
        if "://" in relative:
            continue
        path = relative if relative.startswith("/") else os.path.join(root, relative)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return f"names a data file that is missing ({relative})"
        if "size" in add and size < int(add["size"]):
            return f"names a data file shorter than it says ({relative}: {size} < {add['size']})"
    return None


def _set_aside(root: str, log_dir: str, version: int, why: str) -> None:
    commit = os.path.join(log_dir, f"{version:020d}.json")
    aside = os.path.join(root, SET_ASIDE_DIR)
    os.makedirs(aside, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    shutil.copyfile(commit, os.path.join(aside, f"{version:020d}.json.{stamp}"))
    if version == 0:
        os.unlink(commit)
        return
    info = {
        "commitInfo": {
            "timestamp": int(time.time() * 1000),
            "operation": "REPAIR",
            "operationParameters": {"reason": f"the commit {why}, as a power cut leaves it"},
            "isBlindAppend": True,
            "engineInfo": f"deltaq/{__version__}",
        }
    }
    entry = (json.dumps(info, separators=(",", ":")) + "\n").encode()
    replace_synced(commit, os.path.join(aside, f"{uuid.uuid4().hex}.tmp"), entry)


def _repair_checkpoints(root: str, log_dir: str, names: list[str]) -> tuple[str, ...]:
    """Set aside checkpoint files that are not whole Parquet files, and a ``_last_checkpoint``
    that is torn or points at one: readers then replay the log from an older checkpoint."""
    bad: list[str] = []
    for name in names:
        if _CHECKPOINT.match(name) and not _whole_parquet(os.path.join(log_dir, name)):
            bad.append(name)
    pointer = os.path.join(log_dir, "_last_checkpoint")
    pointer_bad = False
    try:
        with open(pointer, "rb") as f:
            last = json.loads(f.read())
        version = int(last["version"])
        if any(n.startswith(f"{version:020d}.checkpoint") for n in bad) or not any(
            n.startswith(f"{version:020d}.checkpoint") for n in names
        ):
            pointer_bad = True
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        pointer_bad = True
    if pointer_bad:
        bad.append("_last_checkpoint")
    if not bad:
        return ()
    aside = os.path.join(root, SET_ASIDE_DIR)
    os.makedirs(aside, exist_ok=True)
    for name in bad:
        log.warning("%s: checkpoint file %s is torn (left by a power cut); set aside", root, name)
        os.replace(os.path.join(log_dir, name), os.path.join(aside, f"{name}.{uuid.uuid4().hex}"))
    sync_directory(log_dir)
    return tuple(bad)


def _whole_parquet(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 12:
                return False
            f.seek(-4, os.SEEK_END)
            tail = f.read(4)
            f.seek(0)
            return tail == _PARQUET_MAGIC and f.read(4) == _PARQUET_MAGIC
    except FileNotFoundError:
        return True
