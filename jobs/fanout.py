"""The fanout job: deltaq fanout, or spark-submit jobs/fanout.py --warehouse W [--once].

Copies every topic's new messages into each of its channels' tables, exactly once: as a Spark
Structured Streaming query on a cluster, and on a local master as the same micro-batches on the
same checkpoint run by a loop without Spark (fanout_in_spark = true: the query there too).
--once takes what is there now and exits (Trigger.AvailableNow).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

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
        "--log-batches",
        action="store_true",
        help="a log line per batch (the fanout without Spark, on a local master, runs up to 20 "
        "a second and otherwise logs a summary a minute, and each batch slower than 1 s)",
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
    from queue_engine.spark.fanout_loop import loop_keeps
    from queue_engine.spark.session import build_session, runs_locally
    from queue_engine.store.coordination import JobLock

    checkpoint = args.checkpoint or settings.fanout_checkpoint or None
    with JobLock(settings.warehouse, "fanout", lease_s=settings.store_lease_s):
        if (
            runs_locally(args.master)
            and not settings.fanout_in_spark
            and args.channel_writes in ("auto", "driver")
            and loop_keeps(checkpoint)
        ):
            # One machine, channel rows written by this process: no Spark needed.
            return _run_loop(args, settings, checkpoint)
        return _run(
            args,
            settings,
            build_session(args.master, "deltaq-fanout", packages=settings.spark_packages),
        )


def _run_loop(args: argparse.Namespace, settings: Settings, checkpoint: str | None) -> int:
    from queue_engine.spark.fanout_loop import FanoutLoop
    from queue_engine.store.tables import Warehouse

    loop = FanoutLoop(
        Warehouse(settings.warehouse),
        once=args.once,
        checkpoint=checkpoint,
        max_files_per_trigger=args.max_files_per_trigger,
        log_batches=args.log_batches,
    ).start()
    log.info("fanout: in this process, on Spark's checkpoint format, without Spark")
    try:
        return _follow(args, loop, loop.stop, lambda: loop.moved)
    finally:
        loop.stop()  # before the job lock goes, whatever happened


def _run(args: argparse.Namespace, settings: Settings, spark: SparkSession) -> int:
    from queue_engine.spark.fanout_stream import (
        channel_format_for,
        finish_fanout,
        moved_by,
        start_fanout,
    )
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

    def stop_query() -> None:
        quiet_stream_stop(spark)
        query.stop()

    try:
        return _follow(args, query, stop_query, lambda: moved_by(query))
    finally:
        finish_fanout(query)
        spark.stop()


def _follow(
    args: argparse.Namespace, query: Any, stop_query: Callable[[], None], moved: Callable[[], Any]
) -> int:
    """Wait for the fanout (Spark's query or the loop) to end, or stop it on SIGTERM/SIGINT;
    a one-shot run shows its progress."""
    # A signal only asks: the handler runs in the main thread, possibly in the middle of a
    # call to the JVM, and a call of its own there would break that one's connection.
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    progress = _Follow(moved) if args.once else None
    while not query.awaitTermination(1):
        if progress is not None:
            progress.update()
        if stopping.is_set():
            stop_query()
    if progress is not None:
        progress.done()
    exception = query.exception()
    if exception is not None:
        log.error("fanout failed: %s", exception)
        return 1
    return 0


class _Follow:
    """A progress line while a one-shot fanout runs: batches done and messages moved."""

    def __init__(self, moved: Callable[[], Any]) -> None:
        self.progress = Progress()
        self.started = time.monotonic()
        self.moved = moved

    def update(self) -> None:
        moved = self.moved()
        self.progress(
            f"fanout: {moved.batches} batches, {moved.rows:,} messages, "
            f"{time.monotonic() - self.started:.0f} s"
        )

    def done(self) -> None:
        moved = self.moved()
        self.progress.done(
            f"fanout: done, {moved.batches} batches, {moved.rows:,} messages in "
            f"{time.monotonic() - self.started:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    return standalone_main("fanout", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
