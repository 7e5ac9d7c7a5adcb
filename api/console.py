"""The web console: /console (a page and its assets, shipped in the package) and the JSON it
reads under /console/api. Actions (pause, empty, delete, create) are the admin endpoints
themselves, so the console needs nothing the API does not already allow.

The API keeps the last hour of figures (``queue_engine.history``), sampled every
``SAMPLE_EVERY_S``; after a restart each topic's publish history is rebuilt from its commit
log. A message's history is read from the channel's ledger table, its row from the channel's
table; peeking shows the next ready messages without leasing them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from api.responses import error_doc, ok_json
from api.state import broker_of
from queue_engine.broker import Broker
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.history import KEEP_S, History
from queue_engine.names import require_channel, require_topic
from queue_engine.storage_health import STORAGE
from queue_engine.store.delta import read_dataset, recent_writes
from queue_engine.store.tables import LEDGER_SCHEMA, events_from_arrow

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "console_assets"
SAMPLE_EVERY_S = 2.0
# Topics sampled between two turns of the event loop (requests wait for no more than that).
SAMPLE_CHUNK = 50
PEEK_MAX = 100
MESSAGE_ID_CHARS = 16

router = APIRouter(tags=["console"])
Topic = Annotated[str | None, Query(description="Topic name")]
Channel = Annotated[str | None, Query(description="Channel name")]
_NOT_FOUND = error_doc(
    ErrorCode.MISSING_ARG_TOPIC,
    ErrorCode.INVALID_TOPIC,
    ErrorCode.MISSING_ARG_CHANNEL,
    ErrorCode.INVALID_CHANNEL,
    ErrorCode.E_INVALID,
    ErrorCode.TOPIC_NOT_FOUND,
    ErrorCode.CHANNEL_NOT_FOUND,
)


def mount(app: FastAPI) -> None:
    app.mount("/console/static", StaticFiles(directory=str(ASSETS)), name="console")
    app.include_router(router)


async def sample_forever(broker: Broker, history: History) -> None:
    """Record the broker's figures every ``SAMPLE_EVERY_S`` (a task of the app's lifespan), of
    the topics whose figures change (``History.due``); first, rebuild each topic's last hour
    from its commit log."""
    since = time.time() - KEEP_S
    for topic in broker.stats():
        path = broker.warehouse.topic_path(topic.name)
        writes = await asyncio.to_thread(recent_writes, path, since)
        history.backfill_topic(topic.name, writes, topic.message_count)
    while True:
        try:
            now = time.time()
            topics = list(broker.registry.topics)
            # Without commit percentiles (the console's charts do not show them), a few topics
            # at a time: sorting each busy topic's last 1,000 commit times held the event loop
            # ~50 ms every sample with 1,000 busy topics, which set publishing's p99.
            due = history.due(topics, now)
            for start in range(0, len(due), SAMPLE_CHUNK):
                chunk = due[start : start + SAMPLE_CHUNK]
                history.record(broker.topic_stats(chunk, latencies=False), now, topics)
                await asyncio.sleep(0)
        except Exception:
            log.exception("console: sampling the figures failed")
        await asyncio.sleep(SAMPLE_EVERY_S)


def _history(request: Request) -> History:
    history: History = request.app.state.history
    return history


@router.get("/console", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(ASSETS / "index.html", media_type="text/html")


@router.get(
    "/console/api/overview",
    summary="Every topic and channel with its figures, rates and Delta versions",
    response_class=Response,
)
async def overview(request: Request) -> Response:
    broker = broker_of(request)
    history = _history(request)
    here = broker.node.record.http_url if broker.node and broker.node.record else None
    topics = []
    for t in broker.stats():
        info = broker.registry.topics.get(t.name)
        starts = {n: c.start_version for n, c in info.channels.items()} if info else {}
        channels = [
            {
                "name": c.name,
                "paused": c.paused,
                "depth": c.depth,
                "in_flight": c.in_flight_count,
                "deferred": c.deferred_count,
                "dead": c.dead_count,
                # The channel's filter (null: none) and the messages it kept out.
                "filter": c.filter,
                "filtered": c.filtered_count,
                "requeued": c.requeue_count,
                "timed_out": c.timeout_count,
                "clients": c.client_count,
                "messages": c.message_count,
                "table_version": c.table_version,
                "ledger_version": c.ledger_version,
                # Behind when the topic's newest version with messages is past what the
                # fanout brought here and past the channel's start (an empty channel is not).
                "fanout_behind": t.data_version
                > max(c.fanned_topic_version, starts.get(c.name, -1)),
                "topic_data_version": t.data_version,
                "fanned_topic_version": c.fanned_topic_version,
                # Another node serves the channel (its figures are there): its URL.
                "elsewhere": c.node if c.node and c.node != here else None,
                **history.latest_rates(t.name, c.name),
            }
            for c in t.channels
        ]
        topics.append(
            {
                "name": t.name,
                "paused": t.paused,
                "depth": t.depth,
                "messages": t.message_count,
                "version": t.version,
                "refused": t.refused,
                "channels": channels,
                **history.latest_rates(t.name),
            }
        )
    body: dict[str, Any] = {
        "topics": topics,
        "sampled_every_s": SAMPLE_EVERY_S,
        "storage": STORAGE.report(),
    }
    jobs_status = getattr(request.app.state, "jobs_status", None)
    if jobs_status is not None:
        # deltaq up's jobs process (fanout, sweep): the status line says when it cannot run.
        body["jobs"] = dict(jobs_status())
    return ok_json(body)


@router.get(
    "/console/api/history",
    summary="The last hour of a topic's (or a channel's) figures",
    response_class=Response,
    responses=_NOT_FOUND,
)
async def history(request: Request, topic: Topic = None, channel: Channel = None) -> Response:
    broker = broker_of(request)
    name = require_topic(topic)
    broker.registry.existing_topic(name)
    if channel is None:
        return ok_json(_history(request).topic_series(name))
    broker.registry.existing_channel(name, require_channel(channel))
    return ok_json(_history(request).channel_series(name, channel))


def _body_text(body: bytes) -> dict[str, str]:
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode(), "body_encoding": "base64"}


@router.get(
    "/console/api/peek",
    summary="A channel's next ready messages, without leasing them",
    response_class=Response,
    responses=_NOT_FOUND,
)
async def peek(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    n: Annotated[int, Query(ge=1, le=PEEK_MAX, description="How many")] = 10,
) -> Response:
    runtime = await broker_of(request).channel(require_topic(topic), require_channel(channel))
    return ok_json(
        {
            "messages": [
                {
                    "id": message_id,
                    "attempts": attempts,
                    **_body_text(body),
                    "headers": headers or {},
                }
                for message_id, attempts, body, headers in runtime.peek(n)
            ]
        }
    )


def _lookup(messages_path: str, ledger_path: str, message_id: str) -> dict[str, Any]:
    """The message's row and every ledger event about it, in time order (blocking)."""
    row: dict[str, Any] | None = None
    table = _rows_with_id(messages_path, message_id)
    if table is not None and table.num_rows:
        first = table.slice(0, 1).to_pylist()[0]
        row = {
            "id": message_id,
            "published_at_us": _us(first.get("published_at")),
            "topic_version": first.get("topic_version"),
            **_body_text(first["body"]),
            "headers": dict(first.get("headers") or ()),
        }
    table = _rows_with_id(ledger_path, message_id)
    events = (
        sorted(events_from_arrow(table.select(LEDGER_SCHEMA.names)), key=_order)
        if table is not None
        else []
    )
    return {
        "message": row,
        "events": [
            {
                "event": str(e.kind),
                "attempt": e.attempt,
                "at_us": e.at_us,
                "consumer": e.consumer,
                "lease_expires_at_us": e.lease_expires_at_us,
                "deliver_at_us": e.deliver_at_us,
            }
            for e in events
        ],
    }


def _rows_with_id(path: str, message_id: str) -> pa.Table | None:
    """The rows of the Delta table at ``path`` about one message (None: no such table)."""
    try:
        dataset = read_dataset(path)
    except Exception:
        return None
    return dataset.to_table(filter=pc.field("id") == message_id)


def _order(event: Any) -> tuple[int, int]:
    key: tuple[int, int] = event.sort_key()
    return key


def _us(value: Any) -> int | None:
    if value is None:
        return None
    return int(pa.scalar(value, pa.timestamp("us", tz="UTC")).value)


@router.get(
    "/console/api/message",
    summary="A message's row and its whole history on a channel (every ledger event)",
    response_class=Response,
    responses=_NOT_FOUND,
)
async def message(
    request: Request,
    topic: Topic = None,
    channel: Channel = None,
    id: Annotated[str | None, Query(description="Message id (16 hex characters)")] = None,
) -> Response:
    broker = broker_of(request)
    name, channel_name = require_topic(topic), require_channel(channel)
    broker.registry.existing_channel(name, channel_name)
    if id is None or len(id) != MESSAGE_ID_CHARS or not all(c in "0123456789abcdef" for c in id):
        raise QueueError(ErrorCode.E_INVALID, "16 hex characters", param="id")
    warehouse = broker.warehouse
    found = await asyncio.to_thread(
        _lookup,
        warehouse.channel_messages_path(name, channel_name),
        warehouse.channel_ledger_path(name, channel_name),
        id,
    )
    if found["message"] is None and not found["events"]:
        raise QueueError(ErrorCode.NOT_FOUND, id)
    return ok_json(found)
