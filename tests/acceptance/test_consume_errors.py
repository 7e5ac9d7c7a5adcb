"""Consumer requests refused with nsqd's error codes, through both front doors (the plain-ASGI
fast path and the FastAPI routes). No fanout runs: a message row is appended to the channel
table directly where one is needed."""

from __future__ import annotations

from typing import Any

import httpx
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    HEADERS_TYPE,
    Warehouse,
    read_ledger,
)
from tests.conftest import Server
from tests.consumers import answer, body, channel_stats, create_channel, sub


@pytest.mark.parametrize(
    ("params", "code", "param"),
    [
        ({"channel": "c"}, "MISSING_ARG_TOPIC", None),
        ({"topic": "t"}, "MISSING_ARG_CHANNEL", None),
        ({"topic": "t!", "channel": "c"}, "INVALID_TOPIC", None),
        ({"topic": "t", "channel": "c", "max": "0"}, "E_INVALID", "max"),
        ({"topic": "t", "channel": "c", "max": "2501"}, "E_INVALID", "max"),
        ({"topic": "t", "channel": "c", "max": "9" * 40}, "E_INVALID", "max"),
        ({"topic": "t", "channel": "c", "max": "ten"}, "E_INVALID", "max"),
        # Empty is no integer (as nsqd refuses defer=), not the default.
        ({"topic": "t", "channel": "c", "max": ""}, "E_INVALID", "max"),
        ({"topic": "t", "channel": "c", "wait_ms": ""}, "E_INVALID", "wait_ms"),
        ({"topic": "t", "channel": "c", "wait_ms": "-1"}, "E_INVALID", "wait_ms"),
        ({"topic": "t", "channel": "c", "wait_ms": "60001"}, "E_INVALID", "wait_ms"),
        ({"topic": "t", "channel": "c", "msg_timeout_ms": "999"}, "E_INVALID", "msg_timeout_ms"),
        (
            {"topic": "t", "channel": "c", "msg_timeout_ms": "900001"},
            "E_INVALID",
            "msg_timeout_ms",
        ),
        ({"topic": "t", "channel": "c", "consumer": "x" * 129}, "E_INVALID", "consumer"),
        ({"topic": "t", "channel": "c", "consumer": ""}, "E_INVALID", "consumer"),
    ],
)
def test_bad_sub_parameters(
    client: httpx.Client, params: dict[str, str], code: str, param: str | None
) -> None:
    """nsqd's codes; E_INVALID also names the parameter and says what is wrong with it."""
    r = client.get("/sub", params=params)
    assert r.status_code == 400
    answer = r.json()
    if param is None:
        assert answer == {"message": code}
        return
    assert (answer["message"], answer["param"]) == (code, param)
    expected = {"": "empty", "x" * 129: "128 characters"}.get(params[param], params[param])
    assert expected in answer["reason"], answer


def test_bad_answers(client: httpx.Client, shared_server: Server) -> None:
    assert sub(client, "bad", "c", wait_ms=0) == []
    base = {"topic": "bad", "channel": "c"}
    cases: list[tuple[str, dict[str, Any], bytes, int, str]] = [
        (
            "/fin",
            {**base, "id": "0123456789abcdef", "lease": "1-0123456789ab"},
            b"",
            409,
            "E_FIN_FAILED",
        ),
        (
            "/touch",
            {**base, "id": "0123456789abcdef", "lease": "1-0123456789ab"},
            b"",
            409,
            "E_TOUCH_FAILED",
        ),
        ("/fin", {**base, "id": "bad-id", "lease": "1-0123456789ab"}, b"", 400, "E_INVALID:id"),
        ("/fin", {**base, "id": "0123456789abcdef", "lease": "x"}, b"", 400, "E_INVALID:lease"),
        ("/fin", {**base, "id": "0123456789abcdef"}, b"", 400, "E_INVALID:lease"),
        ("/fin", base, b"", 400, "E_INVALID:id"),
        ("/fin", base, b"0123456789abcdef\n", 400, "E_INVALID:body"),
        # Over the server's max_body_size_bytes (4096 here).
        ("/fin", base, b"0123456789abcdef 1-0123456789ab\n" * 200, 413, "BODY_TOO_BIG"),
        (
            "/req",
            {**base, "delay_ms": "soon"},
            b"0123456789abcdef 1-0123456789ab",
            400,
            "E_INVALID:delay_ms",
        ),
        (
            "/fin",
            {"topic": "bad", "channel": "nope"},
            b"0123456789abcdef 1-0123456789ab",
            404,
            "CHANNEL_NOT_FOUND",
        ),
        (
            "/fin",
            {"topic": "nope", "channel": "c"},
            b"0123456789abcdef 1-0123456789ab",
            404,
            "TOPIC_NOT_FOUND",
        ),
    ]
    for path, params, content, status, expected in cases:
        code, _, param = expected.partition(":")
        r = client.post(path, params=params, content=content)
        assert (r.status_code, r.json()["message"]) == (status, code), (path, params, content)
        if param:
            assert r.json()["param"] == param and r.json()["reason"], (params, r.json())
        if code.endswith("_FAILED"):
            assert r.json()["failed"] == ["0123456789abcdef"]
    # Nothing was written to the ledger by any of them.
    assert channel_stats(client, "bad", "c")["requeue_count"] == 0
    ledger = Warehouse(str(shared_server.warehouse)).channel_ledger_path("bad", "c")
    assert read_ledger(ledger)[0] == []


def test_sub_fin_req_touch_round_trip(client: httpx.Client, shared_server: Server) -> None:
    """A message row appended to the channel table as the fanout appends it, then leased and
    answered over HTTP: the same answers from both front doors."""
    create_channel(client, "rt", "c")
    path = Warehouse(str(shared_server.warehouse)).channel_messages_path("rt", "c")
    published_us = 1_790_000_000_000_000
    row = pa.Table.from_arrays(
        [
            pa.array(["00000000000000aa"], pa.string()),
            pa.array([b"\x00body\xff"], pa.binary()),
            pa.array([published_us], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.array([None], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.array([0], pa.int64()),
            pa.nulls(1, pa.timestamp("us", tz="UTC")),
            pa.nulls(1, pa.string()),
            pa.nulls(1, HEADERS_TYPE),
        ],
        schema=CHANNEL_MESSAGES_SCHEMA,
    )
    write_deltalake(path, row, mode="append")
    [m] = sub(client, "rt", "c", wait_ms=10000, max=5)
    assert m["id"] == "00000000000000aa" and m["attempts"] == 1
    assert m["timestamp"] == published_us * 1000 and body(m) == b"\x00body\xff"
    assert (
        client.post(
            "/touch", params={"topic": "rt", "channel": "c", "id": m["id"], "lease": m["lease"]}
        ).text
        == "OK"
    )
    assert answer(client, "req", "rt", "c", m).text == "OK"
    [again] = sub(client, "rt", "c", wait_ms=10000)
    assert again["attempts"] == 2 and again["lease"] != m["lease"]
    assert answer(client, "fin", "rt", "c", m).status_code == 409  # the first lease is stale
    assert answer(client, "fin", "rt", "c", again).text == "OK"
    assert sub(client, "rt", "c", wait_ms=0) == []
    stats = channel_stats(client, "rt", "c")
    assert (stats["requeue_count"], stats["in_flight_count"], stats["depth"]) == (1, 0, 0)
