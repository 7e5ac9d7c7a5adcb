"""``deltaq`` subcommands: api, up (later also fanout, sweep, sql)."""

from __future__ import annotations

import argparse
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
    sub.add_parser("fanout", help="run the fanout job (see: deltaq fanout --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fanout":
        from jobs.fanout import main as fanout_main

        return fanout_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    settings = _settings(args)
    if args.command in ("api", "up"):
        from api.server import serve

        serve(settings)
        return 0
    return 2
