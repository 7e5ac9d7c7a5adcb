"""The jobs of ``deltaq up`` on one local Spark: the fanout stream and the sweep every N s.

``deltaq up`` runs this in a child process next to the API (the API does not use Spark, and
keeping the JVM bridge out of its process keeps its event loop responsive).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

log = logging.getLogger("deltaq.jobs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaq jobs", description=__doc__)
    parser.add_argument("--warehouse", required=True)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between sweeps")
    parser.add_argument("--master", help="Spark master (default local[2])")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from jobs.sweep import run_every
    from queue_engine.spark.fanout_stream import channel_format_for, start_fanout
    from queue_engine.spark.session import build_session
    from queue_engine.store.tables import Warehouse

    spark = build_session(args.master, "deltaq-jobs")
    query = start_fanout(
        spark, Warehouse(args.warehouse), once=False, channel_format=channel_format_for(spark)
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sweeper = threading.Thread(
        target=run_every, args=(spark, args.warehouse, args.every, stop), name="deltaq-sweep"
    )
    sweeper.start()
    log.info(
        "fanout stream and sweep (every %.1f s) on Spark %s, warehouse %s",
        args.every,
        spark.sparkContext.master,
        args.warehouse,
    )
    while not stop.wait(1.0):
        if not query.isActive:
            log.error("fanout stopped: %s", query.exception())
            stop.set()
    query.stop()
    sweeper.join(120)
    failed = query.exception() is not None
    spark.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])
    raise SystemExit(main())
