"""Retention under a steady load: table sizes and sweep time over simulated hours.

    .venv/bin/python -m bench.retention [--hours 4] [--per-hour 1000000] [--retention-hours 1]

Simulated time: each step (a quarter of an hour by default) writes a quarter of an hour's
traffic straight into the tables the API and the fanout write (bench/synthetic.py's way: real
Delta commits, same schemas): the topic's rows, the channel's copies, a DELIVER and a FIN per
message in the ledger, message times from the simulated clock. Then the real sweep runs on
local Spark with ``now`` = the simulated time and the retention pass of the settings (topic
rows ``--retention-hours`` after publishing once taken; channel rows as long after their FIN).

Printed per step: the sweep's seconds (fold + state + retention), and each table's live size
(its current files) as a multiple of one hour's data of that table. Bounded storage means the
multiples stay near 1 (the bar: <= 1.5) and the sweep time stays flat while the data written
grows.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable

from bench.synthetic import register
from queue_engine.settings import RetentionMode, Settings
from queue_engine.spark.session import build_session
from queue_engine.spark.sweep import sweep
from queue_engine.store.delta import LocalAppender, conform, open_or_create
from queue_engine.store.tables import (
    CHANNEL_MESSAGES_SCHEMA,
    LEDGER_SCHEMA,
    TOPIC_SCHEMA,
    Warehouse,
    hex_id_array,
)
from queue_engine.store.upkeep import Maintenance, MaintenancePolicy, RetentionPolicy

_TS = pa.timestamp("us", tz="UTC")
HOUR_US = 3_600_000_000
# A fixed simulated start (2026-01-01): the run is the same whatever the wall clock says.
START_US = 1_767_225_600_000_000


class Load:
    """One topic with one channel, fed and consumed at a steady rate in simulated time."""

    def __init__(self, wh: Warehouse, body_bytes: int, commits_per_step: int) -> None:
        self.wh = wh
        self.body_bytes = body_bytes
        self.commits = commits_per_step
        register(wh, "load", "c")
        self.topic = self._appender(wh.topic_path("load"), TOPIC_SCHEMA)
        self.messages = self._appender(
            wh.channel_messages_path("load", "c"), CHANNEL_MESSAGES_SCHEMA
        )
        self.ledger = self._appender(wh.channel_ledger_path("load", "c"), LEDGER_SCHEMA)
        self.written = {"topic": 0, "messages": 0, "ledger": 0}
        self._rng = np.random.default_rng(7)

    @staticmethod
    def _appender(path: str, schema: pa.Schema) -> LocalAppender:
        open_or_create(path, schema)
        return LocalAppender(path)

    def step(self, start_us: int, length_us: int, count: int) -> None:
        """``count`` messages published, fanned out, delivered and FIN'd in
        [start_us, start_us + length_us), in ``commits`` commits of each table."""
        per_commit = count // self.commits
        for j in range(self.commits):
            at = start_us + j * length_us // self.commits
            n = per_commit
            ids = hex_id_array((at // 1000) << 22, n)
            raw = self._rng.bytes(n * self.body_bytes)
            bodies = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(self.body_bytes), n, [None, pa.py_buffer(raw)]
            ).cast(pa.binary())
            published = pa.array(np.full(n, at, dtype=np.int64)).cast(_TS)
            rows = conform(
                pa.Table.from_arrays(
                    [ids, bodies, published], names=["id", "body", "published_at"]
                ),
                TOPIC_SCHEMA,
            )
            version = self.topic.append(rows)
            copies = conform(
                rows.append_column("topic_version", pa.array(np.full(n, version, dtype=np.int64))),
                CHANNEL_MESSAGES_SCHEMA,
            )
            self.messages.append(copies)
            self.ledger.append(_deliver_and_fin(ids, at))
            self.written["topic"] += n
            self.written["messages"] += n
            self.written["ledger"] += 2 * n


def _deliver_and_fin(ids: pa.StringArray, at: int) -> pa.Table:
    n = len(ids)
    index = np.arange(n, dtype=np.int64)
    leases = pa.array([f"1-{i:012x}" for i in range(n)], pa.string())
    delivered = at + 1_000 + index
    return pa.Table.from_arrays(
        [
            pa.concat_arrays([ids, ids]),
            pa.array(["DELIVER"] * n + ["FIN"] * n, pa.string()),
            pa.array(np.ones(2 * n, dtype=np.int32)),
            pa.concat_arrays([leases, leases]),
            pa.concat_arrays([pa.array(delivered + 60_000_000).cast(_TS), pa.nulls(n, _TS)]),
            pa.nulls(2 * n, _TS),
            pa.array(["bench"] * (2 * n), pa.string()),
            pa.concat_arrays(
                [pa.array(delivered).cast(_TS), pa.array(delivered + 500_000).cast(_TS)]
            ),
        ],
        schema=LEDGER_SCHEMA,
    )


def live(path: str) -> tuple[int, int]:
    """(rows, bytes) of the table's current files."""
    actions = pa.table(DeltaTable(path).get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return 0, 0
    return int(pa.compute.sum(actions["num_records"]).as_py()), int(
        pa.compute.sum(actions["size_bytes"]).as_py()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--per-hour", type=int, default=1_000_000)
    parser.add_argument("--retention-hours", type=float, default=1.0)
    parser.add_argument("--steps-per-hour", type=int, default=4)
    parser.add_argument("--commits-per-step", type=int, default=25)
    parser.add_argument("--body-bytes", type=int, default=100)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="deltaq-bench-retention-"))
    spark = build_session("local[2]", "deltaq-bench-retention")
    try:
        wh = Warehouse(str(root / "wh"))
        load = Load(wh, args.body_bytes, args.commits_per_step)
        policy = RetentionPolicy(args.retention_hours, RetentionMode.TAKEN, args.retention_hours)
        upkeep = Maintenance(MaintenancePolicy.from_settings(Settings()))
        step_us = HOUR_US // args.steps_per_hour
        per_step = args.per_hour // args.steps_per_hour
        steps = round(args.hours * args.steps_per_hour)
        tables = {
            "topic": wh.topic_path("load"),
            "messages": wh.channel_messages_path("load", "c"),
            "ledger": wh.channel_ledger_path("load", "c"),
        }
        print(
            f"{args.per_hour:,} messages/hour for {args.hours:g} simulated hours, retention "
            f"{args.retention_hours:g} h; live size per table as a multiple of one hour's data"
        )
        print(
            f"{'sim time':>8} {'written':>10} {'sweep s':>8} {'retain s':>8} "
            f"{'removed':>9}  " + "  ".join(f"{name:>14}" for name in tables)
        )
        worst = {name: 0.0 for name in tables}
        sweeps: list[float] = []
        hour_bytes: dict[str, list[int]] = {name: [] for name in tables}
        for k in range(steps):
            start = START_US + k * step_us
            before = {name: live(path)[1] for name, path in tables.items()}
            load.step(start, step_us, per_step)
            for name, path in tables.items():
                # Bytes this step wrote: the growth of the table before retention runs.
                hour_bytes[name].append(live(path)[1] - before[name])
            now = start + step_us
            began = time.perf_counter()
            # As deltaq sweep does (and the API, for the topic table): checkpoints, compaction.
            upkeep.upkeep(tables["topic"])
            report = sweep(spark, wh, now=now, maintenance=upkeep, retention=policy)
            seconds = time.perf_counter() - began
            sweeps.append(seconds)
            retained = report.retention
            cells = []
            for name, path in tables.items():
                rows, size = live(path)
                one_hour = sum(hour_bytes[name][-args.steps_per_hour :]) * (
                    args.steps_per_hour / min(len(hour_bytes[name]), args.steps_per_hour)
                )
                ratio = size / one_hour if one_hour else 0.0
                if k + 1 > args.retention_hours * args.steps_per_hour:
                    worst[name] = max(worst[name], ratio)
                cells.append(f"{rows:>9,} {ratio:4.2f}x")
            print(
                f"{(k + 1) / args.steps_per_hour:>7.2f}h {sum(load.written.values()):>10,} "
                f"{seconds:>8.1f} {retained.seconds if retained else 0:>8.1f} "
                f"{retained.files_removed if retained else 0:>9}  " + "  ".join(cells)
            )
        print()
        print(
            "worst live size after the first retention period, x one hour's data: "
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in worst.items())
        )
        later = sweeps[args.steps_per_hour :]
        print(
            f"sweep seconds: first hour {min(sweeps[: args.steps_per_hour]):.1f}-"
            f"{max(sweeps[: args.steps_per_hour]):.1f}, after {min(later or [0]):.1f}-"
            f"{max(later or [0]):.1f}"
        )
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
