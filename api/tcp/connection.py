"""One V2 protocol client: its commands (nsqd's protocol_v2.go, error for error) and, once
subscribed, the pump that pushes messages while it has RDY to spare.

Deliveries go through the channel's ``ChannelRuntime`` like an HTTP ``/sub``: a DELIVER is in
the ledger before its message frame is written. FIN, REQ and TOUCH change the queue at once
and are handed to the ledger writer in command order; the protocol answers them with nothing,
so a failed commit comes back as an error frame. A REQ'd message can be delivered again only
through a later DELIVER in the same ledger, which is committed after the REQ.

When a client disconnects, its in-flight messages are requeued at once (a REQ recorded as
this client's), not left to time out as nsqd does: the next consumer gets them without
waiting msg_timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from api.auth import Authenticator, AuthUnavailable
from api.tcp import frames
from api.tcp.client import Client, State
from api.tcp.frames import ClientError, FatalClientError
from api.tcp.identify import identify
from api.tcp.transport import Closed, Transport
from api.tls import tls_required
from queue_engine.auth import Identity, Role
from queue_engine.broker import Broker
from queue_engine.channel import ChannelRuntime
from queue_engine.channel_queue import Answer, Delivery, SettleError
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.lease import EventKind
from queue_engine.names import is_valid_name
from queue_engine.settings import TlsRequired

log = logging.getLogger(__name__)


# How long the pump waits on a channel before looking at its client again (RDY, closing).
PUMP_WAIT_S = 1.0
# "FIN " and a 16-byte message id.
_FIN_LINE = 4 + frames.MESSAGE_ID_BYTES
_INT64 = 2**63


@dataclass
class _Publishing:
    """A publish under way: its command, and the future done once it is acknowledged."""

    command: str
    acknowledged: asyncio.Future[None]

    async def answer(self) -> bytes:
        try:
            await self.acknowledged
        except QueueError as exc:
            raise FatalClientError(
                f"E_{self.command}_FAILED", f"{self.command} failed {exc}"
            ) from exc
        return frames.OK


# What a command answers: a response frame's data, nothing, or (a publish) its answer to come.
Reply = bytes | None | _Publishing


def _ignore_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def go_quote(data: bytes) -> str:
    """Go's %q of a string (how nsqd names a bad topic in its errors)."""
    out = ['"']
    text = data.decode("utf-8", errors="surrogateescape")
    escapes = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    escapes |= {"\v": "\\v", '"': '\\"', "\\": "\\\\"}
    for char in text:
        code = ord(char)
        if char in escapes:
            out.append(escapes[char])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif not char.isprintable() and code > 0x7F:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def base10(data: bytes) -> int | None:
    """nsqd's ByteToBase10: digits only (an empty string is 0), as a Go int64 (wrapping)."""
    if not all(48 <= b <= 57 for b in data):
        return None
    number = int(data) if data else 0
    number %= 2**64
    return number - 2**64 if number >= _INT64 else number


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class Connection:
    """One client of the TCP protocol, from its magic to its last frame."""

    def __init__(
        self,
        broker: Broker,
        transport: Transport,
        *,
        tls_context: ssl.SSLContext | None,
        on_closed: Callable[[Connection], None],
        authenticator: Authenticator | None = None,
    ) -> None:
        self.broker = broker
        self.settings = broker.settings
        self.transport = transport
        self.tls_context = tls_context
        self._tls_required = tls_required(self.settings) is not TlsRequired.FALSE
        self._on_closed = on_closed
        self.authenticator = authenticator if authenticator and authenticator.enabled else None
        self.client = Client(transport.peer, self.settings.msg_timeout_ms)
        self._ready_changed = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed = False
        # Publishes under way, in the order their commands came (pipelining).
        self._publishing: list[_Publishing] = []
        self._commands: dict[bytes, Callable[[list[bytes]], Awaitable[Reply]]] = {
            b"IDENTIFY": self._identify,
            b"FIN": self._fin,
            b"RDY": self._rdy,
            b"REQ": self._req,
            b"PUB": self._pub,
            b"MPUB": self._mpub,
            b"DPUB": self._dpub,
            b"NOP": self._nop,
            b"TOUCH": self._touch,
            b"SUB": self._sub,
            b"CLS": self._cls,
            b"AUTH": self._auth,
        }

    # -- the connection's life ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            self._set_timeouts()
            self.transport.start_command()
            magic = await self.transport.readexactly(4)
            if magic != frames.MAGIC_V2:
                self.transport.write(frames.error(b"E_BAD_PROTOCOL"))
                await self.transport.flush()
                return
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
            await self._io_loop()
        except Closed as exc:
            log.debug("%s: %s", self.client.name, exc)
        except Exception:
            log.exception("%s: connection failed", self.client.name)
        finally:
            await self.close()

    async def _io_loop(self) -> None:
        transport = self.transport
        # FINs that arrived together are applied and committed as one batch (a consumer at
        # RDY 200 sends them in bursts); any other command first settles the batch before it,
        # so commands still take effect in the order they were sent. Publishes that arrived
        # together are under way together (one journal write carries them all); their answers
        # go out in order before any later answer.
        fins: list[bytes] = []
        while not self._closed:
            transport.start_command()
            line: bytes | None = await transport.readline()
            while line is not None:
                if len(line) == _FIN_LINE and line.startswith(b"FIN ") and self.client.can_answer():
                    fins.append(line[4:])
                    fins += transport.buffered_alike(b"FIN ", _FIN_LINE)
                else:
                    if fins:
                        await self._finish(fins)
                        fins = []
                    if not await self._execute(line):
                        await transport.flush()
                        return
                # Commands that arrived together are answered with one write.
                line = transport.buffered_line()
            if fins:
                await self._finish(fins)
                fins = []
            if not await self._answer_publishes():
                await transport.flush()
                return
            await transport.flush()

    async def _execute(self, line: bytes) -> bool:
        """Run one command and queue its answer; False when the connection must close."""
        params = line.split(b" ")
        try:
            if self._tls_required and params[0] != b"IDENTIFY" and not self.transport.tls:
                # nsqd's enforceTLSPolicy: before the command is even looked up.
                raise FatalClientError(
                    "E_INVALID", f"cannot {_text(params[0])} in current state (TLS required)"
                )
            handler = self._commands.get(params[0])
            if handler is None:
                raise FatalClientError("E_INVALID", f"invalid command {_text(params[0])}")
            answer = await handler(params)
        except ClientError as exc:
            if not await self._answer_publishes():
                return False
            log.info("%s: %s", self.client.name, exc)
            self.transport.write(frames.error(exc.frame_data))
            return not exc.fatal
        if isinstance(answer, _Publishing):
            self._publishing.append(answer)
            return True
        if not await self._answer_publishes():
            return False
        if answer is not None:
            self.transport.write(frames.response(answer))
        return True

    async def _answer_publishes(self) -> bool:
        """Queue the answers of the publishes under way, in order; False (after the error)
        when one failed: as nsqd, a failed publish closes the connection."""
        publishing, self._publishing = self._publishing, []
        for n, publish in enumerate(publishing):
            try:
                answer = await publish.answer()
            except ClientError as exc:
                log.info("%s: %s", self.client.name, exc)
                self.transport.write(frames.error(exc.frame_data))
                for later in publishing[n + 1 :]:
                    # Their outcome goes unread: the connection closes.
                    later.acknowledged.add_done_callback(_ignore_outcome)
                return False
            self.transport.write(frames.response(answer))
        return True

    def _set_timeouts(self) -> None:
        """nsqd's deadlines: a read within two heartbeats, a write within one."""
        interval = self.client.options.heartbeat_interval_ms / 1000
        self.transport.read_timeout_s = 2 * interval if interval > 0 else None
        self.transport.write_timeout_s = interval if interval > 0 else None

    async def _beat(self) -> None:
        with contextlib.suppress(Closed):
            while not self._closed:
                interval = self.client.options.heartbeat_interval_ms / 1000
                if interval <= 0:
                    return
                await asyncio.sleep(interval)
                self.transport.write(frames.response(frames.HEARTBEAT))
                await self.transport.flush()

    async def close(self) -> None:
        """Stop pushing, requeue what this client holds, close the socket."""
        if self._closed:
            return
        self._closed = True
        self._ready_changed.set()
        for publish in self._publishing:
            # Publishes under way finish (acknowledged or not) with no one to answer.
            publish.acknowledged.add_done_callback(_ignore_outcome)
        self._publishing = []
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._pump is not None and self.client.runtime is not None:
            await self.client.runtime.wake()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._pump), PUMP_WAIT_S * 3)
            self._pump.cancel()
        await self._requeue_held()
        await self.transport.close()
        self._on_closed(self)

    async def _requeue_held(self) -> None:
        runtime = self.client.runtime
        held = self.client.take_held()
        if runtime is None or not held:
            return
        try:
            await runtime.answer(EventKind.REQ, held)
            log.info("%s: requeued %d messages it held", self.client.name, len(held))
        except (QueueError, SettleError) as exc:
            log.warning("%s: could not requeue %d messages: %s", self.client.name, len(held), exc)

    def _wanted(self) -> int:
        """How many more messages this client may have in flight now (0: none)."""
        return 0 if self._closed else self.client.wanted()

    # -- pushing messages ---------------------------------------------------------------------

    async def _run_pump(self, runtime: ChannelRuntime) -> None:
        lease_us = self.client.options.msg_timeout_ms * 1000
        try:
            while not self._closed:
                if runtime.closed:
                    # Serving other shares now: carry on with the runtime that serves them.
                    # Else the channel was deleted (or the server is stopping): nsqd closes
                    # its clients.
                    successor = await self.client.follow_hand_on()
                    if successor is None or self._closed:
                        self.transport.abort()
                        return
                    runtime = successor
                    continue
                if self._wanted() <= 0:
                    self._ready_changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._ready_changed.wait(), PUMP_WAIT_S)
                    self.client.forget_ended()
                    continue
                # Frames leave before their DELIVER commit (it follows within the ledger's
                # linger): the leases end with this connection anyway (close() requeues them).
                deliveries = await runtime.sub(
                    self._wanted, PUMP_WAIT_S, lease_us, self.client.name, durable=False
                )
                if deliveries:
                    await self._push(runtime, deliveries)
        except (Closed, QueueError, TimeoutError) as exc:
            log.info("%s: stops receiving: %s", self.client.name, exc)
            self.transport.abort()

    async def _push(self, runtime: ChannelRuntime, deliveries: list[Delivery]) -> None:
        in_flight = self.client.in_flight
        for delivery in deliveries:
            in_flight[delivery.id] = delivery.lease
        if self._closed:
            return  # close() requeues them
        sample_rate = self.client.options.sample_rate
        if sample_rate:
            # nsqd drops the messages a sampling client does not get; deltaq finishes them.
            dropped = [d for d in deliveries if random.randrange(100) > sample_rate]
            if dropped:
                for delivery in dropped:
                    del in_flight[delivery.id]
                dropped_ids = {d.id for d in dropped}
                deliveries = [d for d in deliveries if d.id not in dropped_ids]
                await runtime.answer(EventKind.FIN, [Answer(d.id, d.lease) for d in dropped])
        self.transport.write(frames.messages(deliveries))
        await self.transport.flush()

    # -- commands -----------------------------------------------------------------------------

    async def _nop(self, params: list[bytes]) -> bytes | None:
        return None

    async def _read_body(self, command: str, code: str, what: str, limit: int) -> bytes:
        """A length-prefixed body with nsqd's checks (``what``: "body" or "message body")."""
        try:
            size = frames.read_length(await self.transport.readexactly(4))
        except Closed as exc:
            raise FatalClientError(code, f"{command} failed to read {what} size") from exc
        if command in ("IDENTIFY", "AUTH", "MPUB"):
            if size > limit:
                raise FatalClientError(code, f"{command} body too big {size} > {limit}")
            if size <= 0:
                raise FatalClientError(code, f"{command} invalid {what} size {size}")
        else:
            if size <= 0:
                raise FatalClientError(code, f"{command} invalid {what} size {size}")
            if size > limit:
                raise FatalClientError(code, f"{command} message too big {size} > {limit}")
        try:
            return await self.transport.readexactly(size)
        except Closed as exc:
            raise FatalClientError(code, f"{command} failed to read {what}") from exc

    async def _identify(self, params: list[bytes]) -> bytes | None:
        if self.client.state is not State.INIT:
            raise FatalClientError("E_INVALID", "cannot IDENTIFY in current state")
        body = await self._read_body(
            "IDENTIFY", "E_BAD_BODY", "body", self.settings.max_body_size_bytes
        )
        negotiated = identify(
            self.client.options,
            body,
            self.settings,
            tls_available=self.tls_context is not None,
            auth_required=self.authenticator is not None,
        )
        self._set_timeouts()
        if self.client.options.client_id:
            self.client.name = f"{self.client.options.client_id}@{self.transport.peer}"
        if negotiated.answer is None:
            return frames.OK
        transport = self.transport
        if negotiated.tls:
            transport.hold_reads()
        transport.write(frames.response(negotiated.answer))
        await transport.flush()
        try:
            if negotiated.tls:
                assert self.tls_context is not None
                log.info("%s: upgrading connection to TLS", self.client.name)
                await transport.start_tls(self.tls_context)
                transport.write(frames.response(frames.OK))
                await transport.flush()
            if negotiated.snappy:
                log.info("%s: upgrading connection to snappy", self.client.name)
                transport.start_snappy()
                transport.write(frames.response(frames.OK))
                await transport.flush()
            if negotiated.deflate:
                log.info("%s: upgrading connection to deflate", self.client.name)
                transport.start_deflate(negotiated.deflate_level)
                transport.write(frames.response(frames.OK))
                await transport.flush()
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            raise FatalClientError("E_IDENTIFY_FAILED", f"IDENTIFY failed {exc}") from exc
        return None

    async def _auth(self, params: list[bytes]) -> bytes | None:
        if self.client.state is not State.INIT:
            raise FatalClientError("E_INVALID", "cannot AUTH in current state")
        if len(params) != 1:
            raise FatalClientError("E_INVALID", "AUTH invalid number of parameters")
        secret = await self._read_body(
            "AUTH", "E_BAD_BODY", "body", self.settings.max_body_size_bytes
        )
        if self.client.identity is not None:
            raise FatalClientError("E_INVALID", "AUTH already set")
        if self.authenticator is None:
            # No tokens file and no auth server: as nsqd without --auth-http-address.
            raise FatalClientError("E_AUTH_DISABLED", "AUTH disabled")
        self.client.secret = secret.decode("utf-8", errors="replace")
        identity = await self._identify_secret()
        if identity is None:
            raise FatalClientError("E_AUTH_FAILED", "AUTH failed")
        if not identity.grants:
            raise FatalClientError("E_UNAUTHORIZED", "AUTH no authorizations found")
        self.client.identity = identity
        return json.dumps(
            {
                "identity": identity.name,
                "identity_url": identity.url,
                "permission_count": len(identity.grants),
            },
            separators=(",", ":"),
        ).encode()

    async def _identify_secret(self) -> Identity | None:
        assert self.authenticator is not None
        try:
            return await self.authenticator.identify(
                self.client.secret, self.transport.peer_ip, self.transport.tls
            )
        except AuthUnavailable as exc:
            # As nsqd: the client is not told why.
            log.warning("%s: AUTH failed: %s", self.client.name, exc)
            raise FatalClientError("E_AUTH_FAILED", "AUTH failed") from exc

    async def _check_auth(self, command: str, topic: str, channel: str | None) -> None:
        """nsqd's CheckAuth: with authentication on, AUTH first, then the grant for this
        topic (and channel); an identity whose TTL ran out is asked for again."""
        if self.authenticator is None:
            return
        if self.client.identity is None:
            raise FatalClientError("E_AUTH_FIRST", f"AUTH required before {command}")
        if self.client.identity.expired:
            identity = await self._identify_secret()
            if identity is None:
                raise FatalClientError("E_AUTH_FAILED", "AUTH failed")
            self.client.identity = identity
        role = Role.PUBLISH if channel is None else Role.CONSUME
        if not self.client.identity.allows(role, topic, channel):
            raise FatalClientError(
                "E_UNAUTHORIZED",
                f"AUTH failed for {command} on {go_quote(topic.encode())} "
                f"{go_quote((channel or '').encode())}",
            )

    async def _sub(self, params: list[bytes]) -> bytes | None:
        if self.client.state is not State.INIT:
            raise FatalClientError("E_INVALID", "cannot SUB in current state")
        if self.client.options.heartbeat_interval_ms <= 0:
            raise FatalClientError("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise FatalClientError("E_INVALID", "SUB insufficient number of parameters")
        topic, channel = _text(params[1]), _text(params[2])
        if not is_valid_name(topic) or topic.encode() != params[1]:
            raise FatalClientError(
                "E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid"
            )
        if not is_valid_name(channel) or channel.encode() != params[2]:
            raise FatalClientError(
                "E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid"
            )
        await self._check_auth("SUB", topic, channel)
        try:
            runtime = await self.broker.open_channel(topic, channel)
        except QueueError as exc:
            raise FatalClientError("E_SUB_FAILED", f"SUB failed {exc}") from exc
        self.client.subscribe(runtime)
        self._pump = asyncio.get_running_loop().create_task(self._run_pump(runtime))
        return frames.OK

    async def _rdy(self, params: list[bytes]) -> bytes | None:
        if self.client.state is State.CLOSING:
            return None  # nsqd ignores RDY after CLS
        if self.client.state is not State.SUBSCRIBED:
            raise FatalClientError("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            parsed = base10(params[1])
            if parsed is None:
                raise FatalClientError("E_INVALID", f"RDY could not parse count {_text(params[1])}")
            count = parsed
        if count < 0 or count > self.settings.max_rdy_count:
            # Fatal, as in nsqd: the client's idea of its RDY would be wrong otherwise.
            raise FatalClientError(
                "E_INVALID", f"RDY count {count} out of range 0-{self.settings.max_rdy_count}"
            )
        self.client.ready_count = count
        self._ready_changed.set()
        if self.client.runtime is not None and count > 0:
            await self.client.runtime.wake()
        return None

    def _held(self, command: str, params: list[bytes], least: int) -> tuple[str, str]:
        """The message id a FIN/REQ/TOUCH names and this client's lease on it."""
        if not self.client.can_answer():
            raise FatalClientError("E_INVALID", f"cannot {command} in current state")
        if len(params) < least:
            raise FatalClientError("E_INVALID", f"{command} insufficient number of params")
        raw = params[1]
        if len(raw) != frames.MESSAGE_ID_BYTES:
            raise FatalClientError("E_INVALID", "invalid message ID")
        message_id = raw.decode("latin-1")
        lease = self.client.in_flight.get(message_id)
        if lease is None:
            raise ClientError(
                f"E_{command}_FAILED",
                f"{command} {message_id} failed {self.client.why_not(message_id)}",
            )
        return message_id, lease

    async def _finish(self, raw_ids: list[bytes]) -> None:
        """FIN of each id (16 bytes each, the client subscribed): one ledger submission for
        all; those this client does not hold get nsqd's E_FIN_FAILED, in order."""
        answers: list[tuple[str, str]] = []
        in_flight = self.client.in_flight
        for raw in raw_ids:
            message_id = raw.decode("latin-1")
            lease = in_flight.pop(message_id, None)
            if lease is None:
                why = self.client.why_not(message_id)
                self.transport.write(
                    frames.error(f"E_FIN_FAILED FIN {message_id} failed {why}".encode())
                )
            else:
                # A plain tuple (an Answer's fields): one is built per message consumed.
                answers.append((message_id, lease))
        await self._settle_all("FIN", EventKind.FIN, answers)
        self._ready_changed.set()

    async def _settle_all(
        self, command: str, kind: EventKind, answers: list[tuple[str, str]], *, delay_us: int = 0
    ) -> list[str]:
        """Settle ``answers`` in one ledger submission; returns the ids refused (not in flight
        under that lease any more: their error frames are written)."""
        # If the channel's shares are changing here, the runtime that follows has these leases
        # (restored from the ledger); a closed one with none refuses them below.
        try:
            runtime = await self.client.follow_hand_on() or self.client.runtime
        except TimeoutError:
            runtime = self.client.runtime
        assert runtime is not None
        refused: list[str] = []
        while answers:
            try:
                committed = runtime.answer(
                    kind,
                    answers,
                    delay_us=delay_us,
                    lease_us=self.client.options.msg_timeout_ms * 1000,
                    lazy=True,
                )
            except SettleError as exc:
                failed = set(exc.failed)
                refused.extend(exc.failed)
                answers = [a for a in answers if a[0] not in failed]
                continue
            except QueueError as exc:
                refused.extend(a[0] for a in answers)
                for message_id, _ in answers:
                    self._failed(command, message_id, str(exc))
                return refused
            if isinstance(committed, asyncio.Future):
                committed.add_done_callback(
                    partial(self._after_commit, command=command, answers=answers)
                )
            break
        for message_id in refused:
            self._failed(command, message_id, "ID not in flight")
        return refused

    def _failed(self, command: str, message_id: str, why: str) -> None:
        self.client.in_flight.pop(message_id, None)
        self.transport.write(
            frames.error(f"E_{command}_FAILED {command} {message_id} failed {why}".encode())
        )

    def _after_commit(
        self, future: asyncio.Future[None], *, command: str, answers: list[tuple[str, str]]
    ) -> None:
        """FIN/REQ/TOUCHes whose ledger commit failed: the client hears nsqd's error."""
        error = None if future.cancelled() else future.exception()
        if error is None or self._closed:
            return
        for message_id, _ in answers:
            self._failed(command, message_id, str(error))
        asyncio.get_running_loop().create_task(self._flush_quietly())

    async def _flush_quietly(self) -> None:
        with contextlib.suppress(Closed):
            await self.transport.flush()

    async def _fin(self, params: list[bytes]) -> bytes | None:
        message_id, lease = self._held("FIN", params, 2)
        del self.client.in_flight[message_id]
        await self._settle_all("FIN", EventKind.FIN, [Answer(message_id, lease)])
        self._ready_changed.set()
        return None

    async def _req(self, params: list[bytes]) -> bytes | None:
        if not self.client.can_answer():
            raise FatalClientError("E_INVALID", "cannot REQ in current state")
        if len(params) < 3:
            raise FatalClientError("E_INVALID", "REQ insufficient number of params")
        if len(params[1]) != frames.MESSAGE_ID_BYTES:
            raise FatalClientError("E_INVALID", "invalid message ID")
        timeout_ms = base10(params[2])
        if timeout_ms is None:
            raise FatalClientError("E_INVALID", f"REQ could not parse timeout {_text(params[2])}")
        # nsqd clamps the delay to 0..max_req_timeout rather than refusing it.
        delay_ms = min(max(timeout_ms, 0), self.settings.max_req_timeout_ms)
        message_id, lease = self._held("REQ", params, 3)
        del self.client.in_flight[message_id]
        await self._settle_all(
            "REQ", EventKind.REQ, [Answer(message_id, lease)], delay_us=delay_ms * 1000
        )
        self._ready_changed.set()
        return None

    async def _touch(self, params: list[bytes]) -> bytes | None:
        message_id, lease = self._held("TOUCH", params, 2)
        await self._settle_all("TOUCH", EventKind.TOUCH, [Answer(message_id, lease)])
        return None

    async def _cls(self, params: list[bytes]) -> bytes | None:
        if self.client.state is not State.SUBSCRIBED:
            raise FatalClientError("E_INVALID", "cannot CLS in current state")
        self.client.ready_count = 0
        self.client.state = State.CLOSING
        return frames.CLOSE_WAIT

    # -- publishing ---------------------------------------------------------------------------

    def _topic(self, command: str, raw: bytes, prefix: str = "") -> str:
        topic = _text(raw)
        if not is_valid_name(topic) or topic.encode() != raw:
            raise FatalClientError(
                "E_BAD_TOPIC", f"{prefix}{command} topic name {go_quote(raw)} is not valid"
            )
        return topic

    async def _publish(
        self, command: str, topic: str, bodies: list[bytes], defer_ms: int | None = None
    ) -> _Publishing:
        """Start the publish; its answer comes once it is acknowledged (``_answer_publishes``).
        Publishes are taken in the order their commands came."""
        try:
            return _Publishing(command, await self.broker.start_publish(topic, bodies, defer_ms))
        except QueueError as exc:
            if exc.code is ErrorCode.INVALID_BODY:  # a typed topic's body that does not fit
                raise FatalClientError("E_BAD_MESSAGE", f"{command} {exc.detail}") from exc
            raise FatalClientError(f"E_{command}_FAILED", f"{command} failed {exc}") from exc

    async def _pub(self, params: list[bytes]) -> Reply:
        if len(params) < 2:
            raise FatalClientError("E_INVALID", "PUB insufficient number of parameters")
        topic = self._topic("PUB", params[1])
        body = await self._read_body(
            "PUB", "E_BAD_MESSAGE", "message body", self.settings.max_msg_size_bytes
        )
        await self._check_auth("PUB", topic, None)
        return await self._publish("PUB", topic, [body])

    async def _dpub(self, params: list[bytes]) -> Reply:
        if len(params) < 3:
            raise FatalClientError("E_INVALID", "DPUB insufficient number of parameters")
        topic = self._topic("DPUB", params[1])
        timeout_ms = base10(params[2])
        if timeout_ms is None:
            raise FatalClientError("E_INVALID", f"DPUB could not parse timeout {_text(params[2])}")
        max_ms = self.settings.max_req_timeout_ms
        if not 0 <= timeout_ms <= max_ms:
            raise FatalClientError(
                "E_INVALID", f"DPUB timeout {timeout_ms % 2**64} out of range 0-{max_ms}"
            )
        body = await self._read_body(
            "DPUB", "E_BAD_MESSAGE", "message body", self.settings.max_msg_size_bytes
        )
        await self._check_auth("DPUB", topic, None)
        return await self._publish("DPUB", topic, [body], timeout_ms or None)

    async def _mpub(self, params: list[bytes]) -> Reply:
        if len(params) < 2:
            raise FatalClientError("E_INVALID", "MPUB insufficient number of parameters")
        # nsqd's MPUB error repeats its code in the text.
        topic = self._topic("MPUB", params[1], prefix="E_BAD_TOPIC ")
        await self._check_auth("MPUB", topic, None)
        # nsqd creates the topic before it reads the body.
        try:
            await self.broker.create_topic(topic)
        except QueueError as exc:
            raise FatalClientError("E_MPUB_FAILED", f"MPUB failed {exc}") from exc
        max_body = self.settings.max_body_size_bytes
        max_msg = self.settings.max_msg_size_bytes
        transport = self.transport
        try:
            size = frames.read_length(await transport.readexactly(4))
        except Closed as exc:
            raise FatalClientError("E_BAD_BODY", "MPUB failed to read body size") from exc
        if size <= 0:
            raise FatalClientError("E_BAD_BODY", f"MPUB invalid body size {size}")
        if size > max_body:
            raise FatalClientError("E_BAD_BODY", f"MPUB body too big {size} > {max_body}")
        try:
            count = frames.read_length(await transport.readexactly(4))
        except Closed as exc:
            raise FatalClientError("E_BAD_BODY", "MPUB failed to read message count") from exc
        # nsqd's bound: 4 bytes of count, then at least 5 per message (length + 1 byte).
        if count <= 0 or count > (max_body - 4) // 5:
            raise FatalClientError("E_BAD_BODY", f"MPUB invalid message count {count}")
        bodies = transport.buffered_sized(count, max_msg)
        if bodies is not None:
            return await self._publish("MPUB", topic, bodies)
        bodies = []
        for i in range(count):
            try:
                message_size = frames.read_length(await transport.readexactly(4))
            except Closed as exc:
                raise FatalClientError(
                    "E_BAD_MESSAGE", f"MPUB failed to read message({i}) body size"
                ) from exc
            if message_size <= 0:
                raise FatalClientError(
                    "E_BAD_MESSAGE", f"MPUB invalid message({i}) body size {message_size}"
                )
            if message_size > max_msg:
                raise FatalClientError(
                    "E_BAD_MESSAGE", f"MPUB message too big {message_size} > {max_msg}"
                )
            try:
                bodies.append(await transport.readexactly(message_size))
            except Closed as exc:
                raise FatalClientError("E_BAD_MESSAGE", "MPUB failed to read message body") from exc
        return await self._publish("MPUB", topic, bodies)
