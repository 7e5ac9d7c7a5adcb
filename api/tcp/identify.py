"""IDENTIFY: what a client says of itself, checked as nsqd 1.3.0 checks it, and the features
the answer grants (TLS, deflate, snappy)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api.tcp.frames import FatalClientError
from queue_engine import NSQD_VERSION
from queue_engine.settings import Settings

# nsqd 1.3.0's defaults and limits for these (options.go, client_v2.go); deltaq has no setting
# for them because no NSQ client changes them from nsqd's.
DEFAULT_HEARTBEAT_INTERVAL_MS = 30_000
MAX_HEARTBEAT_INTERVAL_MS = 60_000
DEFAULT_OUTPUT_BUFFER_SIZE = 16 * 1024
MAX_OUTPUT_BUFFER_SIZE = 64 * 1024
DEFAULT_OUTPUT_BUFFER_TIMEOUT_MS = 250
MIN_OUTPUT_BUFFER_TIMEOUT_MS = 25
MAX_OUTPUT_BUFFER_TIMEOUT_MS = 30_000
DEFAULT_DEFLATE_LEVEL = 6
MAX_DEFLATE_LEVEL = 6

_INTS = (
    "heartbeat_interval",
    "output_buffer_size",
    "output_buffer_timeout",
    "deflate_level",
    "sample_rate",
    "msg_timeout",
)
_BOOLS = ("feature_negotiation", "tls_v1", "deflate", "snappy")
_STRINGS = ("client_id", "hostname", "user_agent")
_INT32 = 2**31
_INT64 = 2**63


@dataclass
class ClientOptions:
    """A connection's negotiated options (nsqd's defaults until IDENTIFY changes them)."""

    msg_timeout_ms: int
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    output_buffer_size: int = DEFAULT_OUTPUT_BUFFER_SIZE
    output_buffer_timeout_ms: int = DEFAULT_OUTPUT_BUFFER_TIMEOUT_MS
    sample_rate: int = 0
    client_id: str = ""
    hostname: str = ""
    user_agent: str = ""


@dataclass(frozen=True)
class Negotiated:
    """What the IDENTIFY answer grants; the upgrades follow in this order: TLS, snappy,
    deflate."""

    answer: bytes | None  # None: the client did not negotiate; the answer is "OK"
    tls: bool = False
    snappy: bool = False
    deflate: bool = False
    deflate_level: int = DEFAULT_DEFLATE_LEVEL


def _decode(body: bytes) -> dict[str, Any]:
    """The fields nsqd reads, typed as Go's json.Unmarshal demands (keys match regardless
    of case, unknown keys are ignored)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    fields: dict[str, Any] = {}
    for key, value in data.items():
        name = key.lower()
        if value is None or name not in (*_INTS, *_BOOLS, *_STRINGS):
            continue
        limit = _INT32 if name == "sample_rate" else _INT64
        valid = (
            (isinstance(value, int) and not isinstance(value, bool) and -limit <= value < limit)
            if name in _INTS
            else isinstance(value, bool)
            if name in _BOOLS
            else isinstance(value, str)
        )
        if not valid:
            raise FatalClientError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        fields[name] = value
    return fields


def identify(
    options: ClientOptions,
    body: bytes,
    settings: Settings,
    *,
    tls_available: bool,
    auth_required: bool = False,
) -> Negotiated:
    """Apply an IDENTIFY body to ``options``; FatalClientError as nsqd refuses it."""
    fields = _decode(body)
    options.client_id = fields.get("client_id", "")
    options.hostname = fields.get("hostname", "")
    options.user_agent = fields.get("user_agent", "")
    try:
        _apply(options, fields, settings)
    except ValueError as exc:
        raise FatalClientError("E_BAD_BODY", f"IDENTIFY {exc}") from exc
    if not fields.get("feature_negotiation", False):
        return Negotiated(None)
    tls = tls_available and fields.get("tls_v1", False)
    deflate = fields.get("deflate", False)
    level = DEFAULT_DEFLATE_LEVEL
    if deflate and fields.get("deflate_level", 0) > 0:
        level = fields["deflate_level"]
    level = min(level, MAX_DEFLATE_LEVEL)
    snappy = fields.get("snappy", False)
    if deflate and snappy:
        raise FatalClientError(
            "E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression"
        )
    # Go's encoding/json: struct field order, no spaces.
    answer = {
        "max_rdy_count": settings.max_rdy_count,
        "version": NSQD_VERSION,
        "max_msg_timeout": settings.max_msg_timeout_ms,
        "msg_timeout": options.msg_timeout_ms,
        "tls_v1": tls,
        "deflate": deflate,
        "deflate_level": level,
        "max_deflate_level": MAX_DEFLATE_LEVEL,
        "snappy": snappy,
        "sample_rate": options.sample_rate,
        "auth_required": auth_required,
        "output_buffer_size": options.output_buffer_size,
        "output_buffer_timeout": options.output_buffer_timeout_ms,
    }
    return Negotiated(
        json.dumps(answer, separators=(",", ":")).encode(),
        tls=tls,
        snappy=snappy,
        deflate=deflate,
        deflate_level=level,
    )


def _apply(options: ClientOptions, fields: dict[str, Any], settings: Settings) -> None:
    """nsqd's clientV2.Identify: each option's special values and range, in its order."""
    heartbeat = fields.get("heartbeat_interval", 0)
    if heartbeat == -1:
        options.heartbeat_interval_ms = 0
    elif 1000 <= heartbeat <= MAX_HEARTBEAT_INTERVAL_MS:
        options.heartbeat_interval_ms = heartbeat
    elif heartbeat != 0:
        raise ValueError(f"heartbeat interval ({heartbeat}) is invalid")

    timeout = fields.get("output_buffer_timeout", 0)
    if timeout == -1:
        options.output_buffer_timeout_ms = 0
    elif MIN_OUTPUT_BUFFER_TIMEOUT_MS <= timeout <= MAX_OUTPUT_BUFFER_TIMEOUT_MS:
        options.output_buffer_timeout_ms = timeout
    elif timeout != 0:
        raise ValueError(f"output buffer timeout ({timeout}) is invalid")
    size = fields.get("output_buffer_size", 0)
    if size == -1:
        options.output_buffer_size = 1
        options.output_buffer_timeout_ms = 0
    elif 64 <= size <= MAX_OUTPUT_BUFFER_SIZE:
        options.output_buffer_size = size
    elif size != 0:
        raise ValueError(f"output buffer size ({size}) is invalid")

    sample_rate = fields.get("sample_rate", 0)
    if not 0 <= sample_rate <= 99:
        raise ValueError(f"sample rate ({sample_rate}) is invalid")
    options.sample_rate = sample_rate

    msg_timeout = fields.get("msg_timeout", 0)
    if 1000 <= msg_timeout <= settings.max_msg_timeout_ms:
        options.msg_timeout_ms = msg_timeout
    elif msg_timeout != 0:
        raise ValueError(f"msg timeout ({msg_timeout}) is invalid")
