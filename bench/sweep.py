"""Sweep duration and API restart-to-ready for a channel of 1,000,000 live messages.

    .venv/bin/python -m bench.sweep [--messages 1000000] [--expired 0.1]

The channel is written straight into its tables (bench/synthetic.py): every message delivered
once, ``--expired`` of the leases ended a minute ago. Printed:
- the sweep on a local master (local[2]), each run on the driver (the default there) and as a
  Spark job over a copy of the warehouse: first run (folds the whole ledger, writes TIMEOUTs
  and the state), a run with nothing new but the TIMEOUT commit (reads the state back), a run
  after a FIN of every live lease (a consumed backlog);
- for reference, the first fold row by row (queue_engine.state_fold.fold_tables);
- API restart-to-ready (spawn -> first message handed out by /sub), from the sweep's state
  and, for comparison, from the ledger alone (no state table), with the API's RSS then.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from bench.procs import HOST, api_process, free_port, stop
from bench.synthetic import register, write_deliveries, write_messages
from queue_engine.store.tables import LEDGER_SCHEMA, Warehouse


def build(root: Path, messages: int, expired: float) -> tuple[Warehouse, int]:
    wh = Warehouse(str(root))
    register(wh, "bench", "c")
    ids = write_messages(wh, "bench", "c", messages)
    count = write_deliveries(wh, "bench", "c", ids, expired_fraction=expired)
    return wh, count


def restart_to_ready(root: Path, *, without_state: bool) -> tuple[float, float]:
    """Seconds from spawning the API to its first delivered message, and its RSS (MB) by then
    (sampled while waiting; the API's rebuild happens before it answers /ping)."""
    state = Path(root) / "channels" / "bench" / "c" / "state"
    hidden = state.with_name("state.hidden")
    if without_state and state.exists():
        state.rename(hidden)
    port = free_port()
    started = time.perf_counter()
    proc = api_process(root, port)
    rss = 0.0
    try:
        while True:
            rss = max(rss, psutil.Process(proc.pid).memory_info().rss / 2**20)
            try:
                url = f"http://{HOST}:{port}/sub?topic=bench&channel=c&wait_ms=0"
                with urllib.request.urlopen(url, timeout=5) as r:
                    if b'"id"' in r.read():
                        return time.perf_counter() - started, rss
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("the API exited")
            if time.perf_counter() - started > 300:
                raise TimeoutError("not ready after 300 s")
            time.sleep(0.05)
    finally:
        stop(proc)
        if hidden.exists():
            shutil.rmtree(state, ignore_errors=True)
            hidden.rename(state)


def fin_live_leases(wh: Warehouse) -> int:
    """A FIN for every lease still live, as consumers answering would append them."""
    path = wh.channel_ledger_path("bench", "c")
    ledger = DeltaTable(path).to_pyarrow_table()
    ts = pa.timestamp("us", tz="UTC")
    live = ledger.filter(
        pc.and_(
            pc.equal(ledger["event"], "DELIVER"),
            pc.greater(ledger["lease_expires_at"], pa.scalar(time.time_ns() // 1000, ts)),
        )
    )
    n = live.num_rows
    fins = pa.Table.from_arrays(
        [
            live["id"],
            pa.array(["FIN"] * n, pa.string()),
            live["attempt"],
            live["lease"],
            pa.nulls(n, ts),
            pa.nulls(n, ts),
            pa.nulls(n, pa.string()),
            pa.array([time.time_ns() // 1000 + i for i in range(n)], pa.int64()).cast(ts),
        ],
        schema=LEDGER_SCHEMA,
    )
    write_deltalake(path, fins, mode="append")
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--expired", type=float, default=0.1)
    args = parser.parse_args()

    from queue_engine.spark.session import build_session
    from queue_engine.spark.sweep import sweep
    from queue_engine.state_fold import fold_tables

    tmp = Path(tempfile.mkdtemp(prefix="deltaq-bench-sweep-"))
    try:
        t = time.perf_counter()
        wh, expired = build(tmp / "wh", args.messages, args.expired)
        print(
            f"channel: {args.messages:,} messages, all in flight, {expired:,} leases expired "
            f"(written in {time.perf_counter() - t:.1f} s)"
        )
        ledger = DeltaTable(wh.channel_ledger_path("bench", "c")).to_pyarrow_table()
        messages = DeltaTable(wh.channel_messages_path("bench", "c")).to_pyarrow_table(
            columns=["id", "published_at", "deliver_at", "topic_version"]
        )
        t = time.perf_counter()
        fold_tables(None, messages, ledger, time.time_ns() // 1000, 0)
        reference = time.perf_counter() - t
        del ledger, messages

        spark = build_session(None, "deltaq-bench-sweep")
        spark.sparkContext.setLogLevel("ERROR")
        # Each case on the driver (the default on a local master) and as one Spark job
        # (local_max_rows=0) over a copy of the same warehouse, at the same time.
        copy = Warehouse(str(tmp / "spark"))
        shutil.copytree(wh.root, copy.root)
        now = time.time_ns() // 1000
        first = sweep(spark, wh, now=now)
        first_job = sweep(spark, copy, now=now, local_max_rows=0)
        assert first.timeouts == first_job.timeouts == expired, (first, first_job)
        print(
            f"first sweep ({first.live:,} live, {first.timeouts:,} TIMEOUTs written): "
            f"driver {first.seconds:.1f} s, Spark job {first_job.seconds:.1f} s"
        )
        again = sweep(spark, wh, force=True)
        again_job = sweep(spark, copy, force=True, local_max_rows=0)
        print(
            f"again from the state, nothing new (--force): driver {again.seconds:.1f} s, "
            f"Spark job {again_job.seconds:.1f} s"
        )
        fins = fin_live_leases(wh)
        fin_live_leases(copy)
        consumed = sweep(spark, wh)
        consumed_job = sweep(spark, copy, local_max_rows=0)
        assert consumed.finished == consumed_job.finished == fins, (consumed, consumed_job)
        print(
            f"after {fins:,} FINs of the live leases: driver {consumed.seconds:.1f} s, "
            f"Spark job {consumed_job.seconds:.1f} s"
        )
        spark.stop()
        print(f"reference: the first fold row by row in one Python process, {reference:.1f} s")

        ready, rss = restart_to_ready(tmp / "wh", without_state=False)
        print(
            f"API restart to first delivery, from state + ledger tail: {ready:.1f} s, "
            f"RSS {rss:.0f} MB"
        )
        ready, rss = restart_to_ready(tmp / "wh", without_state=True)
        print(
            f"API restart to first delivery, folding the whole ledger: {ready:.1f} s, "
            f"RSS {rss:.0f} MB"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
