"""Acknowledgements that cross from a writer thread to the event loop.

Topic writers and channel ledgers commit in their own threads; what waits on a commit (a
publisher, a FIN) is an asyncio future. One commit resolves all of its futures in one hop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.storage_health import commit_failed
from queue_engine.store.delta import ConstraintViolation, TableRefusedError

log = logging.getLogger(__name__)


class Acks:
    """Resolves, on ``loop``, the futures a commit carried (None tokens: nobody waits)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    def committed(self, tokens: list[Any], error: BaseException | None) -> None:
        """Writer thread -> event loop: resolve the futures of one commit in one hop."""
        waiting = [t for t in tokens if t is not None]
        if error is not None and len(waiting) < len(tokens):
            log.error("lost %d buffered publishes: %s", len(tokens) - len(waiting), error)
        if waiting and self.loop is not None:
            self.loop.call_soon_threadsafe(resolve, waiting, error)


def commit_error(error: BaseException) -> QueueError:
    """What a publisher is answered when the commit carrying its messages failed."""
    if isinstance(error, QueueError):
        return error
    if isinstance(error, TableRefusedError):
        return QueueError(ErrorCode.E_TABLE_REFUSED, error.reason)
    if isinstance(error, ConstraintViolation):
        return QueueError(ErrorCode.E_CONSTRAINT_VIOLATED, error.reason)
    return commit_failed(error)


def resolve(futures: Iterable[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(commit_error(error))
