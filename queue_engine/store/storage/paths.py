"""Whether a warehouse path is local or on an object store."""

from __future__ import annotations


def is_remote(root: str) -> bool:
    """Whether ``root`` names an object store rather than a local path."""
    return "://" in root and not root.startswith("file://")


def is_local(path: str) -> bool:
    return not is_remote(path)


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path
