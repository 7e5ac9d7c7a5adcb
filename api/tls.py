"""TLS laid out as nsqd 1.3.0 lays it out (nsqd/nsqd.go buildTLSConfig, http.go, protocol_v2.go):

- plain HTTP stays on ``port``; HTTPS is a listener of its own on ``https_address`` (this host,
  port 4152 by default), served only when a certificate and key are configured;
- on the TCP port, TLS is negotiated per connection through IDENTIFY's ``tls_v1``;
- ``tls_required``: "true" refuses a TCP client anything but IDENTIFY until it upgraded, and
  answers plain HTTP with 403 ``{"message": "TLS_REQUIRED", "https_port": N}``; "tcp-https"
  requires TLS on TCP only. A client certificate policy makes it "true", as in nsqd.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from queue_engine.settings import Settings, TlsClientAuthPolicy, TlsMinVersion, TlsRequired

HTTPS_PORT = 4152  # nsqd's --https-address port

_VERSIONS = {
    TlsMinVersion.TLS1_0: ssl.TLSVersion.TLSv1,
    TlsMinVersion.TLS1_1: ssl.TLSVersion.TLSv1_1,
    TlsMinVersion.TLS1_2: ssl.TLSVersion.TLSv1_2,
    TlsMinVersion.TLS1_3: ssl.TLSVersion.TLSv1_3,
}


def tls_configured(settings: Settings) -> bool:
    return bool(settings.tls_cert or settings.tls_key)


def tls_required(settings: Settings) -> TlsRequired:
    """nsqd's rule: a client certificate policy requires TLS."""
    if settings.tls_client_auth_policy and settings.tls_required is TlsRequired.FALSE:
        return TlsRequired.TRUE
    return settings.tls_required


def server_tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of HTTPS and of TCP's upgrade; None without a certificate (the
    settings refuse TLS options that need one)."""
    if not tls_configured(settings):
        return None
    for path in (settings.tls_cert, settings.tls_key, settings.tls_root_ca_file):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"TLS file not found: {path}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[settings.tls_min_version]
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    policy = settings.tls_client_auth_policy
    if policy is TlsClientAuthPolicy.NONE:
        context.verify_mode = ssl.CERT_NONE  # nsqd: no client certificate asked
    else:
        # "require-verify": a certificate verified against tls_root_ca_file. "require": nsqd
        # takes any certificate; Python's TLS verifies every certificate it asks for, so here
        # it is verified too (against tls_root_ca_file, else the system's CAs).
        context.verify_mode = ssl.CERT_REQUIRED
        if settings.tls_root_ca_file:
            context.load_verify_locations(settings.tls_root_ca_file)
        else:
            context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    return context


def https_listener(settings: Settings) -> tuple[str, int] | None:
    """(host, port) of the HTTPS listener; None without a certificate."""
    if not tls_configured(settings):
        return None
    if not settings.https_address:
        return settings.host, HTTPS_PORT
    host, _, port = settings.https_address.rpartition(":")  # checked by the settings
    return host.strip("[]") or "0.0.0.0", int(port)


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def refuse_plain_http(app: ASGIApp, https_port: int) -> ASGIApp:
    """nsqd's plain HTTP server under tls_required=true: every request gets 403 TLS_REQUIRED,
    naming the HTTPS port (the body exactly as nsqd formats it)."""
    body = f'{{"message": "TLS_REQUIRED", "https_port": {https_port}}}'.encode()
    headers = [
        (b"x-nsq-content-type", b"nsq; version=1.0"),
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]

    async def refusing(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)  # the lifespan
            return
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refusing
