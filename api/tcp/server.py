"""The TCP listener: one ``Connection`` per client, in the API's event loop (so TCP and HTTP
consumers share each channel's queue and ledger)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from api.auth import Authenticator
from api.tcp import frames
from api.tcp.connection import Connection
from api.tcp.transport import Transport
from api.tls import server_tls_context
from queue_engine.broker import Broker

log = logging.getLogger(__name__)


class TcpServer:
    """nsqd's TCP protocol on ``settings.host``:``settings.tcp_port``."""

    def __init__(self, broker: Broker, authenticator: Authenticator | None = None) -> None:
        self.broker = broker
        self.authenticator = authenticator
        self.settings = broker.settings
        self.connections: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._tls = server_tls_context(self.settings)

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._accept,
                self.settings.host,
                self.settings.tcp_port,
                limit=2**20,
                reuse_address=True,
                # Many consumers connect at once after a restart (nsqd: the kernel's maximum).
                backlog=1024,
            )
        except OSError as exc:
            raise OSError(
                f"cannot listen for the TCP protocol on "
                f"{self.settings.host}:{self.settings.tcp_port}: {exc.strerror}"
            ) from exc
        log.info(
            "nsqd TCP protocol on %s:%d%s",
            self.settings.host,
            self.settings.tcp_port,
            " (TLS available)" if self._tls else "",
        )

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cap = self.settings.max_tcp_connections
        if cap and len(self.connections) >= cap:
            log.warning("refused a connection: %d open (max_tcp_connections)", cap)
            writer.write(frames.error(b"E_TOO_MANY_CONNECTIONS max_tcp_connections reached"))
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        connection = Connection(
            self.broker,
            Transport(reader, writer),
            tls_context=self._tls,
            on_closed=self.connections.discard,
            authenticator=self.authenticator,
        )
        self.connections.add(connection)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await connection.run()

    async def close(self) -> None:
        """Stop listening and close every client (their messages in flight are requeued)."""
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(c.close() for c in list(self.connections)), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()
