"""Message headers: string names to string values, carried beside a message's body.

NSQ's frames have no headers (a long-standing request: nsqio/nsq #1063, #1377), so they come
in through deltaq's HTTP envelope form (``/pub?envelope=json``, ``/mpub?envelope=json``): a
JSON object with the body and its headers. They are stored as a ``map<string,string>`` column
of the topic, channel and dead-letter tables (null where a message has none), and returned
by ``/sub``; TCP consumers get the body alone, as nsqd sends it.

The limits are Google Pub/Sub's attribute limits, which users of HTTP queues know.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.mpub import check_single

Headers = dict[str, str]

MAX_HEADERS = 100
MAX_NAME_BYTES = 256
MAX_VALUE_BYTES = 1024

_ENVELOPE_KEYS = frozenset({"body", "body_base64", "headers"})


def check_headers(value: object, where: str = "") -> Headers | None:
    """``value`` as headers (None or empty: none), or INVALID_HEADERS naming the limit."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise QueueError(ErrorCode.INVALID_HEADERS, f"{where}headers must be a JSON object")
    if len(value) > MAX_HEADERS:
        raise QueueError(ErrorCode.INVALID_HEADERS, f"{where}{len(value)} headers > {MAX_HEADERS}")
    for name, text in value.items():
        if not name:
            raise QueueError(ErrorCode.INVALID_HEADERS, f"{where}a header name is empty")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise QueueError(
                ErrorCode.INVALID_HEADERS,
                f"{where}header name {name[:32]!r}... is over {MAX_NAME_BYTES} bytes",
            )
        if not isinstance(text, str):
            raise QueueError(
                ErrorCode.INVALID_HEADERS, f"{where}header {name!r}: the value must be a string"
            )
        if len(text.encode()) > MAX_VALUE_BYTES:
            raise QueueError(
                ErrorCode.INVALID_HEADERS,
                f"{where}header {name!r}: the value is over {MAX_VALUE_BYTES} bytes",
            )
    return value or None


def parse_envelope(data: bytes, where: str = "") -> tuple[bytes, Headers | None]:
    """One envelope: ``{"body": ..., "headers": {...}}`` or ``{"body_base64": "...", ...}``.

    ``body`` as a JSON string is the message's UTF-8 text; any other JSON value (an object,
    an array, a number) is the message as compact JSON. ``body_base64`` is for bytes that are
    not text. Exactly one of the two. ``where`` prefixes errors ("line 3: ")."""
    try:
        envelope: Any = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise QueueError(ErrorCode.INVALID_ENVELOPE, f"{where}not JSON: {exc}") from exc
    if not isinstance(envelope, dict):
        raise QueueError(ErrorCode.INVALID_ENVELOPE, f"{where}an envelope is a JSON object")
    unknown = envelope.keys() - _ENVELOPE_KEYS
    if unknown:
        raise QueueError(
            ErrorCode.INVALID_ENVELOPE,
            f"{where}unknown fields {sorted(unknown)} (body, body_base64, headers)",
        )
    if ("body" in envelope) == ("body_base64" in envelope):
        raise QueueError(
            ErrorCode.INVALID_ENVELOPE, f"{where}give exactly one of body and body_base64"
        )
    if "body_base64" in envelope:
        encoded = envelope["body_base64"]
        if not isinstance(encoded, str):
            raise QueueError(ErrorCode.INVALID_ENVELOPE, f"{where}body_base64 is a string")
        try:
            body = base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise QueueError(
                ErrorCode.INVALID_ENVELOPE, f"{where}body_base64 is not base64: {exc}"
            ) from exc
    else:
        value = envelope["body"]
        body = value.encode() if isinstance(value, str) else orjson.dumps(value)
    return body, check_headers(envelope.get("headers"), where)


def parse_envelope_lines(
    data: bytes, max_msg_size: int | None = None
) -> tuple[list[bytes], list[Headers | None]]:
    """JSON Lines of envelopes (``/mpub?envelope=json``), blank lines skipped, each message
    non-empty and at most ``max_msg_size`` bytes; an error names its line (1-based) and
    nothing of the batch is taken."""
    bodies: list[bytes] = []
    headers: list[Headers | None] = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"line {number}: "
        body, found = parse_envelope(line, where)
        if max_msg_size is not None:
            check_single(body, max_msg_size, where)
        bodies.append(body)
        headers.append(found)
    return bodies, headers


def encode_all(headers: list[Headers | None]) -> bytes:
    """Headers of a publish's messages (one entry each), for the node journal."""
    return orjson.dumps(headers)


def decode_all(data: bytes | memoryview) -> list[Headers | None]:
    decoded = orjson.loads(bytes(data))
    if not isinstance(decoded, list):
        raise ValueError("headers are not a list")
    return decoded


def headers_bytes(headers: list[Headers | None] | None) -> int:
    """What a publish's headers weigh in its commit (their names' and values' characters)."""
    if headers is None:
        return 0
    return sum(len(k) + len(v) for h in headers if h for k, v in h.items())


def none_if_bare(headers: list[Headers | None] | None) -> list[Headers | None] | None:
    """None when no message has headers (the common case: the publish path stays as it was)."""
    if headers is None or not any(headers):
        return None
    return headers
