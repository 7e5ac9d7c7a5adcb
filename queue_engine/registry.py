"""The registry of topics and channels: durable events and their fold (pure).

Every create/delete/pause/unpause/empty of a topic or channel is an event; the current registry
is the fold of all events in order. The store appends events to a Delta table before the API
answers, so a restarted process folds the same events into the same registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.names import is_ephemeral


class Action(StrEnum):
    TOPIC_CREATE = "topic_create"
    TOPIC_DELETE = "topic_delete"
    TOPIC_PAUSE = "topic_pause"
    TOPIC_UNPAUSE = "topic_unpause"
    TOPIC_EMPTY = "topic_empty"
    # Per-topic settings (``options``: ttl_ms, retention_hours, retention, schema; only the
    # keys given change; a null value means "the default").
    TOPIC_CONFIGURE = "topic_configure"
    CHANNEL_CREATE = "channel_create"
    CHANNEL_DELETE = "channel_delete"
    CHANNEL_PAUSE = "channel_pause"
    CHANNEL_UNPAUSE = "channel_unpause"
    CHANNEL_EMPTY = "channel_empty"
    # Per-channel settings (``options``: max_attempts, filter; null values mean "the
    # default"). A filter applies from the event's topic version on.
    CHANNEL_CONFIGURE = "channel_configure"
    # An admin handed the channel to another node (``options``: lane, http_url). Ownership
    # itself is the claim in _deltaq/owners; this event tells the nodes at once, and keeps
    # the move in the registry's history.
    CHANNEL_MOVE = "channel_move"


@dataclass(frozen=True)
class RegistryEvent:
    """One change to the registry.

    ``topic_version`` and ``topic_messages`` are the topic table's version and message count
    when the event happened: a channel receives the messages committed after its create event's
    version; a topic empty drops what was committed up to its version.
    """

    seq: int
    at_us: int
    action: Action
    topic: str
    channel: str | None = None
    topic_version: int | None = None
    topic_messages: int | None = None
    options: dict[str, Any] | None = None


@dataclass
class ChannelInfo:
    name: str
    created_at_us: int
    start_version: int
    paused: bool = False
    emptied_at_us: int | None = None
    # Deliveries before a message is dead-lettered (None: the settings' max_attempts).
    max_attempts: int | None = None
    # The channel's filters (queue_engine.channel_filter), oldest first: (topic version, filter
    # or None for none); each applies to the rows committed after its version, until the next.
    # Rows at or before the first version are the channel's without a filter.
    filters: tuple[tuple[int, str | None], ...] = ()
    # The last admin move: its registry seq, and the lane and URL of the node it went to.
    moved_seq: int = -1
    moved_to: int | None = None
    moved_to_url: str | None = None

    @property
    def ephemeral(self) -> bool:
        return is_ephemeral(self.name)

    @property
    def filter(self) -> str | None:
        """The filter messages committed from now on go through (None: none)."""
        return self.filters[-1][1] if self.filters else None


@dataclass
class TopicInfo:
    name: str
    created_at_us: int
    # The registry seq of this topic's creation: tells a re-created topic from the deleted one.
    created_seq: int = 0
    paused: bool = False
    # Messages committed at or before this version have gone to some channel: the topic held
    # channels then. A channel created when the topic has none starts here (nsqd: the first
    # channel receives what the topic buffered while it had no channel).
    drained_version: int = -1
    # Messages committed at or before this topic version were emptied (nsqd's topic/empty).
    empty_version: int = -1
    empty_message_count: int = 0
    channels: dict[str, ChannelInfo] = field(default_factory=dict)
    # Message TTL in ms after publishing (None: the settings' message_ttl_ms).
    ttl_ms: int | None = None
    # Hours a message's row is kept after publishing (None: the settings' retention_hours),
    # and whether every channel must have taken it first ("taken") or not ("fixed").
    retention_hours: float | None = None
    retention: str | None = None
    # A typed topic's schema (queue_engine.topic_schema: canonical Spark DDL; None: untyped).
    schema: str | None = None

    @property
    def ephemeral(self) -> bool:
        return is_ephemeral(self.name)


class Registry:
    """The fold of registry events, and the rules that turn a request into an event."""

    def __init__(self) -> None:
        self.topics: dict[str, TopicInfo] = {}
        self.last_seq = -1

    @classmethod
    def fold(cls, events: list[RegistryEvent]) -> Registry:
        registry = cls()
        for event in sorted(events, key=lambda e: e.seq):
            registry.apply(event)
        return registry

    def apply(self, event: RegistryEvent) -> None:
        """Apply one event; events that no longer make sense (stale) are ignored."""
        self.last_seq = max(self.last_seq, event.seq)
        topic = self.topics.get(event.topic)
        match event.action:
            case Action.TOPIC_CREATE:
                if topic is None:
                    self.topics[event.topic] = TopicInfo(
                        event.topic, event.at_us, created_seq=event.seq
                    )
            case Action.TOPIC_DELETE:
                self.topics.pop(event.topic, None)
            case Action.TOPIC_PAUSE | Action.TOPIC_UNPAUSE if topic is not None:
                topic.paused = event.action is Action.TOPIC_PAUSE
            case Action.TOPIC_EMPTY if topic is not None:
                topic.empty_version = max(topic.empty_version, event.topic_version or -1)
                topic.empty_message_count = max(
                    topic.empty_message_count, event.topic_messages or 0
                )
            case Action.TOPIC_CONFIGURE if topic is not None:
                options = event.options or {}
                if "ttl_ms" in options:
                    value = options["ttl_ms"]
                    topic.ttl_ms = None if value is None else int(value)
                if "retention_hours" in options:
                    hours = options["retention_hours"]
                    topic.retention_hours = None if hours is None else float(hours)
                if "retention" in options:
                    mode = options["retention"]
                    topic.retention = None if mode is None else str(mode)
                if options.get("schema") is not None:
                    topic.schema = str(options["schema"])
            case Action.CHANNEL_CREATE if topic is not None and event.channel is not None:
                if event.channel not in topic.channels:
                    start = event.topic_version or 0
                    given = (event.options or {}).get("filter")
                    topic.channels[event.channel] = ChannelInfo(
                        event.channel,
                        event.at_us,
                        start,
                        filters=((start, str(given)),) if given else (),
                    )
            case _ if topic is not None and event.channel is not None:
                channel = topic.channels.get(event.channel)
                if channel is None:
                    return
                if event.action is Action.CHANNEL_DELETE:
                    del topic.channels[event.channel]
                    if not topic.channels and event.topic_version is not None:
                        topic.drained_version = max(topic.drained_version, event.topic_version)
                elif event.action is Action.CHANNEL_EMPTY:
                    channel.emptied_at_us = event.at_us
                elif event.action is Action.CHANNEL_MOVE:
                    options = event.options or {}
                    channel.moved_seq = event.seq
                    channel.moved_to = int(options["lane"])
                    channel.moved_to_url = str(options["http_url"])
                elif event.action is Action.CHANNEL_CONFIGURE:
                    options = event.options or {}
                    if "max_attempts" in options:
                        value = options["max_attempts"]
                        channel.max_attempts = None if value is None else int(value)
                    if "filter" in options and event.topic_version is not None:
                        given = options["filter"]
                        channel.filters = (
                            *channel.filters,
                            (event.topic_version, None if given is None else str(given)),
                        )
                else:
                    channel.paused = event.action is Action.CHANNEL_PAUSE
            case _:
                return

    def first_channel_start(self, topic: TopicInfo, current_version: int) -> int:
        """The start version of a channel being created now on ``topic``.

        A channel receives the messages committed after its start version: the current version
        normally; for a topic that has no channel, everything not yet drained or emptied.
        """
        if topic.channels:
            return current_version
        return max(topic.drained_version, topic.empty_version)

    def existing_topic(self, name: str) -> TopicInfo:
        topic = self.topics.get(name)
        if topic is None:
            raise QueueError(ErrorCode.TOPIC_NOT_FOUND, name)
        return topic

    def existing_channel(self, topic_name: str, channel_name: str) -> ChannelInfo:
        channel = self.existing_topic(topic_name).channels.get(channel_name)
        if channel is None:
            raise QueueError(ErrorCode.CHANNEL_NOT_FOUND, channel_name)
        return channel

    def next_seq(self) -> int:
        return self.last_seq + 1
