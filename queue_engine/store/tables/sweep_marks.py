"""The sweep's marks: every channel's newest state commit meta, kept in one object.

Planning a sweep needs each channel's ``StateMeta``; reading it from the state table means
opening the table and its history (~1-5 ms each: most of a minute for ten thousand channels).
Each sweep therefore leaves ``_deltaq/sweep/marks.json``: per channel, its creation time, the
state version it wrote and that commit's meta. The next one trusts a mark only while the state
table's newest version is still the marked one (one commit-file probe) and the channel is the
same one (its creation time); any other channel is read from its table as before. The marks are
a cache, never the truth: losing them costs one slow planning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from queue_engine.store.delta.commit_log import latest_version
from queue_engine.store.storage.object_store import read_whole, replace_whole
from queue_engine.store.tables.channel_state import StateMeta, read_meta

log = logging.getLogger(__name__)

MARKS_PATH = "_deltaq/sweep/marks.json"


@dataclass(frozen=True)
class Mark:
    created_at_us: int
    meta: StateMeta


Marks = dict[tuple[str, str], Mark]


def marks_url(root: str) -> str:
    return f"{root.rstrip('/')}/{MARKS_PATH}"


def load_marks(root: str) -> Marks:
    """The marks the last sweep left (empty: none, or unreadable)."""
    try:
        body = read_whole(marks_url(root))
        if body is None:
            return {}
        marks: Marks = {}
        for topic, channel, created, version, info in json.loads(body)["channels"]:
            meta = StateMeta.from_commit_info(info, int(version))
            if meta is not None:
                marks[(topic, channel)] = Mark(int(created), meta)
        return marks
    except Exception as exc:
        log.warning("sweep marks not read (planning reads every state table): %s", exc)
        return {}


def save_marks(root: str, marks: Marks) -> None:
    """Replace the marks. Never raises: without them the next planning is only slower."""
    rows = [
        [topic, channel, mark.created_at_us, mark.meta.state_version, mark.meta.to_commit_info()]
        for (topic, channel), mark in sorted(marks.items())
    ]
    try:
        replace_whole(marks_url(root), json.dumps({"channels": rows}).encode())
    except Exception as exc:
        log.warning("sweep marks not written: %s", exc)


def current_meta(mark: Mark | None, created_at_us: int, state_path: str) -> StateMeta | None:
    """The channel's newest state meta: its mark while that is still the state table's newest
    version (one probe) of the same channel, else read from the table."""
    if mark is not None and mark.created_at_us == created_at_us and mark.meta.state_version >= 0:
        version = mark.meta.state_version
        if latest_version(state_path, version) == version:
            return mark.meta
    return read_meta(state_path)
