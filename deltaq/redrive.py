"""deltaq redrive: make a channel's dead letters ready again (all, or the ids named).

The API serving the warehouse holds the channel's live state, so this asks it
(POST /channel/redrive): the same call, the same all-or-none answer, one ledger commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

HELP = "make a channel's dead letters ready again, attempts reset (asks the running API)"
TOKEN_ENV = "DELTAQ_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument(
        "--id", action="append", default=[], help="a dead letter's message id (repeat; none: all)"
    )
    parser.add_argument(
        "--api",
        default="http://127.0.0.1:4151",
        help="the API's address (default http://127.0.0.1:4151)",
    )
    parser.add_argument(
        "--token", help=f"an admin bearer token, when the API wants one (or ${TOKEN_ENV})"
    )


def run(args: argparse.Namespace) -> int:
    query = [("topic", args.topic), ("channel", args.channel), *[("id", i) for i in args.id]]
    url = f"{args.api.rstrip('/')}/channel/redrive?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, method="POST", data=b"")
    token = args.token or os.environ.get(TOKEN_ENV)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        print(f"deltaq redrive: {exc.code} {detail}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"deltaq redrive: {args.api} did not answer: {exc.reason}", file=sys.stderr)
        return 1
    print(f"{answer['redriven']} dead letters of {args.topic}/{args.channel} redriven")
    return 0
