"""Deferrals longer than nsqd's hour: accepted up to max_req_timeout_ms (a week by default),
durable across restarts, kill -9 and sweeps, and visible in /stats and the state table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from queue_engine.spark.sweep import sweep
from queue_engine.store.tables import Warehouse
from tests.conftest import Server
from tests.consumers import answer, body, channel_stats, create_channel, sub

DAY_MS = 24 * 3_600_000
WEEK_MS = 7 * DAY_MS


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout: None) -> Iterator[Server]:
    s = Server(warehouse).start()
    yield s
    s.stop()


def _wait_for(http: httpx.Client, topic: str, channel: str, key: str, value: int) -> None:
    deadline = time.monotonic() + 30
    while channel_stats(http, topic, channel)[key] != value:
        assert time.monotonic() < deadline, channel_stats(http, topic, channel)
        time.sleep(0.2)


def test_deferrals_past_an_hour_survive_restarts_a_kill_and_a_sweep(
    spark: SparkSession, server: Server, warehouse: Path
) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        create_channel(http, "later", "c")
        published_ms = time.time() * 1000
        # Two days: nsqd refuses anything past an hour.
        r = http.post("/pub", params={"topic": "later", "defer": str(2 * DAY_MS)}, content=b"2d")
        assert r.text == "OK"
        # A week is the limit; a millisecond more is INVALID_DEFER, nothing published.
        too_far = http.post(
            "/pub", params={"topic": "later", "defer": str(WEEK_MS + 1)}, content=b"x"
        )
        assert too_far.status_code == 400 and too_far.json()["message"] == "INVALID_DEFER"
        # A week itself is taken (on a topic of its own: it must not come due here).
        week = http.post("/pub", params={"topic": "a_week", "defer": str(WEEK_MS)}, content=b"w")
        assert week.text == "OK", week.text
        # A short one that must come due after the restarts below, not before (they take
        # ~20 s on a loaded 2-core machine; the test fails, saying so, if they outlast it).
        soon_ms = 60_000
        soon_due = time.monotonic() + soon_ms / 1000
        r = http.post("/pub", params={"topic": "later", "defer": str(soon_ms)}, content=b"soon")
        assert r.text == "OK"
        # And a REQ delayed by three days.
        assert http.post("/pub", params={"topic": "later"}, content=b"req").text == "OK"
        # The fanout's first batch starts Spark's Python workers: on a loaded machine, a minute.
        deadline = time.monotonic() + 120
        got: list[dict[str, object]] = []
        while not got and time.monotonic() < deadline:
            got = sub(http, "later", "c", wait_ms=5000)
        assert len(got) == 1, f"the undeferred message was not delivered in 120 s: {got}"
        [m] = got
        assert body(m) == b"req"
        assert answer(http, "req", "later", "c", m, delay_ms=str(3 * DAY_MS)).text == "OK"
        _wait_for(http, "later", "c", "deferred_count", 3)

    server.stop()
    server.start()
    wh = Warehouse(str(warehouse))
    sweep(spark, wh)
    server.kill9()
    server.start()

    state = DeltaTable(wh.channel_state_path("later", "c")).to_pyarrow_table().to_pylist()
    assert sorted(r["status"] for r in state) == ["deferred"] * 3
    deliver_at_ms = sorted(r["deliver_at"].timestamp() * 1000 for r in state)
    due_ms = [at - published_ms for at in deliver_at_ms]
    assert soon_ms - 2_000 < due_ms[0] < soon_ms + 5_000
    assert 2 * DAY_MS - 60_000 < due_ms[1] < 2 * DAY_MS + 60_000
    assert 3 * DAY_MS - 60_000 < due_ms[2] < 3 * DAY_MS + 60_000
    # When "soon" is due, by the wall clock the server and this test share.
    soon_at_ms = deliver_at_ms[0]

    with httpx.Client(base_url=server.url, timeout=40) as http:
        assert channel_stats(http, "later", "c")["deferred_count"] == 3
        assert channel_stats(http, "later", "c")["depth"] == 0
        early = sub(http, "later", "c", wait_ms=0)
        answered_ms = time.time() * 1000
        # Only a /sub answered before "soon" was due can show that its deferral outlived the
        # restarts, the kill and the sweep: past it, "soon" is rightly ready, and a server that
        # had lost the deferral would look the same.
        assert answered_ms < soon_at_ms, (
            f"the restarts and the sweep took {(answered_ms - published_ms) / 1000:.0f} s, "
            f"longer than the {soon_ms / 1000:.0f} s deferral meant to outlive them"
        )
        assert early == []
        got = []
        while not got and time.monotonic() < soon_due + 60:
            got = sub(http, "later", "c", wait_ms=2000)
        received_ms = time.time() * 1000
        assert len(got) == 1, f"'soon' was not delivered within a minute of its due time: {got}"
        [m] = got
        assert body(m) == b"soon" and m["attempts"] == 1
        # Delivered when due, not before: the server leased it no earlier than its deliver_at.
        assert received_ms >= soon_at_ms
        assert answer(http, "fin", "later", "c", m).text == "OK"
        assert channel_stats(http, "later", "c")["deferred_count"] == 2
        assert sub(http, "later", "c", wait_ms=500) == []
