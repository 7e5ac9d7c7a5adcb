"""Schemathesis hooks for tests/acceptance/test_openapi.py (loaded by SCHEMATHESIS_HOOKS)."""

from __future__ import annotations

import struct
from typing import Any

import schemathesis


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    if case.path == "/sub":
        # Long polls are bounded so the run stays short (any wait is a valid request).
        case.query = {**(case.query or {}), "wait_ms": 0}
    if case.path == "/mpub" and str((case.query or {}).get("binary")) in ("true", "1"):
        # JSON Schema cannot state nsqd's binary framing: send a valid one.
        case.body = struct.pack(">ii", 1, 2) + b"hi"
    if case.path == "/channel/replay":
        # JSON Schema cannot state that from <= to and both lie within the topic's versions:
        # replay the whole topic (a few messages here).
        query = {k: v for k, v in (case.query or {}).items() if k != "to"}
        case.query = {**query, "from": 0}
