"""A lean HTTP/1.1 keep-alive load generator for 127.0.0.1 (asyncio + uvloop when present).

Each connection sends one request, reads the whole response, and repeats until the deadline
(closed loop), so ``connections`` is the number of requests in flight. Bounded in time; it only
ever connects to the host it is given, which the benchmarks set to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    requests: int = 0
    errors: int = 0
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + body


async def _connection(
    host: str,
    port: int,
    request: bytes | Callable[[], bytes],
    deadline: float,
    result: LoadResult,
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(request() if callable(request) else request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            result.latencies_s.append(time.perf_counter() - start)
            result.requests += 1
            if status != 200:
                result.errors += 1
    finally:
        writer.close()


async def run_load(
    host: str,
    port: int,
    path: str | Callable[[], str],
    body: bytes,
    connections: int,
    duration_s: float,
) -> LoadResult:
    """``path``: one path, or a function giving each request's (e.g. a random topic)."""
    result = LoadResult()
    request: bytes | Callable[[], bytes]
    if callable(path):
        make_path = path

        def request() -> bytes:
            return build_request(host, port, make_path(), body)

    else:
        request = build_request(host, port, path, body)
    start = time.perf_counter()
    deadline = start + duration_s
    await asyncio.gather(
        *(_connection(host, port, request, deadline, result) for _ in range(connections))
    )
    result.elapsed_s = time.perf_counter() - start
    return result


def run(
    host: str,
    port: int,
    path: str | Callable[[], str],
    body: bytes,
    connections: int,
    duration_s: float,
) -> LoadResult:
    try:
        import uvloop

        return uvloop.run(run_load(host, port, path, body, connections, duration_s))
    except ImportError:
        return asyncio.run(run_load(host, port, path, body, connections, duration_s))
