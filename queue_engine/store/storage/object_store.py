"""Warehouses on object storage (s3://, gs://, abfss://; az:// is refused): configuration,
the start check.

Configuration has one path: the standard environment variables of each store (``AWS_*``,
``GOOGLE_*``, ``AZURE_*``), which delta-rs, obstore and every child process (the jobs, Spark's
Python workers) read alike. The settings' ``storage_options`` table is exported into the
environment under the same upper-case names, and a variable already set wins, as
``DELTAQ_*`` variables win over the settings file.

Delta's log is safe on a store only if creating ``_delta_log/<version>.json`` fails when the
name is taken (put-if-absent: S3's ``If-None-Match: *``, GCS's and Azure's preconditions);
delta-rs commits that way. ``check_store`` proves it before anything is written: it creates a
probe object twice and requires the second create to be refused. A store that overwrites, is
unreachable or refuses the credentials stops the command with one line naming the store.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

from queue_engine.store.storage.fs_sync import sync_directory
from queue_engine.store.storage.paths import is_remote

PROBE_PREFIX = "_deltaq/probes"


class StoreError(Exception):
    """The warehouse's store cannot hold deltaq's tables safely (or cannot be reached)."""


# The variables the settings configured, which Spark sessions hand to their executors.
_configured: set[str] = set()


def export_storage_options(options: Mapping[str, str]) -> None:
    """Put ``options`` into the environment (upper-case names) where not already set."""
    for key, value in options.items():
        name = key.upper()
        if name not in os.environ:
            os.environ[name] = str(value)
        _configured.add(name)


def executor_environment() -> dict[str, str]:
    """The store variables the settings configured, as Spark's executors need them (a cluster's
    executors do not inherit this process's environment)."""
    return {name: os.environ[name] for name in sorted(_configured) if name in os.environ}


# URL schemes of stores deltaq cannot use (see check_store).
UNREADABLE_SCHEMES = ("az", "adl", "azure")


def check_store(root: str) -> None:
    """Raise ``StoreError`` unless the object store under ``root`` is reachable with the
    configured credentials and honours put-if-absent. Local paths need no check."""
    if not is_remote(root):
        return
    scheme = root.split("://", 1)[0]
    if scheme in UNREADABLE_SCHEMES:
        # delta-rs and obstore reach these stores, but deltaq also lists and reads files
        # through pyarrow's filesystems, which do not know the scheme.
        raise StoreError(
            f"warehouse {root}: {scheme}:// warehouses are not supported (pyarrow, which "
            f"deltaq reads files with, has no filesystem for {scheme}://)"
        )
    import obstore
    from obstore.exceptions import AlreadyExistsError, BaseError
    from obstore.store import from_url

    client: ClientConfig = {
        **client_options(),
        "connect_timeout": timedelta(seconds=5),
        "timeout": timedelta(seconds=10),
    }
    # A start-time check must fail in seconds, not after object_store's 3 minutes of retries.
    retry: RetryConfig = {"max_retries": 2, "retry_timeout": timedelta(seconds=10)}
    try:
        store = from_url(root, client_options=client, retry_config=retry)
    except (BaseError, ValueError) as exc:
        raise StoreError(f"warehouse {root}: {_first_line(exc)}") from exc
    probe = f"{PROBE_PREFIX}/{uuid.uuid4().hex}"
    try:
        obstore.put(store, probe, b"1", mode="create")
    except (BaseError, OSError) as exc:
        raise StoreError(f"warehouse {root} cannot be written: {_first_line(exc)}") from exc
    try:
        try:
            obstore.put(store, probe, b"2", mode="create")
        except AlreadyExistsError:
            return
        except (BaseError, OSError) as exc:
            raise StoreError(f"warehouse {root}: put-if-absent failed: {_first_line(exc)}") from exc
        raise StoreError(
            f"warehouse {root} overwrote an object created with put-if-absent "
            "(If-None-Match: *): two writers could both commit one Delta version there; "
            "deltaq does not write to such a store"
        )
    finally:
        # A leftover probe is harmless: nothing reads _deltaq/probes.
        with contextlib.suppress(BaseError, OSError):
            obstore.delete(store, probe)


def _first_line(exc: BaseException) -> str:
    """The store's answer in brief: its error code (S3's ``<Code>``) and the request, without
    the XML body object_store appends."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    code = re.search(r"<Code>([^<]+)</Code>", text)
    status = re.search(r"status code: (\d{3} [^:]+):", line)
    line = line.split(" - Server returned", 1)[0]
    if code:
        line = f"{code.group(1)} ({status.group(1) if status else 'error'}); {line}"
    return line


# -- reading many small objects ----------------------------------------------------------
#
# Tailing a table on an object store means reading each new commit file (and each new data
# file) once. Done one at a time through pyarrow's filesystem that is a HEAD and a GET per file,
# one after the other, at tens of milliseconds each; here it is one GET per file, many at once.

_READ_THREADS = 16
_stores: dict[str, Any] = {}
_stores_lock = threading.Lock()
_readers: ThreadPoolExecutor | None = None


def client_options() -> ClientConfig:
    """obstore's HTTP client as delta-rs's: plain HTTP only where ``AWS_ALLOW_HTTP`` says so."""
    return {"allow_http": os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true"}


def store_and_key(url: str) -> tuple[Any, str]:
    """The obstore store of ``url``'s bucket (one per bucket, shared) and the key in it."""
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    base = f"{scheme}://{bucket}"
    with _stores_lock:
        store = _stores.get(base)
        if store is None:
            from obstore.store import from_url

            store = _stores[base] = from_url(base, client_options=client_options())
    return store, key


def _pool() -> ThreadPoolExecutor:
    global _readers
    with _stores_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="deltaq-store-read")
        return _readers


def read_object(url: str) -> bytes | None:
    """The whole object at ``url``; None if there is none."""
    import obstore

    store, key = store_and_key(url)
    try:
        return bytes(obstore.get(store, key).bytes())
    except FileNotFoundError:
        return None


def read_objects(urls: list[str]) -> list[bytes | None]:
    """``read_object`` of each URL, concurrently, in order."""
    if len(urls) <= 1:
        return [read_object(u) for u in urls]
    return list(_pool().map(read_object, urls))


def list_objects(prefix_url: str) -> list[str]:
    """The keys under ``prefix_url`` (a "directory"), relative to it, in name order."""
    import obstore

    store, key = store_and_key(prefix_url.rstrip("/"))
    prefix = f"{key}/"
    return sorted(
        str(meta["path"])[len(prefix) :]
        for chunk in obstore.list(store, prefix=prefix, chunk_size=1000)
        for meta in chunk
    )


def put_objects(items: list[tuple[str, bytes]]) -> None:
    """Write each (URL, body), concurrently, replacing what was there (plain PUTs)."""

    def put(item: tuple[str, bytes]) -> None:
        import obstore

        store, key = store_and_key(item[0])
        obstore.put(store, key, item[1])

    list(_pool().map(put, items))


def delete_objects(urls: list[str]) -> None:
    """Delete each object (one that is already gone is no error): one request per bucket and
    1,000 keys where the store deletes in bulk (S3's DeleteObjects), not one per object."""
    import obstore

    by_store: dict[int, tuple[Any, list[str]]] = {}
    for url in urls:
        store, key = store_and_key(url)
        by_store.setdefault(id(store), (store, []))[1].append(key)
    for store, keys in by_store.values():
        try:
            obstore.delete(store, keys)
        except FileNotFoundError:
            # Stores that report a missing key (GCS, Azure) fail the batch: one by one then.
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    obstore.delete(store, key)


def newest_commit_after(table_url: str, known: int) -> int:
    """The newest version of the table at ``table_url`` reached from ``known`` without a gap,
    by one listing of its log from there (instead of a request per version)."""
    import obstore

    store, key = store_and_key(table_url.rstrip("/"))
    prefix = f"{key}/_delta_log/"
    offset = f"{prefix}{known:020d}.json"
    found = set()
    for chunk in obstore.list(store, prefix=prefix, offset=offset, chunk_size=1000):
        for meta in chunk:
            name = str(meta["path"])[len(prefix) :]
            if len(name) == 25 and name.endswith(".json") and name[:20].isdigit():
                found.add(int(name[:20]))
    version = known
    while version + 1 in found:
        version += 1
    return version


def read_whole(url: str) -> bytes | None:
    """A small object or local file, whole (None: there is none)."""
    if is_remote(url):
        return read_object(url)
    try:
        with open(url, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def replace_whole(url: str, body: bytes) -> None:
    """Write a small object or local file in one piece, replacing what was there: a plain PUT,
    or a new file renamed over the old one. For hints and caches that readers check against
    the tables, never for commits (those are put-if-absent)."""
    if is_remote(url):
        import obstore

        store, key = store_and_key(url)
        obstore.put(store, key, body)
        return
    os.makedirs(os.path.dirname(url), exist_ok=True)
    # A new inode each time: readers never see half a file, and tell versions apart. Synced,
    # with its directory: after a power cut the file holds this body or the one before.
    temporary = f"{url}.{uuid.uuid4().hex}.tmp"
    with open(temporary, "wb") as f:
        f.write(body)
        f.flush()
        os.fdatasync(f.fileno())
    os.replace(temporary, url)

    sync_directory(os.path.dirname(os.path.abspath(url)))
