"""The node journal: every publish a node takes, durable before it is acknowledged."""

from __future__ import annotations

from queue_engine.store.journal.node_journal import (
    JOURNAL_DIR,
    PREPARED_NAME,
    REMOTE_IN_FLIGHT,
    REMOTE_TRUNCATE_S,
    SEGMENT_BYTES,
    Durable,
    Journal,
    JournalClosedError,
    Recovered,
    app_id,
    journal_root,
    journal_tokens,
    read_journal,
    remove_journal,
)
from queue_engine.store.journal.records import (
    NONE,
    Decoded,
    Record,
    decode,
    encode,
)

__all__ = [
    "JOURNAL_DIR",
    "NONE",
    "PREPARED_NAME",
    "REMOTE_IN_FLIGHT",
    "REMOTE_TRUNCATE_S",
    "SEGMENT_BYTES",
    "Decoded",
    "Durable",
    "Journal",
    "JournalClosedError",
    "Record",
    "Recovered",
    "app_id",
    "decode",
    "encode",
    "journal_root",
    "journal_tokens",
    "read_journal",
    "remove_journal",
]
