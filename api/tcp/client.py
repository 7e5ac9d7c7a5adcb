"""One TCP client's state, apart from the protocol's commands (as nsqd keeps ``client_v2.go``
apart from ``protocol_v2.go``): who it is, what it negotiated, its RDY, the channel it
subscribed to and the messages it holds there."""

from __future__ import annotations

import asyncio
from enum import Enum

from api.tcp.identify import ClientOptions
from queue_engine.auth import Identity
from queue_engine.channel import ChannelRuntime
from queue_engine.channel_queue import Answer

# How long a client waits for the runtime that follows one closed because the channel's
# shares changed here (it restores from the ledger); past it, answers are refused as the old
# runtime refuses them and the pump closes the connection.
HAND_ON_WAIT_S = 60.0


class State(Enum):
    INIT = "init"
    SUBSCRIBED = "subscribed"
    CLOSING = "closing"


class Client:
    """What the protocol knows of one client between its commands."""

    def __init__(self, peer: str, msg_timeout_ms: int) -> None:
        self.name = peer
        self.identity: Identity | None = None
        self.secret = ""
        self.options = ClientOptions(msg_timeout_ms=msg_timeout_ms)
        self.state = State.INIT
        self.ready_count = 0
        # Messages this client holds: id -> the lease it was delivered under.
        self.in_flight: dict[str, str] = {}
        # The channel it subscribed to, as served here (None before SUB).
        self.runtime: ChannelRuntime | None = None

    def can_answer(self) -> bool:
        """Whether FIN, REQ and TOUCH are allowed now (nsqd: subscribed or closing)."""
        return self.state in (State.SUBSCRIBED, State.CLOSING)

    def wanted(self) -> int:
        """How many more messages this client may have in flight now (0: none)."""
        if self.state is not State.SUBSCRIBED:
            return 0
        return self.ready_count - len(self.in_flight)

    def subscribe(self, runtime: ChannelRuntime) -> None:
        self.runtime = runtime
        self.state = State.SUBSCRIBED

    def forget_ended(self) -> None:
        """Drop leases that ended without this client (timed out, then delivered again):
        nsqd's client in-flight count drops when a message times out."""
        runtime = self.runtime
        if runtime is None:
            return
        for message_id in runtime.ended_leases(self.in_flight):
            del self.in_flight[message_id]

    def take_held(self) -> list[Answer]:
        """The leases this client still holds on its channel, forgotten here (to be requeued
        as it goes)."""
        runtime = self.runtime
        held = []
        if runtime is not None and not runtime.closed:
            held = [
                Answer(message_id, lease)
                for message_id, lease in self.in_flight.items()
                if runtime.holds(message_id, lease)
            ]
        self.in_flight.clear()
        return held

    def why_not(self, message_id: str) -> str:
        """nsqd's reason a message is not this client's to answer."""
        if self.runtime is None:
            return "ID not in flight"
        return self.runtime.why_not_held(message_id)

    async def follow_hand_on(self) -> ChannelRuntime | None:
        """The runtime serving this client's channel now. While the channel's shares change
        here, its runtime closes and a new one restores from the ledger (up to a few hundred
        ms): answers and pushes wait for the new one rather than fail on the old. None: the
        channel is not served here any more (deleted, or the server stops)."""
        runtime = self.runtime
        while runtime is not None and runtime.closed:
            successor = await asyncio.wait_for(asyncio.shield(runtime.handed_on), HAND_ON_WAIT_S)
            if successor is None:
                return None
            runtime = self.runtime = successor
        return runtime
