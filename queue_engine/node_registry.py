"""The registry as one node follows it: folded from its Delta table, changed by events.

Every change to topics and channels (create, delete, pause, configure, move, ...) is a
registry event committed to the table first and applied to memory after: memory never runs
ahead of the table. Admin changes run one at a time under ``admin``; another node's event
that took the version first is read, and the change is decided again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.registry import Action, Registry, RegistryEvent
from queue_engine.store.tables import RegistryMovedError, RegistryStore

# A registry event that raced another node's is decided again this many times.
_RACE_RETRIES = 20


class NodeRegistry:
    def __init__(self, path: str, *, shared: bool) -> None:
        self.path = path
        # Other nodes commit events too (a node of a cluster): look for theirs before creating.
        self._shared = shared
        self.registry = Registry()
        self.admin = asyncio.Lock()
        self._store: RegistryStore | None = None
        # Called after every fold that follows other nodes' events (the broker closes what
        # they deleted and applies what they changed): (before, after).
        self.on_reload: Callable[[Registry, Registry], Awaitable[None]] | None = None

    def load(self) -> Registry:
        """Open the table and fold it (blocking)."""
        self._store = RegistryStore(self.path)
        self.registry = Registry.fold(self._store.load())
        return self.registry

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    @property
    def store(self) -> RegistryStore:
        assert self._store is not None, "registry not loaded"
        return self._store

    def event(
        self,
        action: Action,
        topic: str,
        channel: str | None = None,
        *,
        topic_version: int | None = None,
        topic_messages: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> RegistryEvent:
        """The next event, numbered after the registry as folded."""
        return RegistryEvent(
            seq=self.registry.next_seq(),
            at_us=time.time_ns() // 1000,
            action=action,
            topic=topic,
            channel=channel,
            topic_version=topic_version,
            topic_messages=topic_messages,
            options=options,
        )

    async def record(
        self,
        action: Action,
        topic: str,
        channel: str | None = None,
        *,
        topic_version: int | None = None,
        topic_messages: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Commit an event, then apply it. With ``admin`` held."""
        store = self.store

        def record() -> RegistryEvent:
            event = self.event(
                action,
                topic,
                channel,
                topic_version=topic_version,
                topic_messages=topic_messages,
                options=options,
            )
            store.append(event)
            return event

        await self.commit(record)

    async def commit(self, record: Callable[[], RegistryEvent]) -> None:
        """Run ``record`` (make an event from the registry as folded and commit it; in a
        thread), then apply the event. With ``admin`` held. When another node's event took the
        version first, read the registry again and make the event anew (a stale event is
        harmless: the fold ignores it)."""
        for _ in range(_RACE_RETRIES):
            try:
                event = await asyncio.to_thread(record)
            except RegistryMovedError:
                await self.reload()
                continue
            self.registry.apply(event)
            return
        raise QueueError(ErrorCode.E_COMMIT_FAILED, "the registry kept changing; try again")

    async def moved(self) -> bool:
        """Another node committed events since this one last read them."""
        return self._shared and await asyncio.to_thread(self.store.moved)

    async def reload(self) -> None:
        """With ``admin`` held: fold the table again and follow what changed."""
        before = self.registry
        self.registry = Registry.fold(await asyncio.to_thread(self.store.load))
        if self.on_reload is not None:
            await self.on_reload(before, self.registry)

    async def reload_if_moved(self, missing: bool) -> None:
        """With ``admin`` held, before creating something ``missing`` from the registry:
        another node may have created it since this one last read the registry."""
        if missing and await self.moved():
            await self.reload()
