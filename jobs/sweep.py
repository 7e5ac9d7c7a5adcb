"""The sweep job: ``deltaq sweep`` or ``spark-submit jobs/sweep.py --warehouse W [--once]``.

``--once`` sweeps every channel that needs it and exits (for cron, Airflow or any scheduler);
``--every SECONDS`` repeats until SIGINT/SIGTERM. See queue_engine/spark/sweep.py.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

log = logging.getLogger("deltaq.sweep")


def run_every(spark: object, warehouse: str, every_s: float, stop: threading.Event) -> None:
    """Sweep, then wait ``every_s`` (or until ``stop``), until ``stop`` is set. A failed sweep
    is logged and retried at the next interval: it leaves nothing half-written."""
    from queue_engine.spark.sweep import sweep
    from queue_engine.store.tables import Warehouse

    wh = Warehouse(warehouse)
    upkeep = maintenance()
    while not stop.is_set():
        try:
            sweep(spark, wh, maintenance=upkeep)  # type: ignore[arg-type]
        except Exception:
            if stop.is_set():
                return
            log.exception("sweep failed; retrying in %.1f s", every_s)
        stop.wait(every_s)


def maintenance() -> object:
    """Table upkeep by the settings' policy (DELTAQ_* / DELTAQ_CONFIG), kept across sweeps."""
    from queue_engine.settings import load_settings
    from queue_engine.store.maintenance import Maintenance, MaintenancePolicy

    return Maintenance(MaintenancePolicy.from_settings(load_settings()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaq sweep", description=__doc__)
    parser.add_argument("--warehouse", required=True)
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="sweep once, then exit (default)")
    when.add_argument("--every", type=float, metavar="SECONDS", help="sweep every SECONDS")
    parser.add_argument("--force", action="store_true", help="rewrite every channel's state")
    parser.add_argument("--master", help="Spark master (default local[2], or spark-submit's)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from queue_engine.spark.session import build_session
    from queue_engine.spark.sweep import sweep
    from queue_engine.store.tables import Warehouse

    spark = build_session(args.master, "deltaq-sweep")
    try:
        if args.every is None:
            report = sweep(
                spark,
                Warehouse(args.warehouse),
                force=args.force,
                maintenance=maintenance(),  # type: ignore[arg-type]
            )
            print(
                f"swept {report.channels_swept} channels ({report.channels_skipped} unchanged): "
                f"{report.live} live, {report.timeouts} timed out, {report.finished} finished "
                f"in {report.seconds:.1f} s"
            )
            return 0
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        run_every(spark, args.warehouse, args.every, stop)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])
    raise SystemExit(main())
