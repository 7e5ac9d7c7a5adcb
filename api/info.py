"""GET /ping, /info and /stats, as nsqd serves them."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from typing import Annotated, Any

import psutil
from fastapi import APIRouter, Query, Request, Response

from api.responses import NSQ_HEADER, TEXT_TYPE, ok_json
from api.state import broker_of
from api.tls import https_listener, tls_required
from queue_engine import NSQD_VERSION, __version__
from queue_engine.broker import Broker
from queue_engine.channel import ConsumerSeen
from queue_engine.stats import TopicStats
from queue_engine.storage_health import STORAGE

router = APIRouter(tags=["info"])

_BOOL = {"true": True, "1": True, "false": False, "0": False}


@router.get(
    "/ping",
    summary="Liveness: OK",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"example": "OK"}}}},
)
async def ping() -> Response:
    # As nsqd: 500 with the health string while writes fail (its disk queue's errors).
    health = STORAGE.health()
    return Response(health, status_code=200 if health == "OK" else 500, media_type=TEXT_TYPE)


@router.get("/info", summary="Version and addresses, nsqd's shape", response_class=Response)
async def info(request: Request) -> Response:
    broker = broker_of(request)
    https = https_listener(broker.settings)
    body: dict[str, Any] = {
        "version": NSQD_VERSION,
        "deltaq_version": __version__,
        "broadcast_address": broker.settings.broadcast_address or socket.gethostname(),
        "hostname": socket.gethostname(),
        "http_port": broker.settings.port,
        # 0 when the TCP protocol is turned off.
        "tcp_port": broker.settings.tcp_port,
        # deltaq: HTTPS's port (nsqd's --https-address), 0 without a certificate; and whether
        # plain clients are refused ("true": TCP and HTTP, "tcp-https": TCP only).
        "https_port": https[1] if https else 0,
        "tls_required": str(tls_required(broker.settings)),
        "start_time": int(broker.started_at),
        "warehouse": broker.settings.warehouse,
        "ack": str(broker.settings.ack),
    }
    body.update(await _nodes_json(broker))
    # Topics whose tables deltaq refuses (a Delta feature it cannot keep working with).
    body["refused_topics"] = {t.name: t.refused for t in broker.stats() if t.refused}
    body["storage"] = STORAGE.report()
    jobs = _jobs(request)
    if jobs is not None:
        body["jobs"] = jobs
    return ok_json(body)


async def _nodes_json(broker: Broker) -> dict[str, Any]:
    """This node (lane, URL) and every live node of the warehouse; nothing without nodes."""
    node = broker.node.record if broker.node is not None else None
    if node is None:
        return {}
    nodes = await asyncio.to_thread(broker.live_nodes)
    return {
        "node": {"lane": node.lane, "http_url": node.http_url},
        "nodes": [
            {"lane": n.lane, "http_url": n.http_url, "tcp_address": n.tcp_address}
            for n in sorted(nodes.values(), key=lambda n: n.lane)
        ],
    }


def _e2e() -> dict[str, Any]:
    return {"count": 0, "percentiles": None}


def _client_json(client: ConsumerSeen) -> dict[str, Any]:
    """A consumer in nsqd's client shape: a TCP connection (``client_id`` its address), or an
    HTTP consumer, which has none: ``client_id`` is the name it gave (``consumer=``), else its
    host. Counts are of deliveries to it and of its FINs and REQs."""
    host = client.name.rsplit(":", 1)[0] if ":" in client.name else client.name
    return {
        "client_id": client.name,
        "hostname": host,
        "version": "HTTP",
        "remote_address": client.name,
        "state": 3,  # nsqd's stateSubscribed
        "ready_count": 0,
        "in_flight_count": client.in_flight,
        "message_count": client.delivered,
        "finish_count": client.finished,
        "requeue_count": client.requeued,
        "connect_ts": int(client.first_seen),
        "sample_rate": 0,
        "deflate": False,
        "snappy": False,
        "user_agent": "",
        "tls": False,
    }


def _topic_json(t: TopicStats) -> dict[str, Any]:
    return {
        "topic_name": t.name,
        "channels": [
            {
                "channel_name": c.name,
                "depth": c.depth,
                "backend_depth": c.depth,
                "in_flight_count": c.in_flight_count,
                "deferred_count": c.deferred_count,
                "message_count": c.message_count,
                "requeue_count": c.requeue_count,
                "timeout_count": c.timeout_count,
                # deltaq: messages dead-lettered (max_attempts reached) and not redriven.
                "dead_count": c.dead_count,
                "max_attempts": c.max_attempts,
                # deltaq: the channel's filter (null: every message enters it), and the
                # messages it kept out since the API started.
                "filter": c.filter,
                "filtered_count": c.filtered_count,
                # deltaq: messages expired (message TTL) since the API started.
                "expired_count": c.expired_count,
                "client_count": c.client_count,
                "clients": [_client_json(k) for k in c.clients],
                "paused": c.paused,
                "e2e_processing_latency": _e2e(),
                # deltaq: the node serving the channel here (this one if it serves any of
                # it; null: none known to this node yet) and the id lanes it serves (null:
                # all: a node alone on its warehouse).
                "node": c.node,
                "lanes": list(c.lanes) if c.lanes is not None else None,
            }
            for c in t.channels
        ],
        "depth": t.depth,
        # Every message waiting in deltaq is on disk, so depth and backend depth coincide.
        "backend_depth": t.depth,
        "message_count": t.message_count,
        "message_bytes": t.message_bytes,
        "paused": t.paused,
        "e2e_processing_latency": _e2e(),
        "delta_version": t.version,
        "delta_commits": t.commits,
        "delta_commit_ms": {"p50": t.commit_p50_ms, "p99": t.commit_p99_ms},
        # deltaq: why the topic's table takes no publishes (a Delta feature another engine
        # enabled that deltaq cannot keep working with), or null.
        "refused": t.refused,
        # deltaq: a typed topic's schema (queue_engine.topic_schema; null: untyped).
        "schema": t.schema,
    }


def _memory() -> dict[str, int]:
    rss = psutil.Process().memory_info().rss
    return {
        "heap_objects": 0,
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": rss,
        "heap_released_bytes": 0,
        "gc_pause_usec_100": 0,
        "gc_pause_usec_99": 0,
        "gc_pause_usec_95": 0,
        "next_gc_bytes": 0,
        "gc_total_runs": sum(s["collections"] for s in gc.get_stats()),
    }


def _text(stats: list[TopicStats], started_at: float) -> str:
    uptime = int(time.time() - started_at)
    lines = [
        f"deltaq v{__version__} (nsqd HTTP API {NSQD_VERSION})",
        f"start_time {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(started_at))}",
        f"uptime {uptime}s",
        "",
        "Health: OK",
        "",
    ]
    if not stats:
        lines.append("Topics: None")
    else:
        lines.append("Topics:")
    for t in stats:
        prefix = "*P " if t.paused else "   "
        lines.append(
            f"{prefix}[{t.name:<15}] depth: {t.depth:<5} be-depth: {t.depth:<5} "
            f"msgs: {t.message_count:<8} e2e%: "
        )
        for c in t.channels:
            cprefix = "   *P " if c.paused else "      "
            lines.append(
                f"{cprefix}[{c.name:<25}] depth: {c.depth:<5} be-depth: {c.depth:<5} "
                f"inflt: {c.in_flight_count:<4} def: {c.deferred_count:<4} "
                f"re-q: {c.requeue_count:<5} timeout: {c.timeout_count:<5} "
                f"dead: {c.dead_count:<5} "
                f"msgs: {c.message_count:<8} e2e%: "
            )
    lines += ["", "Producers: None", ""]
    return "\n".join(lines)


@router.get("/stats", summary="Topics and channels with nsqd's figures", response_class=Response)
async def stats(
    request: Request,
    format: Annotated[str | None, Query(description="json for JSON, else text")] = None,
    topic: Annotated[str | None, Query()] = None,
    channel: Annotated[str | None, Query()] = None,
    include_clients: Annotated[str | None, Query()] = None,
    include_mem: Annotated[str | None, Query()] = None,
) -> Response:
    broker = broker_of(request)
    topics = broker.stats(topic or None, channel or None)
    if format != "json":
        return Response(_text(topics, broker.started_at), media_type=TEXT_TYPE, headers=NSQ_HEADER)
    missing = bool(topic) and topic not in broker.registry.topics
    body: dict[str, Any] = {
        "version": NSQD_VERSION,
        "health": STORAGE.health(),
        "start_time": int(broker.started_at),
        # As nsqd: null for a topic that does not exist (its nil slice), else a list (empty
        # when nothing matched a channel filter, or there are no topics).
        "topics": [_topic_json(t) for t in topics] if topics or not missing else None,
        "producers": [],
    }
    if _BOOL.get(include_mem or "", True):
        body["memory"] = _memory()
    body.update(await _nodes_json(broker))
    # Topics whose tables deltaq refuses (a Delta feature it cannot keep working with).
    body["refused_topics"] = {t.name: t.refused for t in broker.stats() if t.refused}
    body["storage"] = STORAGE.report()
    jobs = _jobs(request)
    if jobs is not None:
        body["jobs"] = jobs
    return ok_json(body)


def _jobs(request: Request) -> dict[str, object] | None:
    """The jobs process deltaq up runs beside the API (None: the API runs alone)."""
    status = getattr(request.app.state, "jobs_status", None)
    return None if status is None else dict(status())
