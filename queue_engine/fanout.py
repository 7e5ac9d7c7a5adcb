"""Which channel gets which topic rows (pure): NSQ's fanout rules over Delta versions.

A channel receives the rows of its topic committed after the channel's start version (the
topic version when it was created; for a topic's only channel, the version up to which the
topic had been drained or emptied), except a replay's copies for another channel (rows whose
``to_channel`` names one). The same registry and rows always give the same answer,
so a replayed fanout batch routes exactly as the first attempt did.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.registry import ChannelInfo, Registry

CHANNEL_COLUMNS = (
    "id",
    "body",
    "published_at",
    "deliver_at",
    "topic_version",
    "expires_at",
    "replay_of",
    "headers",
)
# How the fanout job writes channel rows (``deltaq fanout --channel-writes``): see
# queue_engine.spark.fanout_stream.
CHANNEL_WRITES = ("auto", "driver", "delta", "deltaq")
# Topic files (commits) a micro-batch reads at most (``deltaq fanout --max-files-per-trigger``).
# Publishes to many topics are a file each: at 200, micro-batches ~1 s apart over 10,000 topics
# moved ~200 messages each, and the fanout fell behind 500 msg/s spread over random topics.
MAX_FILES_PER_TRIGGER = 1000


def receivers(registry: Registry, topic: str) -> list[tuple[str, ChannelInfo]]:
    """The channels a topic's rows go to, in name order (none once the topic is deleted); each
    takes the rows whose ``topic_version`` is above its ``start_version``."""
    info = registry.topics.get(topic)
    return [] if info is None else sorted(info.channels.items())


def for_channel(to_channel: pa.ChunkedArray | pa.Array, name: str) -> pa.Array:
    """Which rows go to channel ``name``: every row but a replay's copies for other channels."""
    return pc.or_kleene(pc.is_null(to_channel), pc.equal(to_channel, name))


def route(rows: pa.Table, registry: Registry) -> dict[tuple[str, str], pa.Table]:
    """Rows (with ``topic`` and ``topic_version`` columns) per (topic, channel)."""
    out: dict[tuple[str, str], pa.Table] = {}
    if rows.num_rows == 0:
        return out
    topics = pc.unique(rows["topic"]).to_pylist()
    for topic in topics:
        channels = receivers(registry, topic)
        if not channels:
            continue
        of_topic = rows.filter(pc.equal(rows["topic"], topic))
        for name, channel in channels:
            selected = of_topic.filter(
                pc.and_(
                    pc.greater(of_topic["topic_version"], channel.start_version),
                    for_channel(of_topic["to_channel"], name),
                )
            )
            if selected.num_rows:
                out[(topic, name)] = selected.select(list(CHANNEL_COLUMNS))
    return out
