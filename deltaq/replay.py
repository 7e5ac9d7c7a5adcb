"""deltaq replay: deliver a range of a topic's past messages to one channel again.

Asks the running API (POST /channel/replay): it copies the rows of topic versions
--from..--to (versions or RFC 3339 times) for the channel in one commit. Give --replay-id
to make a retry safe: a replay id is committed at most once.
"""

from __future__ import annotations

import argparse

from deltaq.api_call import add_api_arguments, post

HELP = "deliver a range of a topic's past messages to a channel again (asks the running API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument(
        "--from", dest="start", required=True, help="first topic version, or an RFC 3339 time"
    )
    parser.add_argument("--to", dest="end", help="last topic version or time (default: newest)")
    parser.add_argument("--replay-id", help="this replay's id (repeating it copies nothing twice)")
    add_api_arguments(parser)


def run(args: argparse.Namespace) -> int:
    query = [("topic", args.topic), ("channel", args.channel), ("from", args.start)]
    if args.end is not None:
        query.append(("to", args.end))
    if args.replay_id is not None:
        query.append(("replay_id", args.replay_id))
    answer = post(args, "replay", "/channel/replay", query)
    if answer is None:
        return 1
    where = f"{args.topic}/{args.channel}"
    versions = f"versions {answer['from_version']}..{answer['to_version']}"
    if answer["repeated"]:
        print(f"replay {answer['replay_id']} of {where} was done before: nothing copied")
    else:
        print(
            f"replay {answer['replay_id']}: {answer['messages']} messages of {versions} to {where}"
        )
    return 0
