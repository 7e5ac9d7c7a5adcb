"""What the fanout notes with each commit it makes to a filtered channel's table.

A commit's commitInfo ``userMetadata`` (Delta's field for it) holds
``{"deltaq.kept_out": N, "deltaq.topic_version": V}``: the rows the channel's filter kept out
of the fanout batch, and the newest topic version of the batch's rows of its topic. A batch the
filter keeps wholly out is committed all the same, with no rows, so the count and how far the
channel has taken its topic are never lost. The API counts the first (``filtered_count``);
the API and retention take the second as the channel's progress where its rows cannot say.
"""

from __future__ import annotations

import json
from typing import Any

from queue_engine.store.delta.commit_log import commit_info

KEPT_OUT = "deltaq.kept_out"
TOPIC_VERSION = "deltaq.topic_version"


def batch_note(kept_out: int, reached: int) -> str:
    """The note of one batch's commit to a filtered channel."""
    return json.dumps({KEPT_OUT: kept_out, TOPIC_VERSION: reached})


def read_note(user_metadata: str | None) -> dict[str, Any]:
    """A commit's note ({} where it has none, or another writer's metadata)."""
    if not user_metadata:
        return {}
    try:
        note = json.loads(user_metadata)
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}


def note_reached(note: dict[str, Any]) -> int | None:
    """The topic version a note says the fanout reached (None: it says none)."""
    reached = note.get(TOPIC_VERSION)
    return reached if isinstance(reached, int) else None


def noted_topic_version(path: str, latest: int, lookback: int) -> int:
    """The topic version the newest note among the table's ``lookback`` newest commits says
    the fanout reached (-1: none; upkeep's own commits, compactions and removals, carry none)."""
    for version in range(latest, max(-1, latest - lookback), -1):
        info = commit_info(path, version)
        metadata = None if info is None else info.get("userMetadata")
        reached = note_reached(read_note(metadata if isinstance(metadata, str) else None))
        if reached is not None:
            return reached
    return -1
