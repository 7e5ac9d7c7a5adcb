"""Power cuts under ``deltaq api``: the warehouse on a disk that forgets every byte not fsync'd
(``tests.power_cut``), cut at random moments while producers publish over HTTP and TCP, to an
old topic and to topics their first publish creates, with table upkeep set to compact and
checkpoint as often as it can (within a full test run it may not have done both before the last
cut: whether a cut lands in its work is left to timing). After every cut the API starts
again, and no acknowledged publish is lost or doubled.
``test_power_cut_up.py`` cuts deltaq up with consumers, the fanout and the sweep."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests import power_cut
from tests.conftest import Server
from tests.consumers import create_channel
from tests.power_cut import Load, table_bodies

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(power_cut.missing() is not None, reason=str(power_cut.missing())),
]


@pytest.mark.parametrize("ack", ["journal", "commit"])
def test_api_starts_after_power_cuts_and_keeps_every_acknowledged_publish(
    disk: power_cut.PowerCutDisk, tmp_path: Path, ack: str
) -> None:
    warehouse = disk.mnt / "wh"
    env = {
        **power_cut.BUSY_DISK,
        "DELTAQ_ACK": ack,
        "DELTAQ_COMPACT_MIN_SMALL_FILES": "4",
        "DELTAQ_COMPACT_INTERVAL_S": "1",
    }
    seed = int(os.environ.get("POWER_CUT_SEED", time.time_ns()))
    rng = random.Random(seed)
    logs = tmp_path / "server.log"  # beside the cut disk: it keeps what the server said
    server = Server(warehouse, env=env, log_path=logs).start(timeout_s=60)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            create_channel(c, "cut", "c")
        acked: list[bytes] = []
        new_topics: dict[str, list[bytes]] = {}
        for round_ in range(3):
            load = Load(server, "cut", "c", f"r{round_}").start()
            time.sleep(rng.uniform(1.0, 3.0))
            disk.cut(server.process.pid)  # type: ignore[union-attr]
            load.halt()
            acked += load.acked
            for topic, bodies in load.new_topics.items():
                new_topics.setdefault(topic, []).extend(bodies)
            # Every producer was answered before the cut: /pub, /mpub, TCP PUB, and /pub to
            # topics that publish creates.
            kinds = {b.split(b"-")[1][:1] for b in load.acked}
            assert kinds == {b"h", b"m", b"t"}, f"round {round_} (seed {seed}): only {kinds}"
            assert load.new_topics, f"round {round_} (seed {seed}): no topic was created"

            server = Server(
                warehouse, env=env, port=server.port, tcp_port=server.tcp_port, log_path=logs
            )
            server.start(timeout_s=60)
            with httpx.Client(base_url=server.url, timeout=10) as c:
                # Recovery commits the journal before the API serves: the tables hold it all.
                rows = Counter(table_bodies(warehouse / "topics" / "cut"))
                lost = [b for b in acked if b not in rows]
                assert lost == [], f"round {round_} (seed {seed}): {len(lost)} lost"
                doubled = [b for b, n in rows.items() if n > 1]
                assert doubled == [], f"round {round_} (seed {seed}): {len(doubled)} doubled"
                for topic, bodies in new_topics.items():
                    assert sorted(table_bodies(warehouse / "topics" / topic)) == sorted(bodies), (
                        topic
                    )
                after = f"after-{round_}".encode()
                assert c.post("/pub", params={"topic": "cut"}, content=after).text == "OK"
                acked.append(after)
    finally:
        server.stop()
