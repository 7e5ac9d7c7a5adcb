"""The same bytes, in the same order, to nsqd 1.3.0 and to deltaq: the same frames come back
(message ids and timestamps aside), and the same errors close the connection."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server
from tests.nsq_wire import (
    MESSAGE,
    RESPONSE,
    Nsqd,
    Wire,
    identify,
    mpub_body,
    parse_message,
    run_nsqd,
    sized,
)

# How long nsqd is given to say everything it will say after a step (it answers in
# microseconds; deltaq is then waited on for as many frames).
NSQD_QUIET_S = 0.15

# Each script runs on a fresh connection to both servers. "{topic}" is replaced by a topic
# name of the script's own; "{id0}" by the id of the first message the connection received.
SCRIPTS: dict[str, list[bytes]] = {
    "bad magic": [b"  V1"],
    "invalid command": [b"  V2", b"HELLO world\n"],
    "nop is silent, crlf is trimmed": [b"  V2", b"NOP\r\n", b"PUB {topic}\r\n" + sized(b"x")],
    "identify negotiates": [b"  V2", identify(feature_negotiation=True, client_id="a")],
    "identify without negotiation": [b"  V2", identify(client_id="a", hostname="h")],
    "identify twice then bad heartbeat": [
        b"  V2",
        identify(msg_timeout=5000),
        identify(heartbeat_interval=500),
    ],
    "identify bad json": [b"  V2", b"IDENTIFY\n" + sized(b"{not json")],
    "identify wrong type": [b"  V2", b"IDENTIFY\n" + sized(b'{"heartbeat_interval":"x"}')],
    "identify empty body": [b"  V2", b"IDENTIFY\n" + sized(b"")],
    "identify sample rate": [b"  V2", identify(sample_rate=100)],
    "identify msg timeout": [b"  V2", identify(msg_timeout=999)],
    "identify output buffer": [b"  V2", identify(output_buffer_size=10)],
    "identify both compressions": [
        b"  V2",
        identify(feature_negotiation=True, snappy=True, deflate=True),
    ],
    "auth without auth": [b"  V2", b"AUTH\n" + sized(b"secret")],
    "auth with params": [b"  V2", b"AUTH x\n"],
    "pub missing topic": [b"  V2", b"PUB\n"],
    "pub bad topic": [b"  V2", b"PUB bad!name\n"],
    "pub bad topic quoted": [b"  V2", b'PUB a"b\xff\n'],
    "pub empty body": [b"  V2", b"PUB {topic}\n" + sized(b"")],
    "pub too big": [b"  V2", b"PUB {topic}\n" + b"\x00\x20\x00\x00"],
    "pub then more": [b"  V2", b"PUB {topic}\n" + sized(b"one"), b"PUB {topic}\n" + sized(b"two")],
    "dpub": [b"  V2", b"DPUB {topic} 1000\n" + sized(b"later")],
    "dpub bad timeout": [b"  V2", b"DPUB {topic} soon\n"],
    "dpub out of range": [b"  V2", b"DPUB {topic} 99999999999\n"],
    "dpub missing timeout": [b"  V2", b"DPUB {topic}\n"],
    "mpub": [b"  V2", b"MPUB {topic}\n" + mpub_body([b"a", b"b", b"c"])],
    "mpub bad topic": [b"  V2", b"MPUB no/pe\n"],
    "mpub zero messages": [b"  V2", b"MPUB {topic}\n" + sized(b"\x00\x00\x00\x00")],
    "mpub empty message": [
        b"  V2",
        b"MPUB {topic}\n" + b"\x00\x00\x00\x09\x00\x00\x00\x01" + sized(b""),
    ],
    "mpub body too big": [b"  V2", b"MPUB {topic}\n" + b"\x7f\x00\x00\x00"],
    "rdy before sub": [b"  V2", b"RDY 1\n"],
    "fin before sub": [b"  V2", b"FIN 0123456789abcdef\n"],
    "cls before sub": [b"  V2", b"CLS\n"],
    "sub missing channel": [b"  V2", b"SUB {topic}\n"],
    "sub bad channel": [b"  V2", b"SUB {topic} bad*channel\n"],
    "sub heartbeats off": [b"  V2", identify(heartbeat_interval=-1), b"SUB {topic} c\n"],
    "sub twice": [b"  V2", b"SUB {topic} c\n", b"SUB {topic} c\n"],
    "identify after sub": [b"  V2", b"SUB {topic} c\n", identify(client_id="late")],
    "rdy garbage": [b"  V2", b"SUB {topic} c\n", b"RDY many\n"],
    "rdy negative": [b"  V2", b"SUB {topic} c\n", b"RDY -1\n"],
    "rdy too many": [b"  V2", b"SUB {topic} c\n", b"RDY 2501\n"],
    "fin bad id": [b"  V2", b"SUB {topic} c\n", b"RDY 0\n", b"FIN short\n"],
    "fin missing id": [b"  V2", b"SUB {topic} c\n", b"FIN\n"],
    "fin not in flight": [b"  V2", b"SUB {topic} c\n", b"FIN 0123456789abcdef\n", b"NOP\n"],
    "req missing timeout": [b"  V2", b"SUB {topic} c\n", b"REQ 0123456789abcdef\n"],
    "req bad timeout": [b"  V2", b"SUB {topic} c\n", b"REQ 0123456789abcdef x\n"],
    "req not in flight": [b"  V2", b"SUB {topic} c\n", b"REQ 0123456789abcdef 10\n"],
    "touch not in flight": [b"  V2", b"SUB {topic} c\n", b"TOUCH 0123456789abcdef\n"],
    "cls twice": [b"  V2", b"SUB {topic} c\n", b"CLS\n", b"RDY 5\n", b"CLS\n"],
    # FINs that arrive together are taken as one batch: a CRLF line, a NOP, a FIN of a
    # message already finished and one of an unknown id among them answer as nsqd's do.
    "fin burst": [
        b"  V2",
        b"SUB {topic} c\n",
        b"MPUB {topic}\n" + mpub_body([b"x", b"x", b"x"]),
        b"RDY 3\n",
        b"FIN {id0}\nFIN {id1}\r\nNOP\nFIN {id2}\nFIN {id0}\nFIN 0123456789abcdef\n",
        b"CLS\n",
    ],
    "deliver, req, fin": [
        b"  V2",
        b"SUB {topic} c\n",
        b"PUB {topic}\n" + sized(b"payload"),
        b"RDY 1\n",
        b"REQ {id0} 0\n",
        b"TOUCH {id0}\n",
        b"FIN {id0}\n",
        b"FIN {id0}\n",
        b"CLS\n",
    ],
}


def _normal(frame: tuple[int, bytes] | None, ids: list[bytes]) -> object:
    """A frame with what legitimately differs taken out: ids, timestamps."""
    if frame is None:
        return "closed"
    frame_type, data = frame
    if frame_type == MESSAGE:
        message = parse_message(data)
        if message.id not in ids:
            ids.append(message.id)
        return ("message", message.attempts, message.body)
    for i, message_id in enumerate(ids):
        data = data.replace(message_id, f"<id{i}>".encode())
    if frame_type == RESPONSE and data.startswith(b"{"):
        return ("json", json.loads(data))
    return (frame_type, data)


def _converse(wire: Wire, step: bytes, ids: list[bytes], count: int | None) -> list[object]:
    """Send one step; read what follows (nsqd: until quiet; deltaq: as many frames)."""
    for i, message_id in enumerate(ids):
        step = step.replace(f"{{id{i}}}".encode(), message_id)
    wire.send(step)
    frames: list[object] = []
    while count is None or len(frames) < count:
        try:
            got = wire.frame_skipping_heartbeats(NSQD_QUIET_S if count is None else 10)
        except TimeoutError:
            break
        frames.append(_normal(got, ids))
        if got is None:
            break
    return frames


@pytest.fixture(scope="module")
def nsqd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nsqd]:
    yield from run_nsqd(tmp_path_factory.mktemp("nsqd"))


@pytest.fixture(scope="module")
def server(warehouse: Path, fanout_loop: None) -> Iterator[Server]:
    # nsqd's hour for DPUB and REQ (deltaq's default allows a week).
    server = Server(warehouse, env={"DELTAQ_MAX_REQ_TIMEOUT_MS": "3600000"}).start()
    yield server
    server.stop()


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_same_frames_as_nsqd(name: str, nsqd: Nsqd, server: Server) -> None:
    topic = f"diff_{re.sub(r'[^a-z]', '', name)[:20]}_{uuid.uuid4().hex[:6]}".encode()
    steps = [step.replace(b"{topic}", topic) for step in SCRIPTS[name]]
    reference = Wire(nsqd.tcp_port, magic=None)
    ours = Wire(server.tcp_port, magic=None)
    ref_ids: list[bytes] = []
    our_ids: list[bytes] = []
    try:
        for step in steps:
            expected = _converse(reference, step, ref_ids, None)
            got = _converse(ours, step, our_ids, len(expected))
            assert got == expected, f"after {step!r}"
            if expected and expected[-1] == "closed":
                break
        else:
            # Nothing more from deltaq than from nsqd.
            assert _converse(ours, b"", our_ids, None) == []
    finally:
        reference.close()
        ours.close()
