"""``deltaq sql --warehouse W "SELECT ..."``: Spark SQL over the queue's views.

Views: topics, channels, messages, ledger, state, queue_stats (queue_engine/spark/views.py).
``--as-of 2026-11-22T03:12:00Z`` reads every table as it was then (Delta time travel).
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaq sql", description=__doc__)
    parser.add_argument("--warehouse", required=True)
    parser.add_argument("--as-of", help="ISO 8601 timestamp: query the tables as they were then")
    parser.add_argument("--limit", type=int, default=1000, help="rows to print (default 1000)")
    parser.add_argument("--master", help="Spark master (default local[2])")
    parser.add_argument("query", help="a SQL statement over the views")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from queue_engine.spark.session import build_session
    from queue_engine.spark.views import register_views

    spark = build_session(args.master, "deltaq-sql")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        register_views(spark, args.warehouse, as_of=args.as_of)
        spark.sql(args.query).show(args.limit, truncate=False)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/jobs/", 1)[0])
    raise SystemExit(main())
