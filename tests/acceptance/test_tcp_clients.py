"""NSQ's own clients, unchanged, against deltaq's TCP protocol: pynsq, gnsq, go-nsq's to_nsq
and nsq_tail; TCP and HTTP consumers on one channel; what a disconnect does to leases."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from queue_engine.lease import EventKind
from queue_engine.store.tables import Warehouse, read_ledger
from tests.conftest import ROOT, Server, run_bash
from tests.nsq_wire import Wire, identify, tool

CLIENTS = ROOT / "tests" / "clients"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server(
    warehouse: Path, fanout_loop: None, ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    certs = tmp_path_factory.mktemp("certs")
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(certs / "server.pem"))
    issued.private_key_pem.write_to_path(str(certs / "server.key"))
    server = Server(
        warehouse,
        env={
            "DELTAQ_TLS_CERT": str(certs / "server.pem"),
            "DELTAQ_TLS_KEY": str(certs / "server.key"),
            "DELTAQ_MSG_TIMEOUT_MS": "30000",
        },
        # The tests talk HTTPS (the certificate adds that listener beside plain HTTP).
        scheme="https",
    ).start()
    server.verify = ssl.create_default_context()
    ca.configure_trust(server.verify)
    yield server
    server.stop()


def _run_client(script: str, *args: str) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, str(CLIENTS / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("feature", ["plain", "snappy", "deflate"])
def test_pynsq_reader_and_writer(server: Server, feature: str) -> None:
    topic = f"pynsq_{feature}"
    seen = _run_client("pynsq_roundtrip.py", str(server.tcp_port), topic, "30", feature)
    assert seen["acks"] == ["b'OK'"] * 30
    assert sorted(seen["got"]) == sorted(f"py{i}" for i in range(30))
    bodies = server.topic_table(topic)["body"].to_pylist()
    assert sorted(bodies) == sorted(f"py{i}".encode() for i in range(30))


def test_pynsq_over_tls(server: Server, ca: trustme.CA, tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    seen = _run_client(
        "pynsq_roundtrip.py", str(server.tcp_port), "pynsq_tls", "10", "tls", str(ca_file)
    )
    assert sorted(seen["got"]) == sorted(f"py{i}" for i in range(10))
    assert "upgrading connection to TLS" in server.log()


@pytest.mark.parametrize("feature", ["", "deflate", "snappy"])
def test_gnsq_consumer_and_producer(server: Server, feature: str) -> None:
    topic = f"gnsq_{feature or 'plain'}"
    seen = _run_client(
        "gnsq_roundtrip.py", str(server.tcp_port), topic, "20", *([feature] if feature else [])
    )
    assert seen["acks"] == ["OK"] * 11
    assert sorted(seen["got"]) == sorted(f"g{i}" for i in range(20))


def test_to_nsq_then_nsq_tail(server: Server) -> None:
    address = f"--nsqd-tcp-address=127.0.0.1:{server.tcp_port}"
    lines = "".join(f"line {i}\n" for i in range(25))
    subprocess.run(
        [str(tool("to_nsq")), address, "--topic=go_tools"],
        input=lines,
        text=True,
        check=True,
        timeout=60,
        capture_output=True,
    )
    tail = subprocess.run(
        [str(tool("nsq_tail")), address, "--topic=go_tools", "--channel=tail", "-n", "25"],
        text=True,
        timeout=60,
        capture_output=True,
        check=True,
    )
    assert sorted(tail.stdout.splitlines()) == sorted(lines.splitlines())
    # /stats (and nsqadmin) show the connection as a client with its deliveries and FINs.
    with httpx.Client(base_url=server.url, verify=server.verify, timeout=30) as http:
        deadline = time.monotonic() + 10
        while True:
            [topic] = http.get("/stats?format=json&topic=go_tools").json()["topics"]
            [channel] = topic["channels"]
            finished = sum(c["finish_count"] for c in channel["clients"])
            if finished >= 24 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # nsq_tail -n 25 exits on the 25th message; go-nsq sends FINs from its own goroutine,
        # so when the messages came in one burst the last few FINs may not have gone out.
        assert finished >= 20, channel["clients"]
        assert sum(c["message_count"] for c in channel["clients"]) == 25


def test_the_go_tools_lines_of_the_tcp_docs_run_as_written(server: Server) -> None:
    """docs/tcp-protocol.md's first shell block, with NSQ's tools on PATH and the server's
    port for nsqd's default one."""
    text = (ROOT / "docs" / "tcp-protocol.md").read_text()
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert "to_nsq" in block and "nsq_tail" in block
    tools = {tool("to_nsq").parent, tool("nsq_tail").parent}
    path = ":".join([*map(str, tools), os.environ["PATH"]])
    script = block.replace("127.0.0.1:4150", f"127.0.0.1:{server.tcp_port}")
    done = run_bash(script, ROOT, {**os.environ, "PATH": path}, 120)
    assert done.stdout.splitlines() == ["one", "two"]


@pytest.mark.timeout(120)  # the program's first line, or the test fails here
def test_the_pynsq_block_of_the_tcp_docs_runs_as_written(server: Server, tmp_path: Path) -> None:
    """docs/tcp-protocol.md's pynsq program, with the server's port for nsqd's default one:
    it receives the messages it publishes (it runs until stopped, as a consumer does)."""
    text = (ROOT / "docs" / "tcp-protocol.md").read_text()
    [program] = re.findall(r"```python\n(# pynsq.*?)```", text, re.S)
    script = program.replace("127.0.0.1:4150", f"127.0.0.1:{server.tcp_port}")
    errors = tmp_path / "stderr"
    with (
        open(errors, "w") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True
        ) as reader,
    ):
        try:
            assert reader.stdout is not None
            first = reader.stdout.readline()  # blocks until the first one (or its end)
            assert first == "hello\n", errors.read_text()
        finally:
            reader.kill()


def _subscriber(server: Server, topic: str, channel: str, rdy: int, **options: object) -> Wire:
    wire = Wire(server.tcp_port)
    wire.send(identify(client_id="t", **options))
    wire.send(f"SUB {topic} {channel}\nRDY {rdy}\n".encode())
    assert wire.frame() == (0, b"OK")
    assert wire.frame() == (0, b"OK")
    return wire


def _publish(server: Server, topic: str, bodies: list[bytes]) -> None:
    with httpx.Client(base_url=server.url, verify=server.verify, timeout=30) as http:
        for start in range(0, len(bodies), 100):
            chunk = bodies[start : start + 100]
            http.post(f"/mpub?topic={topic}", content=b"\n".join(chunk)).raise_for_status()


def test_tcp_and_http_consumers_share_one_channel(server: Server) -> None:
    topic, channel, count = "shared_channel", "both", 300
    wire = _subscriber(server, topic, channel, 20)
    expected = {f"m{i}".encode() for i in range(count)}
    by_tcp: list[bytes] = []
    by_http: list[bytes] = []
    # Each delivery's attempts, checked here: an assert in a worker thread would be lost.
    attempts: list[int] = []
    done = threading.Event()

    def tcp() -> None:
        while not done.is_set():
            try:
                message = wire.message(timeout_s=2)
            except TimeoutError:
                continue
            attempts.append(message.attempts)
            by_tcp.append(message.body)
            wire.send(b"FIN " + message.id + b"\n")

    def http() -> None:
        with httpx.Client(base_url=server.url, verify=server.verify, timeout=70) as client:
            while not done.is_set():
                answer = client.get(
                    "/sub", params={"topic": topic, "channel": channel, "max": 10, "wait_ms": 500}
                ).json()
                pairs = []
                for message in answer["messages"]:
                    attempts.append(message["attempts"])
                    by_http.append(base64.b64decode(message["body"]))
                    pairs.append(f"{message['id']} {message['lease']}")
                if pairs:
                    client.post(
                        "/fin",
                        params={"topic": topic, "channel": channel},
                        content="\n".join(pairs),
                    ).raise_for_status()

    workers = [threading.Thread(target=tcp), threading.Thread(target=http)]
    for worker in workers:
        worker.start()
    _publish(server, topic, sorted(expected))
    deadline = time.monotonic() + 60
    while len(by_tcp) + len(by_http) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    done.set()
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive(), "a consumer thread did not stop (or died)"
    wire.close()
    assert sorted(by_tcp + by_http) == sorted(expected)  # each once, none lost
    assert by_tcp and by_http
    assert set(attempts) == {1} and len(attempts) == count  # first deliveries only


def test_a_disconnect_requeues_its_messages_at_once(server: Server, warehouse: Path) -> None:
    topic, channel = "dropped_client", "work"
    first = _subscriber(server, topic, channel, 5)
    _publish(server, topic, [f"d{i}".encode() for i in range(5)])
    held = [first.message() for _ in range(5)]
    assert all(m.attempts == 1 for m in held)
    first.close()  # no FIN: msg_timeout is 30 s, so only the disconnect can free them now
    started = time.monotonic()
    second = _subscriber(server, topic, channel, 5)
    again = [second.message() for _ in range(5)]
    assert time.monotonic() - started < 10
    assert sorted(m.body for m in again) == sorted(m.body for m in held)
    assert all(m.attempts == 2 for m in again)
    for message in again:
        second.send(b"FIN " + message.id + b"\n")
    second.send(b"NOP\n")
    second.close()
    ledger = Warehouse(str(warehouse)).channel_ledger_path(topic, channel)
    ids = {m.id.decode() for m in held}
    # A TCP connection's lease events reach the ledger within ledger_linger_ms (10 ms).
    deadline = time.monotonic() + 5
    while True:
        events, _ = read_ledger(ledger)
        kinds = sorted(e.kind for e in events if e.id in ids)
        if kinds.count(EventKind.FIN) == 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert kinds.count(EventKind.FIN) == 5
    assert kinds.count(EventKind.DELIVER) == 10
    assert kinds.count(EventKind.REQ) == 5
    delivered_to = {e.consumer for e in events if e.kind is EventKind.DELIVER and e.id in ids}
    assert all(c is not None and c.startswith("t@127.0.0.1:") for c in delivered_to)


def test_rdy_bounds_what_is_in_flight(server: Server) -> None:
    topic, channel = "rdy_bound", "c"
    wire = _subscriber(server, topic, channel, 3)
    _publish(server, topic, [f"r{i}".encode() for i in range(10)])
    first = [wire.message() for _ in range(3)]
    with pytest.raises(TimeoutError):
        wire.message(timeout_s=2)  # RDY 3 and 3 in flight: nothing more comes
    wire.send(b"FIN " + first[0].id + b"\n")
    assert wire.message().attempts == 1  # one slot freed, one message
    wire.send(b"RDY 0\n")
    for message in first[1:]:
        wire.send(b"FIN " + message.id + b"\n")
    with pytest.raises(TimeoutError):
        wire.message(timeout_s=2)  # RDY 0: nothing, whatever is free
    wire.close()


def test_max_attempts_dead_letters_tcp_deliveries_as_http_ones(server: Server) -> None:
    topic, channel = "tcp_dead", "c"
    with httpx.Client(base_url=server.url, verify=server.verify, timeout=30) as http:
        assert http.post("/topic/create", params={"topic": topic}).is_success
        params = {"topic": topic, "channel": channel, "max_attempts": "2"}
        assert http.post("/channel/create", params=params).status_code == 200
    wire = _subscriber(server, topic, channel, 1)
    _publish(server, topic, [b"poison"])
    for attempt in (1, 2):
        message = wire.message()
        assert (message.body, message.attempts) == (b"poison", attempt)
        wire.send(b"REQ " + message.id + b" 0\n")
    with pytest.raises(TimeoutError):
        wire.message(timeout_s=2)  # its two attempts are spent: dead-lettered, not delivered
    wire.close()
    with httpx.Client(base_url=server.url, verify=server.verify, timeout=30) as http:
        dead = http.get("/channel/dead", params={"topic": topic, "channel": channel}).json()
        [letter] = dead["messages"]
        assert letter["id"] == message.id.decode() and letter["attempts"] == 2
        assert letter["last_event"] == "REQ" and letter["last_consumer"].startswith("t@")


def test_pipelined_publishes_are_answered_in_order_and_a_failure_closes_after_the_earlier(
    server: Server, warehouse: Path
) -> None:
    """A producer that sends before it reads (go-nsq's PublishAsync, pynsq's Writer): the
    publishes that arrived together are under way together, and answered in order."""
    from tests.conftest import topic_rows
    from tests.nsq_wire import mpub_body, sized

    wire = Wire(server.tcp_port)
    burst = b"".join(b"PUB piped\n" + sized(f"m{i}".encode()) for i in range(200))
    burst += b"MPUB piped\n" + mpub_body([b"x", b"y"]) + b"DPUB piped 1000\n" + sized(b"later")
    burst += b"NOP\n" + b"PUB piped\n" + sized(b"last")
    wire.send(burst)
    answers = [wire.frame() for _ in range(203)]
    assert answers == [(0, b"OK")] * 203
    rows = topic_rows(warehouse, "piped", 204).sort_by("id")["body"].to_pylist()
    assert rows[:200] == [f"m{i}".encode() for i in range(200)]
    assert sorted(rows[200:]) == [b"last", b"later", b"x", b"y"]

    # The answers of what came before a failing command go out first, then its error.
    wire = Wire(server.tcp_port)
    wire.send(b"PUB piped\n" + sized(b"ok1") + b"PUB piped\n" + sized(b"ok2") + b"PUB bad!\n")
    assert [wire.frame(), wire.frame()] == [(0, b"OK"), (0, b"OK")]
    kind, data = wire.frame() or (None, b"")
    assert kind == 1 and data.startswith(b"E_BAD_TOPIC")
    assert wire.closed()
