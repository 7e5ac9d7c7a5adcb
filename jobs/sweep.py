"""The sweep job: deltaq sweep, or spark-submit jobs/sweep.py --warehouse W [--once].

Folds each channel's new ledger events into its state table, times out leases that ended,
releases due deferrals, and keeps the tables small (checkpoints, compaction, vacuum) and
bounded (retention: rows past the topics' retention_hours and finished_retention_hours).
--once (the default) sweeps once and exits, for cron, Airflow or any scheduler;
--every SECONDS repeats until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])

from jobs.command import (
    CommandError,
    Progress,
    standalone_main,
)
from queue_engine.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from queue_engine.store.upkeep import Maintenance

HELP = "fold ledgers into the state tables, time out ended leases, keep tables small"
log = logging.getLogger("deltaq.sweep")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="sweep once, then exit (default)")
    when.add_argument("--every", type=float, metavar="SECONDS", help="sweep every SECONDS")
    parser.add_argument("--force", action="store_true", help="rewrite every channel's state")
    parser.add_argument("--master", help="Spark master (default local[2], or spark-submit's)")


def run_every(
    spark: SparkSession, settings: Settings, every_s: float, stop: threading.Event
) -> None:
    """Sweep, then wait ``every_s`` (or until ``stop``), until ``stop`` is set. A failed sweep
    is logged and retried at the next interval: it leaves nothing half-written."""
    from queue_engine.spark.sweep import sweep
    from queue_engine.store.tables import Warehouse
    from queue_engine.store.upkeep import RetentionPolicy

    wh = Warehouse(settings.warehouse)
    upkeep = maintenance(settings)
    policy = RetentionPolicy.from_settings(settings)
    # The first sweep runs a retention pass, then one per retention_interval_s.
    retained_at = float("-inf")
    while not stop.is_set():
        due = time.monotonic() - retained_at >= settings.retention_interval_s
        try:
            sweep(
                spark,
                wh,
                maintenance=upkeep,
                retention=policy if due else None,
                pace_backlog=True,
            )
            if due:
                retained_at = time.monotonic()
        except Exception:
            if stop.is_set():
                return
            log.exception("sweep failed; retrying in %.1f s", every_s)
        stop.wait(every_s)


def maintenance(settings: Settings) -> Maintenance:
    """Table upkeep by the settings' policy, kept across sweeps."""
    from queue_engine.store.upkeep import Maintenance, MaintenancePolicy

    return Maintenance(MaintenancePolicy.from_settings(settings))


def run(args: argparse.Namespace, settings: Settings) -> int:
    from queue_engine.spark.session import LazySession, build_session, runs_locally
    from queue_engine.spark.sweep import sweep
    from queue_engine.store.coordination import JobLock
    from queue_engine.store.tables import Warehouse
    from queue_engine.store.upkeep import RetentionPolicy

    warehouse = Warehouse(settings.warehouse)
    if args.every is None and not warehouse.exists():
        raise CommandError(f"no deltaq warehouse at {settings.warehouse} (no registry table)")
    lock = JobLock(settings.warehouse, "sweep", lease_s=settings.store_lease_s).acquire()
    session = LazySession(
        lambda: build_session(args.master, "deltaq-sweep", packages=settings.spark_packages)
    )
    # One local sweep starts Spark only if its fold needs a Spark job (small ones are folded
    # on the driver): a cron's sweep of a quiet warehouse takes seconds, not a JVM's start.
    # On a cluster, or under spark-submit, the session is the application: built at once.
    if args.every is not None or not runs_locally(args.master):
        session.get()
    try:
        if args.every is None:
            progress = Progress()
            report = sweep(
                session,
                warehouse,
                force=args.force,
                maintenance=maintenance(settings),
                progress=progress,
                retention=RetentionPolicy.from_settings(settings),
            )
            progress.done(
                f"swept {report.channels_swept} channels ({report.channels_skipped} unchanged): "
                f"{report.live} live, {report.timeouts} timed out, {report.finished} finished "
                f"in {report.seconds:.1f} s"
                + (
                    f"; retention removed {report.retention.files_removed} files "
                    f"({report.retention.rows_removed} rows)"
                    if report.retention is not None
                    else ""
                )
            )
            return 0
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        run_every(session.get(), settings, args.every, stop)
        return 0
    finally:
        session.stop()
        lock.release()


def main(argv: list[str] | None = None) -> int:
    return standalone_main("sweep", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
