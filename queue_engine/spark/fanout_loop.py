"""The fanout on one machine without Spark's micro-batch machinery: the same batches, the same
checkpoint, the same channel commits, planned and run by a loop in this process.

Under ``deltaq up`` a Spark micro-batch cost 150-1,500 ms of fixed work on two cores (the
trigger's planning, the offset and commit log entries through Hadoop, the ``foreachBatch``
call over py4j) for a few hundred rows that take 20-30 ms to read and write: most of a
message's way from its topic to its channel. This loop does what Spark's ``MicroBatchExecution``
does for the fanout's single stateless source, in Spark's own checkpoint format, so a
checkpoint either of them wrote is resumed by the other:

- it sizes batch N with the topics stream's own ``latestOffset`` (file and row budgets, the
  topic rotation, paused topics);
- it writes ``offsets/N`` (``v1``, the batch's metadata, the offset), synced, before any
  channel commit records batch N (and pushed first where the checkpoint is in a store);
- it reads the files of (offsets N-1, offsets N] and appends each channel's rows with the app
  transaction ("deltaq-fanout", N), as the Spark path's ``foreachBatch`` does;
- it writes ``commits/N``, synced;
- on start, a batch whose offsets are logged and whose commit is not is run again with the
  same offsets: every channel that has it skips it.

Exactly once therefore rests on the same argument as the Spark path (queue_engine.spark.
fanout_stream): a batch is defined by its logged offsets before any channel sees it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from pyspark.sql.streaming.datasource import ReadMaxFiles

from queue_engine.fanout import MAX_FILES_PER_TRIGGER
from queue_engine.spark.checkpoint_mirror import CheckpointMirror
from queue_engine.spark.checkpoint_sync import (
    local_checkpoint,
    logged_offsets,
    repair_checkpoint,
    sync_batch,
)
from queue_engine.spark.fanout_stream import (
    ChannelSinks,
    Moved,
    fanout_batch,
    refuse_foreign_history,
)
from queue_engine.spark.source import (
    DEFAULT_FILES_PER_PARTITION,
    TopicsBatchReader,
    TopicsStreamReader,
)
from queue_engine.store.storage import sync_directory
from queue_engine.store.tables import NoticeWriter, Warehouse

log = logging.getLogger(__name__)

# A probe of the topics for new versions costs a file check per topic with a channel and a
# pass over every topic: the loop probes at most every MIN_BATCH_INTERVAL_S, and while probes
# find nothing the wait doubles from there up to IDLE_POLL_MAX_S. Measured under deltaq up
# with 1,000 topics: probing every 10 ms cost the jobs process a fifth of a core, and the
# API's publishing slowed by as much.
MIN_BATCH_INTERVAL_S = 0.05
IDLE_POLL_MAX_S = 0.2
# The loop runs up to 20 batches a second: each gets a log line only with ``log_batches``
# (else at DEBUG), a batch slower than SLOW_BATCH_S always; and a summary line every
# SUMMARY_S while batches run.
SLOW_BATCH_S = 1.0
SUMMARY_S = 60.0
# Rows a batch reads at most. The loop reads, routes and writes a batch in this process, a
# copy or two of its rows at once. On a backlog of a million 200-byte messages: 200,000
# (Spark's cap for the rows its driver collects) peaked at 568 MiB and moved 309,000 msg/s;
# 50,000 at 418 MiB and 248,000 msg/s; 20,000 at 379 MiB and 188,000 msg/s.
LOOP_MAX_ROWS_PER_BATCH = 50_000
# Batches whose offset and commit log entries are kept (Spark's minBatchesToRetain default).
RETAIN_BATCHES = 100
# Spark's metadata line of an offset log entry: the fields it reads back, and the SQL
# settings it records for a stateless query (a resumed Spark query takes them from here).
_CONF = {
    "spark.sql.streaming.stateStore.providerClass": (
        "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
    ),
    "spark.sql.streaming.multipleWatermarkPolicy": "min",
    "spark.sql.streaming.aggregation.stateFormatVersion": "2",
    "spark.sql.streaming.flatMapGroupsWithState.stateFormatVersion": "2",
    "spark.sql.streaming.join.stateFormatVersion": "2",
    "spark.sql.streaming.stateStore.compression.codec": "lz4",
    "spark.sql.shuffle.partitions": "2",
}


# Stores the loop keeps a checkpoint in (a local copy mirrored there, as the Spark query does
# where Spark has no FileSystem for them). A checkpoint on a Hadoop FileSystem (s3a://,
# hdfs://, ...) is Spark's to keep: such a fanout runs as Spark's query.
LOOP_STORES = ("s3", "gs", "abfs", "abfss")


def loop_keeps(checkpoint: str | None) -> bool:
    """Whether the loop can keep the checkpoint at ``checkpoint`` (None: the warehouse's
    default, which is where the warehouse is)."""
    if checkpoint is None or local_checkpoint(checkpoint) is not None:
        return True
    return checkpoint.split("://", 1)[0] in LOOP_STORES


class FanoutLoop:
    """The fanout as a thread of this process; the interface of the Spark query it replaces
    (``isActive``, ``exception``, ``stop``, ``awaitTermination``)."""

    def __init__(
        self,
        warehouse: Warehouse,
        *,
        once: bool,
        checkpoint: str | None = None,
        max_files_per_trigger: int = MAX_FILES_PER_TRIGGER,
        max_rows_per_trigger: int = LOOP_MAX_ROWS_PER_BATCH,
        log_batches: bool = False,
    ) -> None:
        self.warehouse = warehouse
        self.log_batches = log_batches
        # Since the last summary line: batches, rows, and each batch's seconds.
        self._summary_at = time.monotonic()
        self._summary: list[float] = []
        self._summary_rows = 0
        self.once = once
        self.moved = Moved()
        location = checkpoint or f"{warehouse.checkpoints_root}/fanout"
        self._mirror: CheckpointMirror | None = None
        root = local_checkpoint(location)
        if root is None:  # in a store: run on a local copy mirrored there
            self._mirror = CheckpointMirror(location)
            self._mirror.restore()
            root = self._mirror.local
        self.location = location
        self.root = root
        self._offsets = TopicsStreamReader(
            warehouse.root,
            DEFAULT_FILES_PER_PARTITION,
            max_files_per_trigger,
            max_rows_per_trigger,
        )
        self._batches = TopicsBatchReader(warehouse.root)
        # One reader for sizing and routing: a change is read once.
        self._registry = self._offsets.registry_reader
        self._sinks = ChannelSinks(warehouse)
        self._notices = NoticeWriter(warehouse.root, "fanout")
        self._recorded_conf: dict[str, str] | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- the query's interface --------------------------------------------------------------

    def start(self) -> FanoutLoop:
        """Check the checkpoint (repairing a torn tail, refusing a foreign history), then run
        the batches in a thread."""
        try:
            repair_checkpoint(self.root)
            self._discard_temporaries()
            self._ensure_metadata()
            if self._latest_logged() < 0:
                refuse_foreign_history(self.warehouse, self._registry.get(), self.location)
        except BaseException:
            if self._mirror is not None:
                self._mirror.discard()
            raise
        self._thread = threading.Thread(target=self._run, name="deltaq-fanout", daemon=True)
        self._thread.start()
        return self

    @property
    def isActive(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def stop(self) -> None:
        """Stop after the batch under way (which finishes: its channels and commit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def awaitTermination(self, timeout: float | None = None) -> bool:
        """Whether the loop has ended within ``timeout`` seconds."""
        return self._done.wait(timeout)

    # -- the batches ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.exception("fanout failed")
            self._error = exc
        finally:
            if self._mirror is not None:
                try:
                    self._mirror.close()
                except Exception:
                    log.exception("fanout checkpoint %s: last files not pushed", self.location)
            self._done.set()

    def _loop(self) -> None:
        latest = self._latest_logged()
        batch_id = latest + 1
        start = logged_offsets(self.root, latest)
        if latest >= 0 and not self._committed(latest):
            # Logged and perhaps partly written before a crash: run again with its offsets,
            # made durable first (a crash may have come before they were synced: channels
            # must never hold a batch whose offsets a power cut could take back).
            sync_batch(self.root, latest)
            batch_id = latest
            start = logged_offsets(self.root, latest - 1)
            self._run_batch(batch_id, start, logged_offsets(self.root, latest))
            start = logged_offsets(self.root, latest)
            batch_id += 1
        if self.once:
            self._offsets.prepareForTriggerAvailableNow()
        limit = ReadMaxFiles(self._offsets.max_files)
        wait = MIN_BATCH_INTERVAL_S
        while not self._stop.is_set():
            probed = time.monotonic()
            end = self._offsets.latestOffset(start, limit)
            if end == start:
                if self.once:
                    return
                self._stop.wait(wait)
                wait = min(wait * 2, IDLE_POLL_MAX_S)
                continue
            self._log_offsets(batch_id, end)
            self._run_batch(batch_id, start, end)
            start = end
            batch_id += 1
            wait = MIN_BATCH_INTERVAL_S
            self._stop.wait(max(0.0, probed + MIN_BATCH_INTERVAL_S - time.monotonic()))

    def _run_batch(self, batch_id: int, start: dict[str, Any], end: dict[str, Any]) -> None:
        started = time.perf_counter()
        before: Callable[[], object] | None = None
        if self._mirror is not None:
            before = self._mirror.push  # offsets N in the store before any channel has N
        rows = fanout_batch(
            lambda: self._batches.rows(start, end),
            batch_id,
            self._registry,
            self._sinks,
            self._notices,
            before,
            log_level=logging.INFO if self.log_batches else logging.DEBUG,
        )
        self._log_commit(batch_id)
        self._offsets.commit(end)
        self.moved.rows += rows
        self.moved.batches += 1
        if batch_id % RETAIN_BATCHES == 0:
            self._purge(batch_id - RETAIN_BATCHES)
        took = time.perf_counter() - started
        if took >= SLOW_BATCH_S and not self.log_batches:
            log.info("fanout batch %d: %d rows in %.0f ms", batch_id, rows, took * 1000)
        self._summarize(took, rows)

    def _summarize(self, took: float, rows: int) -> None:
        """One line a minute while batches run: how many, their rows, their durations."""
        self._summary.append(took)
        self._summary_rows += rows
        now = time.monotonic()
        if now - self._summary_at < SUMMARY_S:
            return
        times = sorted(self._summary)
        log.info(
            "fanout: %d batches, %d messages in the last %.0f s; a batch p50 %.0f ms, "
            "p99 %.0f ms, max %.0f ms",
            len(times),
            self._summary_rows,
            now - self._summary_at,
            times[len(times) // 2] * 1000,
            times[min(len(times) - 1, int(len(times) * 0.99))] * 1000,
            times[-1] * 1000,
        )
        self._summary_at, self._summary, self._summary_rows = now, [], 0

    # -- Spark's checkpoint format ----------------------------------------------------------

    def _discard_temporaries(self) -> None:
        """Temporary files a kill left before their rename (never part of the log)."""
        for log_name in ("offsets", "commits"):
            directory = os.path.join(self.root, log_name)
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    if name.startswith(".") and name.endswith(".tmp"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(directory, name))

    def _ensure_metadata(self) -> None:
        path = os.path.join(self.root, "metadata")
        if not os.path.exists(path):
            os.makedirs(self.root, exist_ok=True)
            _write_durably(path, json.dumps({"id": str(uuid.uuid4())}).encode())
            sync_directory(os.path.dirname(os.path.abspath(self.root)))

    def _batch_ids(self, log_name: str) -> list[int]:
        try:
            names = os.listdir(os.path.join(self.root, log_name))
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def _latest_logged(self) -> int:
        ids = self._batch_ids("offsets")
        return ids[-1] if ids else -1

    def _committed(self, batch_id: int) -> bool:
        return os.path.exists(os.path.join(self.root, "commits", str(batch_id)))

    def _log_offsets(self, batch_id: int, end: dict[str, Any]) -> None:
        metadata = {
            "batchWatermarkMs": 0,
            "batchTimestampMs": int(time.time() * 1000),
            "conf": self._conf(),
        }
        body = f"v1\n{json.dumps(metadata, separators=(',', ':'))}\n{json.dumps(end)}"
        _write_durably(os.path.join(self.root, "offsets", str(batch_id)), body.encode())

    def _conf(self) -> dict[str, str]:
        """The SQL settings the last logged batch recorded (Spark keeps a query's settings for
        its life), else Spark's for a new stateless query; read once."""
        if self._recorded_conf is None:
            self._recorded_conf = dict(_CONF)
            latest = self._latest_logged()
            if latest >= 0:
                with open(os.path.join(self.root, "offsets", str(latest)), "rb") as f:
                    lines = f.read().split(b"\n")
                with contextlib.suppress(ValueError, IndexError):
                    self._recorded_conf = json.loads(lines[1]).get("conf", self._recorded_conf)
        return self._recorded_conf

    def _log_commit(self, batch_id: int) -> None:
        # Not synced (as Spark does not): a commit lost to a power cut makes the batch run
        # again with its logged offsets, which every channel skips; a torn one is set aside
        # at start (repair_checkpoint).
        body = b'v1\n{"nextBatchWatermarkMs":0}'
        _write_durably(os.path.join(self.root, "commits", str(batch_id)), body, sync=False)

    def _purge(self, below: int) -> None:
        """Drop log entries of batches before ``below`` (Spark keeps the last 100 too)."""
        for log_name in ("offsets", "commits"):
            for batch_id in self._batch_ids(log_name):
                if batch_id >= below:
                    break
                for name in (str(batch_id), f".{batch_id}.crc"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.root, log_name, name))


def _write_durably(path: str, body: bytes, *, sync: bool = True) -> None:
    """``body`` at ``path``, whole or not at all: a temporary file renamed over; with ``sync``
    on disk before this returns (the file synced before the rename, then the directory)."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        # The new directory's own entry, or its files could be lost with it.
        sync_directory(os.path.dirname(directory))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as f:
        f.write(body)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temporary, path)
    if sync:
        sync_directory(directory)
    # A checksum Hadoop wrote for an earlier file of this name would no longer match.
    crc = os.path.join(directory, f".{os.path.basename(path)}.crc")
    if os.path.exists(crc):
        os.unlink(crc)
