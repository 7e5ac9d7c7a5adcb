"""GET /sub, POST /fin /req /touch: NSQ's consumer verbs over HTTP (deltaq's own API).

nsqd has no HTTP consumer API; this one keeps its vocabulary (SUB, RDY as ``max``, FIN, REQ,
TOUCH, msg_timeout, attempts) and SQS's long polling. Every lease change is committed to the
channel's ledger before the answer is sent.

As for /pub, the logic (``subscribe``, ``answer``) takes query parameters and a body reader;
the FastAPI routes below and the plain-ASGI ``api.fastpath`` both call it.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request, Response

from api.publish import BodyReader, first_values, reader
from api.responses import JSON_TYPE, NSQ_HEADER, error_doc, ok_text
from api.state import broker_of
from queue_engine.broker import Broker
from queue_engine.channel_queue import Answer, Delivery, SettleError, lease_attempt
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.lease import EventKind
from queue_engine.names import require_channel, require_topic

router = APIRouter(tags=["consume"])

DEFAULT_WAIT_MS = 30_000
MAX_WAIT_MS = 60_000
# nsqd refuses a client msg_timeout under one second.
MIN_MSG_TIMEOUT_MS = 1_000
MAX_CONSUMER_CHARS = 128

_INTEGER = re.compile(r"^[+-]?[0-9]{1,18}$")
_MESSAGE_ID = re.compile(r"^[0-9a-f]{16}$")

_FAILED = {
    EventKind.FIN: ErrorCode.E_FIN_FAILED,
    EventKind.REQ: ErrorCode.E_REQ_FAILED,
    EventKind.TOUCH: ErrorCode.E_TOUCH_FAILED,
}

Topic = Annotated[str | None, Query(description="Topic name")]
Channel = Annotated[str | None, Query(description="Channel name")]


def _integer(params: Mapping[str, str], name: str) -> int | None:
    """An integer parameter (None when absent), else E_INVALID (nsqd's word): an empty value
    is refused, as nsqd refuses ``defer=``."""
    value = params.get(name)
    if value is None:
        return None
    if value == "":
        raise QueueError(ErrorCode.E_INVALID, "empty: an integer is needed", param=name)
    if not _INTEGER.match(value):
        raise QueueError(ErrorCode.E_INVALID, f"not an integer: {value!r}", param=name)
    return int(value)


def _int(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """An integer parameter in low..high, else E_INVALID."""
    number = _integer(params, name)
    if number is None:
        return default
    if not low <= number <= high:
        raise QueueError(ErrorCode.E_INVALID, f"{number} is outside {low}..{high}", param=name)
    return number


def _message(delivery: Delivery) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "attempts": delivery.attempts,
        # nsqd's message timestamp: nanoseconds since the epoch, when it was published.
        "timestamp": delivery.published_at_us * 1000,
        "body": binascii.b2a_base64(delivery.body, newline=False).decode(),
        "lease": delivery.lease,
        # deltaq's headers (queue_engine.headers): {} for a message published without any.
        "headers": delivery.headers or {},
    }


async def subscribe(broker: Broker, params: Mapping[str, str], peer: str) -> bytes:
    """GET /sub: the JSON answer, once messages are leased (and recorded) or the wait ran out."""
    settings = broker.settings
    topic_name = require_topic(params.get("topic"))
    channel_name = require_channel(params.get("channel"))
    limit = _int(params, "max", 1, 1, settings.max_rdy_count)
    wait = _int(params, "wait_ms", DEFAULT_WAIT_MS, 0, MAX_WAIT_MS)
    lease_ms = _int(
        params,
        "msg_timeout_ms",
        settings.msg_timeout_ms,
        MIN_MSG_TIMEOUT_MS,
        settings.max_msg_timeout_ms,
    )
    given = params.get("consumer")
    if given == "":
        raise QueueError(
            ErrorCode.E_INVALID,
            "empty: leave consumer out to be known by your address",
            param="consumer",
        )
    name = given or peer
    if len(name) > MAX_CONSUMER_CHARS:
        raise QueueError(
            ErrorCode.E_INVALID, f"longer than {MAX_CONSUMER_CHARS} characters", param="consumer"
        )
    deliveries = await broker.subscribe(
        topic_name,
        channel_name,
        limit=limit,
        wait_s=wait / 1000,
        lease_us=lease_ms * 1000,
        consumer=name,
    )
    return orjson.dumps({"messages": [_message(d) for d in deliveries]})


async def answer(
    broker: Broker,
    kind: EventKind,
    params: Mapping[str, str],
    query: Iterable[tuple[str, str]],
    read: BodyReader,
) -> None:
    """POST /fin, /req, /touch: every id/lease pair (from ``query``, all query parameters in
    order, and the body) settled in one ledger commit, or none (E_FIN_FAILED & co.)."""
    topic_name = require_topic(params.get("topic"))
    channel_name = require_channel(params.get("channel"))
    delay_us = 0
    if kind is EventKind.REQ:
        delay_us = _delay_ms(params, broker.settings.max_req_timeout_ms) * 1000
    body = await read(broker.settings.max_body_size_bytes, ErrorCode.BODY_TOO_BIG)
    answers = _answers(query, body)
    channel = await broker.answering(topic_name, channel_name, answers)
    try:
        await channel.answer(kind, answers, delay_us=delay_us)
    except SettleError as exc:
        raise QueueError(_FAILED[kind], str(exc), failed=exc.failed) from exc


@router.get(
    "/sub",
    summary="Long-poll a channel for messages; each comes back leased",
    description=(
        "Waits up to `wait_ms` (default 30000, at most 60000) until a message is ready, then "
        "returns up to `max` (default 1, at most max_rdy_count) messages, each leased to the "
        "caller for `msg_timeout_ms` (default msg_timeout_ms, 1000..max_msg_timeout_ms). "
        "Creates the topic and channel if they do not exist, as nsqd's SUB. A paused channel "
        "delivers nothing. `body` is base64; `timestamp` is the publish time in ns; `headers` "
        "are the message's (`{}`: none); answer with `/fin`, `/req` or `/touch` giving `id` "
        "and `lease`."
    ),
    response_class=Response,
    responses={
        200: {
            "description": "Leased messages (an empty list when the wait ran out)",
            "content": {
                "application/json": {
                    "example": {
                        "messages": [
                            {
                                "id": "0001a2b3c4d5e6f7",
                                "attempts": 1,
                                "timestamp": 1700000000000000000,
                                "body": "aGVsbG8=",
                                "lease": "1-4f2a9c0b7d1e",
                                "headers": {"region": "eu"},
                            }
                        ]
                    }
                }
            },
        },
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.MISSING_ARG_CHANNEL,
            ErrorCode.INVALID_CHANNEL,
            ErrorCode.E_INVALID,
            ErrorCode.E_COMMIT_FAILED,
            ErrorCode.EXITING,
        ),
    },
)
async def sub(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    max: Annotated[str | None, Query(description="Most messages to lease (nsqd's RDY)")] = None,
    wait_ms: Annotated[str | None, Query(description="Long-poll wait")] = None,
    msg_timeout_ms: Annotated[str | None, Query(description="Lease length")] = None,
    consumer: Annotated[str | None, Query(description="Name recorded as lease owner")] = None,
) -> Response:
    body = await subscribe(broker_of(request), first_values(request), _peer(request))
    return Response(body, media_type=JSON_TYPE, headers=NSQ_HEADER)


def _peer(request: Request) -> str:
    """An HTTP consumer that gives no ``consumer=`` is known by its host: its long polls come
    from whichever connection of its pool is free, and each would otherwise be a client."""
    client = request.client
    return client.host if client else "unknown"


def _answers(query: Iterable[tuple[str, str]], body: bytes) -> list[Answer]:
    """``id``/``lease`` pairs from the query string, then one ``ID LEASE`` per body line."""
    ids: list[str] = []
    leases: list[str] = []
    for key, value in query:
        if key == "id":
            ids.append(value)
        elif key == "lease":
            leases.append(value)
    if len(ids) != len(leases):
        raise QueueError(
            ErrorCode.E_INVALID,
            f"{len(ids)} id but {len(leases)} lease parameters: every id needs a lease",
            param="lease",
        )
    answers = [Answer(message_id, lease) for message_id, lease in zip(ids, leases, strict=True)]
    for line in body.decode("utf-8", errors="replace").splitlines():
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise QueueError(ErrorCode.E_INVALID, f"line {line!r} is not: ID LEASE", param="body")
        answers.append(Answer(fields[0], fields[1]))
    if not answers:
        raise QueueError(
            ErrorCode.E_INVALID, "no id and lease in the query or the body", param="id"
        )
    for message_id, lease in answers:
        if not _MESSAGE_ID.match(message_id):
            raise QueueError(
                ErrorCode.E_INVALID,
                f"not a message id (16 hex digits): {message_id!r}",
                param="id",
            )
        if lease_attempt(lease) is None:
            raise QueueError(ErrorCode.E_INVALID, f"not a lease token: {lease!r}", param="lease")
    return answers


async def _settle(request: Request, kind: EventKind) -> Response:
    await answer(
        broker_of(request),
        kind,
        first_values(request),
        request.query_params.multi_items(),
        reader(request),
    )
    return ok_text()


def _delay_ms(params: Mapping[str, str], max_ms: int) -> int:
    """REQ's delay: an integer, clamped to 0..max_req_timeout as nsqd clamps it."""
    return min(max(_integer(params, "delay_ms") or 0, 0), max_ms)


_ANSWER_ERRORS = (
    ErrorCode.MISSING_ARG_TOPIC,
    ErrorCode.INVALID_TOPIC,
    ErrorCode.MISSING_ARG_CHANNEL,
    ErrorCode.INVALID_CHANNEL,
    ErrorCode.TOPIC_NOT_FOUND,
    ErrorCode.CHANNEL_NOT_FOUND,
    ErrorCode.E_INVALID,
    ErrorCode.BODY_TOO_BIG,
    ErrorCode.E_COMMIT_FAILED,
)
_BATCH = (
    "Give `id` and `lease` as query parameters (repeat them for several), or one "
    "`ID LEASE` pair per line of the body. All are applied or none: if any is not in flight "
    "under its lease, nothing is written and the answer lists the `failed` ids."
)
_OK: dict[int | str, dict[str, Any]] = {
    200: {"description": "Done", "content": {"text/plain": {"example": "OK"}}}
}


@router.post(
    "/fin",
    summary="Finish in-flight messages: they are never delivered again",
    description=_BATCH,
    response_class=Response,
    responses={**_OK, **error_doc(*_ANSWER_ERRORS, ErrorCode.E_FIN_FAILED)},
)
async def fin(request: Request, topic: Topic = None, channel: Channel = None) -> Response:
    return await _settle(request, EventKind.FIN)


@router.post(
    "/req",
    summary="Requeue in-flight messages, optionally after delay_ms",
    description=_BATCH + " `delay_ms` is clamped to 0..max_req_timeout_ms, as nsqd does.",
    response_class=Response,
    responses={**_OK, **error_doc(*_ANSWER_ERRORS, ErrorCode.E_REQ_FAILED)},
)
async def req(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    delay_ms: Annotated[str | None, Query(description="Defer redelivery by this much")] = None,
) -> Response:
    return await _settle(request, EventKind.REQ)


@router.post(
    "/touch",
    summary="Extend the leases of in-flight messages by their msg_timeout",
    description=_BATCH
    + " A lease never extends past delivery time + max_msg_timeout_ms (nsqd's rule).",
    response_class=Response,
    responses={**_OK, **error_doc(*_ANSWER_ERRORS, ErrorCode.E_TOUCH_FAILED)},
)
async def touch(request: Request, topic: Topic = None, channel: Channel = None) -> Response:
    return await _settle(request, EventKind.TOUCH)
