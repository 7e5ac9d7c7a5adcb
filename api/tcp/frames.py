"""The V2 protocol's bytes: frames, message frames and errors, as nsqd 1.3.0 writes them.

Every frame is ``size:int32 BE`` (of what follows), ``type:int32 BE``, then data. A message
frame's data is ``timestamp_ns:int64``, ``attempts:uint16``, a 16-byte id and the body.
deltaq's message ids are 16 hex characters, so they travel as nsqd's ids do.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from queue_engine.channel_queue import Delivery

MAGIC_V2 = b"  V2"

FRAME_RESPONSE = 0
FRAME_ERROR = 1
FRAME_MESSAGE = 2

OK = b"OK"
HEARTBEAT = b"_heartbeat_"
CLOSE_WAIT = b"CLOSE_WAIT"

MESSAGE_ID_BYTES = 16

_HEADER = struct.Struct(">ii")
_MESSAGE_HEADER = struct.Struct(">iiqH")
_MAX_ATTEMPTS = 0xFFFF


class ClientError(Exception):
    """An error frame that leaves the connection open (nsqd's ClientErr)."""

    fatal = False

    def __init__(self, code: str, description: str) -> None:
        super().__init__(f"{code} {description}")
        self.code = code

    @property
    def frame_data(self) -> bytes:
        return str(self).encode()


class FatalClientError(ClientError):
    """An error frame after which the connection is closed (nsqd's FatalClientErr)."""

    fatal = True


def frame(frame_type: int, data: bytes) -> bytes:
    return _HEADER.pack(len(data) + 4, frame_type) + data


def response(data: bytes) -> bytes:
    return frame(FRAME_RESPONSE, data)


def error(data: bytes) -> bytes:
    return frame(FRAME_ERROR, data)


def messages(deliveries: Iterable[Delivery]) -> bytes:
    """The message frames of ``deliveries``, back to back (one write for a batch); attempts
    past uint16 are shown as its maximum."""
    pack = _MESSAGE_HEADER.pack
    return b"".join(
        [
            pack(
                len(d.body) + 30,
                FRAME_MESSAGE,
                d.published_at_us * 1000,
                min(d.attempts, _MAX_ATTEMPTS),
            )
            + d.id.encode("ascii")
            + d.body
            for d in deliveries
        ]
    )


def read_length(data: bytes) -> int:
    """A signed 32-bit big-endian length, as nsqd reads one (negative values are refused)."""
    return int(struct.unpack(">i", data)[0])
