"""Run the API under uvicorn (uvloop + httptools when installed)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import uvicorn

from api.app import create_app, with_fast_path
from api.tls import https_listener, refuse_plain_http, server_tls_context, tls_required
from queue_engine.ports import Listener, check_ports, listeners
from queue_engine.process_memory import choose_arrow_pool, tune_malloc
from queue_engine.settings import Settings, TlsRequired
from queue_engine.store.coordination import Node

log = logging.getLogger(__name__)


# The commit threads release the GIL inside delta-rs but must win it back several times per
# commit; with CPython's default 5 ms switch interval a busy event loop makes each commit wait
# for it (measured: 60 commits 1.45 s next to a busy thread at 5 ms, 0.58 s at 0.5 ms).
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(
    settings: Settings,
    on_started: Callable[[], None] | None = None,
    *,
    jobs_status: Callable[[], dict[str, object]] | None = None,
    before_serving: Callable[[], None] | None = None,
    also_listening: Sequence[Listener] = (),
    server_log_level: str = "info",
) -> None:
    """Serve until SIGINT/SIGTERM; pending publishes are committed before exit.
    ``on_started`` is called once the server listens. ``also_listening``: ports that
    ``before_serving`` starts something on, checked with the API's own before anything."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    tune_malloc()
    choose_arrow_pool()
    # Ports first: a busy one is one line, before this process joins or starts anything.
    https = https_listener(settings)
    secure = [Listener("HTTPS", https[0], https[1], "https_address")] if https else []
    check_ports([*listeners(settings), *secure, *also_listening])
    # Before anything is opened: join the warehouse's nodes (a lane; refused when all are held).
    node = Node(
        settings.warehouse,
        node_url(settings),
        f"{advertised_host(settings)}:{settings.tcp_port}" if settings.tcp_port else None,
        lease_s=settings.store_lease_s,
        # Lost on an object store (not renewed in time, or taken): stop serving, gracefully.
        on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),
    )
    node.join()
    try:
        if before_serving is not None:
            before_serving()
        _serve(settings, node, on_started, jobs_status, server_log_level)
    finally:
        node.leave()


def advertised_host(settings: Settings) -> str:
    """The host other nodes and clients reach this API at."""
    if settings.broadcast_address:
        return settings.broadcast_address
    if settings.host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return settings.host


def node_url(settings: Settings) -> str:
    """This API's base URL, where other nodes redirect its channels' consumers."""
    host = advertised_host(settings)
    host = f"[{host}]" if ":" in host else host
    https = https_listener(settings)
    if https is not None and tls_required(settings) is TlsRequired.TRUE:
        return f"https://{host}:{https[1]}"  # plain HTTP refuses everything there
    return f"http://{host}:{settings.port}"


def _serve(
    settings: Settings,
    node: Node,
    on_started: Callable[[], None] | None,
    jobs_status: Callable[[], dict[str, object]] | None,
    server_log_level: str,
) -> None:
    app = create_app(settings, node)
    app.state.jobs_status = jobs_status
    if not app.state.authenticator.enabled and not is_loopback(settings.host):
        message = (
            f"listening on {settings.host} without authentication: anyone who reaches it can "
            "publish, consume and delete (set auth_tokens_file or auth_http_address)"
        )
        log.warning(message)
    served = with_fast_path(app, settings)
    https = https_listener(settings)
    plain: Any = served
    if https is not None and tls_required(settings) is TlsRequired.TRUE:
        plain = refuse_plain_http(served, https[1])
    common: dict[str, Any] = {
        "loop": "auto",
        "http": "auto",
        "access_log": False,
        "log_level": server_log_level,
        # Long-polling consumers and bursty producers keep connections; so do we.
        "timeout_keep_alive": 75,
        # uvicorn counts the connection asking among the open ones: with a limit of N, N - 1
        # others open already turn it away. max_http_connections are open, one more is not.
        "limit_concurrency": (settings.max_http_connections + 1)
        if settings.max_http_connections
        else None,
    }
    main = _Server(
        uvicorn.Config(plain, host=settings.host, port=settings.port, **common),
        app.state,
        on_started,
    )
    secure = None
    context = server_tls_context(settings)
    if https is not None and context is not None:
        secure = _HttpsServer(
            uvicorn.Config(
                served,
                host=https[0],
                port=https[1],
                # The app's lifespan (the broker) runs once, with the plain server.
                lifespan="off",
                ssl_context_factory=lambda config, default: context,
                **common,
            )
        )
    log.info(
        "deltaq API on http://%s:%d%s, warehouse %s",
        settings.host,
        settings.port,
        f" and https://{https[0]}:{https[1]}" if https is not None else "",
        settings.warehouse,
    )
    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(_serve_both(main, secure))


async def _serve_both(main: _Server, secure: _HttpsServer | None) -> None:
    """The plain server (it runs the app's lifespan and owns the signals), and once it has
    started, HTTPS beside it on the same event loop; HTTPS stops when the plain one does."""
    # HTTPS listens from the start (checked free before): a client that connects as soon as
    # plain HTTP answers waits in the backlog for a moment instead of being refused.
    early = _listening(secure.config) if secure is not None else None
    serving = asyncio.create_task(main.serve())
    if secure is None or early is None:
        await serving
        return
    while not main.started and not serving.done():
        await asyncio.sleep(0.02)
    secure_serving = asyncio.create_task(secure.serve([early])) if main.started else None
    if secure_serving is None:
        early.close()
    try:
        await serving
    finally:
        if secure_serving is not None:
            secure.should_exit = True
            await secure_serving


def _listening(config: uvicorn.Config) -> socket.socket:
    """A socket bound and listening on ``config``'s address, for uvicorn to serve later."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(config.backlog)
    sock.set_inheritable(True)
    return sock


# Allocations between young-generation collections (CPython's default: 700). The serving path
# allocates a few short-lived tuples per message; at tens of thousands of messages a second the
# default collects hundreds of times a second.
GC_YOUNG_THRESHOLD = 10_000


def settle_garbage_collector() -> None:
    """Once started: what startup built (modules, the app, restored channels) is moved out of
    the collector's generations, so full collections no longer walk it. Measured consuming a
    backlog over TCP: the collector took 70-150 ms of every second, 20-30 ms once frozen."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _HttpsServer(uvicorn.Server):
    """The HTTPS listener: the plain server's signal handlers stop both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Server(uvicorn.Server):
    """uvicorn waits for open requests before shutting down; a long-polling SUB may wait a
    minute, so on SIGINT/SIGTERM waiting SUBs are answered first (with no messages)."""

    def __init__(
        self, config: uvicorn.Config, state: object, on_started: Callable[[], None] | None
    ) -> None:
        super().__init__(config)
        self._state = state
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            settle_garbage_collector()
        if self.started and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        broker = getattr(self._state, "broker", None)
        if broker is not None:
            broker.stop_waiting()
        super().handle_exit(sig, frame)
