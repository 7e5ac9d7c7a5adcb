"""``deltaq`` subcommands: up, api, fanout, sweep, sql."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from queue_engine.settings import Settings, load_settings


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warehouse", help="local path or s3:// abfss:// gs:// URL")
    parser.add_argument("--config", help="a TOML file of settings (see conf/default.toml)")


def _server(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 4151)")
    parser.add_argument(
        "--ack",
        choices=["commit", "buffer"],
        help="answer /pub after the Delta commit (default) or once buffered",
    )


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(
        args.config,
        warehouse=args.warehouse,
        host=getattr(args, "host", None),
        port=getattr(args, "port", None),
        ack=getattr(args, "ack", None),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaq", description="NSQ's semantics on Delta Lake")
    sub = parser.add_subparsers(dest="command", required=True)
    _server(sub.add_parser("api", help="serve the HTTP API"))
    _server(sub.add_parser("up", help="run everything on this machine (the embedded default)"))
    for name, text in _JOBS.items():
        sub.add_parser(name, help=f"{text} (see: deltaq {name} --help)", add_help=False)
    return parser


# Subcommands that are Spark jobs under jobs/ (also runnable with spark-submit).
_JOBS = {
    "fanout": "run the fanout stream",
    "sweep": "sweep leases and deferrals into the state tables",
    "sql": "run Spark SQL over the queue's views",
    "jobs": "the fanout and the sweep on one Spark (what deltaq up starts)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _JOBS:
        import importlib

        module = "embedded" if argv[0] == "jobs" else argv[0]
        job_main = importlib.import_module(f"jobs.{module}").main
        return int(job_main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    settings = _settings(args)
    if args.command == "up":
        return up(settings)
    if args.command == "api":
        from api.server import serve

        # uvicorn re-raises Ctrl-C after its graceful shutdown.
        with contextlib.suppress(KeyboardInterrupt):
            serve(settings)
        return 0
    return 2


def up(settings: Settings) -> int:
    """The API in this process; the fanout stream and the sweep in one child on local Spark.
    Ctrl-C (or SIGTERM) stops both: the API answers waiting SUBs and commits what is pending,
    the child stops its stream and its sweep loop."""
    import os
    import signal
    import subprocess

    from api.server import serve

    log = logging.getLogger("deltaq.up")
    warehouse = (
        os.path.abspath(settings.warehouse)
        if "://" not in settings.warehouse
        else (settings.warehouse)
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltaq",
            "jobs",
            "--warehouse",
            warehouse,
            "--every",
            str(settings.sweep_interval_s),
        ]
    )
    log.info(
        "deltaq up: API http://%s:%d in pid %d; fanout + sweep every %.0f s on local Spark in "
        "pid %d; warehouse %s",
        settings.host,
        settings.port,
        os.getpid(),
        settings.sweep_interval_s,
        child.pid,
        warehouse,
    )
    try:
        serve(settings)
    except KeyboardInterrupt:
        pass  # uvicorn re-raises Ctrl-C after its graceful shutdown
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.info("deltaq up: stopped")
    return 0
