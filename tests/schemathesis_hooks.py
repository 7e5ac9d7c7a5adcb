"""Schemathesis hooks for tests/acceptance/test_openapi.py (loaded by SCHEMATHESIS_HOOKS)."""

from __future__ import annotations

import struct
from typing import Any

import schemathesis


def _positive(case: Any) -> bool:
    """The case was generated to fit the schema (not to break it)."""
    generation = getattr(getattr(case, "meta", None), "generation", None)
    return str(getattr(generation, "mode", "positive")) == "positive"


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    query = case.query or {}
    if case.path == "/sub":
        # Long polls are bounded so the run stays short: waits of up to 50 ms are sent as
        # generated, longer or absent ones (the server's default) as 50 ms. A wait that is
        # not a whole number, negative or past the 60 s maximum is sent as generated (a 400).
        wait = query.get("wait_ms")
        try:
            ms = int(str(wait)) if wait is not None else None
        except ValueError:
            ms = -1
        if ms is None or 50 < ms <= 60_000:
            case.query = {**query, "wait_ms": 50}
    if case.path == "/mpub" and str(query.get("binary")) in ("true", "1") and _positive(case):
        # JSON Schema cannot state nsqd's binary framing: a case meant to fit the schema gets
        # a valid frame. Cases meant to break it are sent as generated: nsqd's answer to a
        # malformed frame is 413 BAD_BODY, a rejection (tests/schemathesis.toml).
        case.body = struct.pack(">ii", 1, 2) + b"hi"
    if case.path in ("/pub", "/mpub") and query.get("envelope") == "json" and _positive(case):
        # The envelope's JSON is chosen by a query parameter, which JSON Schema cannot tie to
        # the body: a case meant to fit gets a valid envelope (and no binary framing beside
        # it). Cases meant to break it are sent as generated (400 INVALID_ENVELOPE).
        case.query = {k: v for k, v in query.items() if k != "binary"}
        case.body = b'{"body": "hi", "headers": {"k": "v"}}'
    # A configure changes max_attempts, the filter or both: JSON Schema cannot say "at least
    # one of"; a case meant to fit that gives neither sets max_attempts.
    neither = "max_attempts" not in query and "filter" not in query
    if case.path == "/channel/configure" and neither and _positive(case):
        query = case.query = {**query, "max_attempts": "default"}
    filtered = case.path in ("/channel/create", "/channel/configure") and "filter" in query
    if filtered and _positive(case):
        # JSON Schema cannot state Spark SQL: a case meant to fit gets a valid filter.
        case.query = {**query, "filter": "headers['k'] = 'v'"}
    typed = case.path in ("/topic/create", "/topic/configure") and "schema" in query
    if typed and _positive(case):
        # JSON Schema cannot state Spark DDL: a case meant to fit types a topic of its own (a
        # generated /pub to a typed topic would be refused) with one schema, which every
        # such case gives again (a change no rows could follow would be refused).
        case.query = {**query, "topic": "typed_by_schema", "schema": "sku STRING"}
    if case.path == "/channel/replay" and _positive(case):
        # JSON Schema cannot state that from <= to and both lie within the topic's versions:
        # a case meant to fit replays the whole topic (a few messages here). Cases meant to
        # break it are sent as generated (400 INVALID_RANGE and the like).
        query = {k: v for k, v in query.items() if k != "to"}
        case.query = {**query, "from": 0}
