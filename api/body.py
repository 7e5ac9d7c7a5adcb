"""Reading request bodies with a limit, before anything is buffered past it."""

from __future__ import annotations

from fastapi import Request

from queue_engine.errors import ErrorCode, QueueError


async def read_limited(request: Request, limit: int, code: ErrorCode) -> bytes:
    """The body, or ``QueueError(code)`` as soon as it is known to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        # nsqd refuses on Content-Length alone, without reading the body.
        if int(length) > limit:
            raise QueueError(code)
        return await request.body()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise QueueError(code)
        chunks.append(chunk)
    return b"".join(chunks)
