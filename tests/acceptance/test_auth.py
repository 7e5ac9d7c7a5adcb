"""Authentication and authorisation on both front doors, HTTPS, and the caps that keep one
client from hurting the others — against real servers on loopback."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import trustme

from api.server import is_loopback
from tests.conftest import HOST, ROOT, Server, free_port, wait_until
from tests.consumers import channel_stats
from tests.nsq_wire import ERROR, RESPONSE, Nsqd, Wire, identify, mpub_body, sized


def make_token(path: Path, name: str, *roles: str, topic: str | None = None) -> str:
    args = ["--file", str(path), "--name", name]
    for role in roles:
        args += ["--role", role]
    if topic:
        args += ["--topic", topic]
    out = subprocess.run(
        [sys.executable, "-m", "deltaq", "token", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return out.stdout.strip()


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "tokens.toml"
    made = {
        "publish": make_token(path, "orders-writer", "publish", topic="orders*"),
        "consume": make_token(path, "reader", "consume"),
        "admin": make_token(path, "ops", "admin"),
    }
    return path, made


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def tcp_connections(server: Server) -> int:
    """The TCP connections the server holds open (its /metrics gauge)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    gauge = "deltaq_tcp_connections "
    [value] = [line.removeprefix(gauge) for line in text.splitlines() if line.startswith(gauge)]
    return int(float(value))


def test_tokens_file_holds_only_hashes(tokens: tuple[Path, dict[str, str]]) -> None:
    path, made = tokens
    text = path.read_text()
    assert all(token not in text for token in made.values())
    assert text.count("sha256 = ") == 3


def test_http_roles_and_patterns(
    server_factory: type[Server], tmp_path: Path, tokens: tuple[Path, dict[str, str]]
) -> None:
    path, made = tokens
    server = server_factory(tmp_path / "wh", env={"DELTAQ_AUTH_TOKENS_FILE": str(path)}).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/ping").text == "OK"  # liveness stays open
        refused = c.get("/stats", params={"format": "json"})
        assert refused.status_code == 401
        assert refused.json() == {"message": "E_AUTH_FAILED"}
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert c.post("/pub?topic=orders", content=b"x", headers=bearer("nope")).status_code == 401

        pub = bearer(made["publish"])
        assert c.post("/pub?topic=orders1", content=b"a", headers=pub).text == "OK"
        assert c.post("/mpub?topic=orders1", content=b"b\nc", headers=pub).text == "OK"
        other = c.post("/pub?topic=payments", content=b"x", headers=pub)
        assert other.status_code == 403
        assert other.json() == {"message": "E_UNAUTHORIZED"}
        assert c.get("/sub?topic=orders1&channel=c&wait_ms=0", headers=pub).status_code == 403
        assert c.post("/topic/create?topic=orders2", headers=pub).status_code == 403

        sub = bearer(made["consume"])
        assert c.post("/pub?topic=orders1", content=b"x", headers=sub).status_code == 403
        got = c.get("/sub?topic=orders1&channel=c&wait_ms=0", headers=sub)
        assert got.status_code == 200

        admin = bearer(made["admin"])
        assert c.post("/topic/create?topic=audit", headers=admin).status_code == 200
        assert c.put("/config/log_level", content=b"info", headers=pub).status_code == 403
        assert c.put("/config/log_level", content=b"info", headers=admin).status_code == 200
        # Any identity may read the figures; what was refused created nothing.
        stats = c.get("/stats?format=json", headers=sub).json()
        names = sorted(t["topic_name"] for t in stats["topics"])
        assert names == ["audit", "orders1"]
        assert stats["topics"][1]["message_count"] == 3
        assert c.get("/metrics", headers=pub).status_code == 200
        # The console's page is open; what it shows needs a token.
        assert c.get("/console").status_code == 200
        assert c.get("/console/api/overview").status_code == 401
        assert c.get("/console/api/overview", headers=sub).status_code == 200


def test_tcp_auth_with_tokens(
    server_factory: type[Server], tmp_path: Path, tokens: tuple[Path, dict[str, str]]
) -> None:
    path, made = tokens
    server = server_factory(tmp_path / "wh", env={"DELTAQ_AUTH_TOKENS_FILE": str(path)}).start()

    w = Wire(server.tcp_port)
    w.send(identify(feature_negotiation=True))
    kind, data = w.frame() or (None, b"")
    assert kind == RESPONSE and json.loads(data)["auth_required"] is True
    w.send(b"SUB orders1 c\n")
    assert w.frame() == (ERROR, b"E_AUTH_FIRST AUTH required before SUB")
    assert w.closed()
    # Publishing too needs AUTH first, each command by its name.
    for command in (b"PUB orders1\n" + sized(b"x"), b"MPUB orders1\n" + mpub_body([b"x"])):
        w = Wire(server.tcp_port)
        w.send(command)
        name = command.split(b" ")[0]
        assert w.frame() == (ERROR, b"E_AUTH_FIRST AUTH required before " + name)
        assert w.closed()

    w = Wire(server.tcp_port)
    w.send(b"AUTH\n" + sized(b"wrong"))
    assert w.frame() == (ERROR, b"E_AUTH_FAILED AUTH failed")
    assert w.closed()

    w = Wire(server.tcp_port)
    w.send(b"AUTH\n" + sized(made["publish"].encode()))
    kind, data = w.frame() or (None, b"")
    assert kind == RESPONSE
    assert json.loads(data) == {
        "identity": "orders-writer",
        "identity_url": "",
        "permission_count": 1,
    }
    w.send(b"PUB orders1\n" + sized(b"over tcp"))
    assert w.frame() == (RESPONSE, b"OK")
    w.send(b"AUTH\n" + sized(made["publish"].encode()))
    assert w.frame() == (ERROR, b"E_INVALID AUTH already set")
    w = Wire(server.tcp_port)
    w.send(b"AUTH\n" + sized(made["publish"].encode()))
    w.frame()
    w.send(b"SUB orders1 c\n")
    assert w.frame() == (ERROR, b'E_UNAUTHORIZED AUTH failed for SUB on "orders1" "c"')
    assert w.closed()
    # The publish token's topics are orders*: another topic is refused, by PUB as by MPUB.
    for command in (b"PUB payments\n" + sized(b"x"), b"MPUB payments\n" + mpub_body([b"x"])):
        w = Wire(server.tcp_port)
        w.send(b"AUTH\n" + sized(made["publish"].encode()))
        w.frame()
        w.send(command)
        name = command.split(b" ")[0]
        want = b"E_UNAUTHORIZED AUTH failed for " + name + b' on "payments" ""'
        assert w.frame() == (ERROR, want)
        assert w.closed()
    # The consume token subscribes.
    w = Wire(server.tcp_port)
    w.send(b"AUTH\n" + sized(made["consume"].encode()))
    w.frame()
    w.send(b"SUB orders1 c\n")
    assert w.frame() == (RESPONSE, b"OK")


class _AuthServer(BaseHTTPRequestHandler):
    """nsqd's auth server protocol: one secret, publish+subscribe on topics ``^orders``."""

    queries: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query, keep_blank_values=True)
        type(self).queries.append(query)
        if query.get("secret") != ["s3cret"]:
            self.send_response(403)
            self.end_headers()
            return
        body = json.dumps(
            {
                "ttl": 3600,
                "identity": "svc",
                "identity_url": "http://example.invalid/svc",
                "authorizations": [
                    {"topic": "^orders", "channels": [".*"], "permissions": ["publish"]},
                    {"topic": "^orders", "channels": ["^c$"], "permissions": ["subscribe"]},
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def auth_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer((HOST, 0), _AuthServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"{HOST}:{httpd.server_address[1]}"
    httpd.shutdown()


def _auth_exchange(port: int) -> list[tuple[int, bytes] | None]:
    """The same AUTH conversation, frame by frame."""
    frames: list[tuple[int, bytes] | None] = []
    w = Wire(port)
    w.send(b"AUTH\n" + sized(b"s3cret"))
    frames.append(w.frame())
    w.send(b"PUB orders_x\n" + sized(b"m"))
    frames.append(w.frame())
    w.send(b"SUB orders_x d\n")
    frames.append(w.frame())
    w.close()
    w = Wire(port)
    w.send(b"AUTH\n" + sized(b"guess"))
    frames.append(w.frame())
    frames.append(None if w.closed() else (0, b"still open"))
    return frames


def test_nsqd_auth_server_answers_like_nsqd(
    server_factory: type[Server], tmp_path: Path, auth_server: str
) -> None:
    """deltaq asks an NSQ auth server as nsqd does; the frames match nsqd 1.3.0's."""
    nsqd = Nsqd(tmp_path / "nsqd").start(f"--auth-http-address={auth_server}")
    try:
        theirs = _auth_exchange(nsqd.tcp_port)
    finally:
        nsqd.stop()
    server = server_factory(tmp_path / "wh", env={"DELTAQ_AUTH_HTTP_ADDRESS": auth_server}).start()
    ours = _auth_exchange(server.tcp_port)
    assert ours == theirs
    assert theirs[0] is not None and json.loads(theirs[0][1])["identity"] == "svc"
    asked = _AuthServer.queries[-1]
    assert asked["remote_ip"] == [HOST] and asked["tls"] == ["false"]
    # The same server authorises HTTP bearer tokens.
    with httpx.Client(base_url=server.url, timeout=30) as c:
        ok = c.post("/pub?topic=orders_y", content=b"x", headers=bearer("s3cret"))
        assert ok.text == "OK"
        assert c.post("/pub?topic=other", content=b"x", headers=bearer("s3cret")).status_code == 403
        assert c.post("/pub?topic=orders_y", content=b"x", headers=bearer("no")).status_code == 401


def test_https_with_a_certificate_made_here(server_factory: type[Server], tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert(HOST)
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    server = server_factory(
        tmp_path / "wh",
        env={"DELTAQ_TLS_CERT": str(cert_path), "DELTAQ_TLS_KEY": str(key_path)},
        scheme="https",
    ).start()
    verify = ssl.create_default_context(cafile=str(ca_path))
    with httpx.Client(base_url=server.url, verify=verify, timeout=30) as c:
        assert c.post("/pub?topic=t", content=b"secure").text == "OK"
        assert c.get("/stats?format=json").json()["topics"][0]["message_count"] == 1
        info = c.get("/info").json()
        assert (info["https_port"], info["http_port"]) == (server.https_port, server.port)
    # Plain HTTP stays where it was, as nsqd keeps --http-address beside --https-address.
    assert httpx.post(f"{server.http_url}/pub?topic=t", content=b"plain").text == "OK"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{HOST}:{server.https_port}/ping", timeout=5)


def test_tokens_guard_http_and_https_alike(
    server_factory: type[Server], tmp_path: Path, tokens: tuple[Path, dict[str, str]]
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert(HOST)
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    path, made = tokens
    env = {
        "DELTAQ_AUTH_TOKENS_FILE": str(path),
        "DELTAQ_TLS_CERT": str(cert_path),
        "DELTAQ_TLS_KEY": str(key_path),
    }
    server = server_factory(tmp_path / "wh", env=env).start()
    verify = ssl.create_default_context()
    ca.configure_trust(verify)
    for base, check in ((server.http_url, True), (server.https_url, verify)):
        with httpx.Client(base_url=base, verify=check, timeout=30) as c:
            assert c.post("/pub?topic=orders_a", content=b"x").status_code == 401
            ok = c.post("/pub?topic=orders_a", content=b"x", headers=bearer(made["publish"]))
            assert ok.text == "OK", base
            other = c.post("/pub?topic=other", content=b"x", headers=bearer(made["publish"]))
            assert other.status_code == 403, base


def test_caps_answer_clearly(server_factory: type[Server], tmp_path: Path) -> None:
    server = server_factory(
        tmp_path / "wh",
        env={
            "DELTAQ_MAX_TOPICS": "2",
            "DELTAQ_MAX_CHANNELS_PER_TOPIC": "1",
            "DELTAQ_MAX_SUB_WAITERS": "1",
            "DELTAQ_MAX_TCP_CONNECTIONS": "2",
            "DELTAQ_MAX_HTTP_CONNECTIONS": "3",
        },
    ).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/topic/create?topic=a").status_code == 200
        assert c.post("/pub?topic=b", content=b"x").text == "OK"
        third = c.post("/topic/create?topic=c")
        assert third.status_code == 403 and third.json() == {
            "message": "E_TOO_MANY_TOPICS",
            "reason": "2 topics (max_topics)",
        }
        assert c.post("/pub?topic=c", content=b"x").status_code == 403
        assert c.post("/channel/create?topic=a&channel=one").status_code == 200
        second = c.post("/channel/create?topic=a&channel=two")
        assert second.json()["message"] == "E_TOO_MANY_CHANNELS"
        topics = c.get("/stats?format=json").json()["topics"]
        assert [(t["topic_name"], len(t["channels"])) for t in topics] == [("a", 1), ("b", 0)]

        waited: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: waited.append(
                httpx.get(f"{server.url}/sub?topic=a&channel=one&wait_ms=3000&consumer=waiter")
            )
        )
        waiting.start()
        # The channel lists a consumer once its /sub waits (the waiter count is taken first).
        wait_until(
            lambda: [x["client_id"] for x in channel_stats(c, "a", "one")["clients"]] == ["waiter"],
            "the first /sub is waiting",
        )
        busy = c.get("/sub?topic=a&channel=one&wait_ms=1000")
        assert busy.status_code == 503 and busy.json()["message"] == "E_TOO_MANY_WAITERS"
        assert c.get("/sub?topic=a&channel=one&wait_ms=0").status_code == 200
        waiting.join()
        # The waiter itself was let in: it held the one place until its wait ran out.
        [first] = waited
        assert first.status_code == 200 and first.json() == {"messages": []}

    # Three HTTP connections open: a fourth is turned away, and served once they close.
    # (Each ping is a connection of its own: 503 once the server counts the three.) Two open:
    # the third is served.
    sockets = [socket.create_connection((HOST, server.port)) for _ in range(2)]
    assert httpx.get(f"{server.url}/ping", timeout=10).text == "OK"
    sockets.append(socket.create_connection((HOST, server.port)))
    wait_until(
        lambda: httpx.get(f"{server.url}/ping", timeout=10).status_code == 503,
        "a fourth HTTP connection turned away while three are open",
    )
    for s in sockets:
        s.close()
    wait_until(
        lambda: httpx.get(f"{server.url}/ping", timeout=10).text == "OK",
        "a connection served once the three closed",
    )

    held = [Wire(server.tcp_port), Wire(server.tcp_port)]
    wait_until(lambda: tcp_connections(server) == 2, "the server holds both TCP connections")
    extra = Wire(server.tcp_port)
    assert extra.frame() == (ERROR, b"E_TOO_MANY_CONNECTIONS max_tcp_connections reached")
    assert extra.closed()
    for w in held:
        w.send(b"PUB a\n" + sized(b"still served"))
        assert w.frame() == (RESPONSE, b"OK")


def _startup_lines(tmp_path: Path, *options: str) -> list[str]:
    """What ``deltaq api`` logs up to its startup's end, with ``options``."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "deltaq", "api", "--warehouse", str(tmp_path / "wh")),
            *("--port", str(free_port()), "--tcp-port", "0", *options),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("startup complete" in x for x in lines):
            lines.append(proc.stderr.readline())
        assert any("startup complete" in x for x in lines), lines
    finally:
        proc.terminate()
        proc.wait(30)
    return lines


def test_listening_beyond_loopback_without_auth_warns(
    tmp_path: Path, tokens: tuple[Path, dict[str, str]]
) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    [line] = [x for x in _startup_lines(tmp_path, "--host", "0.0.0.0") if "authentication" in x]
    assert "WARNING" in line and "listening on 0.0.0.0 without authentication" in line
    # With tokens on the same address, or without them on loopback: no warning.
    path, _ = tokens
    with_auth = _startup_lines(tmp_path, "--host", "0.0.0.0", "--auth-tokens-file", str(path))
    on_loopback = _startup_lines(tmp_path, "--host", "127.0.0.1")
    assert not [x for x in with_auth + on_loopback if "authentication" in x or "WARNING" in x]
