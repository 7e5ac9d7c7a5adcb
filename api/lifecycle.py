"""A message's life over HTTP: a topic's message TTL and retention, a channel's max_attempts,
its dead letters, and redriving them.

A topic's ``ttl_ms`` (/topic/configure; the settings' ``message_ttl_ms`` otherwise) is how long
after publishing a message may still be delivered; an older one is expired (an EXPIRE ledger
event) instead. A channel's ``max_attempts`` (set at /channel/create or with
/channel/configure; the settings' ``max_attempts`` otherwise) is how many deliveries a message
gets; one that had them all is moved to the channel's dead-letter table instead of being
delivered again. /channel/redrive makes dead letters ready again with their attempts reset.
A topic's ``retention_hours`` and ``retention`` say how long its rows are kept (the sweep's
upkeep removes them: queue_engine/retention.py).
"""

from __future__ import annotations

import binascii
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from api.responses import CHANNEL_CODES, error_doc, ok_empty, ok_json
from api.state import broker_of
from queue_engine.channel_filter import compile_filter
from queue_engine.channel_queue import SettleError
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.fanout import fields_of
from queue_engine.names import require_topic, require_topic_channel
from queue_engine.settings import RetentionMode
from queue_engine.topic_schema import parse_schema

router = APIRouter(tags=["dead letters"])

# nsqd's attempts field is 16 bits.
MAX_ATTEMPTS_LIMIT = 65_535
# A year.
MAX_TTL_MS = 365 * 24 * 3_600_000
# Ten years.
MAX_RETENTION_HOURS = 87_600
_NUMBER = re.compile(r"^[0-9]{1,12}$")
# A decimal number (as JSON writes one: exponents allowed, no sign, nan or inf).
_HOURS = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?$")
_MESSAGE_ID = re.compile(r"^[0-9a-f]{16}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Topic = Annotated[str | None, Query(description="Topic name")]
Channel = Annotated[str | None, Query(description="Channel name")]
MaxAttempts = Annotated[
    str | None,
    Query(
        description=f"Deliveries before a message is dead-lettered: 1..{MAX_ATTEMPTS_LIMIT}, "
        "or `default` for the settings' max_attempts"
    ),
]


TtlMs = Annotated[
    str | None,
    Query(
        description=f"Message TTL in ms after publishing: 1..{MAX_TTL_MS}, or `default` for the "
        "settings' message_ttl_ms"
    ),
]


RetentionHours = Annotated[
    str | None,
    Query(
        description=f"Hours a message's row is kept after publishing: 0..{MAX_RETENTION_HOURS} "
        "(decimals allowed; 0: kept for ever), or `default` for the settings' retention_hours"
    ),
]
Retention = Annotated[
    str | None,
    Query(
        description="`taken`: rows are removed only once every channel has taken them; "
        "`fixed`: after retention_hours regardless; `default`: the settings' retention"
    ),
]


SchemaParam = Annotated[
    str | None,
    Query(
        description=(
            "Type the topic: its fields in Spark DDL, e.g. `sku STRING NOT NULL, amount DOUBLE, "
            "placed_at TIMESTAMP` (types STRING, BOOLEAN, INT, BIGINT, DOUBLE, DATE, TIMESTAMP). "
            "Bodies published from then on must be JSON objects that fit it; each field becomes "
            "a column of the topic, channel and dead-letter tables. Given again, it evolves: "
            "the fields kept as they were, new nullable fields added last."
        )
    ),
]


def _limit(value: str | None, high: int, code: ErrorCode) -> int | None:
    """``default`` -> None (the settings' value); else 1..high, or ``code``."""
    if value == "default":
        return None
    if value is None or not _NUMBER.match(value) or not 1 <= int(value) <= high:
        raise QueueError(code, f"{value!r}: 1..{high} or default")
    return int(value)


def parse_max_attempts(value: str | None) -> int | None:
    """``default`` -> None (the settings' value); else 1..65535, or INVALID_MAX_ATTEMPTS."""
    return _limit(value, MAX_ATTEMPTS_LIMIT, ErrorCode.INVALID_MAX_ATTEMPTS)


@router.post(
    "/topic/configure",
    summary="Change a topic's message TTL, retention and schema",
    responses={
        200: {"description": "Done (empty body)"},
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.TOPIC_NOT_FOUND,
            ErrorCode.INVALID_TTL,
            ErrorCode.INVALID_RETENTION,
            ErrorCode.INVALID_SCHEMA,
            ErrorCode.SCHEMA_CHANGE_REFUSED,
        ),
    },
    response_class=Response,
)
async def topic_configure(
    request: Request,
    topic: Topic = None,
    ttl_ms: TtlMs = None,
    retention_hours: RetentionHours = None,
    retention: Retention = None,
    schema: SchemaParam = None,
) -> Response:
    """Only the settings given change (none given: nothing does, the topic must exist)."""
    name = require_topic(topic)
    if schema is not None:
        parse_schema(schema)  # refused before anything changes
    options: dict[str, Any] = {}
    if ttl_ms is not None:
        options["ttl_ms"] = _limit(ttl_ms, MAX_TTL_MS, ErrorCode.INVALID_TTL)
    if retention_hours is not None:
        options["retention_hours"] = parse_retention_hours(retention_hours)
    if retention is not None:
        options["retention"] = parse_retention(retention)
    broker = broker_of(request)
    if schema is not None:
        # First: the one change that can still be refused (SCHEMA_CHANGE_REFUSED), so that a
        # refused call changes nothing.
        await broker.declare_topic_schema(name, schema)
    await broker.configure_topic(name, options)
    return ok_empty()


def parse_retention(value: str) -> str | None:
    """``default`` -> None (the settings' rule); else a RetentionMode, or INVALID_RETENTION."""
    if value == "default":
        return None
    try:
        return RetentionMode(value).value
    except ValueError:
        modes = ", ".join(m.value for m in RetentionMode)
        raise QueueError(ErrorCode.INVALID_RETENTION, f"{value!r}: {modes} or default") from None


def parse_retention_hours(value: str) -> float | None:
    """``default`` -> None (the settings' value); else 0..MAX_RETENTION_HOURS, or
    INVALID_RETENTION."""
    if value == "default":
        return None
    if not _HOURS.match(value) or float(value) > MAX_RETENTION_HOURS:
        wanted = f"{value!r}: 0..{MAX_RETENTION_HOURS} or default"
        raise QueueError(ErrorCode.INVALID_RETENTION, wanted)
    return float(value)


FilterParam = Annotated[
    str | None,
    Query(
        description=(
            "A Spark SQL condition over id, replay_of, published_at, deliver_at, expires_at and "
            "headers['name']: only the messages it holds for enter the channel (e.g. "
            "`headers['region'] = 'eu'`); /channel/configure takes `default` for none. It "
            "applies to the messages committed to the topic from then on."
        )
    ),
]


@router.post(
    "/channel/configure",
    summary="Change a channel's max_attempts or filter",
    responses={
        200: {"description": "Done (empty body)"},
        **error_doc(*CHANNEL_CODES, ErrorCode.INVALID_MAX_ATTEMPTS, ErrorCode.INVALID_FILTER),
    },
    response_class=Response,
)
async def channel_configure(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    max_attempts: MaxAttempts = None,
    filter: FilterParam = None,
) -> Response:
    topic_name, channel_name = require_topic_channel(topic, channel)
    # Both checked before either changes.
    limit = parse_max_attempts(max_attempts) if max_attempts is not None or filter is None else None
    wanted = None if filter in (None, "default") else filter
    broker = broker_of(request)
    if wanted is not None:
        compile_filter(wanted, fields_of(broker.topics.schema(topic_name)))
    if max_attempts is not None or filter is None:
        await broker.configure_channel(topic_name, channel_name, max_attempts=limit)
    if filter is not None:
        await broker.set_channel_filter(topic_name, channel_name, wanted)
    return ok_empty()


@router.post(
    "/channel/redrive",
    summary="Make dead letters ready again, attempts reset (all, or the ids named)",
    description=(
        "Every `id` parameter names one dead letter; without any, all of the channel's dead "
        "letters are redriven. All or none: if one named id is not a dead letter, nothing is "
        'redriven (409 E_REDRIVE_FAILED with the ids in `failed`). Answers `{"redriven": n}`.'
    ),
    responses={
        200: {"description": "How many were redriven"},
        **error_doc(*CHANNEL_CODES, ErrorCode.E_INVALID, ErrorCode.E_REDRIVE_FAILED),
    },
    response_class=Response,
)
async def channel_redrive(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    id: Annotated[list[str] | None, Query(description="A dead letter's message id")] = None,
) -> Response:
    topic_name, channel_name = require_topic_channel(topic, channel)
    for message_id in id or []:
        if not _MESSAGE_ID.match(message_id):
            raise QueueError(ErrorCode.E_INVALID, f"not a message id: {message_id!r}", param="id")
    try:
        count = await broker_of(request).redrive(topic_name, channel_name, id or None)
    except SettleError as exc:
        raise QueueError(ErrorCode.E_REDRIVE_FAILED, str(exc), failed=exc.failed) from exc
    return ok_json({"redriven": count})


@router.get(
    "/channel/dead",
    summary="A channel's dead letters, longest dead first",
    responses={200: {"description": "The dead letters"}, **error_doc(*CHANNEL_CODES)},
    response_class=Response,
)
async def channel_dead(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many")] = 100,
) -> Response:
    topic_name, channel_name = require_topic_channel(topic, channel)
    runtime = await broker_of(request).channel(topic_name, channel_name)
    table = await runtime.dead_letters(limit)
    rows: list[dict[str, Any]] = [
        {
            "id": row["id"],
            "attempts": row["attempts"],
            "last_consumer": row["last_consumer"],
            "last_event": row["last_event"],
            "dead_at": row["dead_at"].isoformat(),
            # nsqd's message timestamp: nanoseconds since the epoch, when it was published.
            "timestamp": (row["published_at"] - _EPOCH) // timedelta(microseconds=1) * 1000,
            "body": binascii.b2a_base64(row["body"], newline=False).decode(),
            "headers": dict(row.get("headers") or ()),
        }
        for row in table.to_pylist()
    ]
    return ok_json({"dead_count": len(runtime.queue.dead), "messages": rows})
