"""The sweep's fold on one process, with the rows whose outcome is known without ``apply``
taken out first as whole columns.

``state_fold.fold_tables`` folds every input row in Python (~5 µs a row). These rows need
none of that, and after a backlog is published or consumed they are nearly all of them:

- **A new message** that no state row or ledger row names: ready, or deferred until its
  ``deliver_at``.
- **A simple delivery**: a message whose one new ledger row is a DELIVER, from a base row (its
  state row, else its channel-table row) that the DELIVER may start: not in flight, not dead,
  its attempt count one less, not deferred past the DELIVER. ``apply`` would put it in flight
  with that lease; the sweep's TIMEOUT follows if the lease had ended by ``now``.
- **A simple consumption**: the same with exactly one DELIVER and the FIN of its attempt and
  lease. ``apply`` would make it finished with the base's counts.
- **An answered lease**: a message whose one new ledger row is the FIN of the attempt and lease
  its state row holds (in flight, or timed out and not delivered again). Finished likewise.
- **An untouched state row**: no new row names it, and nothing about it falls due at ``now``
  (an in-flight lease that had ended, a deferral that has come). Folding it alone gives the
  same row stamped with this sweep's ledger version and time.

Everything else goes through ``fold_tables``. The result holds the same rows as
``fold_tables`` of the same inputs would (tests/unit/test_quick_fold.py holds it to that), in
no particular order.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.lease import Status
from queue_engine.state_fold import FINISHED, FOLD_OUTPUT_SCHEMA, fold_tables
from queue_engine.store.tables import STATE_SCHEMA

_TS = pa.timestamp("us", tz="UTC")
_STARTABLE = pa.array([Status.READY.value, Status.DEFERRED.value])
_LIVE = pa.array([s.value for s in (Status.READY, Status.DEFERRED, Status.IN_FLIGHT, Status.DEAD)])


def fold_quickly(
    state: pa.Table | None,
    messages: pa.Table | None,
    ledger: pa.Table | None,
    now_us: int,
    ledger_version: int,
) -> pa.Table:
    """``fold_tables(state, messages, ledger, now_us, ledger_version)``'s rows (any order)."""
    parts: list[pa.Table] = []
    # Ids whose state rows a sweep would not have written go to the full fold whole.
    odd: tuple[pa.Table | None, ...] = (None, None, None)
    if state is not None and state.num_rows:
        irregular = _irregular(state)
        if len(irregular):
            odd = tuple(_only(t, irregular) for t in (state, messages, ledger))
            state, messages, ledger = (_without(t, irregular) for t in (state, messages, ledger))
    if ledger is not None and ledger.num_rows:
        counts = ledger.group_by("id").aggregate([("id", "count")])
        answered = pa.concat_tables(
            [
                _deliveries(state, messages, ledger, counts, now_us, ledger_version),
                _lone_fins(state, ledger, counts, now_us, ledger_version),
            ]
        )
        if answered.num_rows:
            parts.append(answered)
            done = answered["id"]
            ledger = _without(ledger, done)
            messages = _without(messages, done)
            state = _without(state, done)
    named = [t["id"] for t in (state, ledger) if t is not None and t.num_rows]
    if messages is not None and messages.num_rows:
        arrived = _arrivals(messages, named, now_us, ledger_version)
        if arrived.num_rows:
            parts.append(arrived)
            messages = _without(messages, arrived["id"])
    if state is not None and state.num_rows:
        named = [t["id"] for t in (messages, ledger) if t is not None and t.num_rows]
        touched = (
            pc.is_in(state["id"], value_set=pa.chunked_array(named).combine_chunks())
            if named
            else _filled(False, pa.bool_(), state.num_rows)
        )
        keep = pc.invert(pc.or_(touched, _due(state, now_us)))
        parts.append(_stamped(state.filter(keep), now_us, ledger_version))
        state = state.filter(pc.invert(keep))
    state, messages, ledger = _both(state, odd[0]), _both(messages, odd[1]), _both(ledger, odd[2])
    parts.append(fold_tables(state, messages, ledger, now_us, ledger_version))
    return pa.concat_tables([p.cast(FOLD_OUTPUT_SCHEMA) for p in parts])


def _filled(value: object, type_: pa.DataType, n: int) -> pa.Array:
    """``n`` times ``value``, built in C (a Python list of a million rows costs ~10 ms)."""
    return pa.repeat(pa.scalar(value, type_), n)


def _without(table: pa.Table | None, ids: pa.ChunkedArray | pa.Array) -> pa.Table | None:
    if table is None:
        return None
    return table.filter(pc.invert(pc.is_in(table["id"], value_set=_array(ids))))


def _only(table: pa.Table | None, ids: pa.Array) -> pa.Table | None:
    return None if table is None else table.filter(pc.is_in(table["id"], value_set=ids))


def _both(a: pa.Table | None, b: pa.Table | None) -> pa.Table | None:
    if a is None or b is None:
        return a if b is None else b
    return pa.concat_tables([a, b])


def _array(ids: pa.ChunkedArray | pa.Array) -> pa.Array:
    return ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids


def _irregular(state: pa.Table) -> pa.Array:
    """Ids of state rows unlike those a sweep writes, which the shortcuts' copies of columns
    would not reproduce: an id twice, a status that is not a live one, a negative attempt
    count, none for a row in flight or holding a lease (``state_from_values`` reads such a row
    as never delivered)."""
    counts = state.group_by("id").aggregate([("id", "count")])
    twice = counts.filter(pc.greater(counts["id_count"], 1))["id"]
    unlike = pc.or_(
        pc.invert(pc.is_in(state["status"], value_set=_LIVE)),
        pc.or_(
            pc.less(state["attempts"], 0),
            pc.and_(
                pc.equal(state["attempts"], 0),
                pc.or_(
                    pc.or_(pc.equal(state["status"], Status.IN_FLIGHT.value), state["timed_out"]),
                    pc.is_valid(state["lease"]),
                ),
            ),
        ),
    )
    return pa.chunked_array([twice, state.filter(unlike)["id"]], pa.string()).combine_chunks()


def _due(state: pa.Table, now_us: int) -> pa.ChunkedArray:
    """Rows whose fold at ``now_us`` changes them though nothing new names them: an in-flight
    lease that had ended (the sweep's TIMEOUT), a deferral whose time has come (now ready)."""
    now = pa.scalar(now_us, _TS)
    ended = pc.and_(
        pc.equal(state["status"], Status.IN_FLIGHT.value),
        pc.fill_null(pc.less_equal(state["lease_expires_at"], now), False),
    )
    came = pc.and_(
        pc.equal(state["status"], Status.DEFERRED.value),
        pc.fill_null(pc.less_equal(state["deliver_at"], now), True),
    )
    # A sweep whose clock is behind the last one's (another host's, a step back): a row ready
    # then may be deferred at this ``now``.
    back = pc.and_(
        pc.equal(state["status"], Status.READY.value),
        pc.fill_null(pc.greater(state["deliver_at"], now), False),
    )
    return pc.or_(pc.or_(ended, came), back)


def _stamped(rows: pa.Table, now_us: int, ledger_version: int) -> pa.Table:
    """State rows as the fold outputs them untouched: this sweep's ledger version and time."""
    for name, values in _stamps(rows.num_rows, now_us, ledger_version).items():
        index = rows.schema.get_field_index(name)
        rows = (
            rows.set_column(index, name, values) if index >= 0 else rows.append_column(name, values)
        )
    return rows


def _stamps(n: int, now_us: int, ledger_version: int) -> dict[str, pa.Array]:
    """What the fold writes on each of ``n`` rows it outputs: the ledger version folded, the
    sweep's time, and no TIMEOUT of its own (a caller with one sets ``swept_timeout``)."""
    return {
        "ledger_version": _filled(ledger_version, pa.int64(), n),
        "swept_at": _filled(now_us, _TS, n),
        "swept_timeout": _filled(False, pa.bool_(), n),
    }


def _deliveries(
    state: pa.Table | None,
    messages: pa.Table | None,
    ledger: pa.Table,
    counts: pa.Table,
    now_us: int,
    ledger_version: int,
) -> pa.Table:
    """Rows of the messages delivered simply, and of those consumed simply (see the module's
    docstring)."""
    columns = ["id", "attempt", "lease", "lease_expires_at", "consumer", "at"]
    delivers = ledger.filter(pc.equal(ledger["event"], "DELIVER"))
    ones = counts.filter(pc.equal(counts["id_count"], 1))["id"].combine_chunks()
    twos = counts.filter(pc.equal(counts["id_count"], 2))["id"].combine_chunks()
    alone = delivers.filter(pc.is_in(delivers["id"], value_set=ones)).select(columns)
    alone = alone.append_column("finished", _filled(False, pa.bool_(), alone.num_rows))
    fins = ledger.filter(
        pc.and_(pc.equal(ledger["event"], "FIN"), pc.is_in(ledger["id"], value_set=twos))
    )
    # Two rows per id: a DELIVER joined to a FIN is that id's whole ledger tail.
    pairs = (
        delivers.filter(pc.is_in(delivers["id"], value_set=twos))
        .select(columns)
        .join(
            fins.select(["id", "attempt", "lease", "at"]).rename_columns(
                ["id", "f_attempt", "f_lease", "f_at"]
            ),
            "id",
            join_type="inner",
        )
    )
    pairs = pairs.filter(
        pc.and_(
            pc.and_(
                pc.equal(pairs["attempt"], pairs["f_attempt"]),
                pc.fill_null(pc.equal(pairs["lease"], pairs["f_lease"]), False),
            ),
            # Same time: DELIVER ranks before FIN (lease.RANK), so the FIN still follows it.
            pc.less_equal(pairs["at"], pairs["f_at"]),
        )
    ).select(columns)
    pairs = pairs.append_column("finished", _filled(True, pa.bool_(), pairs.num_rows))
    candidates = pa.concat_tables([alone, pairs], promote_options="permissive")
    if not candidates.num_rows:
        return FOLD_OUTPUT_SCHEMA.empty_table()
    joined = _with_base(candidates, state, messages)
    has_state = pc.is_valid(joined["s_status"])
    base_attempts = pc.if_else(has_state, joined["s_attempts"], pa.scalar(0, pa.int32()))
    base_deliver_at = pc.if_else(has_state, joined["s_deliver_at"], joined["m_deliver_at"])
    startable = pc.and_(
        pc.or_(
            pc.fill_null(pc.is_in(joined["s_status"], value_set=_STARTABLE), False),
            pc.and_(pc.invert(has_state), pc.is_valid(joined["m_present"])),
        ),
        pc.and_(
            pc.equal(joined["attempt"], pc.add(base_attempts, pa.scalar(1, pa.int32()))),
            pc.fill_null(pc.less_equal(base_deliver_at, joined["at"]), True),
        ),
    )
    rows = joined.filter(startable)
    n = rows.num_rows
    if not n:
        return FOLD_OUTPUT_SCHEMA.empty_table()
    has_state = pc.is_valid(rows["s_status"])
    finished = rows["finished"]
    zero = pa.scalar(0, pa.int32())
    at_us = rows["at"].cast(pa.int64())
    expires_us = rows["lease_expires_at"].cast(pa.int64())
    # A lease still held at ``now`` that had ended gets the sweep's TIMEOUT.
    swept = pc.and_(
        pc.invert(finished), pc.fill_null(pc.less_equal(expires_us, pa.scalar(now_us)), False)
    )
    timeouts = pc.if_else(has_state, pc.fill_null(rows["s_timeouts"], zero), zero)
    status = pc.if_else(
        finished,
        pa.scalar(FINISHED),
        pc.if_else(swept, pa.scalar(Status.READY.value), pa.scalar(Status.IN_FLIGHT.value)),
    )
    columns_out = {
        "id": rows["id"],
        "status": status,
        "attempts": rows["attempt"],
        "lease": rows["lease"],
        "lease_owner": rows["consumer"],
        "delivered_at": rows["at"],
        "lease_expires_at": rows["lease_expires_at"],
        # lease.apply's ``(lease_expires_at or at) - at``: an end of 0 counts as none.
        "lease_duration_us": pc.subtract(
            pc.if_else(pc.fill_null(pc.equal(expires_us, 0), True), at_us, expires_us), at_us
        ),
        "deliver_at": pa.nulls(n, _TS),
        "timed_out": swept,
        "requeues": pc.if_else(has_state, pc.fill_null(rows["s_requeues"], zero), zero),
        "timeouts": pc.add(timeouts, pc.cast(swept, pa.int32())),
        "published_at": pc.if_else(has_state, rows["s_published_at"], rows["m_published_at"]),
        "topic_version": pc.if_else(has_state, rows["s_topic_version"], rows["m_topic_version"]),
        **_stamps(n, now_us, ledger_version),
        "swept_timeout": swept,
    }
    return pa.table(columns_out).cast(FOLD_OUTPUT_SCHEMA)


def _arrivals(
    messages: pa.Table, named: list[pa.ChunkedArray], now_us: int, ledger_version: int
) -> pa.Table:
    """Rows of the channel's new messages that no state row or ledger row names (each id once
    in the channel table): ready, or deferred until their ``deliver_at``."""
    counts = messages.group_by("id").aggregate([("id", "count")])
    once = counts.filter(pc.equal(counts["id_count"], 1))["id"].combine_chunks()
    fresh = pc.is_in(messages["id"], value_set=once)
    if named:
        others = pa.chunked_array(named).combine_chunks()
        fresh = pc.and_(fresh, pc.invert(pc.is_in(messages["id"], value_set=others)))
    rows = messages.filter(fresh)
    n = rows.num_rows
    zero = _filled(0, pa.int32(), n)
    later = pc.fill_null(pc.greater(rows["deliver_at"], pa.scalar(now_us, _TS)), False)
    columns_out = {
        "id": rows["id"],
        "status": pc.if_else(
            later, pa.scalar(Status.DEFERRED.value), pa.scalar(Status.READY.value)
        ),
        "attempts": zero,
        "lease": pa.nulls(n, pa.string()),
        "lease_owner": pa.nulls(n, pa.string()),
        "delivered_at": pa.nulls(n, _TS),
        "lease_expires_at": pa.nulls(n, _TS),
        "lease_duration_us": _filled(0, pa.int64(), n),
        "deliver_at": rows["deliver_at"],
        "timed_out": _filled(False, pa.bool_(), n),
        "requeues": zero,
        "timeouts": zero,
        "published_at": rows["published_at"],
        "topic_version": rows["topic_version"],
        **_stamps(n, now_us, ledger_version),
    }
    return pa.table(columns_out).cast(FOLD_OUTPUT_SCHEMA)


def _lone_fins(
    state: pa.Table | None,
    ledger: pa.Table,
    counts: pa.Table,
    now_us: int,
    ledger_version: int,
) -> pa.Table:
    """Finished rows of the messages whose one new ledger row is the FIN of the attempt and
    lease their state row holds, in flight or timed out and not delivered again."""
    if state is None or not state.num_rows:
        return FOLD_OUTPUT_SCHEMA.empty_table()
    ones = counts.filter(pc.equal(counts["id_count"], 1))["id"]
    fins = ledger.filter(
        pc.and_(
            pc.equal(ledger["event"], "FIN"),
            pc.is_in(ledger["id"], value_set=ones.combine_chunks()),
        )
    )
    if not fins.num_rows:
        return FOLD_OUTPUT_SCHEMA.empty_table()
    held = state.filter(pc.is_in(state["id"], value_set=fins["id"].combine_chunks()))
    joined = held.join(
        fins.select(["id", "attempt", "lease"]).rename_columns(["id", "f_attempt", "f_lease"]),
        "id",
        join_type="inner",
    )
    answered = pc.and_(
        pc.and_(
            pc.equal(joined["attempts"], joined["f_attempt"]),
            pc.fill_null(pc.equal(joined["lease"], joined["f_lease"]), False),
        ),
        pc.or_(
            pc.equal(joined["status"], Status.IN_FLIGHT.value),
            pc.and_(pc.equal(joined["status"], Status.READY.value), joined["timed_out"]),
        ),
    )
    rows = joined.filter(answered).select(STATE_SCHEMA.names)
    n = rows.num_rows
    rows = rows.set_column(
        rows.schema.get_field_index("status"), "status", _filled(FINISHED, pa.string(), n)
    )
    rows = rows.set_column(
        rows.schema.get_field_index("timed_out"), "timed_out", _filled(False, pa.bool_(), n)
    )
    return _stamped(rows, now_us, ledger_version).cast(FOLD_OUTPUT_SCHEMA)


def _with_base(joined: pa.Table, state: pa.Table | None, messages: pa.Table | None) -> pa.Table:
    """The candidates with their state row's (``s_``) and channel row's (``m_``) columns, null
    where there is none. A candidate with more than one of either is dropped (left to the
    full fold)."""
    ids = joined["id"].combine_chunks()
    common = ["deliver_at", "published_at", "topic_version"]  # columns both kinds of row have
    for name, table, cols in (
        ("s", state, ["status", "attempts", "requeues", "timeouts", *common]),
        ("m", messages, common),
    ):
        if table is None or not table.num_rows:
            base = pa.table(
                {"id": pa.array([], pa.string())}
                | {f"{name}_{c}": pa.array([], STATE_SCHEMA.field(c).type) for c in cols}
            )
        else:
            base = table.filter(pc.is_in(table["id"], value_set=ids)).select(["id", *cols])
            base = base.rename_columns(["id", *(f"{name}_{c}" for c in cols)])
        if name == "m":
            base = base.append_column("m_present", _filled(True, pa.bool_(), base.num_rows))
        joined = joined.join(base, "id", join_type="left outer")
    counts = joined.group_by("id").aggregate([("id", "count")])
    single = counts.filter(pc.equal(counts["id_count"], 1))["id"]
    return joined.filter(pc.is_in(joined["id"], value_set=single.combine_chunks()))
