"""The sweep and the SQL views over many channels: planning and reading follow what changed.

    .venv/bin/python -m bench.many_channels [--channels 10000] [--changed 100]

``--channels`` topics with one channel each are written straight into their tables
(bench/synthetic.py: 5 messages, one delivered with a live lease). Printed, on local Spark
(local[2]), each from a fresh start of the step:
- the first sweep (every channel has something new);
- a sweep after ``--changed`` channels got a new delivery (bar for 100 of 10,000: under 20 s);
- ``SELECT * FROM queue_stats`` with the views registered (bar: under 60 s);
- for reference, one retention pass over every table (the sweep runs one every
  retention_interval_s, 300 s by default).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from bench.synthetic import write_deliveries, write_messages
from queue_engine.registry import Action, RegistryEvent
from queue_engine.store.tables import RegistryStore, Warehouse


def build(wh: Warehouse, channels: int) -> None:
    store = RegistryStore(wh.registry_path)
    now = time.time_ns() // 1000
    for i in range(channels):
        store.append(RegistryEvent(2 * i, now, Action.TOPIC_CREATE, f"t{i}"))
        store.append(RegistryEvent(2 * i + 1, now, Action.CHANNEL_CREATE, f"t{i}", "c", -1, 0))
    store.close()
    # As the API's upkeep keeps it: compacted and checkpointed (20,000 one-event commits read
    # back file by file cost each sweep ~10 s here).
    from queue_engine.settings import Settings
    from queue_engine.store.upkeep import Maintenance, MaintenancePolicy

    policy = MaintenancePolicy.from_settings(Settings(warehouse=wh.root))
    Maintenance(replace(policy, compact_min_small_files=1)).upkeep(wh.registry_path)
    for i in range(channels):
        ids = write_messages(wh, f"t{i}", "c", 5, first_id=16 * i + 1)
        write_deliveries(wh, f"t{i}", "c", ids[:1], expired_fraction=0.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channels", type=int, default=10_000)
    parser.add_argument("--changed", type=int, default=100)
    args = parser.parse_args()

    from queue_engine.settings import Settings
    from queue_engine.spark.session import build_session
    from queue_engine.spark.sweep import sweep
    from queue_engine.spark.views import register_views
    from queue_engine.store.tables import RegistryReader
    from queue_engine.store.upkeep import RetentionPolicy, apply_retention

    with tempfile.TemporaryDirectory() as tmp:
        wh = Warehouse(str(Path(tmp) / "wh"))
        started = time.perf_counter()
        build(wh, args.channels)
        print(f"{args.channels:,} channels written in {time.perf_counter() - started:.0f} s")
        spark = build_session(None, "deltaq-bench-many-channels")
        spark.sparkContext.setLogLevel("ERROR")
        try:
            first = sweep(spark, wh)
            print(f"first sweep: {first.channels_swept:,} channels swept in {first.seconds:.1f} s")
            for i in range(args.changed):
                ids = write_messages(wh, f"t{i}", "c", 1, first_id=16 * (args.channels + i) + 1)
                write_deliveries(wh, f"t{i}", "c", ids, expired_fraction=0.0)
            second = sweep(spark, wh)
            print(
                f"sweep with {args.changed:,} of {args.channels:,} channels changed: "
                f"{second.channels_swept:,} swept, {second.channels_skipped:,} skipped, "
                f"{second.seconds:.1f} s (bar: under 20 s)"
            )
            started = time.perf_counter()
            register_views(spark, wh)
            rows = spark.sql("SELECT * FROM queue_stats").collect()
            print(
                f"SELECT * FROM queue_stats: {len(rows):,} rows in "
                f"{time.perf_counter() - started:.1f} s (bar: under 60 s)"
            )
            registry = RegistryReader(wh.registry_path).get()
            policy = RetentionPolicy.from_settings(Settings(warehouse=wh.root))
            report = apply_retention(wh, registry, policy, time.time_ns() // 1000)
            print(f"one retention pass over every table: {report.seconds:.1f} s")
        finally:
            spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
