"""Where each of deltaq's tables lives under a warehouse's root."""

from __future__ import annotations

import os
from dataclasses import dataclass

from queue_engine.names import path_segment
from queue_engine.store.delta.open_table import is_table


@dataclass(frozen=True)
class Warehouse:
    """Paths of deltaq's tables under one root (a local path or an object-store URL)."""

    root: str

    def absolute(self) -> Warehouse:
        """This warehouse with a relative local root made absolute (against the working
        directory): another engine resolves a relative path against its own directories (a
        catalog's LOCATION against the database's)."""
        if "://" in self.root or os.path.isabs(self.root):
            return self
        return Warehouse(os.path.abspath(self.root))

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def registry_path(self) -> str:
        return self._join("registry")

    @property
    def topics_root(self) -> str:
        return self._join("topics")

    def topic_path(self, topic: str) -> str:
        return self._join("topics", path_segment(topic))

    @property
    def channels_root_all(self) -> str:
        return self._join("channels")

    def channels_root(self, topic: str) -> str:
        return self._join("channels", path_segment(topic))

    def channel_root(self, topic: str, channel: str) -> str:
        return self._join("channels", path_segment(topic), path_segment(channel))

    def channel_messages_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/messages"

    def channel_ledger_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/ledger"

    def channel_dead_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/dead"

    def channel_state_path(self, topic: str, channel: str) -> str:
        return f"{self.channel_root(topic, channel)}/state"

    @property
    def checkpoints_root(self) -> str:
        return self._join("_checkpoints")

    def exists(self) -> bool:
        """Whether a deltaq API has ever opened this warehouse (its registry table exists)."""
        return is_table(self.registry_path)
