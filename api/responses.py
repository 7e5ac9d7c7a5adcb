"""nsqd's response shapes, and the one place where error codes become HTTP statuses."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Response

from queue_engine.errors import ChannelElsewhereError, ErrorCode, QueueError

NSQ_HEADER = {"X-NSQ-Content-Type": "nsq; version=1.0"}
JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.MISSING_ARG_TOPIC: 400,
    ErrorCode.MISSING_ARG_CHANNEL: 400,
    ErrorCode.INVALID_TOPIC: 400,
    ErrorCode.INVALID_CHANNEL: 400,
    ErrorCode.INVALID_ARG_TOPIC: 400,
    ErrorCode.INVALID_ARG_CHANNEL: 400,
    ErrorCode.INVALID_OPTION: 400,
    ErrorCode.INVALID_VALUE: 400,
    ErrorCode.MSG_EMPTY: 400,
    ErrorCode.INVALID_DEFER: 400,
    ErrorCode.INVALID_ENVELOPE: 400,
    ErrorCode.INVALID_HEADERS: 400,
    ErrorCode.INVALID_FILTER: 400,
    ErrorCode.INVALID_SCHEMA: 400,
    ErrorCode.INVALID_BODY: 400,
    # The topic's rows or their readers could not follow the change.
    ErrorCode.SCHEMA_CHANGE_REFUSED: 409,
    ErrorCode.INVALID_MAX_ATTEMPTS: 400,
    ErrorCode.INVALID_TTL: 400,
    ErrorCode.INVALID_RETENTION: 400,
    ErrorCode.INVALID_RANGE: 400,
    # The rows are gone for good.
    ErrorCode.RANGE_REMOVED: 410,
    ErrorCode.MSG_TOO_BIG: 413,
    ErrorCode.BODY_TOO_BIG: 413,
    # nsqd answers every binary /mpub framing error with 413.
    ErrorCode.BAD_BODY: 413,
    ErrorCode.BAD_MESSAGE: 413,
    ErrorCode.TOPIC_NOT_FOUND: 404,
    ErrorCode.CHANNEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.E_INVALID: 400,
    # Well-formed, but the message is not in flight under that lease: a conflict with state.
    ErrorCode.E_FIN_FAILED: 409,
    ErrorCode.E_REQ_FAILED: 409,
    ErrorCode.E_TOUCH_FAILED: 409,
    ErrorCode.E_REDRIVE_FAILED: 409,
    # A cap of the settings: the request can never succeed as it is (raise the cap).
    ErrorCode.E_TOO_MANY_TOPICS: 403,
    ErrorCode.E_TOO_MANY_CHANNELS: 403,
    # Too many consumers waiting at once: retry later.
    ErrorCode.E_TOO_MANY_WAITERS: 503,
    ErrorCode.E_AUTH_FAILED: 401,
    ErrorCode.E_UNAUTHORIZED: 403,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.E_COMMIT_FAILED: 503,
    ErrorCode.EXITING: 503,
    # A state of the topic's table, not of the request: retrying does not help until the
    # table changes.
    ErrorCode.E_TABLE_REFUSED: 409,
    ErrorCode.E_CONSTRAINT_VIOLATED: 400,
    # Another node serves the channel: the same request there (Location).
    ErrorCode.CHANNEL_ELSEWHERE: 307,
    # The node named is not live (a state of the warehouse, not a malformed request).
    ErrorCode.INVALID_NODE: 409,
}

# The codes nsqd 1.3.0's HTTP API answers itself: deltaq's answers carrying them stay
# nsqd's bare {"message": CODE} (clients compare bodies), unless the check is deltaq's own and
# names its parameter. deltaq's own codes carry the reason.
NSQD_CODES = frozenset(
    {
        ErrorCode.INVALID_REQUEST,
        ErrorCode.MISSING_ARG_TOPIC,
        ErrorCode.MISSING_ARG_CHANNEL,
        ErrorCode.INVALID_TOPIC,
        ErrorCode.INVALID_CHANNEL,
        ErrorCode.INVALID_ARG_TOPIC,
        ErrorCode.INVALID_ARG_CHANNEL,
        ErrorCode.INVALID_OPTION,
        ErrorCode.INVALID_VALUE,
        ErrorCode.MSG_EMPTY,
        ErrorCode.MSG_TOO_BIG,
        ErrorCode.BODY_TOO_BIG,
        ErrorCode.BAD_BODY,
        ErrorCode.BAD_MESSAGE,
        ErrorCode.INVALID_DEFER,
        ErrorCode.TOPIC_NOT_FOUND,
        ErrorCode.CHANNEL_NOT_FOUND,
        ErrorCode.NOT_FOUND,
        ErrorCode.METHOD_NOT_ALLOWED,
        ErrorCode.INTERNAL_ERROR,
        ErrorCode.EXITING,
    }
)

# deltaq's own checks of a request, whose answers say why (``reason``); the others carry
# their specifics in fields of their own (``failed``, ``node``) or are nsqd's bare bodies.
EXPLAINED_CODES = frozenset(
    {
        ErrorCode.E_INVALID,
        ErrorCode.INVALID_ENVELOPE,
        ErrorCode.INVALID_HEADERS,
        ErrorCode.INVALID_FILTER,
        ErrorCode.INVALID_SCHEMA,
        ErrorCode.INVALID_BODY,
        ErrorCode.SCHEMA_CHANGE_REFUSED,
        ErrorCode.INVALID_MAX_ATTEMPTS,
        ErrorCode.INVALID_TTL,
        ErrorCode.INVALID_RETENTION,
        ErrorCode.INVALID_RANGE,
        ErrorCode.RANGE_REMOVED,
        ErrorCode.INVALID_NODE,
        ErrorCode.E_TOO_MANY_TOPICS,
        ErrorCode.E_TOO_MANY_CHANNELS,
        ErrorCode.E_TOO_MANY_WAITERS,
        ErrorCode.E_TABLE_REFUSED,
        ErrorCode.E_CONSTRAINT_VIOLATED,
    }
)

# What nsqd's /channel/* handlers can answer about their topic and channel arguments.
CHANNEL_CODES = (
    ErrorCode.MISSING_ARG_TOPIC,
    ErrorCode.INVALID_ARG_TOPIC,
    ErrorCode.MISSING_ARG_CHANNEL,
    ErrorCode.INVALID_ARG_CHANNEL,
    ErrorCode.TOPIC_NOT_FOUND,
    ErrorCode.CHANNEL_NOT_FOUND,
)


def ok_text(text: str = "OK") -> Response:
    return Response(text, media_type=TEXT_TYPE, headers=NSQ_HEADER)


def ok_empty() -> Response:
    """nsqd's V1 answer for a handler that returns nothing: 200 with an empty body."""
    return Response(b"", headers=NSQ_HEADER)


def ok_json(data: Any) -> Response:
    body = json.dumps(data, separators=(",", ":"))
    return Response(body, media_type=JSON_TYPE, headers=NSQ_HEADER)


def error_body(code: ErrorCode) -> bytes:
    """nsqd's error body: compact JSON, as Go's json.Marshal writes it."""
    return json.dumps({"message": str(code)}, separators=(",", ":")).encode()


def queue_error_body(exc: QueueError) -> bytes:
    """The body of a refused request: nsqd's ``{"message": CODE}``, plus, for deltaq's
    consumer API, which ids a batch refused (``failed``) and, for E_INVALID, which parameter
    was wrong and why (``param``, ``reason``: what nsqd's TCP protocol puts after the code)."""
    payload: dict[str, Any] = {"message": str(exc.code)}
    if exc.code in EXPLAINED_CODES or exc.param is not None:
        if exc.param is not None:
            payload["param"] = exc.param
        if exc.detail:
            payload["reason"] = exc.detail
    if exc.cause is not None:
        payload["reason"] = exc.cause
    if exc.failed is not None:
        payload["failed"] = exc.failed
    if isinstance(exc, ChannelElsewhereError):
        payload["node"] = exc.node_url
    return json.dumps(payload, separators=(",", ":")).encode()


def error(code: ErrorCode, headers: dict[str, str] | None = None) -> Response:
    """nsqd's error answer."""
    return _error_response(code, error_body(code), headers)


def explained_error(code: ErrorCode, param: str, reason: str) -> Response:
    """An error of one of deltaq's own checks: which parameter, and why."""
    body = json.dumps(
        {"message": str(code), "param": param, "reason": reason}, separators=(",", ":")
    )
    return _error_response(code, body.encode(), None)


def _error_response(code: ErrorCode, body: bytes, headers: dict[str, str] | None) -> Response:
    return Response(
        body,
        status_code=STATUS[code],
        media_type=JSON_TYPE,
        headers={**NSQ_HEADER, **(headers or {})},
    )


def from_queue_error(exc: QueueError, request_target: str = "") -> Response:
    """The answer to a refused request; ``request_target`` (path and query) is where a
    redirect to the channel's node goes on that node."""
    headers = None
    if isinstance(exc, ChannelElsewhereError):
        headers = {"Location": elsewhere_location(exc, request_target)}
    return _error_response(exc.code, queue_error_body(exc), headers)


def elsewhere_location(exc: ChannelElsewhereError, request_target: str) -> str:
    """The same request (path and query) on the node that serves the channel."""
    return exc.node_url.rstrip("/") + request_target


def error_doc(*codes: ErrorCode) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these codes, grouped by status."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(STATUS[code], []).append(str(code))
    return {
        status: {
            "description": " | ".join(names),
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {"message": {"type": "string", "enum": names}},
                    }
                }
            },
        }
        for status, names in by_status.items()
    }
