"""Blind appends to a Delta table: deltaq's own appenders where the table's protocol allows,
delta-rs everywhere else.

Why a second path: a delta-rs ``write_deltalake`` append costs 5-12 ms here however small the
batch, and a closed-loop publisher waits for it, so it caps /pub throughput. A blind append
is the simplest thing in the Delta protocol: write one Parquet file, then create
``_delta_log/<version>.json`` holding ``commitInfo`` + ``add``, failing if that version exists
(put-if-absent: an atomic no-replace rename, see ``put_if_absent``). That takes ~1 ms. On an
object store the same two steps are two PUTs (``ObjectStoreAppender``). They are used only
where the table's protocol is one these writers fully honour (reader 1, writer <= 2, no table
features, no column invariants); otherwise every append goes through delta-rs, and a table whose
features neither honours is refused (``table_features``).

Another engine may change the protocol or metadata at any version. A fast appender reads every
commit between the version it last read and the one it appends after (on reopen as much as on
a lost race): a commit carrying ``protocol`` or ``metaData`` makes it step aside, and the table
is judged afresh (``append_or_fall_back``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import CommitProperties, PostCommitHookProperties, Transaction

from queue_engine import __version__
from queue_engine.store.delta.commit_log import commit_actions, latest_version
from queue_engine.store.delta.spare_files import SpareFiles
from queue_engine.store.delta.table_features import (
    TableRefusedError,
    check_constraints,
    table_refusal,
    unsupported_features,
)
from queue_engine.store.storage.fs_sync import sync_commits, sync_directory, sync_file, write_synced
from queue_engine.store.storage.object_store import store_and_key
from queue_engine.store.storage.paths import is_remote
from queue_engine.store.storage.put_if_absent import move_if_absent

log = logging.getLogger(__name__)

# Checkpoints and log cleanup run in the maintenance thread, never inside a publish's commit.
_NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
_ATTEMPTS = 4
_MAX_COMMIT_RACES = 1000
# String statistics are exact only up to Delta's 32-character truncation; ids are 16.
# topic_version (channel tables): the restart skips files by its bounds.
_STAT_COLUMNS = ("id", "topic_version")

# Told the actions of a commit that took the version an append wanted; raises if the append
# must not go on to the next version.
CheckWinner = Callable[[list[Any]], None]


class Appender(Protocol):
    def append(
        self, table: pa.Table, txn: Transaction | None = None, user_metadata: str | None = None
    ) -> int:
        """Commit ``table`` as one new version, recording the app transaction ``txn`` in the
        same commit when given, and ``user_metadata`` as its commitInfo's ``userMetadata``
        (Delta's field for it, which delta-spark's ``userMetadata`` option writes too);
        return that version. No rows: a commit of no data file."""

    def reopen(self, known: int | None = None) -> None:
        """Start from a fresh view of the table (after a checkpoint or an error); ``known``:
        the newest version the caller has read, which the next append follows."""

    def close(self) -> None:
        """Release what the appender holds (no more appends follow)."""


class DeltaRsAppender:
    """Appends through delta-rs with one long-lived handle (any storage, any protocol)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._dt = DeltaTable(path)

    def reopen(self, known: int | None = None) -> None:
        self._dt = DeltaTable(self.path)

    def close(self) -> None:
        pass

    def append(
        self, table: pa.Table, txn: Transaction | None = None, user_metadata: str | None = None
    ) -> int:
        props = None
        if txn is not None or user_metadata is not None:
            props = CommitProperties(
                app_transactions=[txn] if txn is not None else None,
                custom_metadata=(
                    {"userMetadata": user_metadata} if user_metadata is not None else None
                ),
            )
        for attempt in range(1, _ATTEMPTS + 1):
            before = int(self._dt.version())
            try:
                write_deltalake(
                    self._dt,
                    table,
                    mode="append",
                    commit_properties=props,
                    post_commithook_properties=_NO_HOOKS,
                )
                version = int(self._dt.version())
                # delta-rs does not sync what it writes: before anyone relies on the commit.
                sync_commits(self.path, before + 1, version)
                return version
            except CommitFailedError as exc:
                features = unsupported_features(str(exc))
                if features:
                    # No retry makes a feature delta-rs lacks appear: refuse the table.
                    raise TableRefusedError(self.path, features[0]) from exc
                # delta-rs raises this only when its own retries found no free version, so the
                # commit did not land: retrying cannot duplicate the batch.
                if attempt == _ATTEMPTS:
                    raise
                log.warning("commit to %s conflicted (attempt %d), retrying", self.path, attempt)
                self.reopen()
            except DeltaError as exc:
                if "failed validation check" in str(exc) or "Invariant violations" in str(exc):
                    raise ConstraintViolation(self.path, check_constraints(self._dt)) from exc
                raise
        raise AssertionError("unreachable")


class ConstraintViolation(ValueError):
    """Rows of an append broke a CHECK constraint or invariant of the table: nothing of the
    append was committed."""

    def __init__(self, path: str, constraints: dict[str, str]) -> None:
        named = ", ".join(f"{name} ({expr})" for name, expr in sorted(constraints.items()))
        self.reason = "the table's constraints refused the rows" + (
            f": CHECK {named}" if named else " (a column invariant)"
        )
        super().__init__(f"{path}: {self.reason}")
        self.constraints = constraints


class RefusedAppender:
    """The appender of a refused table: every append raises TableRefusedError, nothing is
    written (``refusal`` says why)."""

    def __init__(self, path: str, feature: str) -> None:
        self.path = path
        self.refusal = TableRefusedError(path, feature)

    def reopen(self, known: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass

    def append(
        self, table: pa.Table, txn: Transaction | None = None, user_metadata: str | None = None
    ) -> int:
        raise self.refusal


class LocalAppender:
    """Blind appends on a local filesystem: one Parquet file + one put-if-absent log entry."""

    def __init__(
        self, path: str, version: int | None = None, check_winner: CheckWinner | None = None
    ) -> None:
        """``version``: the table's latest version, when the caller has just loaded it;
        ``check_winner``: what a commit that took the version first may be (default: anything
        but a metadata or protocol change)."""
        self.path = os.path.abspath(path)
        self._check_winner = check_winner or _refuse_schema_change
        self._log_dir = os.path.join(self.path, "_delta_log")
        self._next_version = (DeltaTable(path).version() if version is None else version) + 1
        self._stale: str | None = None
        self._spares = SpareFiles(self.path)

    def reopen(self, known: int | None = None) -> None:
        # Probe onwards from the versions known: opening the table would replay its log.
        target = latest_version(self.path, self._next_version - 1) if known is None else known
        self._stale = self._stale or skipped_change(self.path, self._next_version, target)
        self._next_version = target + 1

    def close(self) -> None:
        self._spares.close()

    def append(
        self, table: pa.Table, txn: Transaction | None = None, user_metadata: str | None = None
    ) -> int:
        if self._stale:
            raise ProtocolChangedError(self._stale)
        if table.num_rows:
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            file_path = os.path.join(self.path, name)
            buffer = pa.BufferOutputStream()
            pq.write_table(table, buffer, compression="snappy")
            data = buffer.getvalue()
            spare = self._spares.take()
            # Synced, then renamed into place: the data file never exists half-written, and
            # is durable before the commit that names it.
            write_synced(spare, data)
            os.rename(spare, file_path)
            entry = blind_append_entry(name, data.size, table, txn, user_metadata)
        else:
            entry = blind_append_entry(None, 0, table, txn, user_metadata)
        staging = self._spares.take()
        write_synced(staging, entry)
        try:
            version = put_log_entry(self._log_dir, self._next_version, staging, self._check_winner)
        except BaseException:
            os.unlink(staging)
            raise
        self._next_version = version + 1
        return version


def blind_append_entry(
    name: str | None,
    size: int,
    table: pa.Table,
    txn: Transaction | None,
    user_metadata: str | None = None,
) -> bytes:
    """The log entry of a blind append of one data file ``name`` holding ``table`` (None: no
    data file, a commit of its commitInfo and app transaction alone)."""
    now_ms = int(time.time() * 1000)
    info: dict[str, object] = {
        "timestamp": now_ms,
        "operation": "WRITE",
        "operationParameters": {"mode": "Append"},
        "isBlindAppend": True,
        "operationMetrics": {
            "numFiles": "0" if name is None else "1",
            "numOutputRows": str(table.num_rows),
        },
        "engineInfo": f"deltaq/{__version__}",
    }
    if user_metadata is not None:
        info["userMetadata"] = user_metadata
    actions: list[dict[str, object]] = [{"commitInfo": info}]
    if name is not None:
        actions.append(add_action(name, size, table, now_ms, data_change=True))
    if txn is not None:
        actions.append(
            {"txn": {"appId": txn.app_id, "version": txn.version, "lastUpdated": now_ms}}
        )
    return log_entry(actions)


class ObjectStoreAppender:
    """Blind appends on an object store: one PUT of the Parquet file, one put-if-absent PUT of
    the log entry (``If-None-Match: *`` on S3; ``check_store`` proved the store honours it).

    Why not delta-rs there: its append made 6 requests per commit (PUT, LIST, PUT, LIST, two
    GETs of the new entry); at an object store's tens of milliseconds per request that is what
    bounds a topic's commit rate, and a publisher waits for every request of it.
    """

    def __init__(
        self, path: str, version: int | None = None, check_winner: CheckWinner | None = None
    ) -> None:
        self.path = path.rstrip("/")
        self._check_winner = check_winner or _refuse_schema_change
        self._store, key = store_and_key(self.path)
        self._prefix = f"{key}/" if key else ""
        self._next_version = (DeltaTable(path).version() if version is None else version) + 1
        self._stale: str | None = None

    def reopen(self, known: int | None = None) -> None:
        # One listing from the versions known: opening the table would replay its log.
        target = latest_version(self.path, self._next_version - 1) if known is None else known
        self._stale = self._stale or skipped_change(self.path, self._next_version, target)
        self._next_version = target + 1

    def close(self) -> None:
        pass

    def append(
        self, table: pa.Table, txn: Transaction | None = None, user_metadata: str | None = None
    ) -> int:
        if self._stale:
            raise ProtocolChangedError(self._stale)
        import obstore
        from obstore.exceptions import AlreadyExistsError

        if table.num_rows:
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            buffer = pa.BufferOutputStream()
            pq.write_table(table, buffer, compression="snappy")
            data = buffer.getvalue()
            # An object appears whole or not at all: no half-written data file is visible.
            obstore.put(self._store, self._prefix + name, data.to_pybytes())
            entry = blind_append_entry(name, data.size, table, txn, user_metadata)
        else:
            entry = blind_append_entry(None, 0, table, txn, user_metadata)
        version = self._next_version
        for _ in range(_MAX_COMMIT_RACES):
            key = f"{self._prefix}_delta_log/{version:020d}.json"
            try:
                obstore.put(self._store, key, entry, mode="create")
            except AlreadyExistsError:
                winner = bytes(obstore.get(self._store, key).bytes())
                self._check_winner(
                    [json.loads(line) for line in winner.splitlines() if line.strip()]
                )
                version += 1
                continue
            self._next_version = version + 1
            return version
        raise CommitFailedError(f"no free version in {self.path}/_delta_log")


def add_action(
    name: str,
    size: int,
    rows: pa.Table | dict[str, object],
    now_ms: int,
    *,
    data_change: bool,
) -> dict[str, object]:
    """The ``add`` action of a data file ``name`` (in the table root) holding ``rows`` (or
    rows whose statistics are ``rows``, as ``file_stats`` gives them)."""
    stats = rows if isinstance(rows, dict) else file_stats(rows)
    return {
        "add": {
            "path": name,
            "partitionValues": {},
            "size": size,
            "modificationTime": now_ms,
            "dataChange": data_change,
            "stats": json.dumps(stats, separators=(",", ":")),
        }
    }


def log_entry(actions: list[dict[str, object]]) -> bytes:
    """A Delta commit file's content: one JSON action per line."""
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions).encode()


def put_log_entry(
    log_dir: str, first_version: int, staging: str, check_winner: Callable[[list[Any]], None]
) -> int:
    """Commit the log entry in file ``staging`` as the first free version from
    ``first_version`` on, moving it into place put-if-absent (``move_if_absent``). For each
    version another writer took first, ``check_winner`` gets that commit's actions and raises
    if this commit must not follow it. Returns the version taken; ``staging`` is gone then,
    and left for the caller to remove when this raises."""
    # What the commit names is durable before the commit's name appears: its data files'
    # names in the table root (their bytes were synced before they were renamed there), and
    # the commit's own bytes (already so when written with write_synced: a second fdatasync
    # of a clean file returns at once).
    log_dir = os.path.abspath(log_dir)
    sync_directory(os.path.dirname(log_dir))
    sync_file(staging)
    version = first_version
    for _ in range(_MAX_COMMIT_RACES):
        target = os.path.join(log_dir, f"{version:020d}.json")
        if move_if_absent(staging, target):
            sync_directory(log_dir)
            return version
        with open(target, "rb") as f:
            check_winner([json.loads(line) for line in f if line.strip()])
        version += 1
    raise CommitFailedError(f"no free version in {log_dir}")


class VersionTakenError(RuntimeError):
    """A strict appender's version was taken by another commit (nothing was committed)."""


def refuse_any_winner(actions: list[Any]) -> None:
    """For appends that must land on exactly the version after the one their writer read."""
    raise VersionTakenError("another commit took the version")


def skipped_change(path: str, first: int, last: int) -> str | None:
    """Why an appender that read the table up to version ``first - 1`` must not append after
    ``last`` blindly: one of the commits ``first..last`` changed the protocol or metadata, or
    is gone (log cleanup: what it held is unknown). None: only data commits."""
    if last < first:
        return None
    commits = commit_actions(path, list(range(first, last + 1)))
    for version in range(first, last + 1):
        actions = commits.get(version)
        if actions is None:
            return f"commit {version} is gone from the log"
        if any("metaData" in a or "protocol" in a for a in actions):
            return f"version {version} changed the table's metadata or protocol"
    return None


def _refuse_schema_change(actions: list[Any]) -> None:
    # Another committer (a compaction) took the version. A blind append does not conflict
    # with data commits, but a metadata or protocol change could make this writer wrong:
    # then let delta-rs decide.
    if any("metaData" in a or "protocol" in a for a in actions):
        raise ProtocolChangedError("the table's metadata or protocol changed")


class ProtocolChangedError(RuntimeError):
    """The table's metadata or protocol changed under the fast appender."""


def file_stats_json(table: pa.Table) -> str:
    """A data file's ``stats`` as its ``add`` action carries them."""
    return json.dumps(file_stats(table), separators=(",", ":"))


def merged_stats(parts: list[dict[str, Any]]) -> dict[str, object]:
    """The ``file_stats`` of the rows of several tables written to one file."""
    minimum: dict[str, object] = {}
    maximum: dict[str, object] = {}
    nulls: dict[str, int] = {}
    for part in parts:
        for column, low in part["minValues"].items():
            if low is not None and (minimum.get(column) is None or low < minimum[column]):
                minimum[column] = low
            else:
                minimum.setdefault(column, low)
        for column, high in part["maxValues"].items():
            if high is not None and (maximum.get(column) is None or high > maximum[column]):
                maximum[column] = high
            else:
                maximum.setdefault(column, high)
        for column, count in part["nullCount"].items():
            nulls[column] = nulls.get(column, 0) + count
    return {
        "numRecords": sum(int(part["numRecords"]) for part in parts),
        "minValues": minimum,
        "maxValues": maximum,
        "nullCount": nulls,
    }


def file_stats(table: pa.Table) -> dict[str, object]:
    """Delta file statistics: row count, and min/max/null count of the exact-able columns."""
    minimum: dict[str, object] = {}
    maximum: dict[str, object] = {}
    nulls: dict[str, int] = {}
    for column in _STAT_COLUMNS:
        if column not in table.column_names:
            continue
        values = table[column]
        bounds = pc.min_max(values)
        minimum[column] = bounds["min"].as_py()
        maximum[column] = bounds["max"].as_py()
        nulls[column] = values.null_count
    return {
        "numRecords": table.num_rows,
        "minValues": minimum,
        "maxValues": maximum,
        "nullCount": nulls,
    }


def fast_path_allowed(path: str, dt: DeltaTable | None = None) -> bool:
    """True when ``LocalAppender`` fully honours this table (``dt``, if already loaded):
    local, reader 1, writer <= 2."""
    if is_remote(path):
        return False
    return blind_appends_honoured(dt or DeltaTable(path))


def blind_appends_honoured(dt: DeltaTable) -> bool:
    """Whether deltaq's own appenders write this table's protocol fully: reader 1, writer <= 2,
    no table features."""
    protocol = dt.protocol()
    return (
        protocol.min_reader_version == 1
        and protocol.min_writer_version <= 2
        and not (protocol.writer_features or [])
        and not (protocol.reader_features or [])
        # Writer version 2's column invariants are checked by delta-rs, not by these writers.
        and "delta.invariants" not in dt.schema().to_json()
    )


def append_or_fall_back(
    appender: Appender,
    path: str,
    table: pa.Table,
    txn: Transaction | None = None,
    check_winner: CheckWinner | None = None,
    user_metadata: str | None = None,
) -> tuple[Appender, int]:
    """Append ``table`` (recording ``txn`` in the same commit) with ``appender``; if the fast
    appender finds the table's protocol or metadata changed, judge the table afresh
    (``appender_for``: the fast appender again, delta-rs, or a refusal) and append with that.
    Returns the appender to use from now on and the version committed."""
    try:
        return appender, appender.append(table, txn, user_metadata)
    except ProtocolChangedError as exc:
        log.warning("%s: %s; reading its protocol again", path, exc)
        appender.close()
        fresh = appender_for(path, check_winner=check_winner)
        return fresh, fresh.append(table, txn, user_metadata)


def appender_for(
    path: str, *, allow_fast: bool = True, check_winner: CheckWinner | None = None
) -> Appender:
    """The fastest appender that honours the table at ``path``; ``check_winner`` as for
    ``LocalAppender`` (delta-rs, where the protocol needs it, retries blind appends itself)."""
    dt = DeltaTable(path)
    refused = table_refusal(dt)
    if refused is not None:
        log.error("%s", TableRefusedError(path, refused))
        return RefusedAppender(path, refused)
    if not allow_fast or not blind_appends_honoured(dt):
        return DeltaRsAppender(path)
    if is_remote(path):
        return ObjectStoreAppender(path, dt.version(), check_winner)
    return LocalAppender(path, dt.version(), check_winner)
