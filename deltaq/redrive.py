"""deltaq redrive: make a channel's dead letters ready again (all, or the ids named).

The API serving the warehouse holds the channel's live state, so this asks it
(POST /channel/redrive): the same call, the same all-or-none answer, one ledger commit.
"""

from __future__ import annotations

import argparse

from deltaq.api_call import add_api_arguments, post

HELP = "make a channel's dead letters ready again, attempts reset (asks the running API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument(
        "--id", action="append", default=[], help="a dead letter's message id (repeat; none: all)"
    )
    add_api_arguments(parser)


def run(args: argparse.Namespace) -> int:
    query = [("topic", args.topic), ("channel", args.channel), *[("id", i) for i in args.id]]
    answer = post(args, "redrive", "/channel/redrive", query)
    if answer is None:
        return 1
    print(f"{answer['redriven']} dead letters of {args.topic}/{args.channel} redriven")
    return 0
