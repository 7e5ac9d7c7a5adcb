"""Many topics on one node: what an idle API costs as the number of tables grows.

Creates ``--topics`` topics with one channel each through the API (a fresh warehouse), then
leaves it idle and prints its threads, resident memory and CPU over ``--idle-seconds``, and
how long the creation took. The bars for 10,000 topics: under 100 threads, under 1.5 GB RSS,
under 5% of one core idle.

    python -m bench.many_topics [--topics 1000] [--idle-seconds 10] [--warehouse DIR]

With ``--warehouse`` the warehouse is kept; run again on it, the topics are not created again
and the figures are those of an API restarted over them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil

from bench.procs import api_process, create_topics, free_port, stop, wait_all_open


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    # delta-rs's I/O threads (tokio's blocking pool) outlive a burst by ~10 s of no work.
    parser.add_argument("--settle-seconds", type=float, default=30.0)
    parser.add_argument("--warehouse", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        warehouse = args.warehouse or Path(tmp) / "wh"
        existing = (warehouse / "topics").is_dir()
        proc = api_process(warehouse, port)
        print(f"API pid {proc.pid} on port {port}", flush=True)  # for a profiler to attach
        try:
            started = time.perf_counter()

            if not existing:
                create_topics(port, args.topics, args.clients)
            created = time.perf_counter() - started
            # A restart: the background opening finishes before idle is measured.
            if existing and wait_all_open(warehouse):
                created = time.perf_counter() - started
                print(f"restarted: every topic and channel open {created:.0f} s after answering")
            api = psutil.Process(proc.pid)
            time.sleep(args.settle_seconds)  # creation's upkeep and I/O threads wind down
            before = api.cpu_times()
            time.sleep(args.idle_seconds)
            after = api.cpu_times()
            busy = (after.user + after.system) - (before.user + before.system)
            print(
                (
                    f"{args.topics:,} topics with a channel each: restarted over them; "
                    if existing
                    else f"{args.topics:,} topics with a channel each: created in {created:.1f} s "
                    f"({created / max(1, args.topics) * 1000:.1f} ms each, "
                    f"{args.clients} clients); "
                )
                + "idle: "
                f"{api.num_threads()} threads, {api.memory_info().rss / 2**20:,.0f} MiB RSS, "
                f"{busy / args.idle_seconds * 100:.1f}% of one core",
                flush=True,
            )
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
