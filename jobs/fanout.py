"""The fanout job: deltaq fanout, or spark-submit jobs/fanout.py --warehouse W [--once].

Copies every topic's new messages into each of its channels' tables, exactly once, as a Spark
Structured Streaming query. --once takes what is there now and exits (Trigger.AvailableNow).
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
    Progress,
    standalone_main,
)
from queue_engine.fanout import MAX_FILES_PER_TRIGGER
from queue_engine.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

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
        "delta/deltaq: Spark's writer of that format, the executors write the files and the "
        "driver commits; auto (default): driver on a local master, deltaq on a cluster",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from queue_engine.spark.session import build_session
    from queue_engine.store.coordination import JobLock

    with JobLock(settings.warehouse, "fanout", lease_s=settings.store_lease_s):
        return _run(
            args,
            settings,
            build_session(args.master, "deltaq-fanout", packages=settings.spark_packages),
        )


def _run(args: argparse.Namespace, settings: Settings, spark: SparkSession) -> int:
    from queue_engine.spark.fanout_stream import channel_format_for, finish_fanout, start_fanout
    from queue_engine.spark.session import quiet_stream_stop
    from queue_engine.store.tables import Warehouse

    query = start_fanout(
        spark,
        Warehouse(settings.warehouse),
        once=args.once,
        checkpoint=args.checkpoint or settings.fanout_checkpoint or None,
        max_files_per_trigger=args.max_files_per_trigger,
        channel_format=channel_format_for(spark, args.channel_writes),
    )

    # A signal only asks: the handler runs in the main thread, possibly in the middle of a
    # call to the JVM, and a call of its own there would break that one's connection.
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    progress = _Follow() if args.once else None
    while not query.awaitTermination(1):
        if progress is not None:
            progress.update(query)
        if stopping.is_set():
            quiet_stream_stop(spark)
            query.stop()
    if progress is not None:
        progress.done(query)
    exception = query.exception()
    finish_fanout(query)
    spark.stop()
    if exception is not None:
        log.error("fanout failed: %s", exception)
        return 1
    return 0


class _Follow:
    """A progress line while a one-shot fanout runs: batches done and messages moved."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.started = time.monotonic()
        self.batches = 0
        self.rows = 0

    def _count(self, query: StreamingQuery) -> None:
        from queue_engine.spark.fanout_stream import moved_by

        moved = moved_by(query)
        self.batches, self.rows = moved.batches, moved.rows

    def update(self, query: StreamingQuery) -> None:
        self._count(query)
        self.progress(
            f"fanout: {self.batches} batches, {self.rows:,} messages, "
            f"{time.monotonic() - self.started:.0f} s"
        )

    def done(self, query: StreamingQuery) -> None:
        self._count(query)
        self.progress.done(
            f"fanout: done, {self.batches} batches, {self.rows:,} messages in "
            f"{time.monotonic() - self.started:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    return standalone_main("fanout", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
