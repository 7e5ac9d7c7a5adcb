"""The engine's latency histograms, in Prometheus' terms (served by the API's /metrics).

Counters and gauges (depth, in flight, ...) are read from the broker when scraped; only what
must be observed as it happens lives here. Buckets span a local commit (~1 ms) to an object
store's (tens of ms) and a stalled one (seconds).
"""

from __future__ import annotations

from prometheus_client import Histogram

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

PUBLISH_SECONDS = Histogram(
    "deltaq_publish_duration_seconds",
    "From a publish (PUB, MPUB, /pub, /mpub) arriving to its acknowledgement.",
    ["topic"],
    buckets=_BUCKETS,
)
TOPIC_COMMIT_SECONDS = Histogram(
    "deltaq_topic_commit_duration_seconds",
    "One group commit of published messages to a topic's Delta table.",
    ["topic"],
    buckets=_BUCKETS,
)
LEDGER_COMMIT_SECONDS = Histogram(
    "deltaq_ledger_commit_duration_seconds",
    "One commit of lease events (DELIVER, FIN, REQ, TOUCH, TIMEOUT) to a channel's ledger.",
    ["topic", "channel"],
    buckets=_BUCKETS,
)


def ledger_histogram(name: str) -> Histogram:
    """The ledger commit histogram of the channel a writer named ``topic/channel`` serves."""
    topic, _, channel = name.partition("/")
    return LEDGER_COMMIT_SECONDS.labels(topic, channel)
