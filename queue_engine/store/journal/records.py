"""The node journal's records: one publish (PUB, MPUB or DPUB) each, framed and checksummed.

A frame is ``length (u32) | crc32 of the payload (u32) | payload``; the payload is the record's
position (u64), its topic, its timestamps and its bodies (their lengths first, then the bytes,
so that reading many bodies is one slice each). Integers are big-endian, as NSQ's wire. A
publish whose messages carry headers has the top bit of its body count set, and their headers
(queue_engine.headers, one entry per message) follow the bodies to the frame's end; frames
written before headers existed read as they always did.

A crash can leave the last frame of a journal file torn (short) or, with a disk that reorders
writes, garbled: ``decode`` stops at the first frame that is short or fails its checksum and
says where. Nothing after it was acknowledged (an acknowledgement follows the write and the
sync of every byte before it). A file may go on with zeros after its last frame (it was
filled with them before it was written to): zeros where a frame would begin are where the
written part ends, not a torn frame (a frame's payload is never empty, so its header is never
all zeros).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from queue_engine.headers import Headers, decode_all, encode_all, headers_bytes

_FRAME = struct.Struct(">II")
# position, published_at_us, deliver_at_us, expires_at_us (-1: none), topic length, bodies.
_HEAD = struct.Struct(">QqqqHI")
NONE = -1
# The body count's top bit: headers follow the bodies (a count never reaches it: a frame holds
# at most a request's bytes).
_WITH_HEADERS = 0x8000_0000


@dataclass(slots=True)
class Record:
    position: int
    topic: str
    published_at_us: int
    deliver_at_us: int | None
    expires_at_us: int | None
    bodies: list[bytes]
    # One entry per body (None: no message of the publish has headers).
    headers: list[Headers | None] | None = None
    # The typed topic's schema the bodies fitted when published (in memory only: a recovery
    # converts the bodies of its frames leniently, as taken before the schema).
    checked: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.bodies)) + headers_bytes(self.headers)


def encode(record: Record) -> bytes:
    topic = record.topic.encode()
    bodies = record.bodies
    headers = b"" if record.headers is None else encode_all(record.headers)
    count = len(bodies) | (_WITH_HEADERS if headers else 0)
    payload = b"".join(
        (
            _HEAD.pack(
                record.position,
                record.published_at_us,
                NONE if record.deliver_at_us is None else record.deliver_at_us,
                NONE if record.expires_at_us is None else record.expires_at_us,
                len(topic),
                count,
            ),
            topic,
            _lengths(bodies),
            *bodies,
            headers,
        )
    )
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


_ONE_LENGTH = struct.Struct(">I")


def _lengths(bodies: list[bytes]) -> bytes:
    if len(bodies) == 1:
        return _ONE_LENGTH.pack(len(bodies[0]))  # a PUB
    return struct.pack(f">{len(bodies)}I", *map(len, bodies))


@dataclass(frozen=True)
class Decoded:
    records: list[Record]
    # Bytes of whole, valid frames from the start: where the next write would go.
    valid_bytes: int
    # Why decoding stopped before the end (None: every byte was a valid frame).
    torn: str | None


def decode(data: bytes) -> Decoded:
    """The records of ``data`` up to the first torn or corrupt frame."""
    records: list[Record] = []
    view = memoryview(data)
    at = 0
    end = len(data)
    while at < end:
        if not any(view[at : at + _FRAME.size]):
            break  # the zeros the file was filled with: nothing was written from here
        if end - at < _FRAME.size:
            return Decoded(records, at, f"a torn frame header at byte {at}")
        length, crc = _FRAME.unpack_from(view, at)
        start = at + _FRAME.size
        if end - start < length:
            return Decoded(records, at, f"a torn frame at byte {at} ({length} bytes announced)")
        payload = view[start : start + length]
        if zlib.crc32(payload) != crc:
            return Decoded(records, at, f"a frame failing its checksum at byte {at}")
        try:
            records.append(_record(payload))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            return Decoded(records, at, f"an unreadable frame at byte {at}: {exc}")
        at = start + length
    return Decoded(records, at, None)


def _record(payload: memoryview) -> Record:
    position, published, deliver, expires, topic_len, count = _HEAD.unpack_from(payload, 0)
    with_headers = bool(count & _WITH_HEADERS)
    count &= ~_WITH_HEADERS
    at = _HEAD.size
    topic = bytes(payload[at : at + topic_len]).decode()
    at += topic_len
    lengths = struct.unpack_from(f">{count}I", payload, at)
    at += 4 * count
    ends = list(itertools.accumulate(lengths, initial=at))
    if with_headers:
        headers = decode_all(payload[ends[-1] :])
        if len(headers) != count:
            raise ValueError("headers do not match the bodies")
    elif count and ends[-1] != len(payload):
        raise ValueError("body lengths do not add up to the frame")
    raw = bytes(payload)
    bodies = [raw[s:e] for s, e in itertools.pairwise(ends)]
    return Record(
        position,
        topic,
        published,
        None if deliver == NONE else deliver,
        None if expires == NONE else expires,
        bodies,
        headers if with_headers else None,
    )
