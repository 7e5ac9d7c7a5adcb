"""GET /metrics: the broker's figures in Prometheus' text format.

Gauges and counters are read from the broker when scraped (the same figures as /stats);
latency histograms are observed as things happen (``queue_engine.metrics``); the process
figures (CPU, memory, file descriptors) are prometheus-client's own collectors. The sweep
runs in another process: its last run per channel is read from the channel's state table
(the sweep's commit metadata), at most once per ``SWEEP_CACHE_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from api.state import broker_of
from queue_engine import NSQD_VERSION, __version__
from queue_engine.broker import Broker
from queue_engine.stats import TopicStats
from queue_engine.store.tables import StateMeta, read_meta

router = APIRouter(tags=["info"])

SWEEP_CACHE_S = 5.0
_TC = ["topic", "channel"]


class _Families(Collector):
    """Metric families built before the scrape (a collector must not block on I/O)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class SweepMetas:
    """Each channel's newest sweep commit, read at most once per ``SWEEP_CACHE_S``."""

    def __init__(self) -> None:
        self._read_at = 0.0
        self._metas: dict[tuple[str, str], StateMeta] = {}

    async def get(self, broker: Broker, topics: list[TopicStats]) -> dict[tuple[str, str], Any]:
        if time.monotonic() - self._read_at >= SWEEP_CACHE_S:
            keys = [(t.name, c.name) for t in topics for c in t.channels]
            self._metas = await asyncio.to_thread(self._read, broker, keys)
            self._read_at = time.monotonic()
        return self._metas

    @staticmethod
    def _read(broker: Broker, keys: list[tuple[str, str]]) -> dict[tuple[str, str], StateMeta]:
        metas = {}
        for topic, channel in keys:
            meta = read_meta(broker.warehouse.channel_state_path(topic, channel))
            if meta is not None:
                metas[(topic, channel)] = meta
        return metas


def families(
    topics: list[TopicStats],
    sweeps: dict[tuple[str, str], StateMeta],
    tcp_connections: int,
    jobs: dict[str, object] | None = None,
    maintenance_bytes: int | None = None,
) -> list[Metric]:
    def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"deltaq_{name}", doc, labels=labels)

    def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(f"deltaq_{name}", doc, labels=labels)

    info = GaugeMetricFamily(
        "deltaq_build_info",
        "deltaq's version and the nsqd API level it answers.",
        labels=["version", "nsqd_version"],
    )
    info.add_metric([__version__, NSQD_VERSION], 1)
    tcp = gauge("tcp_connections", "Open connections of nsqd's TCP protocol.", [])
    tcp.add_metric([], tcp_connections)
    pool = pa.default_memory_pool()
    arrow = gauge(
        "arrow_allocated_bytes",
        "Memory Arrow holds for tables in use (message rows, Parquet), by its allocator.",
        ["allocator"],
    )
    arrow.add_metric([pool.backend_name], pool.bytes_allocated())
    upkeep = gauge(
        "maintenance_process_resident_memory_bytes",
        "Resident memory of the API's table-upkeep process (0 while there is none).",
        [],
    )
    upkeep.add_metric([], maintenance_bytes or 0)
    extra: list[Metric] = [upkeep]
    if jobs is not None:
        # deltaq up's jobs process (fanout, sweep): alert when it is not up for long.
        up = gauge("jobs_up", "1 while deltaq up's jobs process (fanout, sweep) runs.", [])
        up.add_metric([], 1 if jobs.get("state") == "running" else 0)
        restarts = counter("jobs_restarts", "Restarts of deltaq up's jobs process.", [])
        restarts.add_metric([], float(str(jobs.get("restarts") or 0)))
        extra += [up, restarts]

    t_depth = gauge("topic_depth", "Messages no channel has taken yet.", ["topic"])
    t_messages = counter(
        "topic_messages", "Messages the topic's table holds (all time).", ["topic"]
    )
    t_paused = gauge("topic_paused", "1 while the topic is paused.", ["topic"])
    t_version = gauge("topic_delta_version", "The topic table's Delta version.", ["topic"])
    t_commits = counter("topic_commits", "Group commits to the topic since start.", ["topic"])
    t_bytes = counter("topic_published_bytes", "Message bytes committed since start.", ["topic"])

    c_depth = gauge("channel_depth", "Messages ready or not yet read.", _TC)
    c_in_flight = gauge("channel_in_flight", "Messages leased to a consumer.", _TC)
    c_deferred = gauge("channel_deferred", "Messages deferred (defer= or REQ delay).", _TC)
    c_dead = gauge("channel_dead", "Messages in the dead-letter table, not redriven.", _TC)
    c_expired = counter(
        "channel_expired", "Messages expired (message TTL) since the API started.", _TC
    )
    c_filtered = counter(
        "channel_filtered",
        "Messages the channel's filter kept out, in the fanout commits read since the API started.",
        _TC,
    )
    c_clients = gauge("channel_clients", "Consumers seen in the last minute.", _TC)
    c_paused = gauge("channel_paused", "1 while the channel is paused.", _TC)
    c_messages = counter("channel_messages", "Messages the channel's table holds.", _TC)
    c_requeues = counter("channel_requeued", "Messages requeued (REQ) on this channel.", _TC)
    c_timeouts = counter("channel_timed_out", "Leases that ended by timeout.", _TC)
    c_finished = counter(
        "channel_finished", "Messages finished (FIN) on this channel since the API started.", _TC
    )
    c_lag = gauge(
        "channel_fanout_lag_versions",
        "Topic versions committed that the fanout has not yet put in this channel.",
        _TC,
    )
    c_swept = gauge(
        "channel_last_sweep_timestamp_seconds", "When the sweep last ran on the channel.", _TC
    )
    c_sweep_s = gauge(
        "channel_sweep_duration_seconds",
        "How long the last sweep run took up to this channel's state commit.",
        _TC,
    )
    for t in topics:
        t_depth.add_metric([t.name], t.depth)
        t_messages.add_metric([t.name], t.message_count)
        t_paused.add_metric([t.name], int(t.paused))
        t_version.add_metric([t.name], t.version)
        t_commits.add_metric([t.name], t.commits)
        t_bytes.add_metric([t.name], t.message_bytes)
        for c in t.channels:
            labels = [t.name, c.name]
            c_depth.add_metric(labels, c.depth)
            c_in_flight.add_metric(labels, c.in_flight_count)
            c_deferred.add_metric(labels, c.deferred_count)
            c_dead.add_metric(labels, c.dead_count)
            c_expired.add_metric(labels, c.expired_count)
            c_filtered.add_metric(labels, c.filtered_count)
            c_clients.add_metric(labels, c.client_count)
            c_paused.add_metric(labels, int(c.paused))
            c_messages.add_metric(labels, c.message_count)
            c_requeues.add_metric(labels, c.requeue_count)
            c_timeouts.add_metric(labels, c.timeout_count)
            c_finished.add_metric(labels, c.finish_count)
            c_lag.add_metric(labels, max(0, t.version - c.fanned_topic_version))
            meta = sweeps.get((t.name, c.name))
            if meta is not None:
                c_swept.add_metric(labels, meta.swept_at_us / 1e6)
                c_sweep_s.add_metric(labels, meta.sweep_seconds)
    return [
        info,
        tcp,
        arrow,
        *extra,
        t_depth,
        t_messages,
        t_paused,
        t_version,
        t_commits,
        t_bytes,
        c_depth,
        c_in_flight,
        c_deferred,
        c_dead,
        c_expired,
        c_filtered,
        c_clients,
        c_paused,
        c_messages,
        c_requeues,
        c_timeouts,
        c_finished,
        c_lag,
        c_swept,
        c_sweep_s,
    ]


@router.get(
    "/metrics",
    summary="Prometheus metrics: topics, channels, latencies, the process",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    broker = broker_of(request)
    topics = broker.stats()
    state = request.app.state
    if not hasattr(state, "sweep_metas"):
        state.sweep_metas = SweepMetas()
    sweeps = await state.sweep_metas.get(broker, topics)
    tcp = getattr(state, "tcp", None)
    scraped = CollectorRegistry(auto_describe=False)
    status = getattr(state, "jobs_status", None)
    jobs = status() if status is not None else None
    connections = len(tcp.connections) if tcp else 0
    upkeep_bytes = await asyncio.to_thread(broker.maintenance.process_resident_bytes)
    scraped.register(_Families(families(topics, sweeps, connections, jobs, upkeep_bytes)))
    # REGISTRY: the process collectors and the histograms of queue_engine.metrics.
    body = generate_latest(REGISTRY) + generate_latest(scraped)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
