"""POST /topic/* and /channel/*: nsqd's topic and channel administration."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from api.lifecycle import FilterParam, MaxAttempts, SchemaParam, parse_max_attempts
from api.responses import CHANNEL_CODES, error_doc, ok_empty
from api.state import broker_of
from queue_engine.broker import Broker
from queue_engine.channel_filter import compile_filter
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.fanout import fields_of
from queue_engine.names import require_topic, require_topic_channel
from queue_engine.topic_schema import parse_schema

router = APIRouter(tags=["admin"])

Topic = Annotated[str | None, Query(description="Topic name")]
Channel = Annotated[str | None, Query(description="Channel name")]
_OK: dict[int | str, dict[str, Any]] = {200: {"description": "Done (empty body, as nsqd)"}}
_TOPIC_ERRORS = error_doc(
    ErrorCode.MISSING_ARG_TOPIC, ErrorCode.INVALID_TOPIC, ErrorCode.TOPIC_NOT_FOUND
)
_CHANNEL_ERRORS = error_doc(*CHANNEL_CODES)


def _existing_name(topic: str | None) -> str:
    """nsqd's delete/pause/unpause check presence only; any unknown name is TOPIC_NOT_FOUND."""
    if topic is None:
        raise QueueError(ErrorCode.MISSING_ARG_TOPIC)
    return topic


@router.post(
    "/topic/create",
    summary="Create a topic (typed, with schema=)",
    description=(
        "Creates the topic if it does not exist. With `schema=`, the topic is typed (or its "
        "schema evolves, as /topic/configure): see /topic/configure."
    ),
    responses={
        **_OK,
        **error_doc(
            ErrorCode.MISSING_ARG_TOPIC,
            ErrorCode.INVALID_TOPIC,
            ErrorCode.INVALID_SCHEMA,
            ErrorCode.SCHEMA_CHANGE_REFUSED,
        ),
    },
    response_class=Response,
)
async def topic_create(
    request: Request, topic: Topic = None, schema: SchemaParam = None
) -> Response:
    name = require_topic(topic)
    if schema is not None:
        parse_schema(schema)  # refused before anything is created
    broker = broker_of(request)
    await broker.create_topic(name)
    if schema is not None:
        await broker.declare_topic_schema(name, schema)
    return ok_empty()


@router.post(
    "/topic/delete",
    summary="Delete a topic, its channels and their tables",
    responses={**_OK, **_TOPIC_ERRORS},
    response_class=Response,
)
async def topic_delete(request: Request, topic: Topic = None) -> Response:
    await broker_of(request).delete_topic(_existing_name(topic))
    return ok_empty()


@router.post(
    "/topic/empty",
    summary="Drop the messages the topic holds that no channel has taken yet",
    responses={**_OK, **_TOPIC_ERRORS},
    response_class=Response,
)
async def topic_empty(request: Request, topic: Topic = None) -> Response:
    await broker_of(request).empty_topic(require_topic(topic))
    return ok_empty()


@router.post(
    "/topic/pause",
    summary="Pause a topic: its messages stop flowing to channels",
    responses={**_OK, **_TOPIC_ERRORS},
    response_class=Response,
)
async def topic_pause(request: Request, topic: Topic = None) -> Response:
    await broker_of(request).pause_topic(_existing_name(topic), True)
    return ok_empty()


@router.post(
    "/topic/unpause",
    summary="Unpause a topic",
    responses={**_OK, **_TOPIC_ERRORS},
    response_class=Response,
)
async def topic_unpause(request: Request, topic: Topic = None) -> Response:
    await broker_of(request).pause_topic(_existing_name(topic), False)
    return ok_empty()


async def _channel_op(
    request: Request,
    topic: str | None,
    channel: str | None,
    op: Callable[[Broker, str, str], Awaitable[object]],
) -> Response:
    await op(broker_of(request), *require_topic_channel(topic, channel))
    return ok_empty()


@router.post(
    "/channel/create",
    summary="Create a channel; it receives every message published from now on",
    responses={
        **_OK,
        **error_doc(*CHANNEL_CODES, ErrorCode.INVALID_MAX_ATTEMPTS, ErrorCode.INVALID_FILTER),
    },
    response_class=Response,
)
async def channel_create(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    max_attempts: MaxAttempts = None,
    filter: FilterParam = None,
) -> Response:
    topic_name, channel_name = require_topic_channel(topic, channel)
    broker = broker_of(request)
    # Checked before anything is created: a refused request changes nothing.
    limit = parse_max_attempts(max_attempts) if max_attempts is not None else None
    if filter is not None:
        compile_filter(filter, fields_of(broker.topics.schema(topic_name)))
    if not await broker.create_channel(topic_name, channel_name, filter) and filter is not None:
        # nsqd's create of an existing channel changes nothing; a filter given is set.
        await broker.set_channel_filter(topic_name, channel_name, filter)
    if max_attempts is not None:
        await broker.configure_channel(topic_name, channel_name, max_attempts=limit)
    return ok_empty()


@router.post(
    "/channel/delete",
    summary="Delete a channel and its tables",
    responses={**_OK, **_CHANNEL_ERRORS},
    response_class=Response,
)
async def channel_delete(
    request: Request, topic: Topic = None, channel: Channel = None
) -> Response:
    return await _channel_op(request, topic, channel, lambda b, t, c: b.delete_channel(t, c))


@router.post(
    "/channel/empty",
    summary="Drop every message the channel holds",
    responses={**_OK, **_CHANNEL_ERRORS},
    response_class=Response,
)
async def channel_empty(request: Request, topic: Topic = None, channel: Channel = None) -> Response:
    return await _channel_op(request, topic, channel, lambda b, t, c: b.empty_channel(t, c))


@router.post(
    "/channel/move",
    summary="Hand the channel to another node of the warehouse (only its owner moves it)",
    responses={
        200: {"description": 'The new owner: {"node": lane, "http_url": URL}'},
        **error_doc(*CHANNEL_CODES, ErrorCode.INVALID_VALUE, ErrorCode.INVALID_NODE),
    },
)
async def channel_move(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    node: Annotated[str | None, Query(description="Lane of the live node to take it")] = None,
) -> dict[str, Any]:
    topic_name, channel_name = require_topic_channel(topic, channel)
    if node is None or not node.isdigit():
        raise QueueError(ErrorCode.INVALID_VALUE, "node= must be a node's lane", param="node")
    url = await broker_of(request).move_channel(topic_name, channel_name, int(node))
    return {"node": int(node), "http_url": url}


@router.post(
    "/channel/pause",
    summary="Pause a channel: it delivers nothing until unpaused",
    responses={**_OK, **_CHANNEL_ERRORS},
    response_class=Response,
)
async def channel_pause(request: Request, topic: Topic = None, channel: Channel = None) -> Response:
    return await _channel_op(request, topic, channel, lambda b, t, c: b.pause_channel(t, c, True))


@router.post(
    "/channel/unpause",
    summary="Unpause a channel",
    responses={**_OK, **_CHANNEL_ERRORS},
    response_class=Response,
)
async def channel_unpause(
    request: Request, topic: Topic = None, channel: Channel = None
) -> Response:
    return await _channel_op(request, topic, channel, lambda b, t, c: b.pause_channel(t, c, False))
