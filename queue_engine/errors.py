"""Typed errors carrying NSQ's error codes; the API maps codes to HTTP statuses in one place."""

from __future__ import annotations

import errno
from enum import StrEnum


class ErrorCode(StrEnum):
    """nsqd's HTTP error vocabulary (``{"message": CODE}``), plus deltaq's few additions."""

    INVALID_REQUEST = "INVALID_REQUEST"
    MISSING_ARG_TOPIC = "MISSING_ARG_TOPIC"
    MISSING_ARG_CHANNEL = "MISSING_ARG_CHANNEL"
    INVALID_TOPIC = "INVALID_TOPIC"
    INVALID_CHANNEL = "INVALID_CHANNEL"
    # nsqd's /channel/* handlers name a bad topic or channel with these (its shared
    # topic/channel argument parser), where /pub and /topic/* say INVALID_TOPIC.
    INVALID_ARG_TOPIC = "INVALID_ARG_TOPIC"
    INVALID_ARG_CHANNEL = "INVALID_ARG_CHANNEL"
    # GET/PUT /config/<option>.
    INVALID_OPTION = "INVALID_OPTION"
    INVALID_VALUE = "INVALID_VALUE"
    # POST /channel/move: no live node in that lane.
    INVALID_NODE = "INVALID_NODE"
    MSG_EMPTY = "MSG_EMPTY"
    MSG_TOO_BIG = "MSG_TOO_BIG"
    BODY_TOO_BIG = "BODY_TOO_BIG"
    BAD_BODY = "BAD_BODY"
    BAD_MESSAGE = "BAD_MESSAGE"
    INVALID_DEFER = "INVALID_DEFER"
    # deltaq: an ``envelope=json`` body that is not an envelope (queue_engine.headers).
    INVALID_ENVELOPE = "INVALID_ENVELOPE"
    # deltaq: headers over a limit, or not strings (queue_engine.headers).
    INVALID_HEADERS = "INVALID_HEADERS"
    # deltaq: a channel filter that does not parse or is not taken (queue_engine.channel_filter).
    INVALID_FILTER = "INVALID_FILTER"
    # deltaq: a typed topic's schema that does not parse or is not taken
    # (queue_engine.topic_schema); a change to it that its rows could not follow; a body that
    # does not fit it (the line, field and reason named).
    INVALID_SCHEMA = "INVALID_SCHEMA"
    SCHEMA_CHANGE_REFUSED = "SCHEMA_CHANGE_REFUSED"
    INVALID_BODY = "INVALID_BODY"
    # deltaq: a channel's max_attempts outside 1..65535 (or "default").
    INVALID_MAX_ATTEMPTS = "INVALID_MAX_ATTEMPTS"
    # deltaq: a topic's ttl_ms outside 1..MAX_TTL_MS (or "default").
    INVALID_TTL = "INVALID_TTL"
    # deltaq: a topic's retention_hours outside 0..MAX_RETENTION_HOURS, or retention not
    # taken/fixed (or "default").
    INVALID_RETENTION = "INVALID_RETENTION"
    # deltaq: a replay's from/to not a topic version or RFC 3339 time, from after to, outside
    # the table, or more messages than max_replay_messages.
    INVALID_RANGE = "INVALID_RANGE"
    # deltaq: the rows of a replay's range were removed by retention (or the log of those
    # versions was cleaned up).
    RANGE_REMOVED = "RANGE_REMOVED"
    TOPIC_NOT_FOUND = "TOPIC_NOT_FOUND"
    CHANNEL_NOT_FOUND = "CHANNEL_NOT_FOUND"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    # nsqd answers 503 EXITING when a message cannot be put because the daemon is stopping.
    EXITING = "EXITING"
    # nsqd's consumer-side errors (its TCP protocol's; deltaq serves them over HTTP).
    E_INVALID = "E_INVALID"
    E_FIN_FAILED = "E_FIN_FAILED"
    E_REQ_FAILED = "E_REQ_FAILED"
    E_TOUCH_FAILED = "E_TOUCH_FAILED"
    # deltaq: a redrive named messages that are not dead letters (nothing was redriven).
    E_REDRIVE_FAILED = "E_REDRIVE_FAILED"
    # deltaq's caps (settings max_topics, max_channels_per_topic, max_sub_waiters,
    # max_tcp_connections).
    E_TOO_MANY_TOPICS = "E_TOO_MANY_TOPICS"
    E_TOO_MANY_CHANNELS = "E_TOO_MANY_CHANNELS"
    E_TOO_MANY_WAITERS = "E_TOO_MANY_WAITERS"
    # Authentication (api/auth.py): no valid credentials; valid but not allowed.
    E_AUTH_FAILED = "E_AUTH_FAILED"
    E_UNAUTHORIZED = "E_UNAUTHORIZED"
    # deltaq: the Delta commit carrying the message failed; nothing of it was committed.
    E_COMMIT_FAILED = "E_COMMIT_FAILED"
    # deltaq: the topic's table uses a Delta feature deltaq cannot keep working with (another
    # engine enabled it); the body's "reason" names the feature. Nothing was written.
    E_TABLE_REFUSED = "E_TABLE_REFUSED"
    # deltaq: the message broke a CHECK constraint (or invariant) another engine put on the
    # topic's table; the body's "reason" names the constraint. Nothing was written.
    E_CONSTRAINT_VIOLATED = "E_CONSTRAINT_VIOLATED"
    # deltaq: another API node of the warehouse serves the channel (HTTP: a 307 to it).
    CHANNEL_ELSEWHERE = "CHANNEL_ELSEWHERE"


class QueueError(Exception):
    """A request the queue refuses; ``code`` is what the client sees."""

    def __init__(
        self,
        code: ErrorCode,
        detail: str = "",
        failed: list[str] | None = None,
        *,
        param: str | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {detail}" if detail else str(code))
        self.code = code
        self.detail = detail
        # For batch FIN/REQ/TOUCH: the message ids that were refused (nothing was applied).
        self.failed = failed
        # For E_INVALID: the request parameter that was wrong ("max", "id", "body", ...).
        self.param = param
        # A cause the client can act on (a full disk), answered as ``reason`` beside the code.
        self.cause = cause


DISK_FULL = "no space left on the warehouse's device"
QUOTA_EXCEEDED = "the warehouse's disk quota is exhausted"


def storage_cause(error: BaseException | None) -> str | None:
    """What a failed write says about the warehouse's storage, read from the whole chain of
    errors (delta-rs and Arrow wrap the OS error in text): ``DISK_FULL``, ``QUOTA_EXCEEDED``
    or None."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return DISK_FULL
        if isinstance(error, OSError) and error.errno == errno.EDQUOT:
            return QUOTA_EXCEEDED
        text = str(error)
        if "No space left on device" in text or "os error 28" in text:
            return DISK_FULL
        if "Disk quota exceeded" in text or "os error 122" in text:
            return QUOTA_EXCEEDED
        error = error.__cause__ or error.__context__
        seen += 1
    return None


class ChannelElsewhereError(QueueError):
    """The channel is served by another live node, reached at ``node_url`` (HTTP) and
    ``tcp_address`` (nsqd's TCP protocol, if that node speaks it)."""

    def __init__(self, node_url: str, tcp_address: str | None = None) -> None:
        super().__init__(ErrorCode.CHANNEL_ELSEWHERE, node_url)
        self.node_url = node_url
        self.tcp_address = tcp_address
