"""/openapi.json as the API really behaves.

The routes take their parameters as optional strings so that a missing or malformed one gets
nsqd's own error code (``MISSING_ARG_TOPIC``, ``E_INVALID``...) rather than FastAPI's 422. The
published schema states the contract those checks enforce: required parameters are required,
names have nsqd's pattern and length, integers their ranges, and every operation documents
the error body it can answer with (including ``INVALID_REQUEST``, and never a 422).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.consume import MAX_CONSUMER_CHARS, MAX_WAIT_MS, MIN_MSG_TIMEOUT_MS
from api.lifecycle import MAX_ATTEMPTS_LIMIT, MAX_RETENTION_HOURS, MAX_TTL_MS
from queue_engine.message import LANES
from queue_engine.names import MAX_NAME_LENGTH
from queue_engine.replay import REPLAY_ID_PATTERN
from queue_engine.settings import RetentionMode, Settings

# nsqd's names, less the all-dot names deltaq refuses ("." and ".." are directories).
NAME_PATTERN = r"^(?!\.+(#ephemeral)?$)[.a-zA-Z0-9_-]+(#ephemeral)?$"
NAME = {"type": "string", "pattern": NAME_PATTERN, "minLength": 1, "maxLength": MAX_NAME_LENGTH}
ANSWER_LINES = r"^([0-9a-f]{16} [0-9]{1,9}-[0-9a-f]{12}\n)+$"
# Operations whose topic/channel are filters, not targets.
_OPTIONAL_NAMES = {"/stats"}
# Operations with a topic target whose channel is optional (a topic's figures without it).
_OPTIONAL_CHANNEL = {"/console/api/history"}
# Query parameters FastAPI sees as optional (the handler answers their absence with nsqd's
# codes) that an operation needs.
_REQUIRED = {
    ("/channel/replay", "from"),
    ("/channel/move", "node"),
}
_ERROR: dict[str, Any] = {
    "type": "object",
    "properties": {"message": {"type": "string"}},
    "required": ["message"],
}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _limit_or_default(high: int) -> dict[str, Any]:
    return {"anyOf": [_integer(1, high), {"type": "string", "enum": ["default"]}]}


def _parameters(settings: Settings) -> dict[str, dict[str, Any]]:
    return {
        "defer": _integer(0, settings.max_req_timeout_ms),
        "binary": {"type": "string", "enum": ["true", "false", "1", "0"]},
        "max": _integer(1, settings.max_rdy_count),
        "wait_ms": _integer(0, MAX_WAIT_MS),
        "msg_timeout_ms": _integer(MIN_MSG_TIMEOUT_MS, settings.max_msg_timeout_ms),
        "consumer": {"type": "string", "minLength": 1, "maxLength": MAX_CONSUMER_CHARS},
        "delay_ms": _integer(0, settings.max_req_timeout_ms),
        "id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "max_attempts": _limit_or_default(MAX_ATTEMPTS_LIMIT),
        "ttl_ms": _limit_or_default(MAX_TTL_MS),
        "retention_hours": {
            "anyOf": [
                {"type": "number", "minimum": 0, "maximum": MAX_RETENTION_HOURS},
                {"type": "string", "enum": ["default"]},
            ]
        },
        "retention": {"type": "string", "enum": [*(m.value for m in RetentionMode), "default"]},
    }


def _bodies(settings: Settings) -> dict[str, dict[str, Any]]:
    binary = {"type": "string", "format": "binary"}
    answers = {
        "required": True,
        "description": "One `ID LEASE` line per message (an `id` and a `lease` query parameter "
        "may name one more).",
        "content": {"text/plain": {"schema": {"type": "string", "pattern": ANSWER_LINES}}},
    }
    return {
        "/pub": {
            "required": True,
            "content": {
                "application/octet-stream": {
                    "schema": binary | {"minLength": 1, "maxLength": settings.max_msg_size_bytes}
                }
            },
        },
        "/mpub": {
            "required": True,
            "description": "Text: messages separated by newlines (at least one non-empty line, "
            "each at most max_msg_size). binary=true: nsqd's framing, which JSON Schema cannot "
            "state.",
            "content": {
                "application/octet-stream": {
                    "schema": binary
                    | {"pattern": "[^\\n]", "maxLength": settings.max_body_size_bytes}
                }
            },
        },
        "/fin": answers,
        "/req": answers,
        "/touch": answers,
    }


def _error_response(codes: list[str]) -> dict[str, Any]:
    schema = copy.deepcopy(_ERROR)
    schema["properties"]["message"]["enum"] = codes
    return {"description": " | ".join(codes), "content": {"application/json": {"schema": schema}}}


_BOUND = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "format": "date-time"}]}
# Parameters whose schema differs on one operation from their name's.
_OPERATION_PARAMETERS: dict[tuple[str, str], dict[str, Any]] = {
    # A message's own TTL has no "default" (none given: the topic's).
    ("/pub", "ttl_ms"): _integer(1, MAX_TTL_MS),
    ("/mpub", "ttl_ms"): _integer(1, MAX_TTL_MS),
    ("/channel/replay", "from"): _BOUND,
    ("/channel/replay", "to"): _BOUND,
    ("/channel/replay", "replay_id"): {"type": "string", "pattern": REPLAY_ID_PATTERN},
    ("/channel/move", "node"): _integer(0, LANES - 1),
}


def refine(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``schema`` (FastAPI's) made to say what the handlers check."""
    params = _parameters(settings)
    bodies = _bodies(settings)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if path in bodies:
                operation["requestBody"] = copy.deepcopy(bodies[path])
            for parameter in operation.get("parameters", []):
                name = parameter["name"]
                description = parameter.get("schema", {}).get("description")
                if name in ("topic", "channel") and path not in _OPTIONAL_NAMES:
                    parameter["required"] = name == "topic" or path not in _OPTIONAL_CHANNEL
                    parameter["schema"] = dict(NAME)
                elif (path, name) in _OPERATION_PARAMETERS:
                    parameter["schema"] = copy.deepcopy(_OPERATION_PARAMETERS[(path, name)])
                elif name in params and parameter.get("in") == "query":
                    parameter["schema"] = dict(params[name])
                if (path, name) in _REQUIRED:
                    parameter["required"] = True
                if description:
                    parameter["schema"]["description"] = description
            responses = operation.setdefault("responses", {})
            # FastAPI documents its 422; deltaq answers validation errors with nsqd's 400.
            responses.pop("422", None)
            bad = responses.get("400")
            if bad is None:
                responses["400"] = _error_response(["INVALID_REQUEST"])
            else:
                enum = bad["content"]["application/json"]["schema"]["properties"]["message"]
                enum.setdefault("enum", [])
                if "INVALID_REQUEST" not in enum["enum"]:
                    enum["enum"].append("INVALID_REQUEST")
                bad["description"] = " | ".join(enum["enum"])
            if method.lower() != "get" or path == "/sub":
                responses.setdefault("503", _error_response(["E_COMMIT_FAILED", "EXITING"]))
            # With authentication on, every operation but /ping can be refused.
            if path != "/ping":
                responses.setdefault("401", _error_response(["E_AUTH_FAILED"]))
                responses.setdefault("403", _error_response(["E_UNAUTHORIZED"]))
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the refined schema at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            base = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = refine(base, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
