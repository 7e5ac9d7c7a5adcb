"""Replay: a topic's past messages delivered to one channel again (``/channel/replay``).

A replay reads the rows that a range of topic versions added (Delta time travel: the commit
log says which rows those versions added; the rows are read from the table as it is now) and
appends copies of them to the topic, in one commit, for that channel only (``to_channel``):
new ids, published now, ``replay_of`` naming the original. The fanout delivers them like any
row, so the channel's restart cursor, the sweep and retention need nothing new, and attempts
start again at 1 (the copy is a new message). Whether the originals were FIN'd does not matter.

The commit records the replay's id as a Delta app transaction (``deltaq-replay/<channel>/<id>``),
so a replay id is committed at most once: a client that lost the answer (a timeout, a
``kill -9`` of the API) asks again with the same ``replay_id`` and nothing is copied twice.

Ranges are versions ``from..to`` (both included), given as versions or as times (the versions
committed in that interval). The rows a range added are those whose ids lie between the
smallest and the largest id those versions added: the topic writer allocates ids at commit
time, in commit order, so a topic's ids increase with its versions. If retention removed some
of them, the replay is refused (``RANGE_REMOVED``) rather than delivering part of the range.
"""

from __future__ import annotations

import bisect
import functools
import operator
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.fanout import for_channel
from queue_engine.message import LANES
from queue_engine.store.delta import (
    AddedFile,
    added_files,
    commit_info,
    latest_version,
    read_dataset,
)
from queue_engine.store.tables import TopicWriter

REPLAY_APP_PREFIX = "deltaq-replay"
REPLAY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
_REPLAY_ID = re.compile(REPLAY_ID_PATTERN)
_VERSION = re.compile(r"^[0-9]{1,18}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# A bound as given: a topic version, or a time (µs since the epoch).
Bound = tuple[str, int]


@dataclass(frozen=True)
class ReplayRows:
    """What a range holds for a channel: its versions and the rows to copy."""

    first_version: int
    last_version: int
    ids: pa.Array
    bodies: pa.Array
    # The copies keep their originals' headers (None: an empty range).
    headers: pa.Array | None = None


def app_id(channel: str, replay_id: str) -> str:
    return f"{REPLAY_APP_PREFIX}/{channel}/{replay_id}"


def check_replay_id(value: str) -> str:
    if not _REPLAY_ID.match(value):
        raise QueueError(
            ErrorCode.INVALID_REQUEST, f"{value!r}: 1-64 of [A-Za-z0-9._-]", param="replay_id"
        )
    return value


def parse_bound(value: str | None, name: str) -> Bound | None:
    """``from``/``to``: a topic version (digits) or an RFC 3339 time with its offset."""
    if value is None or value == "":
        return None
    if _VERSION.match(value):
        return ("version", int(value))
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise QueueError(
            ErrorCode.INVALID_RANGE,
            f"{name}={value!r}: a topic version or an RFC 3339 time with an offset",
        )
    # Exact to the microsecond (a float timestamp can land one below).
    return ("time", (at - _EPOCH) // timedelta(microseconds=1))


def resolve(path: str, start: Bound, end: Bound | None, known: int = -1) -> tuple[int, int]:
    """The versions ``first..last`` a range names (``end`` None: the newest version);
    ``known``: a version the table has reached (the newest is probed from there)."""
    latest = latest_version(path, known)
    first = (
        start[1] if start[0] == "version" else _first_after(path, start[1], latest, inclusive=True)
    )
    if end is None:
        last = latest
    elif end[0] == "version":
        last = end[1]
    else:
        last = _first_after(path, end[1], latest, inclusive=False) - 1
        if last < 0 or _commit_ms(path, last) is None:
            last = -1  # nothing committed by then that the log still has
    if first > latest or not 0 <= last <= latest:
        raise QueueError(
            ErrorCode.INVALID_RANGE, f"outside the topic's versions (0..{latest}): {start}..{end}"
        )
    if first > last:
        raise QueueError(ErrorCode.INVALID_RANGE, f"from (version {first}) after to ({last})")
    return first, last


def read_range(path: str, channel: str, first: int, last: int, limit: int) -> ReplayRows:
    """The rows versions ``first..last`` added that ``channel`` would receive, in id order."""
    try:
        files = added_files(path, first - 1, last)
    except FileNotFoundError as exc:
        raise QueueError(
            ErrorCode.RANGE_REMOVED, f"versions {first}..{last} are no longer in the log"
        ) from exc
    expected = sum(int(f.num_records or 0) for f in files)
    if expected > limit:
        raise QueueError(
            ErrorCode.INVALID_RANGE,
            f"versions {first}..{last} hold {expected} messages, more than "
            f"max_replay_messages ({limit}): replay a narrower range",
        )
    empty = ReplayRows(first, last, pa.array([], pa.string()), pa.array([], pa.binary()))
    if expected == 0 or not any(f.min_id and f.max_id for f in files):
        return empty
    dataset = read_dataset(path)
    rows = dataset.to_table(
        columns=["id", "body", "to_channel", "headers"], filter=_id_filter(files)
    )
    if rows.num_rows < expected:
        raise QueueError(
            ErrorCode.RANGE_REMOVED,
            f"retention removed {expected - rows.num_rows} of the {expected} messages of "
            f"versions {first}..{last}",
        )
    rows = rows.filter(for_channel(rows["to_channel"], channel)).sort_by("id")
    return ReplayRows(
        first,
        last,
        rows["id"].combine_chunks(),
        rows["body"].combine_chunks(),
        rows["headers"].combine_chunks(),
    )


def _id_filter(files: list[AddedFile]) -> pc.Expression:
    """The rows of ``files``, found by id in the current snapshot (compaction rewrites files).

    Several nodes append to a topic, each with ids of its own lane (the id's last hex digit,
    queue_engine.message.IdAllocator), increasing with that node's commits: the rows the range
    added are, per lane, the ids of that lane between the smallest and largest its files hold.
    A file whose ids are not one block of a lane predates lanes (one writer then, ids
    consecutive): its plain id range is exact.
    """
    bounds: dict[str | None, tuple[str, str]] = {}
    for f in files:
        if f.min_id is None or f.max_id is None:
            continue
        # One commit of one node is one block of its lane: ids exactly LANES apart.
        span = int(f.max_id, 16) - int(f.min_id, 16)
        lane = f.min_id[-1] if span == (int(f.num_records or 1) - 1) * LANES else None
        low, high = bounds.get(lane, (f.min_id, f.max_id))
        bounds[lane] = (min(low, f.min_id), max(high, f.max_id))
    parts = []
    for lane, (low, high) in bounds.items():
        part = (pc.field("id") >= low) & (pc.field("id") <= high)
        if lane is not None:
            part &= pc.ends_with(pc.field("id"), lane)
        parts.append(part)
    return functools.reduce(operator.or_, parts)


def _commit_ms(path: str, version: int) -> int | None:
    info = commit_info(path, version)
    stamp = None if info is None else info.get("timestamp")
    return int(stamp) if isinstance(stamp, int | float) else None


def _first_after(path: str, at_us: int, latest: int, *, inclusive: bool) -> int:
    """The first version committed after ``at_us`` (at it too with ``inclusive``), or
    ``latest + 1``: a binary search over the log, reading one commit file per step. Versions
    the log cleanup removed count as older than anything still there."""

    def after(version: int) -> bool:
        stamp = _commit_ms(path, version)
        return stamp is not None and (stamp * 1000 >= at_us if inclusive else stamp * 1000 > at_us)

    return bisect.bisect_left(range(latest + 1), True, key=after)


@dataclass(frozen=True)
class ReplayResult:
    replay_id: str
    first_version: int
    last_version: int
    # Copies this call committed (0 when the replay id had been committed before).
    messages: int
    # The replay id was committed by an earlier call: nothing was copied again.
    repeated: bool


def run_replay(
    writer: TopicWriter,
    channel: str,
    start: Bound,
    end: Bound | None,
    replay_id: str,
    limit: int,
) -> ReplayResult:
    """Copy the range's rows for ``channel`` into the topic (blocking; one commit or none)."""
    # Other nodes commit to the topic too: the newest version is the log's, not this writer's.
    first, last = resolve(
        writer.path, start, end, latest_version(writer.path, writer.stats().version)
    )
    rows = read_range(writer.path, channel, first, last, limit)
    if len(rows.ids) == 0:
        return ReplayResult(replay_id, first, last, 0, False)
    try:
        version = writer.commit_copies(
            rows.bodies, rows.ids, channel, app_id(channel, replay_id), rows.headers
        )
    except Exception as exc:
        raise QueueError(ErrorCode.E_COMMIT_FAILED, f"replay {replay_id}: {exc}") from exc
    repeated = version is None
    return ReplayResult(replay_id, first, last, 0 if repeated else len(rows.ids), repeated)
