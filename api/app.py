"""The FastAPI application: routes, nsqd-style errors, and the broker's lifetime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from api import (
    admin,
    config,
    console,
    consume,
    info,
    lifecycle,
    metrics,
    openapi,
    publish,
    replay,
)
from api.auth import Authenticator, AuthGate
from api.fastpath import FastPath
from api.lookupd import LookupdRegistrar, identity
from api.responses import error, explained_error, from_queue_error
from api.tcp.server import TcpServer
from queue_engine import NSQD_VERSION, __version__
from queue_engine.broker import Broker
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.history import History
from queue_engine.settings import Settings
from queue_engine.store.coordination import Node

DESCRIPTION = """\
deltaq: NSQ's HTTP API over Delta Lake. Every published message is appended to its topic's
Delta table; `OK` is sent after the commit. Consumers long-poll `/sub` and answer `/fin`,
`/req`, `/touch`; every lease change is in the channel's Delta ledger before the answer.
Errors are nsqd's: `{"message": "CODE"}`.
"""


log = logging.getLogger(__name__)

SWAGGER_ASSETS = "/_static/swagger-ui"
# Swagger UI 5's files as fastapi-offline ships them.
SWAGGER_UI_FILES = Path(fastapi_offline.__file__).parent / "static"
_METHODS = ("DELETE", "GET", "PATCH", "POST", "PUT")


def lookupd_registrar(settings: Settings, broker: Broker) -> LookupdRegistrar | None:
    """The registration with nsqlookupd (None without a TCP port: NSQ's consumers find nodes
    through lookupd to connect over TCP, and nsqlookupd refuses a node without one)."""
    if not settings.tcp_port:
        if settings.nsqlookupd_tcp_addresses:
            log.warning("nsqlookupd_tcp_addresses ignored: registering needs tcp_port")
        return None
    from api.server import advertised_host

    me = identity(advertised_host(settings), settings.tcp_port, settings.port, NSQD_VERSION)
    return LookupdRegistrar(lambda: broker.registry, me, settings.nsqlookupd_tcp_addresses)


def create_app(settings: Settings, node: Node | None = None) -> FastAPI:
    """The API for one warehouse (as ``node``, one of several, when given); the broker starts
    and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        broker = Broker(settings, node)
        await broker.start()
        app.state.broker = broker
        sampler = asyncio.get_running_loop().create_task(
            console.sample_forever(broker, app.state.history)
        )
        tcp = TcpServer(broker, app.state.authenticator) if settings.tcp_port else None
        app.state.tcp = tcp
        lookupd = lookupd_registrar(settings, broker)
        app.state.lookupd = lookupd
        registering = None
        try:
            if tcp is not None:
                await tcp.start()
            if lookupd is not None:
                registering = asyncio.get_running_loop().create_task(lookupd.run())
            yield
        finally:
            if registering is not None:
                registering.cancel()
                assert lookupd is not None
                lookupd.close()
            sampler.cancel()
            if tcp is not None:
                await tcp.close()
            await broker.close()

    # /docs is served from assets shipped in a package (fastapi-offline's), not from a CDN:
    # the API is often run where there is no internet.
    app = FastAPI(
        title="deltaq",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    # Built here, not in the lifespan: the tokens file is read (and a bad one refused) before
    # the server starts listening.
    app.state.authenticator = Authenticator(settings)
    app.state.history = History(period_s=console.SAMPLE_EVERY_S)
    app.mount(
        SWAGGER_ASSETS,
        StaticFiles(directory=str(SWAGGER_UI_FILES)),
        name="swagger-ui",
    )

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="deltaq API",
            swagger_js_url=f"{SWAGGER_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER_ASSETS}/favicon.png",
        )

    app.include_router(publish.router)
    app.include_router(consume.router)
    app.include_router(admin.router)
    app.include_router(lifecycle.router)
    app.include_router(replay.router)
    app.include_router(info.router)
    app.include_router(config.router)
    app.include_router(metrics.router)
    console.mount(app)
    openapi.install(app, settings)

    @app.exception_handler(QueueError)
    async def queue_error(request: Request, exc: QueueError) -> Response:
        query = request.url.query
        return from_queue_error(exc, request.url.path + (f"?{query}" if query else ""))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            allow = {"Allow": nsqd_allow(_path_methods(request))}
            if request.method == "OPTIONS":
                # nsqd's router answers OPTIONS on every route: 200, the methods, no body.
                return Response(status_code=200, headers=allow)
            return error(ErrorCode.METHOD_NOT_ALLOWED, allow)
        if exc.status_code == 404:
            return error(ErrorCode.NOT_FOUND)
        return error(ErrorCode.INVALID_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        # Only deltaq's own endpoints declare typed parameters: say which and why.
        for problem in exc.errors():
            location = [str(part) for part in problem.get("loc", ())]
            if location:
                return explained_error(
                    ErrorCode.INVALID_REQUEST, location[-1], str(problem.get("msg", ""))
                )
        return error(ErrorCode.INVALID_REQUEST)

    return app


def _path_methods(request: Request) -> set[str]:
    """The methods of every route on the request's path (Starlette's own ``Allow`` names only
    the first route that matched the path)."""
    routes = [r for r in request.app.routes if isinstance(r, BaseRoute)]
    return {
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    }


def nsqd_allow(methods: set[str]) -> str:
    """An ``Allow`` header as nsqd's router writes it: the path's methods and OPTIONS,
    sorted."""
    return ", ".join(sorted((methods - {"HEAD"}) | {"OPTIONS"}))


def with_fast_path(app: FastAPI, settings: Settings) -> FastAPI | FastPath | AuthGate:
    """What uvicorn serves: the app, behind the hot-path front door unless it is turned off,
    behind the authentication gate when authentication is set up."""
    served: FastAPI | FastPath = FastPath(app) if settings.http_fast_path else app
    authenticator: Authenticator = app.state.authenticator
    return AuthGate(served, authenticator) if authenticator.enabled else served
