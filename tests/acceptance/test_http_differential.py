"""nsqd's HTTP API, error path by error path: the same requests, in the same order, sent to the
reference nsqd 1.3.0 and to deltaq get the same status, error body and ``Allow`` header."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server
from tests.nsq_wire import Nsqd, run_nsqd

LIMITS = {"max_msg_size": 1024, "max_body_size": 4096}

# (method, path, body). Run in order: earlier ones create what later ones find.
REQUESTS: list[tuple[str, str, bytes]] = [
    ("GET", "/pub?topic=t", b""),
    ("PUT", "/pub?topic=t", b"x"),
    ("POST", "/pub", b"x"),
    ("POST", "/pub?topic=a!b", b"x"),
    ("POST", "/pub?topic=abc%0A", b"x"),
    ("POST", "/pub?topic=t", b""),
    ("POST", "/pub?topic=t", b"x" * 2000),
    ("POST", "/pub?topic=t&defer=abc", b"x"),
    ("POST", "/pub?topic=t&defer=-1", b"x"),
    ("POST", "/pub?topic=t&defer=99999999999", b"x"),
    ("POST", "/pub?topic=t", b"x"),
    ("GET", "/mpub?topic=t", b""),
    ("POST", "/mpub", b"x"),
    ("POST", "/mpub?topic=t", b""),
    ("POST", "/mpub?topic=t", b"x" * 5000),
    ("POST", "/mpub?topic=t&binary=true", b"\x00\x00"),
    ("POST", "/mpub?topic=t&binary=true", b"\x00\x00\x00\x01\x00\x00\x00\x05ab"),
    ("POST", "/mpub?topic=t", b"a\n\nb"),
    ("POST", "/topic/create", b""),
    ("POST", "/topic/create?topic=a!b", b""),
    ("POST", "/topic/create?topic=" + "x" * 65, b""),
    ("GET", "/topic/create?topic=t", b""),
    ("POST", "/topic/create?topic=t", b""),
    ("POST", "/topic/delete?topic=nope", b""),
    ("POST", "/topic/delete", b""),
    ("DELETE", "/topic/delete?topic=t", b""),
    ("POST", "/topic/empty?topic=nope", b""),
    ("POST", "/topic/pause?topic=nope", b""),
    ("POST", "/topic/unpause?topic=nope", b""),
    ("POST", "/channel/create?topic=t", b""),
    ("POST", "/channel/create?channel=c", b""),
    ("POST", "/channel/create?topic=t&channel=a!b", b""),
    ("POST", "/channel/create?topic=a!b&channel=c", b""),
    ("POST", "/channel/create?topic=t&channel=" + "y" * 65, b""),
    ("POST", "/channel/create?topic=t&channel=c%0A", b""),
    ("GET", "/channel/create?topic=t&channel=c", b""),
    ("POST", "/channel/create?topic=t&channel=c", b""),
    ("POST", "/channel/delete?topic=t&channel=nope", b""),
    ("POST", "/channel/delete?topic=nope&channel=c", b""),
    ("POST", "/channel/empty?topic=t&channel=nope", b""),
    ("POST", "/channel/pause?topic=t&channel=nope", b""),
    ("POST", "/channel/pause?topic=t&channel=c", b""),
    ("POST", "/channel/unpause?topic=t", b""),
    ("POST", "/channel/unpause?topic=t&channel=c", b""),
    ("GET", "/nope", b""),
    ("POST", "/ping", b""),
    ("HEAD", "/ping", b""),
    ("POST", "/info", b""),
    ("POST", "/stats", b""),
    ("OPTIONS", "/pub", b""),
    ("OPTIONS", "/stats", b""),
    ("OPTIONS", "/config/log_level", b""),
    ("POST", "/config/log_level", b""),
    ("GET", "/config/nope", b""),
    ("GET", "/config/max_msg_size", b""),
    ("GET", "/config/max_body_size", b""),
    ("GET", "/config/msg_timeout", b""),
    ("GET", "/config/max_req_timeout", b""),
    ("GET", "/config/nsqlookupd_tcp_addresses", b""),
    ("PUT", "/config/max_msg_size", b"5"),
    ("PUT", "/config/log_level", b""),
    ("PUT", "/config/log_level", b"loud"),
    ("PUT", "/config/log_level", b"x" * 1025),
    ("PUT", "/config/log_level", b"warn"),
    ("GET", "/config/log_level", b""),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b"x"),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b'["127.0.0.1:4160"]'),
    ("GET", "/config/nsqlookupd_tcp_addresses", b""),
]


@pytest.fixture
def nsqd(tmp_path: Path) -> Iterator[Nsqd]:
    yield from run_nsqd(tmp_path, *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()))


def _answer(base: str, method: str, path: str, body: bytes) -> tuple[int, str, str | None]:
    r = httpx.request(method, base + path, content=body, timeout=10)
    text = r.text if r.status_code != 200 or path.startswith("/config") else ""
    return r.status_code, text, r.headers.get("allow")


def test_http_answers_match_nsqd(nsqd: Nsqd, server_factory: type[Server], tmp_path: Path) -> None:
    env = {f"DELTAQ_{k.upper()}_BYTES": str(v) for k, v in LIMITS.items()}
    # nsqd's hour (deltaq's default allows a week).
    env["DELTAQ_MAX_REQ_TIMEOUT_MS"] = "3600000"
    server = server_factory(tmp_path / "wh", env=env).start()
    reference = f"http://127.0.0.1:{nsqd.http_port}"
    different = []
    for method, path, body in REQUESTS:
        theirs = _answer(reference, method, path, body)
        ours = _answer(server.url, method, path, body)
        if ours != theirs:
            different.append(f"{method} {path[:50]}: nsqd {theirs}, deltaq {ours}")
    assert not different, "\n".join(different)
    # And what the requests left behind: the refused ones nothing, the others the same topics,
    # messages (the empty line of an /mpub skipped) and channels. deltaq counts a topic's
    # messages once committed to its table: a commit after the acknowledgement.
    expected = _state(reference)
    assert expected == [("t", 3, False, [("c", False)])]
    deadline = time.monotonic() + 10
    while _state(server.url) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(server.url) == expected


def _state(base: str) -> list[tuple[str, int, bool, list[tuple[str, bool]]]]:
    """Each topic in ``/stats``: its name, message count, whether paused, and its channels'
    names and whether paused."""
    topics = httpx.get(f"{base}/stats?format=json", timeout=10).json()["topics"] or []
    return sorted(
        (
            t["topic_name"],
            t["message_count"],
            t["paused"],
            sorted((c["channel_name"], c["paused"]) for c in t["channels"]),
        )
        for t in topics
    )


def _topics(base: str, query: str) -> object:
    """What ``/stats?<query>`` says of topics: None (JSON null) or [(topic, [channels])]."""
    topics = httpx.get(f"{base}/stats?format=json&{query}", timeout=10).json()["topics"]
    if topics is None:
        return None
    return [(t["topic_name"], [c["channel_name"] for c in t["channels"]]) for t in topics]


def test_stats_filters_answer_as_nsqd(
    nsqd: Nsqd, server_factory: type[Server], tmp_path: Path
) -> None:
    server = server_factory(tmp_path / "wh").start()
    reference = f"http://127.0.0.1:{nsqd.http_port}"
    queries = ["topic=nosuch", "", "topic=t", "topic=t&channel=nosuch", "topic=nosuch&channel=c"]
    for base in (reference, server.url):
        assert _topics(base, "") == []
        assert _topics(base, "topic=nosuch") is None
        httpx.post(f"{base}/topic/create?topic=t", timeout=10).raise_for_status()
        httpx.post(f"{base}/channel/create?topic=t&channel=c", timeout=10).raise_for_status()
    for query in queries:
        assert _topics(server.url, query) == _topics(reference, query), query
        text = httpx.get(f"{server.url}/stats?{query}", timeout=10).text
        theirs = httpx.get(f"{reference}/stats?{query}", timeout=10).text
        assert ("Topics: None" in text) == ("Topics: None" in theirs), query
