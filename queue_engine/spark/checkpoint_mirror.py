"""The fanout's streaming checkpoint in an object store that Spark itself cannot write.

Spark keeps a stream's checkpoint through Hadoop's FileSystem, so an ``s3://`` checkpoint needs
the store's connector (hadoop-aws) on Spark's classpath. Where there is none, the fanout runs
on a local working copy that mirrors the checkpoint kept in the store:

- at start the local copy is made from the store (the store is the truth, so a driver on
  another machine, or after kill -9, resumes where the last one got to);
- before a micro-batch writes any channel, every checkpoint file Spark wrote since the last
  push goes to the store. Spark logs batch N's offsets before it runs the batch and batch
  N-1's commit after that one finished, so a batch whose rows may be in a channel is always
  in the store's offsets log: a new driver replays it with the same offsets, and the channels
  skip it by their app transaction. Without that order a new driver would plan batch N again
  over a different range of versions, and the channels would skip rows they never had;
- a batch's commit file goes with the next batch, or at a clean stop (a lost one only
  replays that batch, which the channels skip);
- files Spark purged locally (batches older than it retains) are deleted from the store.

Only the driver writes a stateless query's checkpoint, so a local copy on the driver serves a
cluster as well as one machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

from queue_engine.store.storage import (
    StoreError,
    delete_objects,
    list_objects,
    put_objects,
    read_objects,
)

log = logging.getLogger(__name__)


class CheckpointMirror:
    """A local directory Spark checkpoints into, mirrored to ``url`` in an object store."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.local = tempfile.mkdtemp(prefix="deltaq-fanout-checkpoint-")
        # Relative path -> (size, mtime) of each file the store holds from this copy.
        self._pushed: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def restore(self) -> int:
        """Make the local copy from the store; the number of files."""
        try:
            relatives = [r for r in list_objects(self.url) if not _hidden(r)]
            bodies = read_objects([f"{self.url}/{r}" for r in relatives])
        except Exception as exc:
            raise StoreError(f"fanout checkpoint {self.url}: cannot read it: {exc}") from exc
        for relative, body in zip(relatives, bodies, strict=True):
            if body is None:  # deleted meanwhile: another driver purged it
                continue
            path = os.path.join(self.local, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(body)
            self._pushed[relative] = _signature(path)
        log.info(
            "fanout checkpoint %s: %d files, run from the local copy %s (Spark has no "
            "FileSystem for the store; files go back to it before each batch writes)",
            self.url,
            len(self._pushed),
            self.local,
        )
        return len(self._pushed)

    def push(self) -> int:
        """Put every file Spark added or changed since the last push in the store (all at
        once: one round trip on the batch's path), then delete the ones it purged; the number
        of files put."""
        with self._lock:
            present: dict[str, tuple[int, int]] = {}
            for directory, _, names in os.walk(self.local):
                for name in names:
                    path = os.path.join(directory, name)
                    relative = os.path.relpath(path, self.local).replace(os.sep, "/")
                    if not _hidden(relative):
                        present[relative] = _signature(path)
            changed = sorted(r for r, sig in present.items() if self._pushed.get(r) != sig)
            # Batch N's offsets may land before batch N-1's commit: a store left with offsets
            # N and commits up to N-2 makes Spark warn and run batch N again from offsets N-1,
            # which is what it would do anyway.
            if changed:
                put_objects([(f"{self.url}/{r}", _read(self.local, r)) for r in changed])
            for relative in changed:
                self._pushed[relative] = present[relative]
            purged = sorted(self._pushed.keys() - present.keys())
            if purged:
                delete_objects([f"{self.url}/{r}" for r in purged])
                for relative in purged:
                    del self._pushed[relative]
            return len(changed)

    def close(self) -> None:
        """Push what is left (the last batch's commit) and remove the local copy."""
        try:
            self.push()
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the local copy, pushing nothing (the stream never started on it)."""
        shutil.rmtree(self.local, ignore_errors=True)


def _hidden(relative: str) -> bool:
    """Hadoop's checksum files (``.N.crc``) and Spark's temporary files are not the log."""
    return any(part.startswith(".") for part in relative.split("/"))


def _signature(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _read(root: str, relative: str) -> bytes:
    with open(os.path.join(root, relative), "rb") as f:
        return f.read()
