"""The admin commands' one HTTP call to the running API (it holds the channels' live state)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TOKEN_ENV = "DELTAQ_TOKEN"


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api",
        default="http://127.0.0.1:4151",
        help="the API's address (default http://127.0.0.1:4151)",
    )
    parser.add_argument(
        "--token", help=f"an admin bearer token, when the API wants one (or ${TOKEN_ENV})"
    )


def post(
    args: argparse.Namespace, command: str, path: str, query: list[tuple[str, str]]
) -> dict[str, Any] | None:
    """POST ``path?query`` to ``args.api``; the JSON answer, or None after printing why not."""
    url = f"{args.api.rstrip('/')}{path}?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, method="POST", data=b"")
    token = args.token or os.environ.get(TOKEN_ENV)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        print(f"deltaq {command}: {exc.code} {detail}", file=sys.stderr)
    except urllib.error.URLError as exc:
        print(f"deltaq {command}: {args.api} did not answer: {exc.reason}", file=sys.stderr)
    return None
