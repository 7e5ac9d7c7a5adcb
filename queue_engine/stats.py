"""The figures /stats reports per topic and channel, in nsqd's vocabulary (nsqd's stats.go)."""

from __future__ import annotations

from dataclasses import dataclass

from queue_engine.channel import ConsumerSeen


@dataclass(frozen=True)
class ChannelStats:
    name: str
    paused: bool
    depth: int = 0
    in_flight_count: int = 0
    deferred_count: int = 0
    message_count: int = 0
    requeue_count: int = 0
    timeout_count: int = 0
    # Dead-lettered and not redriven; the channel's limit (0: none).
    dead_count: int = 0
    max_attempts: int = 0
    # Messages expired (TTL) since the API started.
    expired_count: int = 0
    # Messages the channel's filter kept out, in the fanout's commits read since the API
    # started (of the whole channel, whichever node serves its shares).
    filtered_count: int = 0
    clients: tuple[ConsumerSeen, ...] = ()
    # The newest topic version the fanout has put in the channel's table (-1: none yet).
    fanned_topic_version: int = -1
    # FINs since the API started; the Delta versions of the channel's table and ledger.
    finish_count: int = 0
    table_version: int = -1
    ledger_version: int = -1
    # The URL of the node serving the channel (several nodes on one warehouse), if known:
    # this one when it serves any share of it.
    node: str | None = None
    # The id lanes (shares) this node serves of the channel (None: all of it, alone).
    lanes: tuple[int, ...] | None = None
    # The channel's filter for messages committed from now on (None: none).
    filter: str | None = None

    @property
    def client_count(self) -> int:
        return len(self.clients)


@dataclass(frozen=True)
class TopicStats:
    name: str
    paused: bool
    depth: int
    message_count: int
    message_bytes: int
    commits: int
    version: int
    channels: list[ChannelStats]
    commit_p50_ms: float = 0.0
    commit_p99_ms: float = 0.0
    # Why the topic's table takes no publishes (a Delta feature deltaq cannot keep working
    # with), or None.
    refused: str | None = None
    # The newest topic version that added messages (-1: none known): a channel whose rows
    # reach it has every message the fanout could give it.
    data_version: int = -1
    # A typed topic's schema, canonical Spark DDL (None: untyped).
    schema: str | None = None


def percentile_ms(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)
