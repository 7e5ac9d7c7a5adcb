"""Acknowledged publishes survive kill -9; concurrent publishers lose and duplicate nothing."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from queue_engine.store.journal import read_journal
from tests.conftest import HOST, Server, read_topic, topic_rows


def _publisher(
    port: int, topic: str, prefix: str, stop: threading.Event, acked: list[bytes], limit: int
) -> None:
    """Publish unique bodies over one keep-alive connection; record those answered 200 OK."""
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    try:
        for i in range(limit):
            if stop.is_set():
                return
            body = f"{prefix}-{i}".encode()
            try:
                conn.request("POST", f"/pub?topic={topic}", body=body)
                response = conn.getresponse()
                text = response.read()
            except (OSError, http.client.HTTPException):
                return  # the server was killed: this one may or may not be committed
            if response.status == 200 and text == b"OK":
                acked.append(body)
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("ack", ["journal", "commit"])
def test_kill9_mid_load_loses_no_acknowledged_message(
    server_factory: type[Server], tmp_path: Path, ack: str
) -> None:
    warehouse = tmp_path / "wh"
    # Journal segments of 8 KiB: under this load one closes, drains and is deleted every few
    # dozen publishes, so the kill lands among drains and truncations.
    env = {"DELTAQ_ACK": ack, "DELTAQ_JOURNAL_SEGMENT_BYTES": "8192"}
    server = server_factory(warehouse, env=env).start()
    topic = "durable"
    stop = threading.Event()
    acked: list[list[bytes]] = [[] for _ in range(16)]
    threads = [
        threading.Thread(
            target=_publisher, args=(server.port, topic, f"p{n}", stop, acked[n], 5000)
        )
        for n in range(16)
    ]
    for t in threads:
        t.start()
    # Let load build up and commits pile in, then kill the server without warning.
    deadline = time.monotonic() + 10
    while sum(map(len, acked)) < 1500 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.kill9()
    stop.set()
    for t in threads:
        t.join(20)
    acknowledged = [b for per in acked for b in per]
    assert len(acknowledged) >= 500, "the load did not get going"

    # The table is readable straight after the crash and holds nothing twice; with ack =
    # "commit" it holds every acknowledged message already.
    table = read_topic(warehouse, topic)
    assert len(set(table["body"].to_pylist())) == table.num_rows
    if ack == "commit":
        assert set(acknowledged) <= set(table["body"].to_pylist())
    else:
        journal = list((warehouse / "_deltaq" / "journal").iterdir())
        assert len(journal) == 1, "the killed node's journal is left for the next start"
        # Drains committed and truncation deleted drained segments while the load ran: the
        # journal left holds only part of what was acknowledged.
        left = read_journal(str(warehouse), journal[0].name)
        assert table.num_rows > 0
        assert len(left.records) < len(acknowledged)

    # A restarted server first commits what the journal holds: every acknowledged message is in
    # the table once, ids stay unique, and the dead process's journal is gone.
    restarted = server_factory(warehouse, env=env).start()
    table = read_topic(warehouse, topic)
    bodies = table["body"].to_pylist()
    counts: dict[bytes, int] = {}
    for b in bodies:
        counts[b] = counts.get(b, 0) + 1
    missing = [b for b in acknowledged if b not in counts]
    assert missing == []
    assert max(counts.values()) == 1
    assert len(set(table["id"].to_pylist())) == table.num_rows
    if ack == "journal":
        # The dead process's journal, recovered before the restart served, is gone.
        assert journal[0].name not in [
            p.name for p in (warehouse / "_deltaq" / "journal").iterdir()
        ]
    import httpx

    assert (
        httpx.post(f"{restarted.url}/pub", params={"topic": topic}, content=b"after").text == "OK"
    )
    after = topic_rows(warehouse, topic, table.num_rows + 1)
    assert after.num_rows == table.num_rows + 1
    assert len(set(after["id"].to_pylist())) == after.num_rows
    stats = httpx.get(f"{restarted.url}/stats", params={"format": "json", "topic": topic}).json()
    assert stats["topics"][0]["message_count"] == after.num_rows


@pytest.mark.slow
def test_concurrent_publishers_no_loss_no_duplicates(
    server_factory: type[Server], tmp_path: Path
) -> None:
    server = server_factory(tmp_path / "wh").start()
    topic = "busy"
    stop = threading.Event()
    acked: list[list[bytes]] = [[] for _ in range(24)]
    threads = [
        threading.Thread(target=_publisher, args=(server.port, topic, f"c{n}", stop, acked[n], 150))
        for n in range(24)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    acknowledged = sorted(b for per in acked for b in per)
    assert len(acknowledged) == 24 * 150
    table = topic_rows(server.warehouse, topic, 24 * 150)
    assert sorted(table["body"].to_pylist()) == acknowledged
    ids = table["id"].to_pylist()
    assert len(set(ids)) == len(ids) == 24 * 150
    # Group commit: far fewer Delta commits than messages.
    import httpx

    t = httpx.get(f"{server.url}/stats", params={"format": "json", "topic": topic}).json()[
        "topics"
    ][0]
    assert t["delta_commits"] < len(ids)


def test_restart_keeps_registry_and_deferred_messages(
    server_factory: type[Server], tmp_path: Path
) -> None:
    import httpx

    warehouse = tmp_path / "wh"
    server = server_factory(warehouse).start()
    url = server.url
    assert (
        httpx.post(
            f"{url}/pub", params={"topic": "t", "defer": "3600000"}, content=b"d"
        ).status_code
        == 200
    )
    httpx.post(f"{url}/channel/create", params={"topic": "t", "channel": "c"})
    httpx.post(f"{url}/channel/create", params={"topic": "t", "channel": "gone"})
    httpx.post(f"{url}/channel/delete", params={"topic": "t", "channel": "gone"})
    httpx.post(f"{url}/channel/pause", params={"topic": "t", "channel": "c"})
    httpx.post(f"{url}/topic/pause", params={"topic": "t"})
    httpx.post(f"{url}/topic/create", params={"topic": "other"})
    server.kill9()

    restarted = server_factory(warehouse).start()
    topics = httpx.get(f"{restarted.url}/stats", params={"format": "json"}).json()["topics"]
    by_name = {t["topic_name"]: t for t in topics}
    assert set(by_name) == {"t", "other"}
    assert by_name["t"]["paused"] is True
    assert [(c["channel_name"], c["paused"]) for c in by_name["t"]["channels"]] == [("c", True)]
    row = read_topic(warehouse, "t").to_pylist()[0]
    assert (row["deliver_at"] - row["published_at"]).total_seconds() == pytest.approx(
        3600, abs=0.001
    )


def test_failed_commit_answers_5xx_and_writes_nothing(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """With ack = "commit" the answer follows the topic's commit."""
    import httpx
    from deltalake import DeltaTable

    warehouse = tmp_path / "wh"
    server = server_factory(warehouse, env={"DELTAQ_ACK": "commit"}).start()
    assert (
        httpx.post(f"{server.url}/pub", params={"topic": "f"}, content=b"first").status_code == 200
    )
    table_path = warehouse / "topics" / "f"
    version = DeltaTable(str(table_path)).version()
    # Make the next log entry impossible to create: a directory squats on its name.
    blocker = table_path / "_delta_log" / f"{version + 1:020d}.json"
    blocker.mkdir()
    r = httpx.post(f"{server.url}/mpub", params={"topic": "f"}, content=b"a\nb\nc")
    assert r.status_code == 503
    assert r.json() == {"message": "E_COMMIT_FAILED"}
    blocker.rmdir()
    assert DeltaTable(str(table_path)).version() == version
    assert (
        httpx.post(f"{server.url}/pub", params={"topic": "f"}, content=b"second").status_code == 200
    )
    assert sorted(read_topic(warehouse, "f")["body"].to_pylist()) == [b"first", b"second"]


def test_with_the_journal_a_failing_topic_commit_is_retried_in_order(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """With ack = "journal" the answer follows the journal: a topic commit that fails is
    tried again (the publishes after it wait behind it) until the table takes it."""
    import httpx
    from deltalake import DeltaTable

    warehouse = tmp_path / "wh"
    server = server_factory(warehouse).start()
    url = server.url
    assert httpx.post(f"{url}/pub", params={"topic": "f"}, content=b"first").text == "OK"
    table_path = warehouse / "topics" / "f"
    topic_rows(warehouse, "f", 1)
    version = DeltaTable(str(table_path)).version()
    blocker = table_path / "_delta_log" / f"{version + 1:020d}.json"
    blocker.mkdir()
    assert httpx.post(f"{url}/mpub", params={"topic": "f"}, content=b"a\nb\nc").text == "OK"
    assert httpx.post(f"{url}/pub", params={"topic": "f"}, content=b"second").text == "OK"
    # Acknowledged, so counted, though not in the table yet.
    stats = httpx.get(f"{url}/stats", params={"format": "json", "topic": "f"}).json()
    assert stats["topics"][0]["message_count"] == 5
    time.sleep(0.5)
    assert DeltaTable(str(table_path)).version() == version
    blocker.rmdir()
    table = topic_rows(warehouse, "f", 5).sort_by("id")
    assert table["body"].to_pylist() == [b"first", b"a", b"b", b"c", b"second"]
    server.stop()
    assert not (warehouse / "_deltaq" / "journal").exists() or not list(
        (warehouse / "_deltaq" / "journal").iterdir()
    ), "a clean stop leaves no journal behind"


def test_a_start_past_its_open_budget_serves_and_opens_the_rest_behind(
    server_factory: type[Server], tmp_path: Path
) -> None:
    import httpx

    warehouse = tmp_path / "wh"
    server = server_factory(warehouse).start()
    for i in range(20):
        topic = f"t{i}"
        httpx.post(f"{server.url}/pub", params={"topic": topic}, content=b"x").raise_for_status()
        httpx.post(f"{server.url}/channel/create", params={"topic": topic, "channel": "c"})
    server.kill9()

    # No time to open anything before serving: everything is opened behind the requests.
    restarted = server_factory(warehouse, env={"DELTAQ_STARTUP_OPEN_BUDGET_S": "0"}).start()
    r = httpx.post(f"{restarted.url}/pub", params={"topic": "t19"}, content=b"y")
    assert r.text == "OK"
    deadline = time.monotonic() + 20
    while "topics and channels after the start" not in restarted.log():
        assert time.monotonic() < deadline, restarted.log()[-2000:]
        time.sleep(0.1)
    # All of them but what requests (here t19's writer) or the watch opened first.
    [opened] = re.findall(r"opened (\d+) topics and channels after the start", restarted.log())
    assert 20 <= int(opened) <= 40
    assert "serving while 20 topics and 20 channels are still being opened" in restarted.log()
    # The restarted node's lane served the channels before: one line says so, not twenty.
    assert "took back 20 channels this node's lane served before" in restarted.log()
    assert "took channel" not in restarted.log()
    topics = httpx.get(f"{restarted.url}/stats", params={"format": "json"}).json()["topics"]
    counts = {t["topic_name"]: t["message_count"] for t in topics}
    assert counts == {**{f"t{i}": 1 for i in range(19)}, "t19": 2}
    assert all([c["channel_name"] for c in t["channels"]] == ["c"] for t in topics)
    # y is in t19's journal; its commit follows the topic's linger.
    ids = topic_rows(warehouse, "t19", 2).column("id").to_pylist()
    assert len(set(ids)) == 2


@pytest.mark.slow
def test_a_full_disk_is_named_and_nothing_acknowledged_is_lost(
    server_factory: type[Server], tmp_path: Path
) -> None:
    """The warehouse on a 30 MiB tmpfs, /mpub in a loop until the disk is full: the answers,
    /stats, /ping and one log line say why; once space is back publishing resumes, and a
    restart finds every acknowledged message once."""
    import httpx

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(small)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        # Space to give back once the disk is full.
        filler = small / "filler"
        filler.write_bytes(b"\0" * (12 << 20))
        warehouse = small / "wh"
        log_path = tmp_path / "server.log"
        env = {"DELTAQ_JOURNAL_SEGMENT_BYTES": str(1 << 20)}
        server = server_factory(warehouse, env=env, log_path=log_path).start()
        acked: list[bytes] = []
        refusals: list[httpx.Response] = []
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(2000):
                # Bodies that do not compress: the topic's files grow as fast as the journal.
                batch = [f"{i}-{k}-{os.urandom(1000).hex()}".encode() for k in range(50)]
                r = c.post("/mpub", params={"topic": "full"}, content=b"\n".join(batch))
                if r.status_code == 200:
                    acked += batch
                else:
                    refusals.append(r)
                    if len(refusals) >= 5:
                        break
            assert acked and len(refusals) == 5, "the disk never filled"
            for r in refusals:
                assert r.status_code == 503
                assert r.json() == {
                    "message": "E_COMMIT_FAILED",
                    "reason": "no space left on the warehouse's device",
                }
            stats = c.get("/stats", params={"format": "json"}).json()
            assert stats["health"] == "NOK - no space left on the warehouse's device"
            assert stats["storage"]["problem"] == "no space left on the warehouse's device"
            assert stats["storage"]["refused"] >= 5
            ping = c.get("/ping")
            assert (ping.status_code, ping.text) == (
                500,
                "NOK - no space left on the warehouse's device",
            )

            filler.unlink()  # space is back
            deadline = time.monotonic() + 30
            while True:
                r = c.post("/mpub", params={"topic": "full"}, content=b"back-1\nback-2")
                if r.status_code == 200:
                    acked += [b"back-1", b"back-2"]
                    break
                assert time.monotonic() < deadline, r.text
                time.sleep(0.5)
            # Health is OK again once writes have succeeded for a moment (producers go on).
            deadline = time.monotonic() + 30
            n = 0
            while c.get("/ping").text != "OK":
                assert time.monotonic() < deadline, "health stayed NOK once space was back"
                more = f"more-{n}".encode()
                n += 1
                assert c.post("/pub", params={"topic": "full"}, content=more).text == "OK"
                acked.append(more)
                time.sleep(0.2)
        server.stop()
        said = log_path.read_text(errors="replace")
        assert said.count("writes to the warehouse fail: no space left") == 1, said[-3000:]
        assert (
            "Traceback"
            not in said.split("writes to the warehouse fail", 1)[1].split(
                "writes to the warehouse succeed again", 1
            )[0]
        ), "the episode logged tracebacks"

        server_factory(warehouse, env=env, log_path=log_path).start()
        counts: dict[bytes, int] = {}
        for b in read_topic(warehouse, "full")["body"].to_pylist():
            counts[b] = counts.get(b, 0) + 1
        assert [b for b in acked if b not in counts] == []
        assert max(counts.values()) == 1
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_table_damaged_beyond_a_power_cut_is_refused_by_name_and_the_others_serve(
    server_factory: type[Server], tmp_path: Path
) -> None:
    import httpx

    warehouse = tmp_path / "wh"
    server = server_factory(warehouse, env={"DELTAQ_ACK": "commit"}).start()
    for topic in ("damaged", "fine"):
        for n in range(3):
            r = httpx.post(f"{server.url}/pub", params={"topic": topic}, content=b"m%d" % n)
            assert r.text == "OK"
    server.stop()
    # Whole JSON that no reader can use: not what a power cut leaves, so not set aside.
    first = warehouse / "topics" / "damaged" / "_delta_log" / f"{0:020d}.json"
    first.write_text('{"metaData":{"id":5}}\n{"protocol":{"minReaderVersion":"one"}}\n')

    restarted = server_factory(warehouse, env={"DELTAQ_ACK": "commit"}).start()
    assert httpx.post(f"{restarted.url}/pub", params={"topic": "fine"}, content=b"x").text == "OK"
    refused = httpx.post(f"{restarted.url}/pub", params={"topic": "damaged"}, content=b"x")
    assert refused.status_code == 409
    assert refused.json()["message"] == "E_TABLE_REFUSED"
    assert "a damaged log" in refused.json()["reason"]
    assert f"not serving a table: {warehouse / 'topics' / 'damaged'}" in restarted.log()
    assert first.read_text().startswith('{"metaData":{"id":5}}')  # left as it was found
