"""NSQ's TCP protocol at the byte level for tests, and the reference nsqd 1.3.0 as a fixture."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import HOST, ROOT, free_port

NSQ_TOOLS = ROOT.parent / "shared" / "tools" / "nsq-1.3.0"
# Where NSQ's tools are built with Go when NSQ_TOOLS is absent (once per machine).
BUILT_TOOLS = Path.home() / ".cache" / "deltaq" / "nsq-1.3.0"
# ``go install ...@v1.3.0`` also asks the proxy for the module's version list (for
# deprecations), which a proxy mirror may refuse: a module requiring that version is built
# instead.
_GO_MOD = "module deltaq_nsq_tools\n\ngo 1.21\n\nrequire github.com/nsqio/nsq v1.3.0\n"

RESPONSE, ERROR, MESSAGE = 0, 1, 2


def tool(name: str) -> Path:
    """NSQ 1.3.0's ``name`` (nsqd, nsqlookupd, nsq_tail, ...): the workplace's build in
    ../shared, else built here once with Go from the Go module proxy. The test skips, saying
    why, only where neither is at hand and Go is not installed; with Go installed a build that
    fails fails the test, with the compiler's output."""
    path = NSQ_TOOLS / name
    if path.is_file():
        return path
    built = BUILT_TOOLS / name
    if built.is_file():
        return built
    go = shutil.which("go")
    if go is None:
        pytest.skip(f"NSQ 1.3.0's {name} is not at {NSQ_TOOLS} and Go is not installed")
    BUILT_TOOLS.mkdir(parents=True, exist_ok=True)
    # One build at a time across test workers; the others then find the binary.
    with open(BUILT_TOOLS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.is_file():
            module = BUILT_TOOLS / "module"
            module.mkdir(exist_ok=True)
            (module / "go.mod").write_text(_GO_MOD)
            result = subprocess.run(
                [go, "build", "-o", str(built), f"github.com/nsqio/nsq/apps/{name}"],
                cwd=module,
                env={**os.environ, "GOFLAGS": "-mod=mod"},
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            if result.returncode != 0:
                # Go is here, so the tool can be had: a failed build is a failure (a module
                # proxy out of reach included), not a reason to skip.
                pytest.fail(
                    f"building NSQ 1.3.0's {name} with Go failed "
                    f"(exit {result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-4000:]}",
                    pytrace=False,
                )
    return built


def sized(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def mpub_body(bodies: list[bytes]) -> bytes:
    payload = struct.pack(">i", len(bodies)) + b"".join(sized(b) for b in bodies)
    return sized(payload)


def identify(**fields: object) -> bytes:
    return b"IDENTIFY\n" + sized(json.dumps(fields).encode())


@dataclass(frozen=True)
class Message:
    timestamp_ns: int
    attempts: int
    id: bytes
    body: bytes


def parse_message(data: bytes) -> Message:
    timestamp, attempts = struct.unpack(">qH", data[:10])
    return Message(timestamp, attempts, data[10:26], data[26:])


class Wire:
    """A raw V2 client: bytes out, frames in."""

    def __init__(
        self,
        port: int,
        *,
        magic: bytes | None = b"  V2",
        timeout_s: float = 10,
        receive_buffer: int | None = None,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            # Before connecting, so the window the server may fill is this small.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(timeout_s)
        self.sock.connect((HOST, port))
        self.timeout_s = timeout_s
        if magic:
            self.send(magic)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            try:
                chunk = self.sock.recv(size - len(data))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def frame(self, timeout_s: float | None = None) -> tuple[int, bytes] | None:
        """The next frame, or None once the server closed the connection."""
        self.sock.settimeout(timeout_s or self.timeout_s)
        header = self._read(8)
        if header is None:
            return None
        size, frame_type = struct.unpack(">ii", header)
        data = self._read(size - 4)
        return None if data is None else (frame_type, data)

    def frame_skipping_heartbeats(self, timeout_s: float | None = None) -> tuple[int, bytes] | None:
        while True:
            got = self.frame(timeout_s)
            if got != (RESPONSE, b"_heartbeat_"):
                return got
            self.send(b"NOP\n")

    def message(self, timeout_s: float | None = None) -> Message:
        got = self.frame_skipping_heartbeats(timeout_s)
        assert got is not None and got[0] == MESSAGE, got
        return parse_message(got[1])

    def closed(self, timeout_s: float = 5) -> bool:
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


@dataclass
class Nsqd:
    """The reference nsqd, on loopback ports of its own."""

    data_path: Path
    tcp_port: int = 0
    http_port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> Nsqd:
        self.tcp_port, self.http_port = free_port(), free_port()
        self.data_path.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                str(tool("nsqd")),
                f"--tcp-address={HOST}:{self.tcp_port}",
                f"--http-address={HOST}:{self.http_port}",
                f"--data-path={self.data_path}",
                "--log-level=warn",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                ping = httpx.get(f"http://{HOST}:{self.http_port}/ping", timeout=1)
                # 403: up, refusing plain HTTP (--tls-required=true).
                if ping.text == "OK" or ping.status_code == 403:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError("nsqd did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def run_nsqd(tmp: Path, *extra: str) -> Iterator[Nsqd]:
    nsqd = Nsqd(tmp / "nsqd").start(*extra)
    try:
        yield nsqd
    finally:
        nsqd.stop()
