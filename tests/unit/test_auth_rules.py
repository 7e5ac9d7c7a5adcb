"""Who may do what: tokens-file grants (globs) and nsqd auth-server grants (regexes)."""

from __future__ import annotations

import time

import pytest

from api.auth import required_role
from queue_engine.auth import (
    AuthConfigError,
    Role,
    identity_from_auth_server,
    new_token,
    parse_token_file,
    token_entry,
)


def test_token_file_round_trip_and_globs() -> None:
    token = new_token()
    tokens = parse_token_file(token_entry("w", token, ["publish", "consume"], ["orders*"]))
    identity = tokens.identify(token)
    assert identity is not None and identity.name == "w"
    assert identity.allows(Role.PUBLISH, "orders_eu", None)
    assert identity.allows(Role.CONSUME, "orders", "billing")
    assert not identity.allows(Role.PUBLISH, "payments", None)
    assert not identity.allows(Role.ADMIN, "orders", None)
    assert tokens.identify(token + "x") is None


@pytest.mark.parametrize(
    "text",
    [
        '[[token]]\nsha256 = "abc"\nroles = ["publish"]\n',
        f'[[token]]\nsha256 = "{"0" * 64}"\nroles = ["root"]\n',
        f'[[token]]\nsha256 = "{"0" * 64}"\nroles = []\n',
        "not toml =",
    ],
)
def test_bad_token_files_are_refused(text: str) -> None:
    with pytest.raises(AuthConfigError):
        parse_token_file(text)


def test_auth_server_answer_as_nsqd_reads_it() -> None:
    answer = {
        "ttl": 60,
        "identity": "svc",
        "authorizations": [
            {"topic": "^orders", "channels": [".*"], "permissions": ["publish"]},
            {"topic": "metrics", "channels": ["^c$"], "permissions": ["subscribe"]},
        ],
    }
    now = time.monotonic()
    identity = identity_from_auth_server(answer, now)
    # nsqd reads the TTL in seconds: the identity holds for 60 s from the answer, no longer.
    assert identity.expires_at == now + 60
    assert identity_from_auth_server(answer, now - 61).expired
    assert identity.allows(Role.PUBLISH, "orders_x", None)
    assert not identity.allows(Role.PUBLISH, "x_orders", None)  # anchored by the pattern
    assert identity.allows(Role.CONSUME, "app_metrics", "c")  # unanchored, as nsqd
    assert not identity.allows(Role.CONSUME, "app_metrics", "cc")
    assert not identity.expired
    for bad in ({"ttl": 0}, {"ttl": 5, "authorizations": [{"topic": "(", "permissions": []}]}):
        with pytest.raises(AuthConfigError):
            identity_from_auth_server(bad, 0.0)
    with pytest.raises(AuthConfigError):
        identity_from_auth_server(
            {"ttl": 5, "authorizations": [{"topic": "t", "permissions": ["root"]}]}, 0.0
        )


def test_routes_need_their_role() -> None:
    assert required_role("POST", "/pub") is Role.PUBLISH
    assert required_role("GET", "/sub") is Role.CONSUME
    assert required_role("POST", "/fin") is Role.CONSUME
    assert required_role("POST", "/channel/delete") is Role.ADMIN
    assert required_role("PUT", "/config/log_level") is Role.ADMIN
    assert required_role("GET", "/config/log_level") is None
    assert required_role("GET", "/stats") is None
