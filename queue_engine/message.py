"""Message ids: NSQ-style 16 hex characters, unique and increasing per topic."""

from __future__ import annotations

MESSAGE_ID_HEX_LENGTH = 16
# As nsqd's GUIDs: milliseconds in the high bits, a counter in the low 22, so ids sort by
# publish time and a reader can tell when a message was accepted from its id alone.
SEQUENCE_BITS = 22
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
    """Hands out blocks of consecutive ids that never go backwards, even if the clock does.

    ``floor`` is one past the largest id already in the topic table, so ids stay unique across
    restarts whatever the wall clock says.
    """

    def __init__(self, floor: int = 0) -> None:
        self._next = floor

    def allocate(self, count: int, now_ms: int) -> int:
        """Reserve ``count`` ids; return the first. The block is ``[first, first + count)``."""
        first = max(self._next, now_ms << SEQUENCE_BITS)
        if first + count > _MAX_ID:
            raise OverflowError("message id space exhausted")
        self._next = first + count
        return first

    @property
    def next_id(self) -> int:
        return self._next
