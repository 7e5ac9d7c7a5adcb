"""Several API processes on one warehouse: each joins as a node. Any node takes publishes for
any topic; every node serves every channel, each its shares (the messages published through
it, by id lane), and a FIN of another node's message is redirected there (307); when a node
dies (kill -9) the others take its shares over from the ledger, and nothing acknowledged is
lost, nothing FIN'd comes back, the fanout stays exactly once. On an object store the same
holds, a dead node's lane lapsing after ``store_lease_s``."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from deltaq.testing.s3 import S3Server, store_env
from queue_engine.message import LANES
from queue_engine.store.tables import Warehouse
from tests.acceptance.conftest import BUCKET
from tests.conftest import HOST, ROOT, Server, free_port
from tests.nsq_wire import ERROR, RESPONSE, Wire, identify

TOPIC, CHANNEL = "work", "workers"
PER_PUBLISHER = 150
# Unfinished leases of a killed node come back after this (the consumers ask for it).
MSG_TIMEOUT_MS = 2000


def _api(warehouse: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``deltaq api`` on ``warehouse``, to its end (a refused start ends at once)."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "deltaq", "api", "--warehouse", warehouse),
            *("--host", HOST, "--port", str(free_port()), "--tcp-port", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _stats_channel(url: str, topic: str = TOPIC) -> dict[str, object]:
    params = {"format": "json", "topic": topic}
    stats = httpx.get(f"{url}/stats", params=params, timeout=30).json()
    [channel] = stats["topics"][0]["channels"]
    assert isinstance(channel, dict)
    return channel


def _lanes(url: str, topic: str = TOPIC) -> set[int]:
    """The shares (id lanes) of the topic's channel the node at ``url`` serves (none while it
    does not know the channel yet)."""
    params = {"format": "json", "topic": topic}
    stats = httpx.get(f"{url}/stats", params=params, timeout=30).json()
    channels = stats["topics"][0]["channels"] if stats["topics"] else []
    return set(channels[0]["lanes"] or []) if channels else set()


def _wait_for_lanes(expected: dict[str, set[int]], topic: str = TOPIC, within: float = 30) -> None:
    """Until each node serves exactly the lanes given."""
    deadline = time.monotonic() + within
    while True:
        seen = {url: _lanes(url, topic) for url in expected}
        if seen == expected:
            return
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)


def _lane(url: str) -> int:
    lane = httpx.get(f"{url}/info").json()["node"]["lane"]
    assert isinstance(lane, int)
    return lane


class Traffic:
    """Publishers spread over the nodes and consumers on all of them, until every
    acknowledged message is FIN'd (or the deadline); what each saw, for the invariants."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.acked: set[str] = set()
        # FINs answered OK, by body and by message id. A publish whose node died before it
        # answered is published again elsewhere (the client cannot know whether the first
        # committed): a body may be two messages; a message id must be FIN'd once.
        self.finned: Counter[str] = Counter()
        self.finned_ids: Counter[str] = Counter()
        # FINs whose answer never came (the node died meanwhile): (id, lease) -> body. The
        # ledger says whether each was committed; if it was not, the message comes back.
        self.fin_unknown: dict[tuple[str, str], str] = {}
        self.publishing = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def publish(self, index: int) -> None:
        with httpx.Client(timeout=10) as client:
            for i in range(PER_PUBLISHER):
                body = f"p{index}-{i}"
                for attempt in range(len(self.urls) * 4):
                    url = self.urls[(index + attempt) % len(self.urls)]
                    try:
                        r = client.post(f"{url}/pub", params={"topic": TOPIC}, content=body)
                    except httpx.TransportError:
                        time.sleep(0.1)
                        continue  # that node is gone: publish to the next
                    if r.status_code == 200:
                        with self.lock:
                            self.acked.add(body)
                        break
        with self.lock:
            self.publishing -= 1

    def consume(self, index: int) -> None:
        params = {"topic": TOPIC, "channel": CHANNEL, "max": 20, "wait_ms": 500}
        params["msg_timeout_ms"] = MSG_TIMEOUT_MS
        turn = index
        with httpx.Client(timeout=10, follow_redirects=True) as client:
            while not self.stop.is_set():
                url = self.urls[turn % len(self.urls)]
                try:
                    r = client.get(
                        f"{url}/sub", params={**params, "msg_timeout_ms": MSG_TIMEOUT_MS}
                    )
                    if r.status_code != 200:
                        raise httpx.TransportError(r.text)
                    messages = r.json()["messages"]
                    if not messages:
                        continue
                    # FIN at the node that answered (the redirect's target).
                    owner = f"{r.url.scheme}://{r.url.host}:{r.url.port}"
                    lines = "".join(f"{m['id']} {m['lease']}\n" for m in messages)
                except httpx.TransportError:
                    turn += 1  # the node (or the owner it pointed to) is gone: ask the next
                    time.sleep(0.2)
                    continue
                try:
                    fin = client.post(
                        f"{owner}/fin", params={"topic": TOPIC, "channel": CHANNEL}, content=lines
                    )
                except httpx.TransportError:
                    with self.lock:
                        self.fin_unknown.update(
                            ((m["id"], m["lease"]), base64.b64decode(m["body"]).decode())
                            for m in messages
                        )
                    turn += 1  # the node (or the owner it pointed to) is gone: ask the next
                    time.sleep(0.2)
                    continue
                if fin.status_code == 200:
                    with self.lock:
                        self.finned.update(base64.b64decode(m["body"]).decode() for m in messages)
                        self.finned_ids.update(m["id"] for m in messages)

    def unfinished(self, ledger_fins: set[tuple[str, str]] | None = None) -> set[str]:
        """Acknowledged bodies not FIN'd: neither answered OK, nor (given the (id, lease)
        pairs of the ledger's FINs) committed by a FIN whose answer was lost."""
        with self.lock:
            left = self.acked - set(self.finned)
            if ledger_fins and left:
                left -= {b for i, b in self.fin_unknown.items() if i in ledger_fins}
            return left

    def done(self, ledger_path: str) -> bool:
        with self.lock:
            if self.publishing:
                return False
        left = self.unfinished()
        if not left:
            return True
        with self.lock:
            maybe_finned = left <= set(self.fin_unknown.values())
        # The ledger is read only when every message left may have been FIN'd unanswered.
        return maybe_finned and not self.unfinished(_ledger_fins(ledger_path))


def _ledger_fins(ledger_path: str) -> set[tuple[str, str]]:
    """The (id, lease) pairs the channel's ledger records FINs of."""
    table = DeltaTable(ledger_path).to_pyarrow_table(columns=["id", "event", "lease"])
    fins = table.filter(pc.equal(table["event"], "FIN"))
    return set(zip(fins["id"].to_pylist(), fins["lease"].to_pylist(), strict=True))


def _explain_lost(
    lost: set[str], traffic: Traffic, wh: Warehouse, fins: set[tuple[str, str]]
) -> str:
    """What the tables say of the lost messages: in the topic, in the channel, their ledger
    events (a loss on the fanout's side or the channel's)."""
    topic = DeltaTable(wh.topic_path(TOPIC)).to_pyarrow_table(columns=["id", "body"])
    pairs = zip(topic["id"].to_pylist(), topic["body"].to_pylist(), strict=True)
    ids = {b.decode(): i for i, b in pairs}
    rows = DeltaTable(wh.channel_messages_path(TOPIC, CHANNEL)).to_pyarrow_table(columns=["id"])
    in_channel = set(rows["id"].to_pylist())
    ledger = DeltaTable(wh.channel_ledger_path(TOPIC, CHANNEL)).to_pyarrow_table(
        columns=["id", "event"]
    )
    events: dict[str, list[str]] = {}
    for i, e in zip(ledger["id"].to_pylist(), ledger["event"].to_pylist(), strict=True):
        events.setdefault(i, []).append(e)
    unanswered: dict[str, list[tuple[str, bool]]] = {}
    for i, lease in traffic.fin_unknown:
        unanswered.setdefault(i, []).append((lease, (i, lease) in fins))
    lines = [f"{len(lost)} acknowledged messages never FIN'd:"]
    for body in sorted(lost)[:10]:
        i = ids.get(body)
        lines.append(
            f"  {body}: id {i}, in channel {i in in_channel}, ledger {events.get(i or '', [])}, "
            f"unanswered FINs (lease, committed) {unanswered.get(i or '', [])}"
        )
    return "\n".join(lines)


@pytest.fixture
def three_nodes(
    server_factory: type[Server], warehouse: Path, fanout: None
) -> Iterator[list[Server]]:
    env = {"DELTAQ_MSG_TIMEOUT_MS": str(MSG_TIMEOUT_MS)}
    nodes = [server_factory(warehouse, env=env).start() for _ in range(3)]
    yield nodes


def test_three_nodes_one_warehouse_kill9_of_a_channel_owner(
    three_nodes: list[Server], warehouse: Path
) -> None:
    a, b, c = three_nodes
    urls = [a.url, b.url, c.url]
    assert httpx.post(f"{a.url}/topic/create", params={"topic": TOPIC}).is_success
    created = httpx.post(f"{b.url}/channel/create", params={"topic": TOPIC, "channel": CHANNEL})
    assert created.is_success
    # Every node serves its own share; the node that created the channel also the shares of
    # lanes without a live node.
    own = {url: _lane(url) for url in urls}
    _wait_for_lanes(
        {
            a.url: {own[a.url]},
            b.url: set(range(LANES)) - {own[a.url], own[c.url]},
            c.url: {own[c.url]},
        }
    )
    info = httpx.get(f"{a.url}/info").json()
    assert sorted(n["http_url"] for n in info["nodes"]) == sorted(urls)
    # A node's SUB never redirects: it serves its shares.
    sub = httpx.get(f"{c.url}/sub", params={"topic": TOPIC, "channel": CHANNEL, "wait_ms": 0})
    assert sub.status_code == 200 and sub.json()["messages"] == []
    # A FIN of a message of B's share, asked of C, is redirected to B.
    alien = f"{own[b.url]:016x}"
    fin = httpx.post(
        f"{c.url}/fin",
        params={"topic": TOPIC, "channel": CHANNEL},
        content=f"{alien} 1-000000000000\n",
    )
    assert fin.status_code == 307 and fin.headers["location"].startswith(f"{b.url}/fin?")
    owner = b  # the busiest node: sixteen shares less two

    wh = Warehouse(str(warehouse))
    ledger = wh.channel_ledger_path(TOPIC, CHANNEL)
    traffic = Traffic(urls)
    workers = [threading.Thread(target=traffic.publish, args=(i,)) for i in range(3)]
    traffic.publishing = len(workers)
    workers += [threading.Thread(target=traffic.consume, args=(i,)) for i in range(3)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 60
        while len(traffic.finned) < PER_PUBLISHER and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(traffic.finned) >= PER_PUBLISHER, "consumers made no progress"
        owner.kill9()  # the owner of a busy channel, mid-load
        deadline = time.monotonic() + 90
        while not traffic.done(ledger) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        traffic.stop.set()
        for w in workers:
            w.join(30)

    ledger_fins = _ledger_fins(ledger)
    lost = traffic.unfinished(ledger_fins)
    assert not lost, _explain_lost(lost, traffic, wh, ledger_fins)
    twice = {i: n for i, n in traffic.finned_ids.items() if n > 1}
    assert not twice, f"FIN'd twice: {twice}"
    # A FIN committed without its answer reaching the consumer is not delivered again.
    back = {i for i, lease in traffic.fin_unknown if (i, lease) in ledger_fins} & set(
        traffic.finned_ids
    )
    assert not back, f"delivered again after a committed FIN: {sorted(back)[:5]}"
    # Two nodes stayed up: every publish was taken by one of them in the end.
    assert len(traffic.acked) == 3 * PER_PUBLISHER

    # The survivors share every lane now, each its own: a survivor took the dead node's
    # shares within a second of the kill on local disk.
    survivors = [s for s in three_nodes if s is not owner]
    deadline = time.monotonic() + 10
    while True:
        served = {s.url: _lanes(s.url) for s in survivors}
        mine = [served[s.url] for s in survivors]
        if (mine[0] | mine[1] == set(range(LANES)) and not mine[0] & mine[1]) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert mine[0] | mine[1] == set(range(LANES)) and not mine[0] & mine[1], served
    assert all(own[s.url] in served[s.url] for s in survivors)
    assert any(f"took channel {TOPIC}/{CHANNEL} lanes" in s.log() for s in survivors)

    ids = DeltaTable(wh.topic_path(TOPIC)).to_pyarrow_table(columns=["id"])["id"].to_pylist()
    assert len(ids) == len(set(ids)), "a message id was allocated twice"
    lanes = {int(i, 16) % LANES for i in ids}
    assert lanes == set(own.values()), lanes  # every node published, each in its own lane
    # A body FIN'd twice was published twice (a retried publish), never delivered twice.
    bodies = Counter(
        b.decode()
        for b in DeltaTable(wh.topic_path(TOPIC))
        .to_pyarrow_table(columns=["body"])["body"]
        .to_pylist()
    )
    assert all(n <= bodies[body] for body, n in traffic.finned.items())
    rows = DeltaTable(wh.channel_messages_path(TOPIC, CHANNEL)).to_pyarrow_table(columns=["id"])
    assert rows.num_rows == len(ids) == pc.count_distinct(rows["id"]).as_py()


def test_a_second_api_joins_and_one_beyond_the_lanes_is_refused(
    server_factory: type[Server], tmp_path: Path
) -> None:
    warehouse = tmp_path / "wh"
    first = server_factory(warehouse).start()
    second = server_factory(warehouse).start()
    assert httpx.post(f"{first.url}/pub?topic=t", content=b"one").text == "OK"
    assert httpx.post(f"{second.url}/pub?topic=t", content=b"two").text == "OK"
    httpx.post(f"{second.url}/topic/create?topic=t").raise_for_status()
    lanes = {httpx.get(f"{s.url}/info").json()["node"]["lane"] for s in (first, second)}
    assert lanes == {0, 1}
    httpx.post(f"{first.url}/channel/create?topic=t&channel=c").raise_for_status()
    # The second serves its own share once it follows the channel's creation; the first the
    # rest. Both /stats say so, each of itself.
    _wait_for_lanes({first.url: set(range(LANES)) - {1}, second.url: {1}}, "t")
    assert _stats_channel(second.url, "t")["node"] == second.url
    assert _stats_channel(first.url, "t")["node"] == first.url
    r = httpx.get(f"{second.url}/sub?topic=t&channel=c&max=10&wait_ms=0")
    assert r.status_code == 200

    # Every lane held (here by this test, as nodes would hold them): the next API refuses.
    first.stop()
    second.stop()
    directory = warehouse / "_deltaq" / "nodes"
    held = []
    for lane in range(LANES):
        fd = os.open(directory / f"{lane}.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(
            fd,
            b'{"lane": %d, "token": "x", "http_url": "http://elsewhere", "pid": 7, '
            b'"host": "h"}' % lane,
            0,
        )
        held.append(fd)
    try:
        refused = _api(str(warehouse))
    finally:
        for fd in held:
            os.close(fd)
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"deltaq api: error: warehouse {warehouse} already has {LANES} ")
    assert "http://elsewhere (pid 7 on h)" in line


def test_on_an_object_store_a_dead_nodes_channel_moves_once_its_lane_lapses(
    server_factory: type[Server], tmp_path: Path, s3_server: S3Server
) -> None:
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    env = {**store_env(s3_server.endpoint), "DELTAQ_STORE_LEASE_S": "3"}
    first = server_factory(tmp_path / "first", env=env, warehouse_url=root).start()
    second = server_factory(tmp_path / "second", env=env, warehouse_url=root).start()
    httpx.post(f"{first.url}/topic/create?topic=t").raise_for_status()
    httpx.post(f"{first.url}/channel/create?topic=t&channel=c").raise_for_status()
    lane = _lane(second.url)
    _wait_for_lanes({first.url: set(range(LANES)) - {lane}, second.url: {lane}}, "t")

    first.kill9()
    killed = time.monotonic()
    # Until the first's lane lapses the second serves its own share only; then every share.
    # The first renewed its lane at most a third of the lease (1 s) before it died: the lane
    # lapses 2-3 s after the kill, and not before.
    deadline = killed + 30
    moved = None
    while (served := _lanes(second.url, "t")) != set(range(LANES)):
        assert time.monotonic() < deadline, served
        # (Nothing while it restores the channel with every share.)
        assert served in ({lane}, set()), served
        if served != {lane} and moved is None:
            moved = time.monotonic()
        time.sleep(0.2)
    moved = moved or time.monotonic()
    assert moved - killed >= 1.8, f"the lane was taken {moved - killed:.1f} s after the kill"
    assert "took channel t/c lanes" in second.log()


def test_an_admin_moves_a_channel_to_another_node(
    server_factory: type[Server], warehouse: Path, fanout: None
) -> None:
    first = server_factory(warehouse).start()
    second = server_factory(warehouse).start()
    for body in ("m1", "m2", "m3"):
        assert httpx.post(f"{first.url}/pub?topic=mv", content=body).text == "OK"
    httpx.post(f"{first.url}/channel/create?topic=mv&channel=c").raise_for_status()
    for body in ("m4", "m5"):
        assert httpx.post(f"{second.url}/pub?topic=mv", content=body).text == "OK"
    lanes = {s.url: _lane(s.url) for s in (first, second)}
    _wait_for_lanes(
        {first.url: set(range(LANES)) - {lanes[second.url]}, second.url: {lanes[second.url]}},
        "mv",
    )

    # The first node serves its shares (m1-m3): one message FIN'd there, one left in flight.
    sub = {"topic": "mv", "channel": "c", "max": 1, "wait_ms": 5000, "msg_timeout_ms": 60_000}
    got = []
    for _ in range(2):
        [message] = httpx.get(f"{first.url}/sub", params=sub, timeout=10).json()["messages"]
        got.append(message)
    finned, held = got
    assert {base64.b64decode(m["body"]) for m in got} <= {b"m1", b"m2", b"m3"}
    fin = f"{finned['id']} {finned['lease']}\n"
    assert httpx.post(f"{first.url}/fin?topic=mv&channel=c", content=fin).text == "OK"

    bad = httpx.post(f"{first.url}/channel/move?topic=mv&channel=c&node=57")
    assert bad.status_code == 409 and bad.json()["message"] == "INVALID_NODE"
    moved = httpx.post(
        f"{first.url}/channel/move",
        params={"topic": "mv", "channel": "c", "node": lanes[second.url]},
    )
    assert moved.status_code == 200, moved.text
    assert moved.json() == {"node": lanes[second.url], "http_url": second.url}
    assert "moved channel mv/c lanes" in first.log()

    # Now the second serves every share (the moved ones pinned there: not handed back), and
    # the first none; the first redirects FINs of them there.
    _wait_for_lanes({first.url: set(), second.url: set(range(LANES))}, "mv")
    assert _stats_channel(second.url, "mv")["in_flight_count"] == 1
    held_fin = f"{held['id']} {held['lease']}\n"
    redirect = httpx.post(f"{first.url}/fin?topic=mv&channel=c", content=held_fin)
    assert redirect.status_code == 307 and redirect.headers["location"].startswith(second.url)
    # The lease held across the move is FIN'd at the new holder; the FIN'd one never returns.
    assert httpx.post(f"{second.url}/fin?topic=mv&channel=c", content=held_fin).text == "OK"
    # Finished there, not merely answered (its 60 s lease would outlast the loop below).
    assert _stats_channel(second.url, "mv")["in_flight_count"] == 0
    rest = []
    deadline = time.monotonic() + 30
    while len(rest) < 3 and time.monotonic() < deadline:
        r = httpx.get(f"{second.url}/sub", params={**sub, "max": 10, "wait_ms": 1000}, timeout=10)
        rest += r.json()["messages"]
    bodies = sorted(base64.b64decode(m["body"]).decode() for m in rest)
    seen = {base64.b64decode(m["body"]).decode() for m in got}
    assert len(bodies) == 3 and not seen & set(bodies), (bodies, seen)
    assert sorted([*seen, *bodies]) == ["m1", "m2", "m3", "m4", "m5"]


def test_a_node_back_in_its_lane_gets_its_share_back_with_the_leases_held_meanwhile(
    server_factory: type[Server], warehouse: Path, fanout: None
) -> None:
    """The second node stops: the first serves its share (and leases a message of it); a
    node back in that lane gets the share handed back, lease and all."""
    first = server_factory(warehouse).start()
    second = server_factory(warehouse).start()
    httpx.post(f"{first.url}/topic/create?topic=back").raise_for_status()
    httpx.post(f"{first.url}/channel/create?topic=back&channel=c").raise_for_status()
    lane = _lane(second.url)
    _wait_for_lanes({first.url: set(range(LANES)) - {lane}, second.url: {lane}}, "back")
    assert httpx.post(f"{second.url}/pub?topic=back", content=b"b1").text == "OK"
    second.stop()
    _wait_for_lanes({first.url: set(range(LANES))}, "back")
    sub = {"topic": "back", "channel": "c", "max": 1, "wait_ms": 5000, "msg_timeout_ms": 60_000}
    [held] = httpx.get(f"{first.url}/sub", params=sub, timeout=10).json()["messages"]
    assert base64.b64decode(held["body"]) == b"b1"

    back = server_factory(warehouse).start()
    assert _lane(back.url) == lane
    _wait_for_lanes({first.url: set(range(LANES)) - {lane}, back.url: {lane}}, "back")
    assert _stats_channel(back.url, "back")["in_flight_count"] == 1
    fin = f"{held['id']} {held['lease']}\n"
    redirect = httpx.post(f"{first.url}/fin?topic=back&channel=c", content=fin)
    assert redirect.status_code == 307 and redirect.headers["location"].startswith(back.url)
    assert httpx.post(f"{back.url}/fin?topic=back&channel=c", content=fin).text == "OK"
    stats = _stats_channel(back.url, "back")
    assert (stats["in_flight_count"], stats["depth"]) == (0, 0), stats
    # FIN'd once for good: nothing comes back on either node.
    for node in (first, back):
        r = httpx.get(f"{node.url}/sub", params={**sub, "wait_ms": 500}, timeout=10)
        assert r.json()["messages"] == []

    # An empty asked of one node empties every node's shares.
    for node in (first, back):
        assert httpx.post(f"{node.url}/pub?topic=back", content=b"x").text == "OK"
    deadline = time.monotonic() + 30
    while [_stats_channel(n.url, "back")["depth"] for n in (first, back)] != [1, 1]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.post(f"{first.url}/channel/empty?topic=back&channel=c").is_success
    deadline = time.monotonic() + 10
    while [_stats_channel(n.url, "back")["depth"] for n in (first, back)] != [0, 0]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_live_node_commits_what_a_killed_nodes_journal_holds(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """A node killed with acknowledged publishes only in its journal (its topic commits
    linger 5 s): the node that outlives it commits them, once, and removes the journal."""
    warehouse = tmp_path / "wh"
    server_factory(warehouse).start()  # the survivor
    journal = warehouse / "_deltaq" / "journal"
    [survivors] = [p.name for p in journal.iterdir()]
    doomed = server_factory(warehouse, env={"DELTAQ_DRAIN_LINGER_MS": "5000"}).start()
    assert httpx.post(f"{doomed.url}/pub?topic=j", content=b"first").text == "OK"
    deadline = time.monotonic() + 10
    while not (warehouse / "topics" / "j").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    bodies = [f"j{i}".encode() for i in range(20)]
    for body in bodies:
        assert httpx.post(f"{doomed.url}/pub?topic=j", content=body).text == "OK"
    doomed.kill9()
    assert len(list(journal.iterdir())) == 2  # the killed node's journal is left behind
    in_table = set(
        DeltaTable(str(warehouse / "topics" / "j")).to_pyarrow_table()["body"].to_pylist()
    )
    assert not set(bodies) <= in_table, "the publishes were still lingering at the kill"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        table = DeltaTable(str(warehouse / "topics" / "j")).to_pyarrow_table()
        if set(bodies) <= set(table["body"].to_pylist()):
            break
        time.sleep(0.2)
    assert Counter(table["body"].to_pylist()) == Counter([b"first", *bodies])
    # The killed node's journal is removed once its publishes are committed: only the
    # survivor's own is left.
    deadline = time.monotonic() + 20
    while len(list(journal.iterdir())) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(p.name for p in journal.iterdir()) == [survivors]


def test_tcp_fins_sent_while_a_node_joins_are_applied_by_the_runtime_that_follows(
    server_factory: type[Server], warehouse: Path, fanout: None
) -> None:
    """A node joining makes the first restart its channel's runtime for fewer shares; a TCP
    consumer FINs the messages it holds the whole time: each FIN is applied (none refused with
    E_FIN_FAILED), in the runtime before the change or in the one after."""
    first = server_factory(warehouse).start()
    topic, held_count = "handover", 1500
    httpx.post(f"{first.url}/topic/create?topic={topic}").raise_for_status()
    httpx.post(f"{first.url}/channel/create?topic={topic}&channel=c").raise_for_status()
    body = "\n".join(f"m{i}" for i in range(held_count))
    assert httpx.post(f"{first.url}/mpub?topic={topic}", content=body).text == "OK"
    deadline = time.monotonic() + 60
    while _stats_channel(first.url, topic)["depth"] != held_count:
        assert time.monotonic() < deadline, "the fanout did not deliver the backlog"
        time.sleep(0.2)

    wire = Wire(first.tcp_port)
    wire.send(identify(msg_timeout=300_000))
    assert wire.frame() == (RESPONSE, b"OK")
    wire.send(f"SUB {topic} c\nRDY {held_count}\n".encode())
    assert wire.frame() == (RESPONSE, b"OK")
    held = [wire.message(30).id for _ in range(held_count)]

    joined: list[Server] = []
    joining = threading.Thread(target=lambda: joined.append(server_factory(warehouse).start()))
    joining.start()
    all_lanes = set(range(LANES))
    changed_at: int | None = None
    for n, message_id in enumerate(held):
        wire.send(b"FIN " + message_id + b"\n")
        time.sleep(0.01)
        if changed_at is None and n % 10 == 0 and _lanes(first.url, topic) != all_lanes:
            changed_at = n
        if changed_at is not None and n > changed_at + 100:
            break
    joining.join(60)
    assert changed_at is not None, "the FINs ran out before the first node's shares changed"
    sent = held[: n + 1]
    # No answer comes to a FIN that took effect; a refused one gets E_FIN_FAILED.
    errors = []
    with contextlib.suppress(TimeoutError):
        while (got := wire.frame(2)) is not None:
            if got[0] == ERROR:
                errors.append(got[1])
    assert errors == []
    deadline = time.monotonic() + 10
    while _stats_channel(first.url, topic)["in_flight_count"] != held_count - len(sent):
        assert time.monotonic() < deadline, _stats_channel(first.url, topic)
        time.sleep(0.1)
    wire.close()
    for node in (first, *joined):
        node.stop()
