"""deltaq token: make a bearer token and add its hash (with its roles) to a tokens file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from queue_engine.auth import Role, new_token, parse_token_file, token_entry

HELP = "make a bearer token with roles; its hash goes into the tokens file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", required=True, help="the tokens file (auth_tokens_file)")
    parser.add_argument("--name", required=True, help="who the token is for (shown in logs)")
    parser.add_argument(
        "--role",
        action="append",
        required=True,
        choices=[r.value for r in Role],
        help="publish, consume or admin (repeat for several)",
    )
    parser.add_argument(
        "--topic",
        action="append",
        help="topic name pattern the roles cover, shell-style, e.g. orders* (default: all)",
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    token = new_token()
    entry = token_entry(args.name, token, args.role, args.topic or ["*"])
    before = path.read_text() if path.exists() else ""
    parse_token_file(before + entry, str(path))  # refused before anything is written
    with path.open("a") as f:
        f.write(entry)
    print(token)
    print(f"token for {args.name!r} added to {path} (only its hash is kept)", file=sys.stderr)
    return 0
