"""POST /pub and /mpub, as nsqd serves them.

The logic lives in ``pub`` and ``mpub``, which take the query parameters and a body reader.
Two front doors call them: the FastAPI routes below (which also make the OpenAPI docs) and
``api.fastpath``, a plain ASGI handler that skips FastAPI's per-request machinery for these
two hot paths. Both give the same answers; the tests run both.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from api.body import read_limited
from api.lifecycle import MAX_TTL_MS
from api.responses import error_doc, ok_text
from api.state import broker_of
from queue_engine.broker import Broker
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.headers import Headers, none_if_bare, parse_envelope, parse_envelope_lines
from queue_engine.mpub import check_single, parse_binary, split_text
from queue_engine.names import require_topic

# Reads the request body, raising QueueError(code) once it exceeds limit bytes.
BodyReader = Callable[[int, ErrorCode], Awaitable[bytes]]

_INTEGER = re.compile(r"^[+-]?[0-9]+$")
# nsqd's boolParams; any other value of ?binary= also means binary (deprecated in nsqd).
_FALSE = {"false", "0"}


def defer_ms(value: str | None, max_ms: int) -> int | None:
    """``defer=`` in ms: an integer in 0..max_req_timeout, else INVALID_DEFER (as nsqd)."""
    if value is None:
        return None
    if not _INTEGER.match(value):
        raise QueueError(ErrorCode.INVALID_DEFER, value)
    defer = int(value)
    if not 0 <= defer <= max_ms:
        raise QueueError(ErrorCode.INVALID_DEFER, value)
    return defer


def ttl_ms(value: str | None) -> int | None:
    """``ttl_ms=``: 1..MAX_TTL_MS, else INVALID_TTL (absent: the topic's TTL applies)."""
    if value is None:
        return None
    if not _INTEGER.match(value) or not 1 <= int(value) <= MAX_TTL_MS:
        raise QueueError(ErrorCode.INVALID_TTL, f"{value!r}: 1..{MAX_TTL_MS}")
    return int(value)


def enveloped(params: Mapping[str, str]) -> bool:
    """``envelope=json``: the body is JSON carrying the message and its headers
    (queue_engine.headers); absent: the body is the message, as nsqd reads it."""
    value = params.get("envelope")
    if value is None:
        return False
    if value != "json":
        raise QueueError(ErrorCode.INVALID_ENVELOPE, f"envelope={value!r}: the one form is json")
    return True


async def pub(broker: Broker, params: Mapping[str, str], read: BodyReader) -> None:
    """nsqd's doPUB: body checks first, then the topic, then defer (then deltaq's ttl_ms)."""
    limits = broker.settings
    headers: list[Headers | None] | None = None
    if enveloped(params):
        # The envelope's JSON (and base64) is larger than the message it carries: it is read
        # up to the batch limit, and the message it holds is held to the message limit.
        body, found = parse_envelope(await read(limits.max_body_size_bytes, ErrorCode.MSG_TOO_BIG))
        body = check_single(body, limits.max_msg_size_bytes)
        headers = none_if_bare([found])
    else:
        body = check_single(
            await read(limits.max_msg_size_bytes, ErrorCode.MSG_TOO_BIG),
            limits.max_msg_size_bytes,
        )
    name = require_topic(params.get("topic"))
    # nsqd creates the topic as soon as the name is valid, even if the request fails later.
    await broker.create_topic(name)
    defer = defer_ms(params.get("defer"), limits.max_req_timeout_ms)
    await broker.publish(name, [body], defer, ttl_ms(params.get("ttl_ms")), headers)


async def mpub(
    broker: Broker, params: Mapping[str, str], read: BodyReader, content_length: int | None
) -> None:
    """nsqd's doMPUB: Content-Length, then the topic, then the body."""
    limits = broker.settings
    if content_length is not None and content_length > limits.max_body_size_bytes:
        raise QueueError(ErrorCode.BODY_TOO_BIG)
    name = require_topic(params.get("topic"))
    # nsqd creates the topic as soon as the name is valid, even if the body is then refused.
    await broker.create_topic(name)
    ttl = ttl_ms(params.get("ttl_ms"))
    envelope = enveloped(params)
    body = await read(limits.max_body_size_bytes, ErrorCode.BODY_TOO_BIG)
    binary = params.get("binary")
    headers: list[Headers | None] | None = None
    if binary is not None and binary not in _FALSE:
        if envelope:
            raise QueueError(ErrorCode.INVALID_ENVELOPE, "envelope=json takes no binary=")
        messages = parse_binary(body, limits.max_msg_size_bytes, limits.max_body_size_bytes)
    elif envelope:
        messages, found = parse_envelope_lines(body, limits.max_msg_size_bytes)
        headers = none_if_bare(found)
    else:
        messages = split_text(body, limits.max_msg_size_bytes, limits.max_body_size_bytes)
    if messages:
        await broker.publish(name, messages, ttl_ms=ttl, headers=headers)


# -- FastAPI routes (documentation, and the path used when the fast path is off) -------------

router = APIRouter(tags=["publish"])

_RAW_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "Acknowledged", "content": {"text/plain": {"example": "OK"}}}
}
TtlParam = Annotated[
    str | None,
    Query(
        description=f"Message TTL in ms after publishing: 1..{MAX_TTL_MS} (replaces the topic's)"
    ),
]
EnvelopeParam = Annotated[
    str | None,
    Query(
        # Checked by ``enveloped``, so that both front doors answer INVALID_ENVELOPE.
        json_schema_extra={"enum": ["json"]},
        description=(
            "`json`: the body is an envelope carrying the message and its headers: "
            '`{"body": "text", "headers": {"name": "value"}}` (`body_base64` instead of '
            "`body` for bytes); /mpub takes one envelope per line"
        ),
    ),
]
TopicParam = Annotated[
    str | None, Query(description="Topic name: 1-64 of [.a-zA-Z0-9_-], optional #ephemeral")
]


def first_values(request: Request) -> dict[str, str]:
    """Query parameters, the first value of each (nsqd reads the first)."""
    params: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        params.setdefault(key, value)
    return params


def content_length(request: Request) -> int | None:
    header = request.headers.get("content-length")
    return None if header is None else int(header)


def reader(request: Request) -> BodyReader:
    length = content_length(request)

    async def read(limit: int, code: ErrorCode) -> bytes:
        return await read_limited(request.receive, length, limit, code)

    return read


@router.post(
    "/pub",
    summary="Publish one message",
    description=(
        "The raw body is the message. With `defer=MS` the message is not delivered before "
        "MS milliseconds (0..max_req_timeout_ms); with `ttl_ms=MS` it is never delivered "
        "once MS milliseconds have passed since publishing (it is expired instead; this "
        "replaces the topic's TTL). `OK` means the message is durable: in the "
        'node\'s fsync\'d journal (`ack = "journal"`) or a synced Delta commit (`ack = "commit"`); '
        'with `ack = "buffer"`: queued for the next commit. `envelope=json`: the body is '
        '`{"body": ..., "headers": {...}}` (see /mpub).'
    ),
    response_class=Response,
    responses={
        **_OK,
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.MSG_EMPTY,
            ErrorCode.INVALID_DEFER,
            ErrorCode.INVALID_TTL,
            ErrorCode.INVALID_ENVELOPE,
            ErrorCode.INVALID_HEADERS,
            ErrorCode.MSG_TOO_BIG,
            ErrorCode.E_COMMIT_FAILED,
            ErrorCode.EXITING,
        ),
    },
    openapi_extra=_RAW_BODY,
)
async def pub_route(
    request: Request,
    topic: TopicParam = None,
    defer: Annotated[str | None, Query(description="Delay in ms before delivery")] = None,
    ttl_ms: TtlParam = None,
    envelope: EnvelopeParam = None,
) -> Response:
    await pub(broker_of(request), first_values(request), reader(request))
    return ok_text()


@router.post(
    "/mpub",
    summary="Publish many messages in one request",
    description=(
        "Text mode (default): messages separated by `\\n`, empty lines skipped. "
        "`binary=true`: `[4-byte count][4-byte size][bytes]...`, big-endian. "
        "All messages of one request go into one Delta commit: all or none. "
        "`ttl_ms=MS`: as for /pub, for every message of the request. "
        "`envelope=json`: JSON Lines, one envelope per message, "
        '`{"body": "text", "headers": {"name": "value"}}` (`body_base64` for bytes); '
        "an error names its line and nothing of the request is published. Headers: at "
        "most 100 per message, names 1-256 bytes, values up to 1,024 bytes."
    ),
    response_class=Response,
    responses={
        **_OK,
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.INVALID_TTL,
            ErrorCode.INVALID_ENVELOPE,
            ErrorCode.INVALID_HEADERS,
            ErrorCode.BODY_TOO_BIG,
            ErrorCode.MSG_TOO_BIG,
            ErrorCode.BAD_BODY,
            ErrorCode.BAD_MESSAGE,
            ErrorCode.E_COMMIT_FAILED,
            ErrorCode.EXITING,
        ),
    },
    openapi_extra=_RAW_BODY,
)
async def mpub_route(
    request: Request,
    topic: TopicParam = None,
    binary: Annotated[str | None, Query(description="true/1 for the binary framing")] = None,
    ttl_ms: TtlParam = None,
    envelope: EnvelopeParam = None,
) -> Response:
    await mpub(broker_of(request), first_values(request), reader(request), content_length(request))
    return ok_text()
