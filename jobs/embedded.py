"""The jobs of deltaq up on one local Spark: the fanout stream, the sweep every N seconds, and
a Spark Connect endpoint on loopback that deltaq sql uses instead of starting its own Spark.

deltaq up runs this in a child process next to the API (the API does not use Spark, and
keeping the JVM bridge out of its process keeps its event loop responsive). It gets the API's
settings whole, as JSON on standard input (--config -).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])

from jobs.command import (
    standalone_main,
)
from queue_engine.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from queue_engine.spark.fanout_loop import FanoutLoop
    from queue_engine.store.tables import Warehouse

HELP = "the fanout and the sweep on one Spark (what deltaq up starts)"
log = logging.getLogger("deltaq.jobs")

# What the jobs process writes to --ready-fd once the stream and the sweep are running.
READY = b"ready\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--every", type=float, metavar="SECONDS", help="seconds between sweeps (settings' default)"
    )
    parser.add_argument("--master", help="Spark master (default local[2])")
    parser.add_argument(
        "--ready-fd", type=int, metavar="FD", help="write 'ready' to this file descriptor"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="Spark's own output too (else in a log file)"
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        metavar="FD",
        help="the read end of a pipe the starting process holds open: stop when it closes",
    )


class ParentWatch:
    """The jobs process ends with the process that started it (``deltaq up``), however that
    one ends (SIGKILL included): it holds a pipe's write end open and never writes; the kernel
    closes it when the process is gone, and the read here returns. Before the jobs serve
    (Spark starting) the process exits at once; the JVM follows by itself (PySpark's gateway
    exits when its stdin, a pipe from this process, closes), and Spark's Python workers with
    it. Once serving, it stops in order (the stream, the sweep), within PARENT_GONE_GRACE_S."""

    def __init__(self, fd: int, stop: threading.Event) -> None:
        self.stop = stop
        self.serving = threading.Event()
        self._fd = fd
        threading.Thread(target=self._watch, daemon=True, name="deltaq-parent-watch").start()

    def _watch(self) -> None:
        with os.fdopen(self._fd, "rb") as pipe:
            pipe.read()  # returns at end of file: every write end is closed
        self.gone()

    def gone(self) -> None:
        log.warning("the process that started this one (deltaq up) is gone: stopping")
        if not self.serving.is_set():
            os._exit(PARENT_GONE)
        self.stop.set()
        threading.Timer(PARENT_GONE_GRACE_S, os._exit, args=(PARENT_GONE,)).start()


# Exit code of a jobs process whose parent went away; seconds it may take to stop in order.
PARENT_GONE = 3
PARENT_GONE_GRACE_S = 60.0


def run(args: argparse.Namespace, settings: Settings) -> int:
    from queue_engine.store.coordination import JobLock

    stop = threading.Event()
    # First, before anything slow (the job locks, Spark's start).
    parent = ParentWatch(args.parent_fd, stop) if args.parent_fd is not None else None
    every = args.every if args.every is not None else settings.sweep_interval_s
    with contextlib.ExitStack() as held:
        for job in ("fanout", "sweep"):
            held.enter_context(JobLock(settings.warehouse, job, lease_s=settings.store_lease_s))
        return _run(args, settings, every, stop, parent)


def _run(
    args: argparse.Namespace,
    settings: Settings,
    every: float,
    stop: threading.Event,
    parent: ParentWatch | None,
) -> int:
    from queue_engine.ports import check_ports, spark_connect_listener
    from queue_engine.spark.fanout_loop import FanoutLoop, loop_keeps
    from queue_engine.spark.session import build_session, runs_locally
    from queue_engine.store.tables import Warehouse

    warehouse = Warehouse(settings.warehouse)
    checkpoint = settings.fanout_checkpoint or None
    # On one machine the fanout runs in this process without Spark (queue_engine.spark.
    # fanout_loop), from before Spark starts; on a cluster master it is Spark's query.
    loop = None
    if runs_locally(args.master) and not settings.fanout_in_spark and loop_keeps(checkpoint):
        loop = FanoutLoop(warehouse, once=False, checkpoint=checkpoint).start()
    try:
        # Spark would print a Java stack trace for a busy port: one line instead.
        check_ports(spark_connect_listener(settings))
        spark = build_session(
            args.master,
            "deltaq-jobs",
            connect_port=settings.spark_connect_port or None,
            # Spark's banners, log4j warnings and Spark Connect's errors about deltaq sql's
            # sessions go to a file, not to deltaq up's terminal (--verbose shows them).
            quiet=not args.verbose,
            packages=settings.spark_packages,
        )
        return _serve(args, settings, every, stop, parent, spark, loop, warehouse, checkpoint)
    except BaseException:
        # Nothing may go on writing once this returns: the job locks are released then.
        stop.set()
        if loop is not None:
            loop.stop()
        raise


def _serve(
    args: argparse.Namespace,
    settings: Settings,
    every: float,
    stop: threading.Event,
    parent: ParentWatch | None,
    spark: SparkSession,
    loop: FanoutLoop | None,
    warehouse: Warehouse,
    checkpoint: str | None,
) -> int:
    """The fanout (Spark's query unless ``loop`` runs it), the sweep and Spark Connect, until
    ``stop`` is set."""
    from jobs.sweep import run_every
    from queue_engine.spark.fanout_stream import channel_format_for, finish_fanout, start_fanout
    from queue_engine.spark.session import quiet_stream_stop

    query: Any = loop
    if loop is None:
        query = start_fanout(
            spark,
            warehouse,
            once=False,
            checkpoint=checkpoint,
            channel_format=channel_format_for(spark),
        )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent is not None:
        parent.serving.set()
    sweeper = threading.Thread(
        target=run_every, args=(spark, settings, every, stop), name="deltaq-sweep"
    )
    sweeper.start()
    log.info(
        "fanout %s and sweep (every %.1f s) on Spark %s, warehouse %s%s",
        "in this process" if loop is not None else "stream",
        every,
        spark.sparkContext.master,
        settings.warehouse,
        f"; Spark Connect on sc://127.0.0.1:{settings.spark_connect_port}"
        if settings.spark_connect_port
        else "",
    )
    if args.ready_fd is not None:
        try:
            with os.fdopen(args.ready_fd, "wb") as ready:
                ready.write(READY)
        except BrokenPipeError:
            # Nobody to tell: the parent is gone (its watch stops this process).
            stop.set()
    warming: list[Any] = []  # the warming's Spark Connect session, while it runs
    if settings.spark_connect_port and not stop.is_set():
        threading.Thread(
            target=_warm_spark_connect, args=(settings, warming), daemon=True, name="deltaq-warm"
        ).start()
    while not stop.wait(1.0):
        if not query.isActive:
            log.error("fanout stopped: %s", query.exception())
            stop.set()
    for client in list(warming):
        # A warming still under way (a busy machine) ends now: its session, left open, would
        # retry its exit-time cleanup against the stopped server for two minutes.
        with contextlib.suppress(Exception):
            client.stop()
    if loop is None:
        quiet_stream_stop(spark)
    query.stop()
    if loop is None:
        finish_fanout(query)
    sweeper.join(120)
    failed = query.exception() is not None
    spark.stop()
    return 1 if failed else 0


def _warm_spark_connect(settings: Settings, warming: list[Any]) -> None:
    """Run one query over every view through this process's own Spark Connect endpoint, as
    deltaq sql does: the server's first planning of each kind of scan starts a Python worker
    that imports deltaq, and a user's first query paid for it (5-7 s instead of ~1.4).
    In-process, so nothing outlives this process (a client through pyspark's Connect
    session class: the generic builder refuses a remote session beside the classic one)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from queue_engine.spark.session import register
    from queue_engine.spark.views import register_views

    client = None
    try:
        client = ConnectSession.builder.remote(
            f"sc://127.0.0.1:{settings.spark_connect_port}"
        ).getOrCreate()
        warming.append(client)
        client.client.disable_reattachable_execute()
        register(client)  # type: ignore[arg-type]
        register_views(client, settings.warehouse)  # type: ignore[arg-type]
        client.sql(WARM_QUERY).collect()
    except Exception:
        log.debug("warming Spark Connect failed", exc_info=True)
    finally:
        if client is not None:
            # Closed whatever happened: an open client's exit handler retries its cleanup
            # calls against the stopped server for two minutes, and the process waits.
            with contextlib.suppress(Exception):
                client.stop()
            with contextlib.suppress(ValueError):
                warming.remove(client)


# Every kind of scan the views use.
WARM_QUERY = (
    "SELECT (SELECT count(*) FROM topics), (SELECT count(*) FROM messages), "
    "(SELECT count(*) FROM queue_stats), (SELECT count(*) FROM dead_letters)"
)


def main(argv: list[str] | None = None) -> int:
    return standalone_main("jobs", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
