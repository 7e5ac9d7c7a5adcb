"""Consumers end to end: a real server, the fanout `deltaq up` runs on one machine, real HTTP
clients."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from queue_engine.lease import fold
from queue_engine.store.tables import Warehouse, read_ledger
from tests.conftest import Server, wait_until
from tests.consumers import answer, body, channel_stats, create_channel, sub


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout_loop: None) -> Iterator[Server]:
    s = Server(warehouse, env={"DELTAQ_MAX_REQ_TIMEOUT_MS": "5000"}).start()
    yield s
    s.stop()


def test_sub_creates_topic_and_channel_and_long_polls_until_a_publish(
    http: httpx.Client, server: Server
) -> None:
    assert sub(http, "lp", "c", wait_ms=0) == []
    names = {t["topic_name"]: t for t in http.get("/stats?format=json").json()["topics"]}
    assert [c["channel_name"] for c in names["lp"]["channels"]] == ["c"]

    got: list[dict[str, Any]] = []
    waiter = threading.Thread(
        target=lambda: got.extend(sub(http, "lp", "c", wait_ms=30000, consumer="waiter"))
    )
    waiter.start()
    # The channel lists the consumer once its /sub has reached it: the publish then comes
    # while the long poll is under way, not before it started.
    wait_until(
        lambda: "waiter" in {x["client_id"] for x in channel_stats(http, "lp", "c")["clients"]},
        "the /sub is waiting in the channel",
    )
    assert waiter.is_alive() and got == []
    assert http.post("/pub", params={"topic": "lp"}, content=b"hello").text == "OK"
    waiter.join(35)
    assert not waiter.is_alive(), "the long poll did not end with the publish"
    [message] = got
    assert body(message) == b"hello" and message["attempts"] == 1
    assert len(message["id"]) == 16 and message["timestamp"] > 1_600_000_000 * 10**9
    assert answer(http, "fin", "lp", "c", message).text == "OK"


def test_many_consumers_on_two_channels_each_get_every_message_once(
    http: httpx.Client, server: Server
) -> None:
    for ch in ("one", "two"):
        create_channel(http, "load", ch)
    sent = [f"m{i}".encode() for i in range(1500)]
    for i in range(0, len(sent), 250):
        assert (
            http.post("/mpub", params={"topic": "load"}, content=b"\n".join(sent[i : i + 250])).text
            == "OK"
        )

    received: dict[str, list[bytes]] = {"one": [], "two": []}
    leased: dict[str, Counter[str]] = {"one": Counter(), "two": Counter()}
    lock = threading.Lock()
    deadline = time.monotonic() + 90

    def consume(channel: str, name: str) -> None:
        with httpx.Client(base_url=server.url, timeout=70) as c:
            while time.monotonic() < deadline:
                with lock:
                    if len(received[channel]) >= len(sent):
                        return
                messages = sub(c, "load", channel, max=40, wait_ms=500, consumer=name)
                if not messages:
                    continue
                with lock:
                    received[channel].extend(body(m) for m in messages)
                    leased[channel].update(m["id"] for m in messages)
                assert all(m["attempts"] == 1 for m in messages)
                assert answer(c, "fin", "load", channel, *messages).text == "OK"

    threads = [
        threading.Thread(target=consume, args=(ch, f"{ch}-{i}"))
        for ch in ("one", "two")
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for ch in ("one", "two"):
        # Every message reached every channel, and no message was leased twice (leases are
        # 60 s and every one was FIN'd, so a second lease would be a second consumer).
        assert sorted(received[ch]) == sorted(sent)
        assert max(leased[ch].values()) == 1
        stats = channel_stats(http, "load", ch)
        assert stats["depth"] == 0 and stats["in_flight_count"] == 0
        assert stats["message_count"] == len(sent)
        assert stats["client_count"] == 4
        clients = {c["client_id"]: c for c in stats["clients"]}
        assert sorted(clients) == [f"{ch}-{i}" for i in range(4)]
        assert sum(c["message_count"] for c in clients.values()) == len(sent)
        assert sum(c["finish_count"] for c in clients.values()) == len(sent)
        assert all(c["in_flight_count"] == 0 for c in clients.values())


def test_an_http_consumer_without_a_name_is_one_client_with_its_answers(
    http: httpx.Client, server: Server
) -> None:
    assert http.post("/mpub", params={"topic": "named"}, content=b"a\nb\nc\nd").text == "OK"
    create_channel(http, "named", "c")
    got = []
    # Each poll on a connection of its own (another port each time): still one consumer.
    for _ in range(4):
        with httpx.Client(base_url=server.url, timeout=30) as fresh:
            got += sub(fresh, "named", "c", max=1, wait_ms=10000)
    assert len(got) == 4
    assert answer(http, "fin", "named", "c", *got[:3]).text == "OK"
    assert answer(http, "req", "named", "c", got[3]).text == "OK"
    stats = channel_stats(http, "named", "c")
    assert stats["client_count"] == 1
    [client] = stats["clients"]
    assert client["client_id"] == "127.0.0.1"
    assert (client["message_count"], client["finish_count"], client["requeue_count"]) == (4, 3, 1)


def test_req_with_and_without_delay(http: httpx.Client, warehouse: Path) -> None:
    assert http.post("/pub", params={"topic": "rq"}, content=b"again").text == "OK"
    create_channel(http, "rq", "c")
    # The first channel of a topic receives what the topic buffered.
    [m1] = sub(http, "rq", "c", wait_ms=30000)
    assert answer(http, "req", "rq", "c", m1).text == "OK"
    [m2] = sub(http, "rq", "c", wait_ms=5000)
    assert m2["id"] == m1["id"] and m2["attempts"] == 2 and m2["lease"] != m1["lease"]
    started = time.monotonic()
    assert answer(http, "req", "rq", "c", m2, delay_ms=1500).text == "OK"
    assert sub(http, "rq", "c", wait_ms=500) == []
    assert channel_stats(http, "rq", "c")["deferred_count"] == 1
    [m3] = sub(http, "rq", "c", wait_ms=10000)
    assert time.monotonic() - started >= 1.4
    assert m3["attempts"] == 3
    # A huge delay is clamped to max_req_timeout (5 s here), not refused.
    assert answer(http, "req", "rq", "c", m3, delay_ms=10**9).text == "OK"
    stats = channel_stats(http, "rq", "c")
    assert stats["requeue_count"] == 3 and stats["deferred_count"] == 1
    # The REQ is answered once its ledger commit landed: the deferral it recorded is 5 s.
    ledger = read_ledger(Warehouse(str(warehouse)).channel_ledger_path("rq", "c"))[0]
    [req] = [e for e in ledger if e.kind == "REQ" and e.attempt == 3]
    assert req.deliver_at_us is not None and req.deliver_at_us - req.at_us == 5_000_000


def test_touch_keeps_a_lease_past_its_first_timeout_and_expired_leases_come_back(
    http: httpx.Client,
) -> None:
    create_channel(http, "tt", "c")
    assert http.post("/mpub", params={"topic": "tt"}, content=b"kept\nlost").text == "OK"
    deadline = time.monotonic() + 30
    leased: list[dict[str, Any]] = []
    while len(leased) < 2 and time.monotonic() < deadline:
        leased += sub(http, "tt", "c", max=2, wait_ms=2000, msg_timeout_ms=2000)
    kept, lost = sorted(leased, key=body)
    assert (body(kept), body(lost)) == (b"kept", b"lost")
    # Touches 0.5 s apart keep a 2 s lease alive with a wide margin on a busy machine.
    for _ in range(5):
        time.sleep(0.5)
        assert answer(http, "touch", "tt", "c", kept).text == "OK"
    # 2.5 s after delivery: "kept" is still leased; "lost" timed out and is delivered again.
    [again] = sub(http, "tt", "c", wait_ms=3000, msg_timeout_ms=30000)
    assert again["id"] == lost["id"] and again["attempts"] == 2
    # The first consumer's lease on "lost" is stale now.
    r = answer(http, "fin", "tt", "c", lost)
    assert r.status_code == 409 and r.json() == {"message": "E_FIN_FAILED", "failed": [lost["id"]]}
    assert answer(http, "touch", "tt", "c", lost).status_code == 409
    assert answer(http, "req", "tt", "c", lost).json()["message"] == "E_REQ_FAILED"
    assert answer(http, "fin", "tt", "c", kept, again).text == "OK"
    stats = channel_stats(http, "tt", "c")
    assert stats["timeout_count"] == 1 and stats["in_flight_count"] == 0


def test_a_lease_from_a_sub_answered_at_once_times_out_when_it_ends(http: httpx.Client) -> None:
    """A channel with nothing in flight is ticked only every minute (queue_engine/pump.py); a
    SUB answered from ready messages (no wait, so the channel never turned hot) must bring
    its next tick forward, or its lease would time out up to a minute late."""
    create_channel(http, "quiet", "c")
    assert http.post("/pub", params={"topic": "quiet"}, content=b"q").text == "OK"
    wait_until(lambda: channel_stats(http, "quiet", "c")["depth"] == 1, "the fanout")
    # The fanout's notices stop; the channel's last tick found nothing leased.
    time.sleep(1.0)
    [leased] = sub(http, "quiet", "c", msg_timeout_ms=1000)
    assert channel_stats(http, "quiet", "c")["in_flight_count"] == 1
    wait_until(
        lambda: channel_stats(http, "quiet", "c")["timeout_count"] == 1,
        "the 1 s lease to time out within 5 s",
        timeout_s=5,
    )
    [again] = sub(http, "quiet", "c", msg_timeout_ms=30000)
    assert again["id"] == leased["id"] and again["attempts"] == 2
    assert answer(http, "fin", "quiet", "c", again).text == "OK"


def test_a_paused_channel_delivers_nothing_until_unpaused(http: httpx.Client) -> None:
    create_channel(http, "pz", "c")
    assert http.post("/channel/pause", params={"topic": "pz", "channel": "c"}).is_success
    assert http.post("/pub", params={"topic": "pz"}, content=b"x").text == "OK"
    # In the channel (fanned out) before the pause is tested: an empty /sub proves nothing
    # about a message that has not arrived.
    wait_until(lambda: channel_stats(http, "pz", "c")["depth"] == 1, "the message in the channel")
    assert sub(http, "pz", "c", wait_ms=300) == []
    assert http.post("/channel/unpause", params={"topic": "pz", "channel": "c"}).is_success
    [m] = sub(http, "pz", "c", wait_ms=5000)
    assert body(m) == b"x"


def test_channel_empty_drops_ready_deferred_and_in_flight_for_good(
    http: httpx.Client, server: Server, warehouse: Path
) -> None:
    create_channel(http, "em", "c")
    assert http.post("/mpub", params={"topic": "em"}, content=b"a\nb\nc\nd\ne").text == "OK"
    deferred = http.post("/pub", params={"topic": "em", "defer": 3000}, content=b"later")
    assert deferred.text == "OK"
    deadline = time.monotonic() + 30
    # All six fanned out (the deferred one may come in a later batch than the five).
    while time.monotonic() < deadline:
        stats = channel_stats(http, "em", "c")
        if stats["depth"] + stats["deferred_count"] >= 6:
            break
        time.sleep(0.1)
    leased = sub(http, "em", "c", max=2, wait_ms=2000)
    assert len(leased) == 2
    stats = channel_stats(http, "em", "c")
    # (The deferred one counts in depth until its row is read into memory.)
    assert (stats["depth"] + stats["deferred_count"], stats["in_flight_count"]) == (4, 2)

    assert http.post("/channel/empty", params={"topic": "em", "channel": "c"}).is_success
    stats = channel_stats(http, "em", "c")
    assert (stats["depth"], stats["in_flight_count"], stats["deferred_count"]) == (0, 0, 0)
    # A lease handed out before the empty no longer answers (nsqd: the message is gone).
    assert answer(http, "fin", "em", "c", leased[0]).status_code == 409
    events = fold(read_ledger(Warehouse(str(warehouse)).channel_ledger_path("em", "c"))[0])
    assert len(events) == 6 and all(s.finished for s in events.values())

    # What is published afterwards is delivered; nothing emptied comes back, not after the
    # deferral's time, not after a restart.
    assert http.post("/pub", params={"topic": "em"}, content=b"after").text == "OK"
    [m] = sub(http, "em", "c", max=10, wait_ms=10000)
    assert body(m) == b"after"
    assert answer(http, "fin", "em", "c", m).text == "OK"
    # Past the deferral's time (3 s after its publish) in this process, then after a restart.
    assert sub(http, "em", "c", max=10, wait_ms=3000) == []
    server.stop()
    server.start()
    assert sub(http, "em", "c", max=10, wait_ms=1500) == []


def test_leases_survive_a_restart(http: httpx.Client, server: Server) -> None:
    create_channel(http, "rs", "c")
    assert http.post("/mpub", params={"topic": "rs"}, content=b"a\nb\nc").text == "OK"
    leased: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(leased) < 3 and time.monotonic() < deadline:
        leased += sub(http, "rs", "c", max=3, wait_ms=2000)
    a, b, c = sorted(leased, key=body)
    assert answer(http, "fin", "rs", "c", a).text == "OK"
    assert answer(http, "req", "rs", "c", b).text == "OK"

    server.stop()
    server.start()
    # b was requeued: delivered again; c is still leased (60 s): nobody else gets it;
    # a was finished: never again.
    [again] = sub(http, "rs", "c", max=10, wait_ms=3000)
    assert again["id"] == b["id"] and again["attempts"] == 2
    assert sub(http, "rs", "c", max=10, wait_ms=300) == []
    # The lease handed out before the restart still answers.
    assert answer(http, "fin", "rs", "c", c, again).text == "OK"
    stats = channel_stats(http, "rs", "c")
    assert (stats["depth"], stats["in_flight_count"], stats["requeue_count"]) == (0, 0, 1)


@pytest.mark.slow
def test_kill9_mid_consumption_loses_nothing_and_resurrects_nothing(
    http: httpx.Client, server: Server
) -> None:
    create_channel(http, "k9", "c")
    sent = {f"k{i}".encode() for i in range(3000)}
    ordered = sorted(sent)
    for i in range(0, len(ordered), 500):
        assert (
            http.post(
                "/mpub", params={"topic": "k9"}, content=b"\n".join(ordered[i : i + 500])
            ).text
            == "OK"
        )

    finished: dict[bytes, str] = {}  # body -> id, FIN answered OK
    # FINs sent whose answer never came (the kill): committed or not, nobody knows yet.
    unanswered: dict[bytes, str] = {}
    delivered_after_fin: list[bytes] = []
    stop = threading.Event()
    lock = threading.Lock()

    def consume() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            while not stop.is_set():
                try:
                    messages = sub(c, "k9", "c", max=25, wait_ms=500, msg_timeout_ms=1000)
                except (httpx.HTTPError, AssertionError):
                    time.sleep(0.05)  # the server is down or restarting
                    continue
                with lock:
                    delivered_after_fin.extend(body(m) for m in messages if body(m) in finished)
                if not messages:
                    continue
                try:
                    ok = answer(c, "fin", "k9", "c", *messages).text == "OK"
                except httpx.HTTPError:
                    with lock:
                        unanswered.update({body(m): m["id"] for m in messages})
                    time.sleep(0.05)
                    continue
                if ok:
                    with lock:
                        finished.update({body(m): m["id"] for m in messages})

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(finished) < 800 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.kill9()
    before_kill = dict(finished)
    assert 0 < len(before_kill) < len(sent)
    server.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with lock:
            answered_or_lost = set(finished) | set(unanswered)
        if answered_or_lost >= sent:
            stats = channel_stats(http, "k9", "c")
            if (stats["depth"], stats["in_flight_count"]) == (0, 0):
                break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    # Nothing FIN'd (OK answered) came back.
    assert delivered_after_fin == []
    stats = channel_stats(http, "k9", "c")
    assert (stats["depth"], stats["in_flight_count"]) == (0, 0)
    # Nothing lost: every message was finished with an OK, or its FIN was committed just
    # before the kill and the answer lost with the process (then it never came back).
    lost_answers = sent - set(finished)
    assert lost_answers <= set(unanswered)
    if lost_answers:
        ledger = Warehouse(str(server.warehouse)).channel_ledger_path("k9", "c")
        states = fold(read_ledger(ledger)[0])
        assert all(states[unanswered[b]].finished for b in lost_answers), lost_answers
