"""Registration with a real nsqlookupd 1.3.0, beside nsqd 1.3.0 registered with the same one:
lookupd's HTTP API lists deltaq's node as it lists nsqd, follows topics and channels as they
are created and deleted, and an NSQ consumer given only the lookupd address consumes."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pyspark.sql import SparkSession

from queue_engine.spark.fanout_stream import start_fanout
from queue_engine.store.tables import Warehouse
from tests.acceptance.test_metrics import scrape
from tests.conftest import HOST, Server, free_port
from tests.nsq_wire import Nsqd, tool

pytestmark = pytest.mark.slow


@dataclass
class Lookupd:
    tcp_port: int
    http_port: int
    process: subprocess.Popen[bytes]

    def get(self, path: str, **params: str) -> Any:
        return httpx.get(f"http://{HOST}:{self.http_port}{path}", params=params, timeout=5).json()


@pytest.fixture
def lookupd() -> Iterator[Lookupd]:
    tcp_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            str(tool("nsqlookupd")),
            f"--tcp-address={HOST}:{tcp_port}",
            f"--http-address={HOST}:{http_port}",
            f"--broadcast-address={HOST}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    found = Lookupd(tcp_port, http_port, process)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            # nsqlookupd's /ping answers "OK" as text.
            if httpx.get(f"http://{HOST}:{http_port}/ping", timeout=5).text == "OK":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    yield found
    process.terminate()
    process.wait(10)


def eventually(check: Callable[[], bool], lookupd: Lookupd | None = None) -> None:
    """``check`` comes true within the time nsqd takes to tell nsqlookupd (about a second)."""
    deadline = time.monotonic() + 10
    while not check():
        state = lookupd.get("/debug") if lookupd is not None else None
        assert time.monotonic() < deadline, f"not within 10 s; nsqlookupd holds {state}"
        time.sleep(0.1)


def _topics_of(lookupd: Lookupd, tcp_port: int) -> list[str]:
    """The topics lookupd's /nodes lists for the producer on ``tcp_port``."""
    nodes = {n["tcp_port"]: n for n in lookupd.get("/nodes")["producers"]}
    return list(nodes.get(tcp_port, {}).get("topics", []))


def producers(lookupd: Lookupd, topic: str) -> dict[int, dict[str, Any]]:
    """The producers lookupd lists for ``topic``, by TCP port."""
    answer = httpx.get(f"http://{HOST}:{lookupd.http_port}/lookup", params={"topic": topic})
    if answer.status_code != 200:
        return {}
    return {p["tcp_port"]: p for p in answer.json()["producers"]}


def test_nodes_register_with_nsqlookupd_as_nsqd_does(
    lookupd: Lookupd, server_factory: type[Server], tmp_path: Path, spark: SparkSession
) -> None:
    address = f"{HOST}:{lookupd.tcp_port}"
    nsqd = Nsqd(tmp_path / "nsqd").start(
        f"--lookupd-tcp-address={address}", f"--broadcast-address={HOST}"
    )
    env = {
        "DELTAQ_NSQLOOKUPD_TCP_ADDRESSES": json.dumps([address]),
        "DELTAQ_BROADCAST_ADDRESS": HOST,
    }
    server = server_factory(tmp_path / "wh", env=env).start()
    fanout = start_fanout(spark, Warehouse(str(tmp_path / "wh")), once=False)
    try:
        for base in (server.url, f"http://{HOST}:{nsqd.http_port}"):
            assert httpx.post(f"{base}/topic/create", params={"topic": "t"}).is_success
            params = {"topic": "t", "channel": "c"}
            assert httpx.post(f"{base}/channel/create", params=params).is_success
        eventually(lambda: {server.tcp_port, nsqd.tcp_port} <= set(producers(lookupd, "t")))
        listed = producers(lookupd, "t")
        ours, theirs = listed[server.tcp_port], listed[nsqd.tcp_port]
        # The same fields, with this node's own addresses.
        assert set(ours) == set(theirs)
        assert (ours["broadcast_address"], ours["http_port"]) == (HOST, server.port)
        assert ours["version"] == theirs["version"] == "1.3.0"
        assert lookupd.get("/channels", topic="t")["channels"] == ["c"]
        nodes = {n["tcp_port"]: n for n in lookupd.get("/nodes")["producers"]}
        assert nodes[server.tcp_port]["topics"] == ["t"]
        assert nodes[server.tcp_port]["tombstones"] == [False]
        # Tombstoning this node's topic hides it from /lookup (consumers stop connecting)
        # while nsqd's producer stays: lookupd treats deltaq's registration as nsqd's.
        tombstoned = httpx.post(
            f"http://{HOST}:{lookupd.http_port}/topic/tombstone",
            params={"topic": "t", "node": f"{HOST}:{server.port}"},
        )
        assert tombstoned.status_code == 200, tombstoned.text
        eventually(lambda: server.tcp_port not in producers(lookupd, "t"))
        assert nsqd.tcp_port in producers(lookupd, "t")
        nodes = {n["tcp_port"]: n for n in lookupd.get("/nodes")["producers"]}
        assert nodes[server.tcp_port]["tombstones"] == [True]
        # /config reports the address, as nsqd's does.
        config = httpx.get(f"{server.url}/config/nsqlookupd_tcp_addresses").json()
        assert config == [address]

        # NSQ's consumer given only the lookupd address consumes from deltaq (nsqd's topic
        # is another one, so every message comes from deltaq).
        assert httpx.post(f"{server.url}/topic/create", params={"topic": "only"}).is_success
        eventually(lambda: server.tcp_port in producers(lookupd, "only"))
        body = b"\n".join(f"m{i}".encode() for i in range(10))
        assert httpx.post(f"{server.url}/mpub", params={"topic": "only"}, content=body).is_success
        tail = subprocess.run(
            [
                str(tool("nsq_tail")),
                f"--lookupd-http-address={HOST}:{lookupd.http_port}",
                "--topic=only",
                "--channel=tail",
                "-n",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert sorted(tail.stdout.split()) == sorted(f"m{i}" for i in range(10))
        eventually(lambda: "tail" in lookupd.get("/channels", topic="only")["channels"])

        # Deleting a channel, then a topic: gone from lookupd, as with nsqd.
        for base in (server.url, f"http://{HOST}:{nsqd.http_port}"):
            params = {"topic": "t", "channel": "c"}
            assert httpx.post(f"{base}/channel/delete", params=params).is_success
        # nsqlookupd keeps a channel's name once registered; the producers go.
        eventually(lambda: not lookupd.get("/debug").get("channel:t:c"), lookupd)
        assert httpx.post(f"{server.url}/topic/delete", params={"topic": "t"}).is_success
        # Unregistered (/lookup hid the node already, since its tombstone): gone from the
        # node's topics in /nodes, while nsqd still has its own.
        eventually(lambda: "t" not in _topics_of(lookupd, server.tcp_port), lookupd)
        assert "t" in _topics_of(lookupd, nsqd.tcp_port)
        assert nsqd.tcp_port in producers(lookupd, "t")
    finally:
        fanout.stop()
        nsqd.stop()
    # A stopped node is gone from lookupd (its connection closed), like a stopped nsqd.
    server.stop()
    eventually(lambda: server.tcp_port not in producers(lookupd, "only"))


def test_an_nsq_consumer_given_lookupd_gets_one_channel_from_every_node(
    lookupd: Lookupd, server_factory: type[Server], tmp_path: Path, spark: SparkSession
) -> None:
    """Two nodes on one warehouse, each given messages: nsq_tail, told only lookupd's
    address, connects to both and gets every message, each from the node it was published
    to (its share), none twice."""
    address = f"{HOST}:{lookupd.tcp_port}"
    env = {
        "DELTAQ_NSQLOOKUPD_TCP_ADDRESSES": json.dumps([address]),
        "DELTAQ_BROADCAST_ADDRESS": HOST,
    }
    warehouse = tmp_path / "wh"
    nodes = [server_factory(warehouse, env=env).start() for _ in range(2)]
    fanout = start_fanout(spark, Warehouse(str(warehouse)), once=False)
    try:
        for i, node in enumerate(nodes):
            body = b"\n".join(f"n{i}-{k}".encode() for k in range(10))
            assert httpx.post(f"{node.url}/mpub", params={"topic": "hot"}, content=body).is_success
        ports = {n.tcp_port for n in nodes}
        eventually(lambda: ports <= set(producers(lookupd, "hot")))
        tail = subprocess.run(
            [
                str(tool("nsq_tail")),
                f"--lookupd-http-address={HOST}:{lookupd.http_port}",
                "--topic=hot",
                "--channel=tail",
                "-n",
                "20",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=True,
        )
        got = tail.stdout.split()
        assert sorted(got) == sorted(f"n{i}-{k}" for i in range(2) for k in range(10))

        # Each node served its own share of the channel: the 10 messages published to it,
        # FIN'd there but for the last message of all, whose FIN nsq_tail never sends (it
        # exits in the handler of its -n'th message).
        labels = (("channel", "tail"), ("topic", "hot"))

        def finished(node: Server) -> float:
            stats = httpx.get(f"{node.url}/stats", params={"format": "json", "topic": "hot"})
            [channel] = stats.json()["topics"][0]["channels"]
            lane = httpx.get(f"{node.url}/info").json()["node"]["lane"]
            assert lane in channel["lanes"], channel["lanes"]
            with httpx.Client(base_url=node.url, timeout=10) as c:
                samples = scrape(c)
            return samples.get(("deltaq_channel_finished_total", labels), 0.0)

        eventually(lambda: sorted(finished(node) for node in nodes) == [9, 10])
    finally:
        fanout.stop()
