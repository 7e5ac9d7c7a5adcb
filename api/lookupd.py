"""Registration with nsqlookupd, as nsqd 1.3.0 does it (nsqd/lookup.go, lookup_peer.go), so that
NSQ consumers given only lookupd addresses find this node.

Per nsqlookupd address one TCP connection: the magic ``"  V1"``, ``IDENTIFY`` with nsqd's JSON
(version, tcp_port, http_port, hostname, broadcast_address), then ``REGISTER topic [channel]``
for every topic and channel; ``REGISTER``/``UNREGISTER`` as they are created and deleted;
``PING`` every 15 s. A connection that fails is opened again at the next ping, and everything is
registered again (nsqlookupd forgets a node's registrations when its connection closes).

Every node of a warehouse serves every topic, so each registers them all; the registry is
the source (a topic or channel created on another node is registered here within a second).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Callable

from queue_engine.registry import Registry

log = logging.getLogger(__name__)

MAGIC_V1 = b"  V1"
PING_EVERY_S = 15.0  # nsqd's lookupLoop ticker
FOLLOW_EVERY_S = 1.0  # how often the registry is compared with what was registered
TIMEOUT_S = 1.0  # nsqd's lookupPeer: dial, read and write deadlines
MAX_RESPONSE_BYTES = 5 * 1024 * 1024

Registration = tuple[str, str]  # (topic, channel); channel "" for the topic itself


def registrations(registry: Registry) -> set[Registration]:
    """What nsqd registers for its topics: each topic, and each of its channels."""
    wanted: set[Registration] = set()
    for topic in registry.topics.values():
        wanted.add((topic.name, ""))
        wanted.update((topic.name, channel) for channel in topic.channels)
    return wanted


def command(name: str, *params: str) -> bytes:
    return " ".join((name, *(p for p in params if p))).encode() + b"\n"


class LookupPeer:
    """One nsqlookupd: a connection opened on demand, identified, then sent commands one at a
    time, each answered with a size-prefixed response."""

    def __init__(self, address: str, identity: dict[str, object]) -> None:
        self.address = address
        self._identity = identity
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.registered: set[Registration] = set()
        self.failing = False

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def connect(self, wanted: set[Registration]) -> None:
        """Connect, IDENTIFY, and REGISTER everything in ``wanted`` (nsqd's connectCallback)."""
        host, _, port = self.address.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), TIMEOUT_S
        )
        self._reader, self._writer = reader, writer
        writer.write(MAGIC_V1)
        body = json.dumps(self._identity).encode()
        answer = await self._send(b"IDENTIFY\n" + struct.pack(">i", len(body)) + body)
        if answer == b"E_INVALID" or not answer.startswith(b"{"):
            raise ConnectionError(f"nsqlookupd answered IDENTIFY with {answer[:100]!r}")
        self.registered = set()
        await self.sync(wanted)
        if self.failing:
            log.info("nsqlookupd %s: connected again", self.address)
        else:
            log.info(
                "nsqlookupd %s: registered (%d topics and channels)", self.address, len(wanted)
            )
        self.failing = False

    async def sync(self, wanted: set[Registration]) -> None:
        """REGISTER what is new in ``wanted``, UNREGISTER what went (a topic's UNREGISTER takes
        its channels' registrations with it, in nsqlookupd)."""
        gone_topics = {t for t, c in self.registered - wanted if not c}
        for topic, channel in sorted(self.registered - wanted):
            if channel and topic in gone_topics:
                self.registered.discard((topic, channel))
                continue
            await self._checked(command("UNREGISTER", topic, channel))
            self.registered.discard((topic, channel))
        for topic, channel in sorted(wanted - self.registered):
            await self._checked(command("REGISTER", topic, channel))
            self.registered.add((topic, channel))

    async def ping(self) -> None:
        await self._checked(b"PING\n")

    async def _checked(self, line: bytes) -> None:
        answer = await self._send(line)
        if answer != b"OK":
            log.warning("nsqlookupd %s: %s answered %r", self.address, line.strip(), answer)

    async def _send(self, data: bytes) -> bytes:
        assert self._reader is not None and self._writer is not None
        self._writer.write(data)
        await asyncio.wait_for(self._writer.drain(), TIMEOUT_S)
        size_bytes = await asyncio.wait_for(self._reader.readexactly(4), TIMEOUT_S)
        (size,) = struct.unpack(">i", size_bytes)
        if not 0 <= size <= MAX_RESPONSE_BYTES:
            raise ConnectionError(f"response of {size} bytes")
        return await asyncio.wait_for(self._reader.readexactly(size), TIMEOUT_S)

    def failed(self, exc: BaseException) -> None:
        """Drop the connection; log the first failure of a run of them."""
        if not self.failing:
            log.warning(
                "nsqlookupd %s: %s (trying again every %.0f s)",
                self.address,
                exc or type(exc).__name__,
                PING_EVERY_S,
            )
        self.failing = True
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self.registered = set()


class LookupdRegistrar:
    """nsqd's lookupLoop: the peers of the configured addresses, kept registered."""

    def __init__(
        self, registry: Callable[[], Registry], identity: dict[str, object], addresses: list[str]
    ) -> None:
        self._registry = registry
        self._identity = identity
        self.peers: dict[str, LookupPeer] = {}
        self.set_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self.peers)

    def set_addresses(self, addresses: list[str]) -> None:
        """Keep the peers of ``addresses`` (``PUT /config/nsqlookupd_tcp_addresses``): new ones
        connect at the next round, removed ones are closed."""
        for address in list(self.peers):
            if address not in addresses:
                self.peers.pop(address).close()
                log.info("nsqlookupd %s: removed", address)
        for address in addresses:
            self.peers.setdefault(address, LookupPeer(address, self._identity))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + PING_EVERY_S
        while True:
            wanted = registrations(self._registry())
            ping = loop.time() >= next_ping
            if ping:
                next_ping = loop.time() + PING_EVERY_S
            for peer in list(self.peers.values()):
                try:
                    if not peer.connected:
                        # A new peer at once; a failed one again at the next ping (nsqd).
                        if ping or not peer.failing:
                            await peer.connect(wanted)
                        continue
                    await peer.sync(wanted)
                    if ping:
                        await peer.ping()
                except (OSError, ConnectionError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    peer.failed(exc)
            await asyncio.sleep(FOLLOW_EVERY_S)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


def identity(
    broadcast_address: str, tcp_port: int, http_port: int, version: str
) -> dict[str, object]:
    """nsqd's IDENTIFY body to nsqlookupd."""
    return {
        "version": version,
        "tcp_port": tcp_port,
        "http_port": http_port,
        "hostname": socket.gethostname(),
        "broadcast_address": broadcast_address,
        "topology_zone": "",
        "topology_region": "",
    }
