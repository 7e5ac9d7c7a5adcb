"""GET /metrics: Prometheus' text format with the figures of /stats, latency histograms, the
fanout's lag and the sweep's last run, parsed by prometheus-client's own parser."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from deltalake import DeltaTable
from prometheus_client.parser import text_string_to_metric_families
from pyspark.sql import SparkSession

from queue_engine.spark.sweep import sweep
from queue_engine.store.tables import Warehouse
from tests.conftest import Server
from tests.consumers import create_channel, sub


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout: None) -> Iterator[Server]:
    s = Server(warehouse).start()
    yield s
    s.stop()


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


def test_metrics_follow_the_queue(
    http: httpx.Client, spark: SparkSession, warehouse: Path, server: Server
) -> None:
    create_channel(http, "m", "c")
    for i in range(5):
        assert http.post("/pub", params={"topic": "m"}, content=f"m{i}".encode()).text == "OK"
    # A topic no channel takes from: its depth is its backlog.
    assert http.post("/mpub", params={"topic": "m_kept"}, content=b"k1\nk2").text == "OK"
    # Acknowledged publishes reach the topic table a commit or two apart (the first at once,
    # the rest after the topic's linger): take two leases, then let the fanout bring all five.
    leased: list[dict[str, object]] = []
    deadline = time.monotonic() + 60
    while len(leased) < 2 and time.monotonic() < deadline:
        leased += sub(http, "m", "c", max=2 - len(leased), wait_ms=1000)
    assert len(leased) == 2
    while time.monotonic() < deadline:
        stats = http.get("/stats", params={"format": "json", "topic": "m"}).json()
        [channel_stats] = stats["topics"][0]["channels"]
        if channel_stats["depth"] + channel_stats["in_flight_count"] == 5:
            break
        time.sleep(0.1)
    sweep(spark, Warehouse(str(warehouse)), force=True)

    samples = scrape(http)
    topic = (("topic", "m"),)
    channel = (("channel", "c"), ("topic", "m"))
    assert samples[("deltaq_topic_messages_total", topic)] == 5
    assert samples[("deltaq_topic_depth", topic)] == 0
    assert samples[("deltaq_topic_depth", (("topic", "m_kept"),))] == 2
    # Every byte of the five bodies, committed.
    assert samples[("deltaq_topic_published_bytes_total", topic)] == sum(
        len(f"m{i}") for i in range(5)
    )
    assert samples[("deltaq_channel_clients", channel)] == 1
    # The topic table's newest version (it took a commit or two: at least version 1).
    version = DeltaTable(Warehouse(str(warehouse)).topic_path("m")).version()
    assert version >= 1 and samples[("deltaq_topic_delta_version", topic)] == version
    assert samples[("deltaq_channel_in_flight", channel)] == 2
    assert samples[("deltaq_channel_depth", channel)] == 3
    assert samples[("deltaq_channel_messages_total", channel)] == 5
    assert samples[("deltaq_channel_paused", channel)] == 0
    # All five publishes are in a version the fanout has put in the channel.
    assert samples[("deltaq_channel_fanout_lag_versions", channel)] == 0
    swept_at = samples[("deltaq_channel_last_sweep_timestamp_seconds", channel)]
    assert time.time() - 120 < swept_at <= time.time()
    assert samples[("deltaq_channel_sweep_duration_seconds", channel)] > 0
    # One observation per publish; at least one ledger commit (the DELIVERs).
    assert samples[("deltaq_publish_duration_seconds_count", topic)] == 5
    assert samples[("deltaq_topic_commit_duration_seconds_count", topic)] >= 1
    assert samples[("deltaq_ledger_commit_duration_seconds_count", channel)] >= 1
    assert samples[("process_resident_memory_bytes", ())] > 10 * 2**20
    # Arrow allocates from jemalloc (queue_engine/process_memory.py: mimalloc keeps what
    # threads free, malloc fragments), unless the environment chose.
    pool = os.environ.get("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
    # Between requests the serving process holds no Arrow memory: what it builds (publish
    # batches, rows read from the channel table) is written or turned into Python objects and
    # dropped. A gauge of the pool's peak, or tables kept after their request, would not be 0.
    assert samples[("deltaq_arrow_allocated_bytes", (("allocator", pool),))] == 0
    # The table-upkeep process's memory: 0 until a round with work has started it, and no
    # table has had one yet (a checkpoint is due after 100 commits, a vacuum after an hour).
    assert server.process is not None
    upkeep = [
        child.pid
        for child in psutil.Process(server.process.pid).children()
        if "queue_engine.upkeep_worker" in child.cmdline()
    ]
    assert upkeep == [], "a maintenance process started: the scenario no longer implies 0"
    assert samples[("deltaq_maintenance_process_resident_memory_bytes", ())] == 0
    # The serving process never loaded pandas or numpy (queue_engine/process_memory.py),
    # having published, fanned out, consumed and read its tables by now.
    mapped = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "/numpy/" not in mapped and "/pandas/" not in mapped
    assert samples[("deltaq_build_info", (("nsqd_version", "1.3.0"), ("version", "0.1.0")))] == 1

    # A REQ with a delay: requeued and deferred. A lease of 1 s (the least) left to lapse:
    # timed out.
    assert samples[("deltaq_channel_requeued_total", channel)] == 0
    assert samples[("deltaq_channel_timed_out_total", channel)] == 0
    assert samples[("deltaq_channel_deferred", channel)] == 0
    r = http.post(
        "/req",
        params={"topic": "m", "channel": "c", "delay_ms": "600000"},
        content=f"{leased[0]['id']} {leased[0]['lease']}",
    )
    assert r.text == "OK"
    [short] = sub(http, "m", "c", max=1, wait_ms=1000, msg_timeout_ms=1000)
    deadline = time.monotonic() + 30
    while scrape(http)[("deltaq_channel_timed_out_total", channel)] < 1:
        assert time.monotonic() < deadline, "the 1 s lease never timed out"
        time.sleep(0.1)
    samples = scrape(http)
    assert samples[("deltaq_channel_timed_out_total", channel)] == 1
    assert samples[("deltaq_channel_requeued_total", channel)] == 1
    assert samples[("deltaq_channel_deferred", channel)] == 1
    # Of the five: one deferred, one still leased (leased[1]), three ready again.
    assert samples[("deltaq_channel_in_flight", channel)] == 1
    assert samples[("deltaq_channel_depth", channel)] == 3
    assert short["id"] not in (leased[0]["id"], leased[1]["id"])
    assert samples[("deltaq_channel_finished_total", channel)] == 0
    fin = f"{leased[1]['id']} {leased[1]['lease']}"
    assert http.post("/fin", params={"topic": "m", "channel": "c"}, content=fin).text == "OK"
    samples = scrape(http)
    assert samples[("deltaq_channel_finished_total", channel)] == 1
    assert samples[("deltaq_channel_in_flight", channel)] == 0

    assert http.post("/channel/pause", params={"topic": "m", "channel": "c"}).is_success
    assert scrape(http)[("deltaq_channel_paused", channel)] == 1


def test_the_maintenance_process_memory_is_the_one_given() -> None:
    from api.metrics import families

    def upkeep_gauge(resident: int | None) -> float:
        [family] = [
            f
            for f in families([], {}, 0, None, resident)
            if f.name == "deltaq_maintenance_process_resident_memory_bytes"
        ]
        [sample] = family.samples
        return sample.value

    assert upkeep_gauge(123 * 2**20) == 123 * 2**20
    assert upkeep_gauge(None) == 0  # no maintenance process (yet)
