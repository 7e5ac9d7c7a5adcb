"""One TCP connection's bytes in and out, and the upgrades IDENTIFY negotiates: TLS, deflate
and snappy (nsqd's: raw deflate with a sync flush per write, snappy's framing format).

Reads go through one buffer so that a line, a length and a body are read alike whatever the
stream is wrapped in. Writes are collected and sent (compressed, if negotiated) by ``flush``;
a peer that does not read within ``write_timeout_s`` is disconnected, as nsqd's write
deadline does.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
import zlib
from collections.abc import Callable

import snappy

READ_CHUNK_BYTES = 64 * 1024
# nsqd reads commands through a 16 KiB bufio.Reader; a longer line ends the connection.
MAX_LINE_BYTES = 16 * 1024
_SIZE = struct.Struct(">i")


class Closed(Exception):
    """The peer closed the connection, sent a line too long, or stopped sending or reading."""


class Transport:
    """Buffered, optionally compressed reads and writes over an asyncio stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._buffer = bytearray()
        self._pending: list[bytes] = []
        self._decompress: Callable[[bytes], bytes] | None = None
        self._compress: Callable[[bytes], bytes] | None = None
        # nsqd's read deadline: a whole command (line and body) within this of its start.
        self.read_timeout_s: float | None = None
        self._read_deadline: float | None = None
        # One timer watches the deadline, re-armed only when it fires early: each read under
        # ``asyncio.wait_for`` cost a task and a timer (py-spy: ~4% of the API's time at PUB
        # c16).
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._reading: asyncio.Task[None] | None = None
        self._timed_out = False
        self.write_timeout_s: float | None = None
        self.closed = False

    @property
    def peer(self) -> str:
        address = self._writer.get_extra_info("peername")
        return f"{address[0]}:{address[1]}" if address else "unknown"

    @property
    def peer_ip(self) -> str:
        address = self._writer.get_extra_info("peername")
        return str(address[0]) if address else ""

    @property
    def tls(self) -> bool:
        return self._writer.get_extra_info("ssl_object") is not None

    # -- reading ------------------------------------------------------------------------------

    def start_command(self) -> None:
        """A new command is awaited: its deadline starts now."""
        timeout = self.read_timeout_s
        loop = asyncio.get_running_loop()
        self._read_deadline = None if timeout is None else loop.time() + timeout

    async def _fill(self) -> None:
        deadline = self._read_deadline
        if deadline is not None:
            loop = asyncio.get_running_loop()
            if loop.time() >= deadline:
                raise Closed("read deadline passed")
            if self._deadline_timer is None:
                self._deadline_timer = loop.call_at(deadline, self._check_deadline)
        self._reading = asyncio.current_task()
        try:
            chunk = await self._reader.read(READ_CHUNK_BYTES)
        except asyncio.CancelledError:
            if not self._timed_out:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise Closed("read deadline passed") from None
        except (ConnectionError, ssl.SSLError) as exc:
            raise Closed(f"read failed: {exc!r}") from exc
        finally:
            self._reading = None
        if not chunk:
            raise Closed("closed by the peer")
        if self._decompress is not None:
            try:
                chunk = self._decompress(chunk)
            except Exception as exc:  # zlib.error, snappy's errors: the stream is garbage
                raise Closed(f"could not decompress: {exc}") from exc
        self._buffer += chunk

    def _check_deadline(self) -> None:
        """The timer fired: end a read that is past its command's deadline, or wait on for
        the deadline as it stands now (each new command moves it on)."""
        self._deadline_timer = None
        deadline = self._read_deadline
        if deadline is None or self._reading is None:
            return  # armed again by the next read that waits
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._deadline_timer = loop.call_at(deadline, self._check_deadline)
            return
        self._timed_out = True
        self._reading.cancel()

    async def readline(self) -> bytes:
        """One command line without its ``\\n`` (and an optional ``\\r``, as nsqd trims)."""
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end >= 0:
                break
            if len(self._buffer) >= MAX_LINE_BYTES:
                raise Closed("command line too long")
            start = len(self._buffer)
            await self._fill()
        if end >= MAX_LINE_BYTES:
            raise Closed("command line too long")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line[:-1] if line.endswith(b"\r") else line

    def buffered_line(self) -> bytes | None:
        """The next line if it is already buffered (commands that arrived together)."""
        end = self._buffer.find(b"\n")
        if end < 0 or end >= MAX_LINE_BYTES:
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line[:-1] if line.endswith(b"\r") else line

    def buffered_alike(self, prefix: bytes, length: int) -> list[bytes]:
        """What follows ``prefix`` in each of the buffered lines at the head of the buffer that
        are ``length`` bytes long and start with it, consumed (the first other line stops
        them; it and the rest stay). A consumer at RDY 200 sends its FINs in bursts: one
        split of the burst costs less than a line at a time."""
        buffer = self._buffer
        last = buffer.rfind(b"\n")
        if last < 0 or not buffer.startswith(prefix):
            return []
        found = []
        for line in bytes(buffer[:last]).split(b"\n"):
            if len(line) != length or not line.startswith(prefix):
                break
            found.append(line[len(prefix) :])
        del buffer[: len(found) * (length + 1)]
        return found

    def buffered_sized(self, count: int, max_size: int) -> list[bytes] | None:
        """``count`` length-prefixed items (4-byte big-endian sizes, each 1..``max_size``) if
        all of them are already buffered; else None and nothing is consumed (the caller reads
        them one by one, with an error for the first bad one). One pass instead of two awaits
        per item: an MPUB of 100 arrives whole."""
        buffer = self._buffer
        end = len(buffer)
        pos = 0
        items: list[bytes] = []
        unpack = _SIZE.unpack_from
        for _ in range(count):
            if pos + 4 > end:
                return None
            (size,) = unpack(buffer, pos)
            if size <= 0 or size > max_size or pos + 4 + size > end:
                return None
            items.append(bytes(buffer[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        del buffer[:pos]
        return items

    async def readexactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            await self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self._pending.append(data)

    def _outgoing(self) -> bytes:
        """What was written since the last send, compressed if negotiated."""
        data = b"".join(self._pending)
        self._pending.clear()
        return self._compress(data) if self._compress is not None else data

    async def flush(self) -> None:
        """Send what was written; a peer that does not take it in time is disconnected."""
        if not self._pending or self.closed:
            self._pending.clear()
            return
        try:
            self._writer.write(self._outgoing())
            if self._writer.transport.get_write_buffer_size():
                # Not all sent at once: wait for the peer (a timer and a task; most writes
                # leave nothing behind and skip both).
                await asyncio.wait_for(self._writer.drain(), self.write_timeout_s)
        except (TimeoutError, ConnectionError, ssl.SSLError, RuntimeError) as exc:
            self.abort()
            raise Closed(f"write failed: {exc!r}") from exc

    # -- upgrades -----------------------------------------------------------------------------

    def hold_reads(self) -> None:
        """Stop reading from the socket until ``start_tls``: the client's TLS handshake follows
        the IDENTIFY answer at once, and bytes read before the upgrade would land in the
        plaintext buffer, where the TLS layer never sees them (the handshake then stalls)."""
        self._writer.transport.pause_reading()  # type: ignore[attr-defined]

    async def start_tls(self, context: ssl.SSLContext) -> None:
        await self.flush()
        # asyncio's start_tls resumes reading, through the TLS layer.
        await self._writer.start_tls(context)

    def start_deflate(self, level: int) -> None:
        decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)

        def compress(data: bytes) -> bytes:
            return compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)

        self._start_compression(decompressor.decompress, compress)

    def start_snappy(self) -> None:
        self._start_compression(
            snappy.StreamDecompressor().decompress, snappy.StreamCompressor().add_chunk
        )

    def _start_compression(
        self, decompress: Callable[[bytes], bytes], compress: Callable[[bytes], bytes]
    ) -> None:
        # Bytes after the IDENTIFY were sent compressed (a client sends nothing before the
        # answer; this keeps a pipelining one working).
        buffered = bytes(self._buffer)
        self._buffer.clear()
        self._decompress, self._compress = decompress, compress
        if buffered:
            self._buffer += decompress(buffered)

    # -- closing ------------------------------------------------------------------------------

    def _stop_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    def abort(self) -> None:
        self.closed = True
        self._stop_deadline()
        transport = self._writer.transport
        if not transport.is_closing():
            transport.abort()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_deadline()
        try:
            await self.flush_unchecked()
            self._writer.close()
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (TimeoutError, ConnectionError, ssl.SSLError, RuntimeError):
            self._writer.transport.abort()

    async def flush_unchecked(self) -> None:
        if self._pending:
            self._writer.write(self._outgoing())
            await asyncio.wait_for(self._writer.drain(), 1.0)
