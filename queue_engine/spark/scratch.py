"""Where a local Spark driver keeps its scratch files, and the leftovers of drivers that died.

A local session copies every jar on its classpath into a ``spark-<uuid>/userFiles-*``
directory under ``spark.local.dir`` (~86 MB with delta-spark's), beside its block manager's
files, and deletes them from a JVM shutdown hook. A driver killed with ``kill -9``, the OOM
killer or a power cut never runs that hook, so every crash of ``deltaq up``'s jobs process,
which ``deltaq up`` then restarts, left its 86 MB in ``/tmp`` for good.

Each driver process therefore gets a directory of its own under
``$TMPDIR/deltaq-spark-<uid>/``, with a lock file it holds (``flock``) for as long as it
lives: the kernel releases the lock however the process ends. Every local session that starts
removes the directories whose lock it can take, the leftovers of drivers no longer running.
Where ``SPARK_LOCAL_DIRS`` is set (Spark's own setting, which wins over ``spark.local.dir``)
the user has chosen, and deltaq leaves Spark's scratch space alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

LOCK = "owner.lock"
# A directory without its lock file: a driver that died between making the directory and
# taking the lock (a few microseconds), or one still doing so. Swept once this old.
UNLOCKED_GRACE_S = 600.0

# This process's directory and the open lock file that holds it (one per process: a second
# session of the same driver shares it).
_held: tuple[Path, int] | None = None


def root() -> Path:
    """The parent of every driver's scratch directory on this machine, for this user."""
    return Path(tempfile.gettempdir()) / f"deltaq-spark-{os.getuid()}"


def local_dir() -> str | None:
    """This process's scratch directory for ``spark.local.dir``, made and locked on first use,
    after removing those of drivers no longer running (None: ``SPARK_LOCAL_DIRS`` is set, or
    no private directory could be made; Spark then uses its default)."""
    global _held
    if os.environ.get("SPARK_LOCAL_DIRS"):
        return None
    if _held is not None:
        if _held[0].is_dir():
            return str(_held[0])
        os.close(_held[1])  # removed under it (a cleaner of /tmp): take a new one
        _held = None
    parent = root()
    try:
        parent.mkdir(mode=0o700, exist_ok=True)
        info = parent.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            # Someone else's, or open to others: not a place for this user's files.
            log.warning("%s is not private to this user; Spark keeps its default", parent)
            return None
        sweep(parent)
        mine = parent / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        mine.mkdir(mode=0o700)
        fd = os.open(mine / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        log.warning("could not make a scratch directory under %s", parent, exc_info=True)
        return None
    _held = (mine, fd)
    return str(mine)


def sweep(parent: Path) -> list[Path]:
    """Remove the scratch directories under ``parent`` whose driver no longer runs: those whose
    lock can be taken. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if _held is not None and entry == _held[0]:
            continue
        if _stale(entry):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    if removed:
        log.info("removed the Spark scratch files of %d driver(s) no longer running", len(removed))
    return removed


def _stale(entry: Path) -> bool:
    """Whether ``entry``'s driver is gone: its lock can be taken (or, without a lock file,
    it is older than UNLOCKED_GRACE_S)."""
    try:
        fd = os.open(entry / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return entry.is_dir() and time.time() - entry.stat().st_mtime > UNLOCKED_GRACE_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        # Taken, it is dropped again when fd closes: nobody takes over a dead driver's
        # directory (a driver starting makes one of its own).
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # BlockingIOError: its driver holds it
        return False
    finally:
        os.close(fd)
