"""The sweep's fold: previous state rows + new message rows + new ledger events -> state rows.

Pure (``now_us`` is passed in) and streaming over Arrow batches, so Spark can run it in
``mapInArrow`` on rows partitioned by id and sorted by (id, source, event time, rank); any
split of a message's rows across batches is carried over. Every transition goes through
``queue_engine.lease.apply``: the sweep and the API cannot disagree on a message's state
(``queue_engine.quick_fold``'s shortcuts are property-tested to give the same rows).

After a message's rows, a lease that had ended by ``now_us`` gets the sweep's TIMEOUT (marked
``swept_timeout`` so the caller appends it to the ledger).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from queue_engine.lease import RANK, EventKind, LeaseEvent, MessageState, apply, initial
from queue_engine.store.tables import (
    STATE_FIELDS,
    STATE_SCHEMA,
    columns_as_lists,
    state_from_values,
)

_TS = pa.timestamp("us", tz="UTC")

# Where a row of the fold's input comes from (also its sort order within one id).
SRC_STATE = 0
SRC_MESSAGE = 1
SRC_EVENT = 2

FOLD_INPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("src", pa.int8()),
        # SRC_STATE: a previous state row (these columns as in STATE_SCHEMA);
        # SRC_MESSAGE: a channel-table row (published_at, deliver_at, topic_version).
        pa.field("status", pa.string()),
        pa.field("attempts", pa.int32()),
        pa.field("lease", pa.string()),
        pa.field("lease_owner", pa.string()),
        pa.field("delivered_at", _TS),
        pa.field("lease_expires_at", _TS),
        pa.field("lease_duration_us", pa.int64()),
        pa.field("deliver_at", _TS),
        pa.field("timed_out", pa.bool_()),
        pa.field("requeues", pa.int32()),
        pa.field("timeouts", pa.int32()),
        pa.field("published_at", _TS),
        pa.field("topic_version", pa.int64()),
        # SRC_EVENT: a ledger row.
        pa.field("event", pa.string()),
        pa.field("e_attempt", pa.int32()),
        pa.field("e_lease", pa.string()),
        pa.field("e_lease_expires_at", _TS),
        pa.field("e_deliver_at", _TS),
        pa.field("e_consumer", pa.string()),
        pa.field("e_at", _TS),
        pa.field("e_rank", pa.int8()),
    ]
)

FOLD_OUTPUT_SCHEMA = pa.schema(
    [*STATE_SCHEMA, pa.field("swept_timeout", pa.bool_(), nullable=False)]
)

# status of a message that finished (dropped from the state by the caller; counted).
FINISHED = "finished"

EVENT_RANKS = {kind.value: rank for kind, rank in RANK.items()}
_KINDS = {kind.value: kind for kind in EventKind}
_EVENT_COLUMNS = [
    "event",
    "e_attempt",
    "e_lease",
    "e_lease_expires_at",
    "e_deliver_at",
    "e_consumer",
    "e_at",
]


class _Output:
    """Output columns built a row at a time."""

    def __init__(self) -> None:
        self.columns: dict[str, list[object]] = {f.name: [] for f in FOLD_OUTPUT_SCHEMA}

    def add(
        self,
        message_id: str,
        state: MessageState,
        published_at: int | None,
        topic_version: int | None,
        now_us: int,
        ledger_version: int,
        swept_timeout: bool,
    ) -> None:
        c = self.columns
        c["id"].append(message_id)
        c["status"].append(FINISHED if state.finished else state.status(now_us).value)
        c["attempts"].append(state.attempts)
        c["lease"].append(state.lease)
        c["lease_owner"].append(state.lease_owner)
        c["delivered_at"].append(state.delivered_at_us)
        c["lease_expires_at"].append(state.lease_expires_at_us)
        c["lease_duration_us"].append(state.lease_duration_us)
        c["deliver_at"].append(state.deliver_at_us)
        c["timed_out"].append(state.timed_out)
        c["requeues"].append(state.requeues)
        c["timeouts"].append(state.timeouts)
        c["published_at"].append(published_at)
        c["topic_version"].append(topic_version)
        c["ledger_version"].append(ledger_version)
        c["swept_at"].append(now_us)
        c["swept_timeout"].append(swept_timeout)

    def __len__(self) -> int:
        return len(self.columns["id"])

    def batch(self) -> pa.RecordBatch:
        arrays = []
        for field in FOLD_OUTPUT_SCHEMA:
            values = self.columns[field.name]
            if pa.types.is_timestamp(field.type):
                arrays.append(pa.array(values, pa.int64()).cast(field.type))
            else:
                arrays.append(pa.array(values, field.type))
        self.columns = {f.name: [] for f in FOLD_OUTPUT_SCHEMA}
        return pa.RecordBatch.from_arrays(arrays, schema=FOLD_OUTPUT_SCHEMA)


def sweep_timeout(state: MessageState, now_us: int) -> MessageState:
    """The state after the sweep's TIMEOUT at ``now_us`` (itself if the lease has not ended)."""
    if not state.in_flight:
        return state
    return apply(state, LeaseEvent("", EventKind.TIMEOUT, state.attempts, now_us))


def fold_sorted(
    batches: Iterable[pa.RecordBatch],
    now_us: int,
    ledger_version: int,
    out_rows: int = 65_536,
) -> Iterator[pa.RecordBatch]:
    """Fold input rows (FOLD_INPUT_SCHEMA, sorted by id, src, e_at, e_rank) into state rows."""
    out = _Output()
    current: str | None = None
    state: MessageState | None = None
    published: int | None = None
    topic_version: int | None = None

    def flush() -> None:
        if current is None or state is None:
            return  # events only: the message was FIN'd before the previous state
        swept = sweep_timeout(state, now_us)
        out.add(
            current, swept, published, topic_version, now_us, ledger_version, swept is not state
        )

    for batch in batches:
        if batch.num_rows == 0:
            continue
        ids, srcs, statuses, published_col, topic_col = columns_as_lists(
            batch, ["id", "src", "status", "published_at", "topic_version"]
        )
        fields = columns_as_lists(batch, STATE_FIELDS)
        events = columns_as_lists(batch, _EVENT_COLUMNS)
        for i, message_id in enumerate(ids):
            if message_id != current:
                flush()
                if len(out) >= out_rows:
                    yield out.batch()
                current, state, published, topic_version = str(message_id), None, None, None
            src = srcs[i]
            if src == SRC_STATE:
                state = state_from_values([f[i] for f in fields], str(statuses[i]))
                published, topic_version = published_col[i], topic_col[i]  # type: ignore[assignment]
            elif src == SRC_MESSAGE:
                if state is None:
                    state = initial(fields[6][i])  # type: ignore[arg-type]
                    published, topic_version = published_col[i], topic_col[i]  # type: ignore[assignment]
            elif state is not None:
                state = apply(
                    state,
                    LeaseEvent(
                        current,  # type: ignore[arg-type]
                        _KINDS[str(events[0][i])],
                        events[1][i],  # type: ignore[arg-type]
                        events[6][i],  # type: ignore[arg-type]
                        lease=events[2][i],  # type: ignore[arg-type]
                        lease_expires_at_us=events[3][i],  # type: ignore[arg-type]
                        deliver_at_us=events[4][i],  # type: ignore[arg-type]
                        consumer=events[5][i],  # type: ignore[arg-type]
                    ),
                )
    flush()
    if len(out):
        yield out.batch()


def event_input(ledger: pa.Table) -> pa.Table:
    """Ledger rows (LEDGER_SCHEMA) as fold input rows."""
    n = ledger.num_rows
    ranks = [EVENT_RANKS[k] for k in ledger["event"].to_pylist()]
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "id": ledger["id"],
        "src": pa.array([SRC_EVENT] * n, pa.int8()),
        "event": ledger["event"],
        "e_attempt": ledger["attempt"],
        "e_lease": ledger["lease"],
        "e_lease_expires_at": ledger["lease_expires_at"],
        "e_deliver_at": ledger["deliver_at"],
        "e_consumer": ledger["consumer"],
        "e_at": ledger["at"],
        "e_rank": pa.array(ranks, pa.int8()),
    }
    return _fill(columns, n)


def message_input(messages: pa.Table) -> pa.Table:
    """Channel-table rows as fold input rows."""
    n = messages.num_rows
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "id": messages["id"],
        "src": pa.array([SRC_MESSAGE] * n, pa.int8()),
        "deliver_at": messages["deliver_at"],
        "published_at": messages["published_at"],
        "topic_version": messages["topic_version"],
    }
    return _fill(columns, n)


def state_input(state: pa.Table) -> pa.Table:
    """Previous state rows as fold input rows."""
    n = state.num_rows
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        name: state[name] for name in FOLD_INPUT_SCHEMA.names if name in state.column_names
    }
    columns["src"] = pa.array([SRC_STATE] * n, pa.int8())
    return _fill(columns, n)


def _fill(columns: dict[str, pa.Array | pa.ChunkedArray], n: int) -> pa.Table:
    arrays = [
        columns[f.name].cast(f.type) if f.name in columns else pa.nulls(n, f.type)
        for f in FOLD_INPUT_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=FOLD_INPUT_SCHEMA)


def fold_tables(
    state: pa.Table | None,
    messages: pa.Table | None,
    ledger: pa.Table | None,
    now_us: int,
    ledger_version: int,
) -> pa.Table:
    """The whole fold in one process (Arrow sort + ``fold_sorted``), row by row: the reference
    the Spark job and ``quick_fold`` are tested against, and what ``quick_fold`` runs for the
    rows its shortcuts do not cover."""
    parts = []
    if state is not None:
        parts.append(state_input(state))
    if messages is not None:
        parts.append(message_input(messages))
    if ledger is not None:
        parts.append(event_input(ledger))
    if not parts:
        return FOLD_OUTPUT_SCHEMA.empty_table()
    table = pa.concat_tables(parts).sort_by(
        [("id", "ascending"), ("src", "ascending"), ("e_at", "ascending"), ("e_rank", "ascending")]
    )
    batches = list(fold_sorted(table.to_batches(), now_us, ledger_version))
    return pa.Table.from_batches(batches, schema=FOLD_OUTPUT_SCHEMA)
