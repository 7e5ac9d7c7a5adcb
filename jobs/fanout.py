"""The fanout job: ``deltaq fanout`` or ``spark-submit jobs/fanout.py --warehouse W [--once]``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType


def main(argv: list[str] | None = None) -> int:
    from queue_engine.fanout import CHANNEL_WRITES

    parser = argparse.ArgumentParser(prog="deltaq fanout", description=__doc__)
    parser.add_argument("--warehouse", required=True)
    parser.add_argument(
        "--once",
        action="store_true",
        help="process everything available, then exit (Trigger.AvailableNow)",
    )
    parser.add_argument("--checkpoint", help="default: <warehouse>/_checkpoints/fanout")
    parser.add_argument("--master", help="Spark master (default local[2], or spark-submit's)")
    parser.add_argument("--max-files-per-trigger", type=int, default=200)
    parser.add_argument(
        "--channel-writes",
        default="auto",
        choices=CHANNEL_WRITES,
        help="driver: collect each micro-batch and append through delta-rs (lowest latency); "
        "delta/deltaq: Spark's writer of that format; auto (default): delta where "
        "delta-spark's jars load, else driver",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from queue_engine.spark.fanout_stream import channel_format_for, start_fanout
    from queue_engine.spark.session import build_session
    from queue_engine.store.tables import Warehouse

    spark = build_session(args.master, "deltaq-fanout")
    query = start_fanout(
        spark,
        Warehouse(args.warehouse),
        once=args.once,
        checkpoint=args.checkpoint,
        max_files_per_trigger=args.max_files_per_trigger,
        channel_format=channel_format_for(spark, args.channel_writes),
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        query.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    query.awaitTermination()
    exception = query.exception()
    spark.stop()
    if exception is not None:
        logging.getLogger("deltaq.fanout").error("fanout failed: %s", exception)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])
    raise SystemExit(main())
