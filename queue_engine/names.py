"""Topic and channel names, as nsqd validates them."""

from __future__ import annotations

import re

from queue_engine.errors import ErrorCode, QueueError

MAX_NAME_LENGTH = 64
EPHEMERAL_SUFFIX = "#ephemeral"
_NAME = re.compile(r"[.a-zA-Z0-9_-]+(#ephemeral)?")


def is_valid_name(name: str) -> bool:
    """True for nsqd-valid names, except all-dot names ("." and ".."), which deltaq refuses
    because every name becomes a directory in the warehouse."""
    if not 1 <= len(name) <= MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        return False
    return name.removesuffix(EPHEMERAL_SUFFIX).strip(".") != ""


def is_ephemeral(name: str) -> bool:
    return name.endswith(EPHEMERAL_SUFFIX)


def require_topic(name: str | None) -> str:
    if name is None:
        raise QueueError(ErrorCode.MISSING_ARG_TOPIC)
    if not is_valid_name(name):
        raise QueueError(ErrorCode.INVALID_TOPIC, name)
    return name


def require_channel(name: str | None) -> str:
    if name is None:
        raise QueueError(ErrorCode.MISSING_ARG_CHANNEL)
    if not is_valid_name(name):
        raise QueueError(ErrorCode.INVALID_CHANNEL, name)
    return name


def require_topic_channel(topic: str | None, channel: str | None) -> tuple[str, str]:
    """The topic and channel of nsqd's /channel/* calls, with that parser's codes
    (``INVALID_ARG_TOPIC``, ``INVALID_ARG_CHANNEL``)."""
    if topic is None:
        raise QueueError(ErrorCode.MISSING_ARG_TOPIC)
    if not is_valid_name(topic):
        raise QueueError(ErrorCode.INVALID_ARG_TOPIC, topic)
    if channel is None:
        raise QueueError(ErrorCode.MISSING_ARG_CHANNEL)
    if not is_valid_name(channel):
        raise QueueError(ErrorCode.INVALID_ARG_CHANNEL, channel)
    return topic, channel


def path_segment(name: str) -> str:
    """The directory name of a topic or channel: '#' would start a URL fragment in object-store
    URLs, so it becomes '@', which no valid name contains."""
    return name.replace("#", "@")
