"""Who may do what: bearer tokens from a file, or nsqd's auth server protocol (pure).

Three roles: ``publish`` (PUB/MPUB/DPUB, /pub, /mpub), ``consume`` (SUB, /sub, FIN, REQ,
TOUCH) and ``admin`` (create/delete/empty/pause, PUT /config). Any authenticated identity may
read (/stats, /metrics, /info). A grant names a role and the topics and channels it covers.

Tokens file (TOML, the ``auth_tokens_file`` setting)::

    [[token]]
    name = "orders-writer"
    sha256 = "<hex sha256 of the token>"
    roles = ["publish"]
    topics = ["orders*"]      # shell-style patterns (fnmatch); default ["*"]
    channels = ["*"]

Only the SHA-256 of a token is stored. Tokens are 32 random bytes (``deltaq token``), so an
unsalted fast hash is enough: there is no dictionary to try against it.

nsqd's auth server (``auth_http_address``): asked ``GET /auth?remote_ip=&tls=&secret=
&common_name=`` and answering ``{"ttl", "identity", "identity_url", "authorizations":
[{"topic": regex, "channels": [regex], "permissions": ["publish", "subscribe"]}]}``; matched
as nsqd matches (unanchored regular expressions). deltaq also accepts the permission
``admin`` there.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import secrets
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class Role(StrEnum):
    PUBLISH = "publish"
    CONSUME = "consume"
    ADMIN = "admin"


# nsqd's auth server names roles as permissions.
_PERMISSIONS = {"publish": Role.PUBLISH, "subscribe": Role.CONSUME, "admin": Role.ADMIN}


class AuthConfigError(ValueError):
    """The tokens file or an auth server's answer is not valid."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Grant:
    """One role over the topics (and channels) its patterns match."""

    role: Role
    topics: tuple[str, ...] = ("*",)
    channels: tuple[str, ...] = ("*",)
    # True: patterns are nsqd's unanchored regular expressions; False: shell-style globs.
    regex: bool = False

    def _match(self, patterns: Sequence[str], name: str) -> bool:
        if self.regex:
            return any(re.search(p, name) for p in patterns)
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    def allows(self, role: Role, topic: str | None, channel: str | None) -> bool:
        if role is not self.role:
            return False
        if topic is not None and not self._match(self.topics, topic):
            return False
        if channel is None:
            # nsqd checks a publish's empty channel name against the channel patterns too.
            return not self.regex or self._match(self.channels, "")
        return self._match(self.channels, channel)


@dataclass(frozen=True)
class Identity:
    """An authenticated client: its name and what it may do, until ``expires_at`` (monotonic)."""

    name: str
    grants: tuple[Grant, ...]
    url: str = ""
    expires_at: float = float("inf")

    def allows(self, role: Role, topic: str | None = None, channel: str | None = None) -> bool:
        return any(g.allows(role, topic, channel) for g in self.grants)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at


@dataclass
class TokenFile:
    """The identities of a tokens file, by the SHA-256 of their token."""

    by_hash: dict[str, Identity] = field(default_factory=dict)

    def identify(self, token: str) -> Identity | None:
        return self.by_hash.get(token_hash(token))


def _strings(entry: dict[str, Any], key: str, default: list[str]) -> tuple[str, ...]:
    value = entry.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise AuthConfigError(f"{key} must be a list of non-empty strings")
    return tuple(value)


def load_token_file(path: str | Path) -> TokenFile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AuthConfigError(f"cannot read tokens file {path}: {exc}") from exc
    return parse_token_file(text, str(path))


def parse_token_file(text: str, path: str = "tokens file") -> TokenFile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AuthConfigError(f"cannot read tokens file {path}: {exc}") from exc
    tokens = TokenFile()
    for i, entry in enumerate(data.get("token", [])):
        where = f"{path}: token {i + 1}"
        digest = entry.get("sha256", "")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise AuthConfigError(f"{where}: sha256 must be 64 hex digits")
        try:
            roles = [Role(r) for r in _strings(entry, "roles", [])]
            topics = _strings(entry, "topics", ["*"])
            channels = _strings(entry, "channels", ["*"])
        except (ValueError, AuthConfigError) as exc:
            raise AuthConfigError(f"{where}: {exc}") from exc
        if not roles:
            raise AuthConfigError(f"{where}: no roles")
        name = str(entry.get("name") or digest[:8])
        grants = tuple(Grant(role, topics, channels) for role in roles)
        tokens.by_hash[digest] = Identity(name, grants)
    return tokens


def token_entry(name: str, token: str, roles: Sequence[str], topics: Sequence[str]) -> str:
    """A tokens-file entry for ``token`` (TOML), holding only its hash."""
    for role in roles:
        Role(role)

    # JSON strings are valid TOML basic strings (the same escapes).
    return (
        f"\n[[token]]\nname = {json.dumps(name)}\nsha256 = {json.dumps(token_hash(token))}\n"
        f"roles = {json.dumps(list(roles))}\ntopics = {json.dumps(list(topics))}\n"
        'channels = ["*"]\n'
    )


def identity_from_auth_server(answer: Any, now: float) -> Identity:
    """nsqd's auth server answer as an identity, checked as nsqd checks it."""
    if not isinstance(answer, dict):
        raise AuthConfigError("auth server answer is not a JSON object")
    ttl = answer.get("ttl")
    if not isinstance(ttl, int) or ttl <= 0:
        raise AuthConfigError(f"invalid TTL {ttl} (must be >0)")
    grants: list[Grant] = []
    for auth in answer.get("authorizations") or []:
        if not isinstance(auth, dict):
            raise AuthConfigError(f"authorization is not an object: {auth!r}")
        topic = auth.get("topic", "")
        channels = tuple(auth.get("channels") or [])
        if not isinstance(topic, str) or not all(isinstance(c, str) for c in channels):
            raise AuthConfigError(f"topic and channels must be strings: {auth!r}")
        for pattern in (topic, *channels):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise AuthConfigError(f"unable to compile {pattern!r}: {exc}") from exc
        for permission in auth.get("permissions") or []:
            role = _PERMISSIONS.get(permission)
            if role is None:
                raise AuthConfigError(f"unknown permission {permission}")
            grants.append(Grant(role, (topic,), channels, regex=True))
    return Identity(
        str(answer.get("identity", "")),
        tuple(grants),
        url=str(answer.get("identity_url", "")),
        expires_at=now + ttl,
    )
