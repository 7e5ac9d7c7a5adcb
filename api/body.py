"""Reading request bodies with a limit, before anything is buffered past it.

One reader for both front doors: the plain-ASGI fast path hands it its ``receive``, the FastAPI
routes their request's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from queue_engine.errors import ErrorCode, QueueError

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_limited(
    receive: Receive, content_length: int | None, limit: int, code: ErrorCode
) -> bytes:
    """The body, or ``QueueError(code)`` as soon as it is known to exceed ``limit`` bytes;
    ``ClientDisconnect`` if the client goes away first."""
    # nsqd refuses on Content-Length alone, without reading the body.
    if content_length is not None and content_length > limit:
        raise QueueError(code)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise QueueError(code)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
