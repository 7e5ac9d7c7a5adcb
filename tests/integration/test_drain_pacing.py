"""How journaled publishes reach their topic tables when many topics are busy: paced to the
node's commit budget, except a topic whose consumers wait, which commits first."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from deltalake import DeltaTable

from queue_engine.broker import Broker
from queue_engine.settings import load_settings
from queue_engine.topics import DrainPacer
from tests.conftest import Server

TOPICS = 8


def test_the_pace_follows_the_busy_topics_and_a_waited_topic_is_not_paced() -> None:
    now = [100.0]
    pacer = DrainPacer(0.05, commits_per_s=100, clock=lambda: now[0], unwatched_s=0.25)
    # Nobody waits for it: the longer linger.
    assert pacer.linger("a") == 0.25
    for i in range(1000):
        pacer.linger(f"t{i}")
    now[0] += 0.6  # the busy topics are counted twice a second
    assert pacer.linger("t0") == 1001 / 100
    assert pacer.waited("t1") is True  # paced until now
    assert pacer.waited("t1") is False  # already waited on
    assert pacer.linger("t1") == 0.05
    assert pacer.linger("t2") == 1001 / 100
    # Once no consumer has waited for WAITED_S, the topic is paced again.
    now[0] += DrainPacer.WAITED_S + 0.1
    assert pacer.linger("t1") > 0.05
    assert pacer.waited("t1") is True


def test_topics_that_turn_busy_together_are_paced_as_they_come() -> None:
    now = [100.0]
    pacer = DrainPacer(0.05, commits_per_s=100, clock=lambda: now[0], unwatched_s=0.25)
    # 1,000 idle topics get their first publishes in the same instant: each waits as one of
    # the busy topics counted so far, not as one of the few counted before them, so their
    # first commits spread over ~10 s instead of all coming 0.25 s later.
    lingers = [pacer.linger(f"t{i}", idle=True) for i in range(1000)]
    assert lingers[0] == 0.25
    assert lingers[-1] >= 6.0, lingers[-1]
    assert sum(1 for linger in lingers if linger <= 1.0) <= 200
    # A topic a consumer waits for commits at once after an idle spell.
    pacer.waited("t5")
    assert pacer.linger("t5", idle=True) == 0.0
    assert pacer.linger("t5") == 0.05
    assert pacer.linger("t6", idle=True) > 1.0


def test_an_idle_writer_counts_its_linger_from_its_first_publish(tmp_path: Path) -> None:
    from queue_engine.store.delta import commit_info, open_or_create
    from queue_engine.store.tables import TOPIC_SCHEMA, TopicWriter
    from tests.integration.test_topic_writer import Results, now_us

    path = str(tmp_path / "t")
    open_or_create(path, TOPIC_SCHEMA)
    results = Results()
    writer = TopicWriter(path, results, commit_max_bytes=1 << 20)
    try:
        writer.linger = lambda idle: 60.0 if idle else 0.05
        # Idle since ever: not committed at once, but after the idle linger (cut short here).
        writer.submit_publish([b"m0"], now_us(), None, 0)
        time.sleep(0.3)
        assert not results.done, "an idle writer committed at once"
        writer.expedite()
        results.wait(1)
        # Idle for longer than its linger again, where a consumer waits: at once.
        writer.linger = lambda idle: 0.0 if idle else 0.05
        time.sleep(0.1)
        writer.submit_publish([b"m1"], now_us(), None, 1)
        results.wait(2, timeout=10)
        # Busy (within its linger of the previous commit): the linger after that commit.
        writer.linger = lambda idle: 60.0 if idle else 1.0
        writer.submit_publish([b"m2"], now_us(), None, 2)
        results.wait(3, timeout=10)
    finally:
        writer.close()
    assert all(error is None for error in results.done.values())
    assert DeltaTable(path).to_pyarrow_table().num_rows == 3
    # m2's commit (version 3) came its linger after m1's drain began: the commit times in the
    # log are that far apart, less m1's own commit (at once, it would be milliseconds).
    m1, m2 = (commit_info(path, v) or {} for v in (2, 3))
    assert int(str(m2["timestamp"])) - int(str(m1["timestamp"])) >= 500, (m1, m2)


def _commit_times(topic_log: Path) -> list[float]:
    """When each of a topic table's versions after its creation appeared (file mtimes)."""
    return sorted(p.stat().st_mtime for p in topic_log.glob("*.json") if p.stem != "0" * 20)


def test_a_topic_whose_consumer_waits_commits_ahead_of_the_paced_ones(
    server_factory: type[Server], tmp_path: Path
) -> None:
    # A budget of 2 commits a second over 8 busy topics: each commits every ~4 s.
    server = server_factory(tmp_path / "wh", env={"DELTAQ_DRAIN_MAX_COMMITS_PER_S": "2"}).start()
    client = httpx.Client(base_url=server.url, timeout=30)
    for i in range(TOPICS):
        assert client.post(f"/topic/create?topic=t{i}").status_code == 200
    assert client.post("/channel/create?topic=t0&channel=c").status_code == 200
    stop = threading.Event()
    refused: list[str] = []

    def publish() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as pub:
            while not stop.is_set():
                for i in range(TOPICS):
                    answer = pub.post(f"/pub?topic=t{i}", content=b"m").text
                    if answer != "OK":
                        refused.append(answer)
                time.sleep(0.02)

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        time.sleep(5)  # the pace settles: every topic is busy
        watched_from = time.time()
        time.sleep(3)
        paced = [
            t for t in _commit_times(tmp_path / "wh/topics/t0/_delta_log") if t >= watched_from
        ]
        assert len(paced) <= 1, f"t0 committed {len(paced)} times in 3 s while paced"

        # A consumer waits on t0's channel (nothing fans out here: it keeps waiting).
        waiting = threading.Thread(
            target=lambda: httpx.get(
                f"{server.url}/sub?topic=t0&channel=c&wait_ms=8000", timeout=30
            )
        )
        waiting.start()
        time.sleep(0.5)
        waited_from = time.time()
        time.sleep(2)
        first = _commit_times(tmp_path / "wh/topics/t0/_delta_log")
        other = _commit_times(tmp_path / "wh/topics/t1/_delta_log")
        waited = [t for t in first if t >= waited_from]
        # Every drain_linger_ms (50) while the consumer waits: dozens in 2 s, not one.
        assert len(waited) >= 10, f"t0 committed {len(waited)} times in 2 s with a consumer"
        assert len([t for t in other if t >= waited_from]) <= 1, "t1 is no longer paced"
        # ... but still commits at its pace (every ~4 s): once or twice since watched_from.
        assert 1 <= len([t for t in other if t >= watched_from]) <= 2, other
        waiting.join()
    finally:
        stop.set()
        publisher.join()
    assert refused == []


def test_a_consumer_still_waiting_keeps_its_topic_committing_at_once(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """An HTTP long poll that outlasts DrainPacer.WAITED_S still counts: a message published
    to its idle topic is committed at once, not after the linger of a topic nobody waits for
    (5 s here)."""
    env = {"DELTAQ_DRAIN_UNWATCHED_LINGER_MS": "5000"}
    server = server_factory(tmp_path / "wh", env=env).start()
    client = httpx.Client(base_url=server.url, timeout=30)
    assert client.post("/topic/create?topic=t").status_code == 200
    assert client.post("/channel/create?topic=t&channel=c").status_code == 200
    topic_log = tmp_path / "wh/topics/t/_delta_log"
    waiting = threading.Thread(
        target=lambda: httpx.get(f"{server.url}/sub?topic=t&channel=c&wait_ms=8000", timeout=30)
    )
    waiting.start()
    try:
        time.sleep(DrainPacer.WAITED_S + 1.5)  # past what the poll's start alone counts for
        assert client.post("/pub?topic=t", content=b"m").text == "OK"
        published = time.monotonic()
        while not _commit_times(topic_log):
            assert time.monotonic() - published < 2.5, "committed as a topic nobody waits for"
            time.sleep(0.02)
    finally:
        waiting.join()


@pytest.mark.slow
def test_a_topic_whose_publishers_wait_for_its_commit_is_not_paced(tmp_path: Path) -> None:
    """A topic with a CHECK constraint answers publishers after its commit (only the commit
    can refuse a row): it commits at drain_linger_ms, as one whose consumers wait, not at
    the longer linger of a topic nobody waits for."""

    async def scenario() -> tuple[float, float, bool]:
        broker = Broker(load_settings(None, warehouse=str(tmp_path / "wh")))
        await broker.start()
        try:
            await broker.create_topic("t")
            writer = await broker.topics.writer("t")
            await (await broker.start_publish("t", [b"a"]))
            broker.topics.settle(writer)
            assert writer.linger is not None
            unwatched = writer.linger(False)
            DeltaTable(writer.path).alter.add_constraint({"not_x": "body <> 'x'"})
            writer.request_reopen()
            for _ in range(100):  # the writer judges the table again at its next commit
                await (await broker.start_publish("t", [b"b"]))
                if writer.validates:
                    break
                await asyncio.sleep(0.1)
            validates = writer.validates
            await (await broker.start_publish("t", [b"c"]))
            return unwatched, writer.linger(False), validates
        finally:
            await broker.close()

    unwatched, waited_on, validates = asyncio.run(scenario())
    assert validates
    assert (unwatched, waited_on) == (0.25, 0.05)
