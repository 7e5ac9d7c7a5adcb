"""deltaq's tables: where each lives and its schema, and one module per table (topics,
channel messages, ledgers, lease state, dead letters, the registry) and per small record
beside them (notices, sweep marks)."""

from __future__ import annotations

from queue_engine.store.tables.batch_notes import batch_note
from queue_engine.store.tables.channel_messages import (
    COLUMNS,
    READ_BUFFER_BYTES,
    ChannelReader,
    max_topic_version,
)
from queue_engine.store.tables.channel_state import (
    STATE_FIELDS,
    STATE_SCHEMA,
    SWEEP_WRITER,
    WRITER_KEY,
    StateMeta,
    StateSnapshot,
    columns_as_lists,
    load_states,
    meta_as_of,
    meta_of,
    read_meta,
    read_state,
    state_from_values,
    write_state,
)
from queue_engine.store.tables.dead_letters import (
    DeadLetterStore,
    letters_to_arrow,
)
from queue_engine.store.tables.ids import (
    hex_id_array,
)
from queue_engine.store.tables.ledger import (
    EVENT_BYTES,
    LedgerWriter,
    OwnVersions,
    append_sweep_events,
    events_from_arrow,
    events_to_arrow,
    is_sweep_commit,
    read_ledger,
    read_ledger_after,
    read_versions,
)
from queue_engine.store.tables.loop_ledger import (
    LoopLedgerWriter,
    open_ledger_writer,
)
from queue_engine.store.tables.notices import (
    KEEP_BATCHES,
    KEEP_CHANNELS,
    NOTICES_DIR,
    TOPIC_WRITER_PREFIX,
    WRITERS,
    Channel,
    NoticeReader,
    NoticeWriter,
    notice_url,
    topic_notice_writer,
    topic_notice_writers,
)
from queue_engine.store.tables.registry import (
    RegistryMovedError,
    RegistryReader,
    RegistryStore,
    events_from_table,
    load_events,
)
from queue_engine.store.tables.schemas import (
    CHANNEL_MESSAGES_SCHEMA,
    DEAD_LETTER_SCHEMA,
    HEADERS_TYPE,
    LEDGER_SCHEMA,
    REGISTRY_SCHEMA,
    TOPIC_SCHEMA,
)
from queue_engine.store.tables.sweep_marks import (
    MARKS_PATH,
    Mark,
    Marks,
    current_meta,
    load_marks,
    marks_url,
    save_marks,
)
from queue_engine.store.tables.topic_writer import (
    CommitStats,
    TopicWriter,
)
from queue_engine.store.tables.warehouse import (
    Warehouse,
)

__all__ = [
    "CHANNEL_MESSAGES_SCHEMA",
    "COLUMNS",
    "DEAD_LETTER_SCHEMA",
    "EVENT_BYTES",
    "HEADERS_TYPE",
    "KEEP_BATCHES",
    "KEEP_CHANNELS",
    "LEDGER_SCHEMA",
    "MARKS_PATH",
    "NOTICES_DIR",
    "READ_BUFFER_BYTES",
    "REGISTRY_SCHEMA",
    "STATE_FIELDS",
    "STATE_SCHEMA",
    "SWEEP_WRITER",
    "TOPIC_SCHEMA",
    "TOPIC_WRITER_PREFIX",
    "WRITERS",
    "WRITER_KEY",
    "Channel",
    "ChannelReader",
    "CommitStats",
    "DeadLetterStore",
    "LedgerWriter",
    "LoopLedgerWriter",
    "Mark",
    "Marks",
    "NoticeReader",
    "NoticeWriter",
    "OwnVersions",
    "RegistryMovedError",
    "RegistryReader",
    "RegistryStore",
    "StateMeta",
    "StateSnapshot",
    "TopicWriter",
    "Warehouse",
    "append_sweep_events",
    "batch_note",
    "columns_as_lists",
    "current_meta",
    "events_from_arrow",
    "events_from_table",
    "events_to_arrow",
    "hex_id_array",
    "is_sweep_commit",
    "letters_to_arrow",
    "load_events",
    "load_marks",
    "load_states",
    "marks_url",
    "max_topic_version",
    "meta_as_of",
    "meta_of",
    "notice_url",
    "open_ledger_writer",
    "read_ledger",
    "read_ledger_after",
    "read_meta",
    "read_state",
    "read_versions",
    "save_marks",
    "state_from_values",
    "topic_notice_writer",
    "topic_notice_writers",
    "write_state",
]
