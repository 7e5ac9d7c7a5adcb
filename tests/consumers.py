"""HTTP consumer helpers shared by the end-to-end tests."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx


def sub(c: httpx.Client, topic: str, channel: str, **params: Any) -> list[dict[str, Any]]:
    r = c.get("/sub", params={"topic": topic, "channel": channel, **params})
    assert r.status_code == 200, r.text
    messages: list[dict[str, Any]] = r.json()["messages"]
    return messages


def sub_all(
    c: httpx.Client, topic: str, channel: str, n: int, **params: Any
) -> list[dict[str, Any]]:
    """Subscribe until ``n`` messages came (the fanout delivers within a few seconds)."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += sub(c, topic, channel, max=n - len(got), wait_ms=2000, **params)
    assert len(got) == n, got
    return got


def answer(
    c: httpx.Client, verb: str, topic: str, channel: str, *messages: dict[str, Any], **params: Any
) -> httpx.Response:
    body = "".join(f"{m['id']} {m['lease']}\n" for m in messages)
    return c.post(f"/{verb}", params={"topic": topic, "channel": channel, **params}, content=body)


def channel_stats(c: httpx.Client, topic: str, channel: str) -> dict[str, Any]:
    stats = c.get("/stats", params={"format": "json", "topic": topic, "channel": channel}).json()
    [t] = stats["topics"]
    [ch] = t["channels"]
    result: dict[str, Any] = ch
    return result


def create_channel(c: httpx.Client, topic: str, channel: str) -> None:
    assert c.post("/topic/create", params={"topic": topic}).is_success
    assert c.post("/channel/create", params={"topic": topic, "channel": channel}).is_success


def body(m: dict[str, Any]) -> bytes:
    return base64.b64decode(m["body"])
