"""Table upkeep off the publish path: checkpoints, compaction of small files, vacuum.

Constant small commits make a Delta table slow to open and to append to (the log to replay
grows) and slow to read (many small files). One background thread per process keeps every
table it is told about healthy. Compaction commits are ``dataChange=false`` and do not conflict
with appends; vacuum deletes only files removed longer ago than the retention, so readers that
are behind by less than that never find their files gone.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from queue_engine.settings import Settings
from queue_engine.store.delta.append import blind_appends_honoured
from queue_engine.store.delta.commit_log import latest_version
from queue_engine.store.storage.fs_sync import sync_checkpoint, sync_commits
from queue_engine.store.upkeep.compaction import compact_small_files, small_files

log = logging.getLogger(__name__)

# Opening a table lists its log. A local directory listed while a commit file is renamed
# into it may show the next commit but not this one (readdir's order is the directory's
# hash order, not creation order): delta-rs then sees a gap; the listing is taken again.
_GAP_RETRIES = 3


def _open(path: str) -> DeltaTable:
    for attempt in range(_GAP_RETRIES):
        try:
            return DeltaTable(path)
        except DeltaError as exc:
            if "gap" not in str(exc) or attempt == _GAP_RETRIES - 1:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


QUIET_MAX_ROUNDS = 60


@dataclass
class _Upkeep:
    last_checkpoint_version: int = -1
    last_checkpoint_s: float = float("-inf")
    known_version: int = -1
    last_compaction_s: float = float("-inf")
    last_vacuum_s: float = 0.0
    # The version the last vacuum saw, and when the version last moved: a table that has not
    # changed since its last vacuum has nothing new to vacuum until what its last commits
    # removed is older than the retention (then once more).
    vacuumed_version: int = -1
    changed_s: float = 0.0
    matured_vacuumed: bool = False
    # A table that stopped changing is probed less and less often (up to QUIET_MAX_ROUNDS
    # rounds apart): ten thousand idle tables do not mean ten thousand probes a second.
    quiet_rounds: int = 0
    next_probe_s: float = 0.0


@dataclass(frozen=True)
class MaintenancePolicy:
    checkpoint_interval_commits: int
    compact_min_small_files: int
    compact_target_file_bytes: int
    compact_interval_s: int
    vacuum_retention_hours: int
    vacuum_interval_s: int
    interval_ms: int
    # Seconds between two checkpoints of one table however fast it commits (settings: 10).
    checkpoint_min_interval_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> MaintenancePolicy:
        return cls(
            checkpoint_interval_commits=settings.checkpoint_interval_commits,
            compact_min_small_files=settings.compact_min_small_files,
            compact_target_file_bytes=settings.compact_target_file_bytes,
            compact_interval_s=settings.compact_interval_s,
            vacuum_retention_hours=settings.vacuum_retention_hours,
            vacuum_interval_s=settings.vacuum_interval_s,
            interval_ms=settings.maintenance_interval_ms,
            checkpoint_min_interval_s=settings.checkpoint_min_interval_s,
        )


@dataclass(frozen=True)
class UpkeepDone:
    """What one round of a table's upkeep did."""

    # The compaction's summary (None: none was due).
    compaction: str | None
    # The version checkpointed (None: no checkpoint was due).
    checkpoint_version: int | None
    # How many files a vacuum deleted (None: no vacuum was due).
    vacuumed: int | None
    # The process that did it.
    pid: int


def table_upkeep(
    path: str,
    policy: MaintenancePolicy,
    compaction_due: bool,
    checkpoint_due: bool,
    vacuum_due: bool,
) -> UpkeepDone:
    """Open the table and do what is due: compact (before the checkpoint, when enough small
    files wait), checkpoint, vacuum. In the maintenance process when there is one."""
    compaction: str | None = None
    checkpoint_version: int | None = None
    vacuumed: int | None = None
    try:
        dt = _open(path)
        opened = int(dt.version())
        if checkpoint_due:
            target = policy.compact_target_file_bytes
            if compaction_due and len(small_files(dt, target)) >= policy.compact_min_small_files:
                compaction = _compact(path, dt, target)
                dt.update_incremental()  # just the compaction's commit, not the whole log
            dt.create_checkpoint()
            checkpoint_version = dt.version()
            sync_checkpoint(path)
        if vacuum_due:
            removed = dt.vacuum(
                retention_hours=policy.vacuum_retention_hours,
                dry_run=False,
                enforce_retention_duration=False,
            )
            dt.cleanup_metadata()
            vacuumed = len(removed)
            # delta-rs records a vacuum as commits of its own (VACUUM START / END).
            dt.update_incremental()
            sync_commits(path, opened + 1, int(dt.version()))
    finally:
        # What delta-rs and Arrow allocated replaying the log and rewriting files goes back
        # to the system (it stayed with the allocator: ~20 MiB per few hundred commits).
        pa.default_memory_pool().release_unused()
    return UpkeepDone(compaction, checkpoint_version, vacuumed, os.getpid())


def _compact(path: str, dt: DeltaTable, target_file_bytes: int) -> str:
    if not blind_appends_honoured(dt):
        # Another engine enabled features deltaq does not write: compaction is that
        # engine's (OPTIMIZE); a second compactor could race it.
        return "left to the engine that enabled the table's features"
    done = compact_small_files(path, dt, target_file_bytes)
    return "nothing" if done is None else f"{done.files_removed} files -> 1"


class MaintenanceProcessError(RuntimeError):
    """A round in the maintenance process failed, or the process ended."""


def _start_worker() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "queue_engine.upkeep_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        # Ctrl-C in a terminal reaches the whole process group; the parent stops the child.
        start_new_session=True,
    )


def _end(worker: subprocess.Popen[bytes]) -> None:
    """Close the child's input (it exits at the end of its round) and reap it."""
    for pipe in (worker.stdin, worker.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        worker.wait(60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


class Maintenance:
    """A background thread that checkpoints, compacts and vacuums the tables it watches.

    With ``in_process=False`` the thread only decides what is due (probing for new commit
    files is cheap) and a child process does it (``queue_engine.upkeep_worker``, one round at a time
    over its stdin and stdout): opening a table replays its log through delta-rs and a
    compaction decodes its inputs, and in a serving process that memory stays with the
    allocators (measured: ~20 MiB more after a publish burst, peaks of +150 MiB while
    compacting). The child starts at the first round that has work and again if it dies; it
    exits when its input closes, so also when its parent is killed."""

    def __init__(
        self,
        policy: MaintenancePolicy,
        on_checkpoint: Callable[[str], None] | None = None,
        *,
        in_process: bool = True,
    ) -> None:
        self.policy = policy
        self._on_checkpoint = on_checkpoint
        self._in_process = in_process
        self._worker: subprocess.Popen[bytes] | None = None
        # One round at a time through the child's pipes.
        self._worker_lock = threading.Lock()
        self._tables: dict[str, _Upkeep] = {}
        # When each table is next probed (stale entries of unwatched tables are dropped when
        # due): a round visits only the tables due, not every table watched.
        self._schedule: list[tuple[float, int, str, _Upkeep]] = []
        self._scheduled = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltaq-maintenance", daemon=True)
        self.checkpoints = 0
        self.compactions = 0
        self.vacuums = 0
        # The process of the latest round that had work (this one, or the child).
        self.last_upkeep_pid: int | None = None

    def start(self) -> None:
        self._thread.start()

    def watch(self, path: str) -> None:
        with self._lock:
            if path not in self._tables:
                upkeep = self._tables[path] = _Upkeep(last_vacuum_s=time.monotonic())
                heapq.heappush(self._schedule, (0.0, next(self._scheduled), path, upkeep))

    def unwatch(self, path: str) -> None:
        with self._lock:
            self._tables.pop(path, None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            _end(worker)

    def process_resident_bytes(self) -> int | None:
        """The maintenance process's resident memory (Linux), or None while there is none."""
        worker = self._worker
        if worker is None or worker.poll() is not None:
            return None
        try:
            with open(f"/proc/{worker.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def _do(
        self, path: str, compaction_due: bool, checkpoint_due: bool, vacuum_due: bool
    ) -> UpkeepDone:
        request = (path, self.policy, compaction_due, checkpoint_due, vacuum_due)
        if self._in_process:
            return table_upkeep(*request)
        with self._worker_lock:
            if self._worker is None or self._worker.poll() is not None:
                self._worker = _start_worker()
            worker = self._worker
            assert worker.stdin is not None and worker.stdout is not None
            try:
                pickle.dump(request, worker.stdin)
                worker.stdin.flush()
                ok, answer = pickle.load(worker.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                # The child died (killed, out of memory): the next round starts another.
                self._worker = None
                _end(worker)
                raise MaintenanceProcessError(f"the maintenance process ended: {exc!r}") from exc
        if not ok:
            raise MaintenanceProcessError(answer)
        assert isinstance(answer, UpkeepDone)
        return answer

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_ms / 1000):
            now = time.monotonic()
            while not self._stop.is_set():
                with self._lock:
                    if not self._schedule or self._schedule[0][0] > now:
                        break
                    _, _, path, upkeep = heapq.heappop(self._schedule)
                    if self._tables.get(path) is not upkeep:
                        continue  # unwatched since
                try:
                    self.upkeep(path, upkeep)
                except Exception:
                    # A table deleted meanwhile, or a transient storage error: next round.
                    log.warning("maintenance of %s failed", path, exc_info=True)
                with self._lock:
                    if self._tables.get(path) is upkeep:
                        at = max(upkeep.next_probe_s, now + self.policy.interval_ms / 1000)
                        heapq.heappush(self._schedule, (at, next(self._scheduled), path, upkeep))

    def upkeep(self, path: str, upkeep: _Upkeep | None = None) -> None:
        """One round of upkeep for one table (public so tests and jobs can force it)."""
        if upkeep is None:
            with self._lock:
                upkeep = self._tables.setdefault(path, _Upkeep())
        started = time.perf_counter()
        # Probing for the next commit files is cheap; opening the table replays its log.
        version = latest_version(path, upkeep.known_version)
        if version == upkeep.known_version:
            upkeep.quiet_rounds = min(upkeep.quiet_rounds * 2 or 1, QUIET_MAX_ROUNDS)
        else:
            upkeep.quiet_rounds = 0
            upkeep.changed_s = time.monotonic()
        upkeep.next_probe_s = time.monotonic() + (
            upkeep.quiet_rounds * self.policy.interval_ms / 1000
        )
        upkeep.known_version = version
        checkpoint_due = (
            version - upkeep.last_checkpoint_version >= self.policy.checkpoint_interval_commits
            and time.monotonic() - upkeep.last_checkpoint_s >= self.policy.checkpoint_min_interval_s
        )
        vacuum_due = (
            time.monotonic() - upkeep.last_vacuum_s >= self.policy.vacuum_interval_s
            and self._vacuum_useful(upkeep, version)
        )
        if not (checkpoint_due or vacuum_due):
            return
        compaction_due = (
            time.monotonic() - upkeep.last_compaction_s >= self.policy.compact_interval_s
        )
        done = self._do(path, compaction_due, checkpoint_due, vacuum_due)
        self.last_upkeep_pid = done.pid
        elapsed_ms = (time.perf_counter() - started) * 1000
        if done.compaction is not None:
            upkeep.last_compaction_s = time.monotonic()
            self.compactions += 1
            log.info("compacted %s: %s (%.0f ms)", path, done.compaction, elapsed_ms)
        if done.checkpoint_version is not None:
            upkeep.last_checkpoint_version = done.checkpoint_version
            upkeep.last_checkpoint_s = time.monotonic()
            self.checkpoints += 1
            log.info(
                "checkpointed %s at version %d (%.0f ms)",
                path,
                done.checkpoint_version,
                elapsed_ms,
            )
            if self._on_checkpoint is not None:
                self._on_checkpoint(path)
        if done.vacuumed is not None:
            upkeep.last_vacuum_s = time.monotonic()
            self.vacuums += 1
            if upkeep.vacuumed_version == version:
                upkeep.matured_vacuumed = True
            else:
                upkeep.vacuumed_version = version
                upkeep.matured_vacuumed = False
            if done.vacuumed:
                log.info("vacuumed %d files from %s", done.vacuumed, path)

    def _vacuum_useful(self, upkeep: _Upkeep, version: int) -> bool:
        """Whether a vacuum may find files to delete: the table changed since the last one, or
        what its last commits removed has since passed the retention (once)."""
        if version != upkeep.vacuumed_version:
            return True
        matured_at = upkeep.changed_s + self.policy.vacuum_retention_hours * 3600
        return not upkeep.matured_vacuumed and time.monotonic() >= matured_at
