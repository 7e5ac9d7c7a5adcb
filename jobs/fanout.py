"""The fanout job: deltaq fanout, or spark-submit jobs/fanout.py --warehouse W [--once].

Copies every topic's new messages into each of its channels' tables, exactly once, as a Spark
Structured Streaming query. --once takes what is there now and exits (Trigger.AvailableNow).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from types import FrameType

if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])

from jobs.command import (
    Progress,
    standalone_main,
)
from queue_engine.fanout import MAX_FILES_PER_TRIGGER
from queue_engine.settings import Settings

HELP = "run the fanout stream (topics -> channel tables, exactly once)"
log = logging.getLogger("deltaq.fanout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from queue_engine.fanout import CHANNEL_WRITES

    parser.add_argument(
        "--once",
        action="store_true",
        help="fan out everything available now, then exit (Trigger.AvailableNow)",
    )
    parser.add_argument(
        "--checkpoint",
        help="where Spark keeps the stream's offsets (default: the settings' fanout_checkpoint, "
        "else <warehouse>/_checkpoints/fanout)",
    )
    parser.add_argument("--master", help="Spark master (default local[2], or spark-submit's)")
    parser.add_argument(
        "--max-files-per-trigger",
        type=int,
        default=MAX_FILES_PER_TRIGGER,
        metavar="N",
        help=f"topic files read per micro-batch at most (default {MAX_FILES_PER_TRIGGER})",
    )
    parser.add_argument(
        "--channel-writes",
        default="auto",
        choices=CHANNEL_WRITES,
        help="driver: collect each micro-batch and append through delta-rs (lowest latency); "
        "delta/deltaq: Spark's writer of that format; auto (default): delta where "
        "delta-spark's jars load, else driver",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from queue_engine.spark.fanout_stream import channel_format_for, start_fanout
    from queue_engine.spark.session import build_session, quiet_stream_stop
    from queue_engine.store.tables import Warehouse

    spark = build_session(args.master, "deltaq-fanout")
    query = start_fanout(
        spark,
        Warehouse(settings.warehouse),
        once=args.once,
        checkpoint=args.checkpoint or settings.fanout_checkpoint or None,
        max_files_per_trigger=args.max_files_per_trigger,
        channel_format=channel_format_for(spark, args.channel_writes),
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        quiet_stream_stop(spark)
        query.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.once:
        _follow(query)
    query.awaitTermination()
    exception = query.exception()
    spark.stop()
    if exception is not None:
        log.error("fanout failed: %s", exception)
        return 1
    return 0


def _follow(query: object) -> None:
    """A progress line while a one-shot fanout runs: batches done and messages moved."""
    progress = Progress()
    started = time.monotonic()
    rows = 0
    seen: set[int] = set()
    while query.isActive:  # type: ignore[attr-defined]
        for p in query.recentProgress:  # type: ignore[attr-defined]
            if p["batchId"] not in seen:
                seen.add(p["batchId"])
                rows += int(p["numInputRows"])
        progress(
            f"fanout: {len(seen)} batches, {rows:,} messages, {time.monotonic() - started:.0f} s"
        )
        time.sleep(0.5)
    for p in query.recentProgress:  # type: ignore[attr-defined]
        if p["batchId"] not in seen:
            seen.add(p["batchId"])
            rows += int(p["numInputRows"])
    progress.done(
        f"fanout: done, {len(seen)} batches, {rows:,} messages in "
        f"{time.monotonic() - started:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    return standalone_main("fanout", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
