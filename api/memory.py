"""How the serving process keeps its memory small: modules it never uses are left out, and
the allocators give freed memory back to the system.

Consuming a 200,000-message backlog over TCP right after publishing it (bench/tcp.py) peaked
at ~295 MiB before these and at ~193 MiB with them, at the same rate.
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

# glibc's malloc: blocks from 64 KiB up are mapped on their own and unmapped when freed, the
# top of the heap is trimmed past 64 KiB free, and threads share two arenas. By default the
# mmap threshold rises to the largest block freed (up to 32 MiB), so once a publish burst has
# freed its request bodies and Parquet buffers the next ones come from the heap and stay
# there: ~100 MiB kept after publishing 200,000 messages, ~30 MiB with these. Each is left to
# its MALLOC_*_ environment variable where one is set.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MALLOC_OPTIONS = {
    "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, 64 * 1024),
    "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, 64 * 1024),
    "MALLOC_ARENA_MAX": (_M_ARENA_MAX, 2),
}


class _LeftOut:
    """A finder that answers "not installed" for the modules left out."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.split(".", 1)[0] in LEFT_OUT:
            raise ModuleNotFoundError(f"{name} is left out of the deltaq API process", name=name)
        return None


def leave_out_unused_modules() -> None:
    """Make the modules of ``LEFT_OUT`` import as if absent in this process (call it before
    anything imports pyarrow.dataset; pyarrow and deltalake then go without them, as they do
    where they are not installed). Does nothing to a module already imported."""
    if not any(isinstance(finder, _LeftOut) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LeftOut())


def give_freed_memory_back() -> dict[str, int]:
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


def use_system_allocator_for_arrow() -> None:
    """Arrow's tables (rows read, ledger rows, Parquet) from the C library's malloc rather than
    the wheel's bundled mimalloc, unless ARROW_DEFAULT_MEMORY_POOL chooses. mimalloc keeps what
    each thread freed: consuming a 400,000-message backlog over TCP peaked at 315-406 MiB with
    it and at 261-324 MiB with the system allocator, four runs of each in turn, at rates within
    run-to-run spread (bench/tcp.py)."""
    import pyarrow as pa  # not at the top: leave_out_unused_modules() runs before pyarrow loads

    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        pa.set_memory_pool(pa.system_memory_pool())
