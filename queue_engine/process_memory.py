"""How the serving process (and its maintenance process) keeps its memory small: modules it
never uses are left out, and its allocators give freed memory back.

Consuming a 200,000-message backlog over TCP right after publishing it (bench/tcp.py): the
API's peak RSS was ~295 MiB before these and ~175 MiB with them, at the same rates.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

log = logging.getLogger(__name__)

# pyarrow.dataset, which deltalake's readers import, imports pandas when it loads only to learn
# whether pandas is there (46 MiB of the ~165 MiB of modules an API process held), and
# pyarrow imports numpy when present (14 MiB). The API builds no DataFrame and no numpy array;
# the Spark jobs, which do, run in processes of their own.
LEFT_OUT = ("pandas", "numpy")

# Arrow's allocator in the serving process. Measured consuming that backlog, four runs each:
# the wheel's default, mimalloc, reserves a 1 GiB arena and keeps what each thread freed
# (peak 315-406 MiB); the C library's malloc fragments under Parquet's buffers (~200 MiB,
# 56 MiB of it free but resident; fixed mmap thresholds fix that but cost /mpub 25%, a
# mapping and its page faults per large block); jemalloc, which Arrow configures to hand
# freed pages back after a second, peaked at ~175 MiB with /mpub as fast as mimalloc.
ARROW_POOL = "jemalloc"

# glibc's malloc: threads share two arenas (by default up to eight per core, each keeping
# what its threads freed). Left to MALLOC_ARENA_MAX where that is set.
_M_ARENA_MAX = -8
MALLOC_OPTIONS = {"MALLOC_ARENA_MAX": (_M_ARENA_MAX, 2)}


class _LeftOut:
    """A finder that answers "not installed" for the modules left out."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.split(".", 1)[0] in LEFT_OUT:
            raise ModuleNotFoundError(f"{name} is left out of the deltaq API process", name=name)
        return None


def prepare_serving_process() -> None:
    """For a process that serves the API, before anything loads pyarrow:

    - the modules of ``LEFT_OUT`` import as if absent (pyarrow and deltalake then go without
      them, as they do where they are not installed); a module already imported stays;
    - Arrow allocates from ``ARROW_POOL`` (ARROW_DEFAULT_MEMORY_POOL, unless set): only the
      environment chooses the pool Arrow's C++ code takes (Parquet's reader and writer);
      ``pa.set_memory_pool`` changes Python's side only. Linux wheels have jemalloc."""
    if not any(isinstance(finder, _LeftOut) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LeftOut())
    if sys.platform.startswith("linux"):
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", ARROW_POOL)


def tune_malloc() -> dict[str, int]:
    """Set glibc's malloc as ``MALLOC_OPTIONS`` says (where the environment does not); returns
    what was set. Nothing elsewhere than glibc."""
    path = ctypes.util.find_library("c")
    if path is None or not sys.platform.startswith("linux"):
        return {}
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return {}  # not glibc (musl's mallopt tunes nothing)
    applied = {}
    for variable, (param, value) in MALLOC_OPTIONS.items():
        if variable in os.environ:
            continue
        if libc.mallopt(param, value) == 1:
            applied[variable] = value
        else:
            log.warning("mallopt(%d, %d) refused", param, value)
    return applied


def choose_arrow_pool() -> None:
    """Arrow's Python-side allocations from ``ARROW_POOL`` (the C library's malloc where this
    pyarrow has no jemalloc) unless ARROW_DEFAULT_MEMORY_POOL chooses. For a process that
    loaded pyarrow before ``prepare_serving_process`` could set the environment (a server
    started in-process)."""
    import pyarrow as pa  # not at the top: prepare_serving_process() runs before pyarrow loads

    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        try:
            pa.set_memory_pool(pa.jemalloc_memory_pool())
        except NotImplementedError:
            pa.set_memory_pool(pa.system_memory_pool())
