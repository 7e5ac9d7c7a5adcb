"""Message ids: NSQ-style 16 hex characters, unique and increasing per topic."""

from __future__ import annotations

MESSAGE_ID_HEX_LENGTH = 16
# As nsqd's GUIDs: milliseconds in the high bits, a counter in the low 22, so ids sort by
# publish time and a reader can tell when a message was accepted from its id alone.
SEQUENCE_BITS = 22
# Id lanes: the low bits of the counter name the API node that allocated the id (IdAllocator).
LANES = 16
_MAX_ID = (1 << 63) - 1


def id_to_hex(value: int) -> str:
    return f"{value:016x}"


def id_from_hex(text: str) -> int:
    if len(text) != MESSAGE_ID_HEX_LENGTH:
        raise ValueError(f"message id must be {MESSAGE_ID_HEX_LENGTH} hex chars: {text!r}")
    return int(text, 16)


def id_timestamp_ms(value: int) -> int:
    return value >> SEQUENCE_BITS


class IdAllocator:
    """Hands out blocks of ids that never go backwards, even if the clock does.

    ``floor`` is one past the largest id already in the topic table, so ids stay unique across
    restarts whatever the wall clock says. Several API nodes append to one topic: each holds
    a ``lane`` (0..LANES-1) and all of its ids are that lane modulo LANES, so two nodes never
    hand out the same id however their clocks and commits interleave. A block is therefore
    ``count`` ids ``LANES`` apart: ``first, first + LANES, ...``.
    """

    def __init__(self, floor: int = 0, lane: int = 0) -> None:
        if not 0 <= lane < LANES:
            raise ValueError(f"id lane must be in 0..{LANES - 1}: {lane}")
        self.lane = lane
        self._next = self._in_lane(floor)

    def _in_lane(self, value: int) -> int:
        """The smallest id of this lane at or above ``value``."""
        return value + (self.lane - value) % LANES

    def allocate(self, count: int, now_ms: int) -> int:
        """Reserve ``count`` ids; return the first. The block is
        ``range(first, first + count * LANES, LANES)``."""
        first = max(self._next, self._in_lane(now_ms << SEQUENCE_BITS))
        if first + count * LANES > _MAX_ID:
            raise OverflowError("message id space exhausted")
        self._next = first + count * LANES
        return first

    @property
    def next_id(self) -> int:
        return self._next
