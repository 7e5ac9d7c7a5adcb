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
            [*command, "-H", HOST, "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT
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


def store_env(endpoint: str) -> dict[str, str]:
    """The standard variables that point delta-rs, obstore, pyarrow and boto3 at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "deltaq-test",
        "AWS_SECRET_ACCESS_KEY": "deltaq-test-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


def storage_options(endpoint: str) -> dict[str, str]:
    """The same, as delta-rs ``storage_options`` for reading tables from the test process."""
    return {key.lower(): value for key, value in store_env(endpoint).items()}


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

    Each request is forwarded on a fresh upstream connection and its client connection is
    closed after the answer (``Connection: close``), which keeps the proxy a few lines of
    stream copying. ``delay_s`` is added before every request; ``down`` drops every new
    request's connection unanswered; ``strip_conditional`` removes ``If-None-Match``.
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
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

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
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        if self.down:
            writer.transport.abort()
            return
        lines = head.decode("latin-1").split("\r\n")[:-2]
        headers = []
        length = 0
        for line in lines[1:]:
            name = line.split(":", 1)[0].strip().lower()
            if name == "content-length":
                length = int(line.split(":", 1)[1])
            if name == "connection" or (self.strip_conditional and name == "if-none-match"):
                continue
            headers.append(line)
        body = await reader.readexactly(length) if length else b""
        self.requests += 1
        if self.trace is not None:
            self.trace.append(lines[0])
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        request = "\r\n".join([lines[0], *headers, "Connection: close", "", ""])
        up_writer.write(request.encode("latin-1") + body)
        await up_writer.drain()
        answer = await up_reader.read()
        up_writer.close()
        writer.write(_close_after(answer))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


def _close_after(answer: bytes) -> bytes:
    """``answer`` with ``Connection: close``, so the client opens a new connection next time."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    kept = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*kept, b"Connection: close"]) + sep + body


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def environ_with(endpoint: str) -> dict[str, str]:
    return {**os.environ, **store_env(endpoint)}
