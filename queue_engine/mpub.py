"""Bodies of /pub and /mpub as nsqd reads them (text: newline separated; binary: framed)."""

from __future__ import annotations

import struct

from queue_engine.errors import ErrorCode, QueueError

_U32 = struct.Struct(">i")


def check_single(body: bytes, max_msg_size: int, where: str = "") -> bytes:
    """A /pub body: non-empty and at most ``max_msg_size`` bytes (``where``: which one)."""
    if len(body) > max_msg_size:
        raise QueueError(ErrorCode.MSG_TOO_BIG, f"{where}{len(body)} > {max_msg_size}")
    if not body:
        raise QueueError(ErrorCode.MSG_EMPTY, where.removesuffix(": "))
    return body


def split_text(body: bytes, max_msg_size: int, max_body_size: int) -> list[bytes]:
    """Newline-separated messages; empty lines are skipped, as nsqd has done since 0.2.22."""
    if len(body) > max_body_size:
        raise QueueError(ErrorCode.BODY_TOO_BIG, f"{len(body)} > {max_body_size}")
    messages = [line for line in body.split(b"\n") if line]
    if messages and max(map(len, messages)) > max_msg_size:
        raise QueueError(ErrorCode.MSG_TOO_BIG)
    return messages


def parse_binary(body: bytes, max_msg_size: int, max_body_size: int) -> list[bytes]:
    """``[4-byte count][4-byte size][bytes]...``, big-endian signed as nsqd reads them.

    Errors use nsqd's codes (``BAD_BODY`` for the count, ``BAD_MESSAGE`` for a message); bytes
    after the last announced message are ignored, as nsqd ignores them.
    """
    if len(body) > max_body_size:
        raise QueueError(ErrorCode.BODY_TOO_BIG, f"{len(body)} > {max_body_size}")
    if len(body) < 4:
        raise QueueError(ErrorCode.BAD_BODY, "MPUB failed to read message count")
    (count,) = _U32.unpack_from(body, 0)
    # 4 bytes of count, then at least 4 bytes of size + 1 byte of body per message.
    max_messages = (max_body_size - 4) // 5
    if count <= 0 or count > max_messages:
        raise QueueError(ErrorCode.BAD_BODY, f"MPUB invalid message count {count}")
    messages: list[bytes] = []
    pos = 4
    end = len(body)
    for i in range(count):
        if pos + 4 > end:
            raise QueueError(ErrorCode.BAD_MESSAGE, f"MPUB failed to read message({i}) body size")
        (size,) = _U32.unpack_from(body, pos)
        pos += 4
        if size <= 0:
            raise QueueError(ErrorCode.BAD_MESSAGE, f"MPUB invalid message({i}) body size {size}")
        if size > max_msg_size:
            raise QueueError(ErrorCode.BAD_MESSAGE, f"MPUB message too big {size} > {max_msg_size}")
        if pos + size > end:
            raise QueueError(ErrorCode.BAD_MESSAGE, f"MPUB failed to read message({i}) body")
        messages.append(body[pos : pos + size])
        pos += size
    return messages


def encode_binary(messages: list[bytes]) -> bytes:
    """The binary /mpub body for ``messages`` (for clients, tests and benchmarks)."""
    parts = [_U32.pack(len(messages))]
    for message in messages:
        parts.append(_U32.pack(len(message)))
        parts.append(message)
    return b"".join(parts)
