"""A plain ASGI front door for the hot paths: POST /pub /mpub /fin /req /touch, GET /sub.

FastAPI's routing, dependency solving and middleware stack cost ~100 us per request, as much as
a publish itself; on the hottest paths that halves throughput. This handler parses the query
and body directly and calls the same functions as the FastAPI routes (``api.publish``,
``api.consume``); anything else goes on to FastAPI.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from api.body import Receive, read_limited
from api.consume import answer, subscribe
from api.publish import mpub, pub
from api.responses import (
    JSON_TYPE,
    NSQ_HEADER,
    STATUS,
    TEXT_TYPE,
    elsewhere_location,
    queue_error_body,
)
from queue_engine.broker import Broker
from queue_engine.errors import ChannelElsewhereError, ErrorCode, QueueError
from queue_engine.lease import EventKind

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

# The FastAPI routes' headers (api.responses), as raw ASGI header pairs.
_NSQ = next((k.lower().encode(), v.encode()) for k, v in NSQ_HEADER.items())
_OK_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", TEXT_TYPE.encode()), _NSQ, (b"content-length", b"2")],
}
_OK_BODY = {"type": "http.response.body", "body": b"OK"}
_JSON = (b"content-type", JSON_TYPE.encode())
_ROUTES = {
    ("POST", "/pub"),
    ("POST", "/mpub"),
    ("GET", "/sub"),
    ("POST", "/fin"),
    ("POST", "/req"),
    ("POST", "/touch"),
}
_ANSWERS = {"/fin": EventKind.FIN, "/req": EventKind.REQ, "/touch": EventKind.TOUCH}


class FastPath:
    """ASGI middleware: serve the hot routes itself, pass everything else to ``app``."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) not in _ROUTES:
            await self.app(scope, receive, send)
            return
        broker: Broker = self.app.state.broker
        path = scope["path"]
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        params: dict[str, str] = {}
        for key, value in query:
            params.setdefault(key, value)
        content_length: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                content_length = int(value)
                break

        async def read(limit: int, code: ErrorCode) -> bytes:
            return await read_limited(receive, content_length, limit, code)

        json: bytes | None = None
        try:
            if path == "/pub":
                await pub(broker, params, read)
            elif path == "/mpub":
                await mpub(broker, params, read, content_length)
            elif path == "/sub":
                client = scope.get("client")
                json = await subscribe(broker, params, client[0] if client else "unknown")
            else:
                await answer(broker, _ANSWERS[path], params, query, read)
        except QueueError as exc:
            body = queue_error_body(exc)
            headers = [_JSON, _NSQ, (b"content-length", str(len(body)).encode())]
            if isinstance(exc, ChannelElsewhereError):
                target = path + (f"?{scope['query_string'].decode('latin-1')}" if query else "")
                headers.append((b"location", elsewhere_location(exc, target).encode()))
            start = {"type": "http.response.start", "status": STATUS[exc.code], "headers": headers}
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        except ClientDisconnect:
            return
        if json is None:
            await send(_OK_START)
            await send(_OK_BODY)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [_JSON, _NSQ, (b"content-length", str(len(json)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": json})
