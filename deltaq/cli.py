"""The deltaq command: one parser, a subcommand per part (up, api, fanout, sweep, sql, jobs),
and the tools (token, redrive, replay)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from types import ModuleType

from jobs.command import (
    add_settings_arguments,
    configure_logging,
    run_reporting_errors,
    settings_of,
)
from queue_engine.process_memory import prepare_serving_process
from queue_engine.settings import Settings

DESCRIPTION = (
    "deltaq: a message queue with nsqd's API whose topics and channels are Delta tables. "
    "deltaq up runs everything on this machine; the other commands run one part each."
)
UP = (
    "Run everything on this machine: the HTTP API in this process, and the fanout stream and "
    "the sweep on a local Spark in a child process (which also serves deltaq sql). Ctrl-C "
    "stops it all: waiting consumers are answered and pending publishes committed first."
)
API = "Serve nsqd's HTTP API (publish, consume, admin, stats) over the warehouse's tables."


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 4151, nsqd's)")
    parser.add_argument(
        "--tcp-port",
        type=int,
        help="port of nsqd's TCP protocol for NSQ's clients (default 4150, nsqd's; 0: off)",
    )
    parser.add_argument(
        "--tls-cert",
        help="PEM certificate: HTTPS on --https-address, and TCP clients may upgrade to TLS",
    )
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--https-address",
        metavar="HOST:PORT",
        help="where HTTPS listens when a certificate is given (default: --host, port 4152)",
    )
    parser.add_argument("--tls-root-ca-file", help="PEM CAs that client certificates verify with")
    parser.add_argument(
        "--tls-client-auth-policy",
        choices=["require", "require-verify"],
        help="ask TCP and HTTPS clients for a certificate (and require TLS, as nsqd)",
    )
    parser.add_argument(
        "--tls-required",
        nargs="?",
        const="true",
        metavar="true|false|tcp-https",
        help="refuse plaintext clients: TCP and HTTP (true), TCP only (tcp-https)",
    )
    parser.add_argument(
        "--tls-min-version",
        choices=["tls1.0", "tls1.1", "tls1.2", "tls1.3"],
        help="oldest TLS version accepted (default tls1.2)",
    )
    parser.add_argument(
        "--lookupd-tcp-address",
        action="append",
        metavar="HOST:PORT",
        help="an nsqlookupd to register topics and channels with (repeatable, as nsqd's)",
    )
    parser.add_argument(
        "--broadcast-address",
        help="the host other nodes and clients reach this one at (default: --host, or the "
        "hostname when listening on every address)",
    )
    parser.add_argument(
        "--auth-tokens-file", help="bearer tokens with roles, hashed (made by deltaq token)"
    )
    parser.add_argument(
        "--auth-http-address", help="nsqd's auth server (host:port, or a URL), as nsqd's flag"
    )
    parser.add_argument(
        "--ack",
        choices=["journal", "commit", "buffer"],
        help="answer publishes once the node journal holds them (journal, the default), after "
        "the topic's Delta commit (commit), or once buffered in memory (buffer)",
    )


def _jobs() -> dict[str, ModuleType]:
    from jobs import embedded, fanout, sql, sweep

    return {"fanout": fanout, "sweep": sweep, "sql": sql, "jobs": embedded}


def version_line() -> str:
    """deltaq's version and the engines it runs on (read from the installed packages' metadata,
    without starting anything)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    engines = ", ".join(f"{p} {of(p)}" for p in ("pyspark", "delta-spark", "deltalake"))
    return f"deltaq {of('deltaq')} ({engines})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaq", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, short, text in (
        ("up", "run everything on this machine (API, fanout, sweep)", UP),
        ("api", "serve nsqd's HTTP API over the warehouse's tables", API),
    ):
        command = sub.add_parser(name, help=short, description=text)
        add_settings_arguments(command)
        _server_arguments(command)
        if name == "up":
            command.add_argument(
                "--verbose",
                action="store_true",
                help="also show Spark's and uvicorn's own output (else Spark's goes to a log "
                "file, named at start)",
            )
    from deltaq import redrive, replay, token

    command = sub.add_parser("token", help=token.HELP, description=token.__doc__)
    token.add_arguments(command)
    command = sub.add_parser("redrive", help=redrive.HELP, description=redrive.__doc__)
    redrive.add_arguments(command)
    command = sub.add_parser("replay", help=replay.HELP, description=replay.__doc__)
    replay.add_arguments(command)
    for name, module in _jobs().items():
        command = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_settings_arguments(command)
        module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((a for a in argv if not a.startswith("-")), None) in ("api", "up"):
        # A serving process: before the parser imports the jobs' modules (and pyarrow).
        prepare_serving_process()
    args = build_parser().parse_args(argv)
    jobs = _jobs()
    if args.command == "token":
        from deltaq import token

        return run_reporting_errors("token", lambda: token.run(args))
    if args.command == "redrive":
        from deltaq import redrive

        return run_reporting_errors("redrive", lambda: redrive.run(args))
    if args.command == "replay":
        from deltaq import replay

        return run_reporting_errors("replay", lambda: replay.run(args))
    if args.command in jobs:
        module = jobs[args.command]
        if args.command == "sql":
            module.quiet_logging()
        else:
            configure_logging()
        return run_reporting_errors(args.command, lambda: module.run(args, settings_of(args)))
    configure_logging()

    def settings() -> Settings:
        return settings_of(
            args,
            host=args.host,
            port=args.port,
            tcp_port=args.tcp_port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            broadcast_address=args.broadcast_address,
            nsqlookupd_tcp_addresses=args.lookupd_tcp_address,
            auth_tokens_file=args.auth_tokens_file,
            auth_http_address=args.auth_http_address,
            ack=args.ack,
            https_address=args.https_address,
            tls_root_ca_file=args.tls_root_ca_file,
            tls_client_auth_policy=args.tls_client_auth_policy,
            tls_required=args.tls_required,
            tls_min_version=args.tls_min_version,
        )

    if args.command == "up":
        from deltaq.up import up

        return run_reporting_errors("up", lambda: up(settings(), verbose=args.verbose))
    return run_reporting_errors("api", lambda: api(settings()))


def api(settings: Settings) -> int:
    from api.server import serve

    # uvicorn re-raises Ctrl-C after its graceful shutdown.
    with contextlib.suppress(KeyboardInterrupt):
        serve(settings)
    return 0
