"""Object storage for tests and benchmarks: moto's S3 server as a process on 127.0.0.1, and a
proxy in front of it that can slow every request down, drop connections (a store that went
away) or strip ``If-None-Match`` (a store that ignores put-if-absent)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"
_READY_TIMEOUT_S = 30.0


def moto_server_command() -> list[str] | None:
    """How to start moto's server from this interpreter's environment (None if not installed)."""
    script = Path(sys.executable).parent / "moto_server"
    if script.exists():
        return [str(script)]
    found = shutil.which("moto_server")
    return [found] if found else None


@dataclass
class S3Server:
    """A moto S3 server process (a real S3 wire protocol; objects live in its memory)."""

    port: int
    log_path: Path
    # Extra environment of the server process (moto's own switches).
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> S3Server:
        command = moto_server_command()
        if command is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.process = subprocess.Popen(
            [*command, "-H", HOST, "-p", str(self.port)],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited: {self.log_path.read_text()}")
            try:
                httpx.get(f"{self.endpoint}/moto-api/", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError("moto_server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def create_bucket(self, name: str) -> None:
        import boto3

        s3 = boto3.client("s3", **client_arguments(self.endpoint))
        s3.create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str) -> set[str]:
        """The keys under ``prefix``, relative to it."""
        import boto3

        s3 = boto3.client("s3", **client_arguments(self.endpoint))
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])}


def store_env(endpoint: str) -> dict[str, str]:
    """The standard variables that point delta-rs, obstore, pyarrow and boto3 at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "deltaq-test",
        "AWS_SECRET_ACCESS_KEY": "deltaq-test-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


def storage_options(env: dict[str, str]) -> dict[str, str]:
    """Store variables ``env`` as delta-rs ``storage_options``, for reading tables from the
    test process (whose own environment does not point at the store)."""
    return {key.lower(): value for key, value in env.items()}


def client_arguments(endpoint: str) -> dict[str, str]:
    env = store_env(endpoint)
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_REGION"],
    }


@dataclass
class StoreProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (host, port), in its own thread.

    ``delay_s`` is added before every request; ``down`` drops every request's connection
    unanswered; ``strip_conditional`` removes ``If-None-Match``.
    """

    upstream_port: int
    delay_s: float = 0.0
    down: bool = False
    strip_conditional: bool = False
    port: int = 0
    requests: int = 0
    # Request lines seen, when a list is given (to see what a client asks of the store).
    trace: list[str] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _started: threading.Event = field(default_factory=threading.Event)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> StoreProxy:
        self._thread = threading.Thread(target=self._run, name="store-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise TimeoutError("store proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            # Connections clients keep alive end here, on the running loop, not when their
            # coroutines are collected after it closed.
            ended = asyncio.run_coroutine_threadsafe(self._end_connections(), self._loop)
            with contextlib.suppress(Exception):
                ended.result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    @staticmethod
    async def _end_connections() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        server = loop.run_until_complete(asyncio.start_server(self._handle, HOST, self.port))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward requests from one client connection over one upstream connection, both kept
        alive (a new connection per request cost ~12 ms here, more than the delay modelled)."""
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                request = await _read_message(reader, is_request=True)
                if request is None:
                    return
                head, body = request
                if self.down:
                    writer.transport.abort()
                    return
                lines = head.decode("latin-1").split("\r\n")
                if self.strip_conditional:
                    lines = [ln for ln in lines if not ln.lower().startswith("if-none-match:")]
                self.requests += 1
                if self.trace is not None:
                    self.trace.append(lines[0])
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(HOST, self.upstream_port)
                    except OSError:
                        writer.transport.abort()
                        return
                up_reader, up_writer = upstream
                up_writer.write("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)
                await up_writer.drain()
                head_only = lines[0].startswith("HEAD ")
                answer = await _read_message(up_reader, is_request=False, head_only=head_only)
                if answer is None:
                    writer.transport.abort()
                    return
                writer.write(answer[0] + b"\r\n\r\n" + answer[1])
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.transport.abort()
        finally:
            if upstream is not None:
                upstream[1].close()
            writer.close()


async def _read_message(
    reader: asyncio.StreamReader, *, is_request: bool, head_only: bool = False
) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message: its head (without the blank line) and its body, framed by
    Content-Length or chunked encoding; None at a clean end of the connection."""
    try:
        head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    lines = head.decode("latin-1").split("\r\n")
    fields = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1] for ln in lines[1:]}
    if head_only or (not is_request and lines[0].split(" ")[1] in ("204", "304")):
        return head, b""
    if "content-length" in fields:
        return head, await reader.readexactly(int(fields["content-length"]))
    if fields.get("transfer-encoding", "").strip().lower() == "chunked":
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            body += size_line
            size = int(size_line.split(b";")[0], 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                return head, bytes(body)
    if is_request:
        return head, b""
    return head, await reader.read()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
