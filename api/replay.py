"""POST /channel/replay: a topic's past messages delivered to one channel again
(queue_engine.replay)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from api.responses import CHANNEL_CODES, error_doc, ok_json
from api.state import broker_of
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.names import require_topic_channel
from queue_engine.replay import check_replay_id, parse_bound

router = APIRouter(tags=["dead letters"])

_BOUND = "a topic version, or an RFC 3339 time with its offset (the versions committed then)"


@router.post(
    "/channel/replay",
    summary="Deliver a range of the topic's past messages to the channel again",
    description=(
        "Copies of the messages the topic versions `from`..`to` added (both included; `to` "
        "defaults to the newest) are published to this channel only, FIN'd or not: new ids, "
        "attempts from 1, `replay_of` naming the original in the channel table. One commit: "
        "all or none. `replay_id` (generated if absent) is recorded with the commit, so "
        "repeating a call with the same one copies nothing twice. Answers "
        '`{"replay_id", "from_version", "to_version", "messages", "repeated"}`.'
    ),
    responses={
        200: {"description": "The copies are committed (delivered as the fanout passes them)"},
        **error_doc(
            *CHANNEL_CODES,
            ErrorCode.INVALID_REQUEST,
            ErrorCode.INVALID_RANGE,
            ErrorCode.RANGE_REMOVED,
            ErrorCode.E_COMMIT_FAILED,
        ),
    },
    response_class=Response,
)
async def channel_replay(
    request: Request,
    topic: Annotated[str | None, Query(description="Topic name")] = None,
    channel: Annotated[str | None, Query(description="Channel name")] = None,
    start: Annotated[str | None, Query(alias="from", description=f"First: {_BOUND}")] = None,
    end: Annotated[str | None, Query(alias="to", description=f"Last: {_BOUND}")] = None,
    replay_id: Annotated[
        str | None, Query(description="This replay's id, 1-64 of [A-Za-z0-9._-]")
    ] = None,
) -> Response:
    topic_name, channel_name = require_topic_channel(topic, channel)
    first = parse_bound(start, "from")
    if first is None:
        raise QueueError(ErrorCode.INVALID_RANGE, "required", param="from")
    last = parse_bound(end, "to")
    name = uuid.uuid4().hex if replay_id is None else check_replay_id(replay_id)
    result = await broker_of(request).replay(topic_name, channel_name, first, last, name)
    return ok_json(
        {
            "replay_id": result.replay_id,
            "from_version": result.first_version,
            "to_version": result.last_version,
            "messages": result.messages,
            "repeated": result.repeated,
        }
    )
