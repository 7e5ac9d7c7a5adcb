"""Authentication for both front doors, and the HTTP gate that enforces it.

``Authenticator`` turns a secret (an HTTP bearer token, a TCP ``AUTH`` body) into an
``Identity``: from the tokens file, else from nsqd's auth server (its answers cached for their
``ttl``). ``AuthGate`` is the outermost ASGI layer: every request but the open ones
(``/ping``, the API's description) needs a token, and the route's role for the topic and
channel it names; refusals are nsqd-style, and nothing is done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from api.body import Receive
from api.fastpath import Scope, Send
from queue_engine.auth import (
    AuthConfigError,
    Identity,
    Role,
    TokenFile,
    identity_from_auth_server,
    load_token_file,
)
from queue_engine.settings import Settings

log = logging.getLogger(__name__)

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

AUTH_SERVER_TIMEOUT_S = 5.0
_CACHE_MAX = 10_000


class AuthUnavailable(Exception):
    """The auth server could not be asked, or answered something invalid."""


class Authenticator:
    """Who a secret belongs to (None: nobody); ``enabled`` is False when nothing is set up."""

    def __init__(self, settings: Settings) -> None:
        self.tokens: TokenFile | None = (
            load_token_file(settings.auth_tokens_file) if settings.auth_tokens_file else None
        )
        self.server = settings.auth_http_address
        self._cache: dict[tuple[str, str, bool], Identity] = {}

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or bool(self.server)

    async def identify(self, secret: str, remote_ip: str, tls: bool) -> Identity | None:
        if self.tokens is not None:
            identity = self.tokens.identify(secret)
            if identity is not None or not self.server:
                return identity
        key = (secret, remote_ip, tls)
        cached = self._cache.get(key)
        if cached is not None and not cached.expired:
            return cached
        identity = await asyncio.to_thread(self._ask_server, secret, remote_ip, tls)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        if identity is not None:
            self._cache[key] = identity
        return identity

    def _ask_server(self, secret: str, remote_ip: str, tls: bool) -> Identity | None:
        """nsqd's QueryAuthd: GET <server>/auth?remote_ip&tls&secret&common_name."""
        query = urllib.parse.urlencode(
            {"remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret}
            | {"common_name": ""}
        )
        base = self.server if "://" in self.server else f"http://{self.server}/auth"
        try:
            with urllib.request.urlopen(f"{base}?{query}", timeout=AUTH_SERVER_TIMEOUT_S) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                return None  # the server refused the secret
            raise AuthUnavailable(f"auth server {self.server}: HTTP {exc.code}") from exc
        except (OSError, ValueError) as exc:
            raise AuthUnavailable(f"auth server {self.server}: {exc}") from exc
        try:
            return identity_from_auth_server(answer, time.monotonic())
        except AuthConfigError as exc:
            raise AuthUnavailable(f"auth server {self.server}: {exc}") from exc


# Paths anyone may reach: liveness, the API's own description, the console's page and assets
# (what the console shows comes from /console/api, which needs a token).
_OPEN = ("/ping", "/docs", "/openapi.json", "/_static/", "/console/static/")
_CONSUME = {"/sub", "/fin", "/req", "/touch"}


def required_role(method: str, path: str) -> Role | None:
    """The role a request needs (None: any authenticated identity may read it)."""
    if path in ("/pub", "/mpub"):
        return Role.PUBLISH
    if path in _CONSUME:
        return Role.CONSUME
    if path.startswith(("/topic/", "/channel/")) or (
        path.startswith("/config/") and method != "GET"
    ):
        return Role.ADMIN
    return None


def _refusal(status: int, code: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = json.dumps({"message": code}, separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"x-nsq-content-type", b"nsq; version=1.0"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deltaq"'))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class AuthGate:
    """ASGI: refuse what the request's token does not allow; pass the rest to ``app``."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"].startswith(_OPEN)
            or scope["path"]
            in (
                "/",
                "/console",
            )
        ):
            await self.app(scope, receive, send)
            return
        refusal = await self._check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        start, body = refusal
        await send(start)
        await send(body)

    async def _check(self, scope: Scope) -> tuple[dict[str, Any], dict[str, Any]] | None:
        token = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
                break
        if not token:
            return _refusal(401, "E_AUTH_FAILED")
        client = scope.get("client")
        try:
            identity = await self.authenticator.identify(
                token, client[0] if client else "", scope.get("scheme") == "https"
            )
        except AuthUnavailable as exc:
            # As nsqd: the client is not told why (the auth server's errors are ours).
            log.warning("authentication failed: %s", exc)
            return _refusal(401, "E_AUTH_FAILED")
        if identity is None:
            return _refusal(401, "E_AUTH_FAILED")
        role = required_role(scope["method"], scope["path"])
        if role is None:
            return None
        params: dict[str, str] = {}
        for key, value in parse_qsl(scope["query_string"].decode("latin-1")):
            params.setdefault(key, value)
        channel = params.get("channel") if role is not Role.PUBLISH else None
        if path_is_topic_only(scope["path"]):
            channel = None
        if not identity.allows(role, params.get("topic"), channel):
            log.info("%s may not %s %s", identity.name, scope["method"], scope["path"])
            return _refusal(403, "E_UNAUTHORIZED")
        return None


def path_is_topic_only(path: str) -> bool:
    return path.startswith("/topic/")
