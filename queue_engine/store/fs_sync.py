"""Making what was written to a local filesystem durable before something that relies on it.

deltaq does not fsync each Delta file it writes (a topic commit is a Parquet file and a commit
file, hundreds a second). What it deletes because those files hold its data (the node
journal's drained segments) goes only after one ``syncfs`` of their filesystem: a power loss
then cannot keep the deletion and lose the commits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def sync_filesystem(path: str) -> None:
    """Flush everything written to the filesystem holding ``path`` to its disk (Linux's
    ``syncfs``; elsewhere ``sync``, every filesystem)."""
    if _syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _syncfs(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), path)
    finally:
        os.close(fd)
