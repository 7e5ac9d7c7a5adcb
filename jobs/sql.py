"""deltaq sql "SELECT ...": Spark SQL over the queue's views, printed as a table.

Views: topics, channels, messages, ledger, state, queue_stats, dead_letters, each with topic
and channel columns first. queue_stats and state are as of each channel's last sweep (up to
one sweep interval behind /stats). --as-of 2026-11-22T03:12:00Z reads every table as it was then.

Where deltaq up runs on this machine, the query runs on its Spark (Spark Connect on
127.0.0.1:<spark_connect_port>) and answers within a few seconds; otherwise a local Spark starts
for it first (README.md gives the figures measured).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])

from jobs.command import (
    CommandError,
    configure_logging,
    standalone_main,
)
from queue_engine.settings import Settings

HELP = "run Spark SQL over the queue's views (topics, channels, messages, ledger, ...)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--as-of", metavar="TIME", help="ISO 8601 time: query the tables as they were then"
    )
    parser.add_argument(
        "--limit", type=int, default=1000, metavar="N", help="rows to print (default 1000)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--remote", metavar="URL", help="run on this Spark Connect server (sc://host:port)"
    )
    where.add_argument(
        "--local", action="store_true", help="always start a local Spark for the query"
    )
    parser.add_argument("--master", help="Spark master of a started Spark (default local[2])")
    parser.add_argument("query", help="a SQL statement over the views")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from queue_engine.spark.session import build_session, remote_session
    from queue_engine.spark.views import register_views
    from queue_engine.store.tables import Warehouse

    warehouse = settings.warehouse
    if "://" not in warehouse:
        # A Spark Connect server resolves paths from its own working directory.
        warehouse = os.path.abspath(warehouse)
    if not Warehouse(warehouse).exists():
        raise CommandError(
            f"no deltaq warehouse at {settings.warehouse} (no registry table): "
            "start deltaq there first, or give --warehouse"
        )
    remote = args.remote or (None if args.local else _running_connect(settings))
    if remote is not None:
        print(f"deltaq sql: on the Spark at {remote}", file=sys.stderr)
        spark = remote_session(remote)
    else:
        spark = build_session(args.master, "deltaq-sql", quiet=True)
    try:
        register_views(spark, warehouse, as_of=args.as_of)
        spark.sql(args.query).show(args.limit, truncate=False)
    finally:
        spark.stop()
    return 0


def _running_connect(settings: Settings) -> str | None:
    """deltaq up's Spark Connect endpoint, if something answers on its port."""
    port = settings.spark_connect_port
    if not port:
        return None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return f"sc://127.0.0.1:{port}"
    except OSError:
        return None


def quiet_logging() -> None:
    """The answer or one error line: PySpark also logs a failed query's error, with the JVM's
    stack trace, as JSON to stderr (its SQLQueryContextLogger); deltaq sql prints it once."""
    configure_logging(logging.WARNING)
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL + 1)


def main(argv: list[str] | None = None) -> int:
    quiet_logging()
    return standalone_main("sql", __doc__, add_arguments, run, argv, log_level=logging.WARNING)


if __name__ == "__main__":
    raise SystemExit(main())
