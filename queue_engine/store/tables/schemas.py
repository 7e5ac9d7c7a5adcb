"""The schema of each of deltaq's tables (Arrow), as the store writes and Spark reads them."""

from __future__ import annotations

import pyarrow as pa

_TS = pa.timestamp("us", tz="UTC")

_ID = pa.field("id", pa.string(), nullable=False)
_BODY = pa.field("body", pa.binary(), nullable=False)
_PUBLISHED_AT = pa.field("published_at", _TS, nullable=False)
_DELIVER_AT = pa.field("deliver_at", _TS, nullable=True)
# The message's own TTL (``/pub?ttl_ms=``): not delivered from then on (null: the topic's TTL).
# Added after the first release: ``open_or_create`` adds it to older tables, whose files read
# it as null. Columns added later go last, so an evolved table and a new one look the same.
_EXPIRES_AT = pa.field("expires_at", _TS, nullable=True)
# A replay's copy of a message (/channel/replay): the id it copies.
_REPLAY_OF = pa.field("replay_of", pa.string(), nullable=True)
# A replay's copy goes to one channel only (null: every channel, as any published message).
_TO_CHANNEL = pa.field("to_channel", pa.string(), nullable=True)
# The message's headers (queue_engine.headers; null: none). SQL reads them as headers['name'].
HEADERS_TYPE = pa.map_(pa.string(), pa.string())
_HEADERS = pa.field("headers", HEADERS_TYPE, nullable=True)

# topics/<t>: one row per published message (and per replayed copy), append-only.
TOPIC_SCHEMA = pa.schema(
    [_ID, _BODY, _PUBLISHED_AT, _DELIVER_AT, _EXPIRES_AT, _TO_CHANNEL, _REPLAY_OF, _HEADERS]
)

# channels/<t>/<c>/messages: the topic's rows each channel receives, with the topic version
# each came from (append-only; written by the fanout job).
CHANNEL_MESSAGES_SCHEMA = pa.schema(
    [
        _ID,
        _BODY,
        _PUBLISHED_AT,
        _DELIVER_AT,
        pa.field("topic_version", pa.int64(), nullable=False),
        _EXPIRES_AT,
        _REPLAY_OF,
        _HEADERS,
    ]
)

# channels/<t>/<c>/ledger: one row per lease event (queue_engine.lease), append-only. Written by
# the API (and the sweep job); its fold is every message's delivery state.
LEDGER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("lease", pa.string(), nullable=True),
        pa.field("lease_expires_at", _TS, nullable=True),
        pa.field("deliver_at", _TS, nullable=True),
        pa.field("consumer", pa.string(), nullable=True),
        pa.field("at", _TS, nullable=False),
    ]
)

# channels/<t>/<c>/dead: one row per message the channel dead-lettered (its max_attempts
# reached), append-only. Written before the ledger's DEAD event (at = dead_at), so every DEAD
# event has its row; a row without its event (a crash in between) is not a dead letter.
DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("published_at", _TS, nullable=False),
        pa.field("attempts", pa.int32(), nullable=False),
        pa.field("last_consumer", pa.string(), nullable=True),
        pa.field("last_event", pa.string(), nullable=False),
        pa.field("dead_at", _TS, nullable=False),
        # The message's own expiry, kept so a redriven message keeps it.
        _EXPIRES_AT,
        _HEADERS,
    ]
)

# registry: one row per create/delete/pause/unpause/empty of a topic or channel, append-only.
REGISTRY_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("at", _TS, nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("channel", pa.string(), nullable=True),
        pa.field("topic_version", pa.int64(), nullable=True),
        pa.field("topic_messages", pa.int64(), nullable=True),
        # Settings a configure event sets, as a JSON object (e.g. {"max_attempts": 5}).
        pa.field("options", pa.string(), nullable=True),
    ]
)
