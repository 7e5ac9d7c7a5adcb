"""Put-if-absent for local files: move a finished file into place unless the name is taken.

Delta's log needs it (two writers must never both create version N). ``renameat2`` with
``RENAME_NOREPLACE`` does it in one atomic step and leaves nothing to delete. The portable
alternative — hard link, then unlink the staging name — frees an inode per commit, and ext4
scans past recently freed inodes on every later create (``recently_deleted`` in
``find_inode_bit``): measured here at ~10% of the API's CPU under a consume load. The link path
stays as the fallback where ``renameat2`` is missing (old glibc, non-Linux) or the filesystem
refuses the flag.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    char_p = ctypes.c_char_p
    function.argtypes = [ctypes.c_int, char_p, ctypes.c_int, char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def move_if_absent(source: str, target: str) -> bool:
    """Move ``source`` to ``target`` if no file is named ``target``: True when moved (``source``
    is gone), False when ``target`` already exists (``source`` is left as it was)."""
    global _renameat2
    if _renameat2 is not None:
        source_b, target_b = os.fsencode(source), os.fsencode(target)
        if _renameat2(_AT_FDCWD, source_b, _AT_FDCWD, target_b, _RENAME_NOREPLACE) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), target)
        _renameat2 = None  # this filesystem refuses the flag: link from now on
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    os.unlink(source)
    return True
