"""POST /pub and /mpub, as nsqd serves them."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from api.body import read_limited
from api.responses import error_doc, ok_text
from api.state import broker_of
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.mpub import check_single, parse_binary, split_text
from queue_engine.names import require_topic

router = APIRouter(tags=["publish"])

_INTEGER = re.compile(r"^[+-]?[0-9]+$")
# nsqd's boolParams; any other value of ?binary= also means binary (deprecated in nsqd).
_FALSE = {"false", "0"}

_RAW_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_OK = {200: {"description": "Acknowledged", "content": {"text/plain": {"example": "OK"}}}}

TopicParam = Annotated[str | None, Query(description="Topic name: 1-64 of [.a-zA-Z0-9_-], optional #ephemeral")]


def _defer_ms(value: str | None, max_ms: int) -> int | None:
    if value is None:
        return None
    if not _INTEGER.match(value):
        raise QueueError(ErrorCode.INVALID_DEFER, value)
    defer = int(value)
    if not 0 <= defer <= max_ms:
        raise QueueError(ErrorCode.INVALID_DEFER, value)
    return defer


@router.post(
    "/pub",
    summary="Publish one message",
    description=(
        "The raw body is the message. With `defer=MS` the message is not delivered before "
        "MS milliseconds (0..max_req_timeout_ms). `OK` means the message is in a committed "
        "Delta version (with `ack = \"buffer\"`: queued for the next commit)."
    ),
    response_class=Response,
    responses={
        **_OK,
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.MSG_EMPTY,
            ErrorCode.INVALID_DEFER,
            ErrorCode.MSG_TOO_BIG,
            ErrorCode.E_COMMIT_FAILED,
            ErrorCode.EXITING,
        ),
    },
    openapi_extra=_RAW_BODY,
)
async def pub(
    request: Request,
    topic: TopicParam = None,
    defer: Annotated[str | None, Query(description="Delay in ms before delivery")] = None,
) -> Response:
    broker = broker_of(request)
    limits = broker.settings
    body = check_single(
        await read_limited(request, limits.max_msg_size_bytes, ErrorCode.MSG_TOO_BIG),
        limits.max_msg_size_bytes,
    )
    name = require_topic(topic)
    await broker.publish(name, [body], _defer_ms(defer, limits.max_req_timeout_ms))
    return ok_text()


@router.post(
    "/mpub",
    summary="Publish many messages in one request",
    description=(
        "Text mode (default): messages separated by `\\n`, empty lines skipped. "
        "`binary=true`: `[4-byte count][4-byte size][bytes]...`, big-endian. "
        "All messages of one request go into one Delta commit: all or none."
    ),
    response_class=Response,
    responses={
        **_OK,
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
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
async def mpub(
    request: Request,
    topic: TopicParam = None,
    binary: Annotated[str | None, Query(description="true/1 for the binary framing")] = None,
) -> Response:
    broker = broker_of(request)
    limits = broker.settings
    length = request.headers.get("content-length")
    if length is not None and int(length) > limits.max_body_size_bytes:
        raise QueueError(ErrorCode.BODY_TOO_BIG)
    name = require_topic(topic)
    body = await read_limited(request, limits.max_body_size_bytes, ErrorCode.BODY_TOO_BIG)
    if binary is not None and binary not in _FALSE:
        messages = parse_binary(body, limits.max_msg_size_bytes, limits.max_body_size_bytes)
    else:
        messages = split_text(body, limits.max_msg_size_bytes, limits.max_body_size_bytes)
    if messages:
        await broker.publish(name, messages)
    else:
        # nsqd creates the topic even when every line was empty.
        await broker.create_topic(name)
    return ok_text()
