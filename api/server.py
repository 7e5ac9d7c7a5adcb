"""Run the API under uvicorn (uvloop + httptools when installed)."""

from __future__ import annotations

import logging

import uvicorn

from api.app import create_app
from queue_engine.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; pending publishes are committed before exit."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="auto",
        http="auto",
        access_log=False,
        log_level="info",
        # Long-polling consumers and bursty producers keep connections; so do we.
        timeout_keep_alive=75,
    )
    log.info("deltaq API on http://%s:%d, warehouse %s", settings.host, settings.port,
             settings.warehouse)
    uvicorn.Server(config).run()
