"""Spark's streaming checkpoint on a local disk, made to survive a power cut.

Spark writes its offset and commit logs (``offsets/N``, ``commits/N``, each with a Hadoop
``.N.crc`` beside it) by rename and never syncs them. After a cut one can be empty or torn,
and Spark then refuses to start the query. Two steps keep the fanout exactly once:

- before a micro-batch's rows reach any channel, its ``offsets/N`` (and the previous batch's
  ``commits/N-1``) are synced: a channel commit recording batch N (its ``txn``) is never
  durable while the offsets that define batch N are not;
- at start, a torn or empty file at the tail of either log is set aside. A lost ``offsets/N``
  means no channel recorded batch N (it was synced first); a lost ``commits/N`` makes Spark
  run batch N again with the same offsets, which every channel skips by its ``txn``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from typing import Any

from queue_engine.store.storage import sync_directory, sync_file

log = logging.getLogger(__name__)

_BATCH = re.compile(r"^\d+$")
SET_ASIDE_DIR = "_deltaq_set_aside"


def local_checkpoint(location: str) -> str | None:
    """The local directory of a checkpoint location (None: not on a local filesystem)."""
    if location.startswith("file://"):
        return location[len("file://") :]
    if location.startswith("file:"):
        return location[len("file:") :]
    if "://" in location:
        return None
    return location


def sync_batch(location: str, batch_id: int) -> None:
    """Make batch ``batch_id``'s offsets and the previous batch's commit durable."""
    root = local_checkpoint(location)
    if root is None:
        return
    synced = False
    for log_name, batch in (("offsets", batch_id), ("commits", batch_id - 1)):
        directory = os.path.join(root, log_name)
        # Each log on its own: before its first commit the commit log has no directory yet
        # (a fanout killed in its first batch), and nothing of it needs syncing.
        found = False
        for name in (str(batch), f".{batch}.crc"):
            try:
                sync_file(os.path.join(directory, name))
                found = True
            except FileNotFoundError:
                continue
        if found:
            sync_directory(directory)
            synced = True
    if batch_id == 0 or not synced:
        # The first batch: the query's metadata and the logs' directories themselves.
        for name in ("metadata", ".metadata.crc"):
            try:
                sync_file(os.path.join(root, name))
            except FileNotFoundError:
                continue
        sync_directory(root)
        sync_directory(os.path.dirname(os.path.abspath(root)))


def logged_offsets(root: str, batch_id: int) -> dict[str, Any]:
    """The end offset of a single-source query's batch ``batch_id`` as its offset log holds
    it (``{}``: before the first batch), read from the local checkpoint ``root``."""
    if batch_id < 0:
        return {}
    with open(os.path.join(root, "offsets", str(batch_id)), "rb") as f:
        lines = [line for line in f.read().split(b"\n") if line.strip()]
    # "v1", the batch's metadata, then one line per source: this query has one.
    if len(lines) != 3:
        raise ValueError(f"offsets/{batch_id} of {root}: {len(lines)} lines, not 3")
    line = _source_line(lines[2].strip())
    if line == b"-":
        return {}
    offset: dict[str, Any] = json.loads(line)
    return offset


def _source_line(line: bytes) -> bytes:
    """A source's offset as Spark logs it: ``{...}`` or ``-`` (format 1), the same after the
    source's id and a colon (format 2, ``0:{...}``)."""
    match = re.fullmatch(rb"\d+:(.*)", line, flags=re.DOTALL)
    return match.group(1) if match else line


def repair_checkpoint(location: str) -> list[str]:
    """Set aside the torn or empty files at the tail of the offset and commit logs (what a
    power cut leaves); returns their paths."""
    root = local_checkpoint(location)
    if root is None or not os.path.isdir(root):
        return []
    set_aside: list[str] = []
    metadata = os.path.join(root, "metadata")
    if os.path.exists(metadata) and not _sound_metadata(metadata):
        # Synced with the first batch's offsets: torn, no batch ever reached a channel, and
        # Spark starts the query afresh.
        _set_aside(root, metadata, "metadata")
        set_aside.append(metadata)
        sync_directory(root)
    for log_name in ("offsets", "commits"):
        directory = os.path.join(root, log_name)
        try:
            batches = sorted(
                (int(n) for n in os.listdir(directory) if _BATCH.match(n)), reverse=True
            )
        except FileNotFoundError:
            continue
        for batch in batches:
            path = os.path.join(directory, str(batch))
            if _sound(path):
                # Its checksum may not have reached the disk with it: Hadoop reads a log
                # file without a .crc, and refuses one whose .crc disagrees.
                crc = os.path.join(directory, f".{batch}.crc")
                if os.path.exists(crc):
                    os.unlink(crc)
                break
            _set_aside(root, path, f"{log_name}-{batch}")
            log.warning(
                "fanout checkpoint: %s/%d was torn (left by a power cut); set aside",
                log_name,
                batch,
            )
            set_aside.append(path)
        if set_aside:
            sync_directory(directory)
    return set_aside


def _set_aside(root: str, path: str, name: str) -> None:
    """Move a torn log file out of Spark's way (kept for a look), with its Hadoop checksum."""
    aside = os.path.join(root, SET_ASIDE_DIR)
    os.makedirs(aside, exist_ok=True)
    os.replace(path, os.path.join(aside, f"{name}-{uuid.uuid4().hex}"))
    directory, base = os.path.split(path)
    crc = os.path.join(directory, f".{base}.crc")
    if os.path.exists(crc):
        os.unlink(crc)


def _sound_metadata(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return "id" in json.loads(f.read().splitlines()[0])
    except (ValueError, IndexError):
        return False


def _sound(path: str) -> bool:
    """Whether a log file is whole: a version line, then JSON lines (``-``: a source with no
    offset yet)."""
    with open(path, "rb") as f:
        text = f.read()
    lines = [line for line in text.split(b"\n") if line.strip()]
    if len(lines) < 2 or not re.fullmatch(rb"v\d+", lines[0].strip()):
        return False
    for raw in lines[1:]:
        line = _source_line(raw.strip())
        if line == b"-":
            continue
        try:
            json.loads(line)
        except ValueError:
            return False
    return True
