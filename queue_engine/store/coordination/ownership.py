"""Which node serves what of a channel: numbered claims, each created put-if-absent.

A share's memory (queue_engine.shares) is the fold of its ledger events and only one writer
may fold it, so exactly one node serves a share at a time: its holder. Holding is a sequence
of claim objects under ``_deltaq/owners/<topic>/<channel>/``, named by a number; the newest
names the holder of each share (a node's lane and the token of the process that held the lane
then). A node changes the holders by creating claim ``n + 1`` put-if-absent after reading
claim ``n``: of two nodes claiming at once one wins, and the other decides again. It takes a
share only when claim ``n`` names nobody for it or a node that is no longer live (its lane is
free, or held by another process): a holder keeps a share for as long as it lives, so it never
needs renewing — the node's lane is the lease. A claim written before shares existed names
one node for the whole channel: it reads as that node holding every share. Other things
claimed the same way (a dead node's journal) use the single-holder form.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from queue_engine.message import LANES
from queue_engine.names import path_segment
from queue_engine.shares import Holder, Shares
from queue_engine.store.coordination.nodes import NodeRecord
from queue_engine.store.storage.files import delete_tree
from queue_engine.store.storage.fs_sync import sync_directory
from queue_engine.store.storage.paths import is_remote
from queue_engine.store.storage.put_if_absent import move_if_absent

OWNERS_DIR = "_deltaq/owners"
# Older claims than this many are removed after a successful claim.
_KEEP = 4


@dataclass(frozen=True)
class Claim:
    seq: int
    lane: int | None
    token: str | None
    http_url: str | None
    # Who holds each share of a channel (lane -> holder).
    shares: Shares

    def held_by(self, nodes: dict[int, NodeRecord]) -> NodeRecord | None:
        """The live node this claim names, if it still lives."""
        if self.lane is None:
            return None
        node = nodes.get(self.lane)
        return node if node is not None and node.token == self.token else None


class Ownership:
    """Claims of the channels of one warehouse."""

    def __init__(self, root: str, directory: str = OWNERS_DIR) -> None:
        """``directory``: where under the warehouse the claims live (another directory for
        things claimed the same way, such as a dead node's journal)."""
        self.root = root.rstrip("/") if is_remote(root) else os.path.abspath(root)
        self._remote = is_remote(root)
        self._directory = directory

    def _dir(self, topic: str, channel: str) -> str:
        return f"{self.root}/{self._directory}/{path_segment(topic)}/{path_segment(channel)}"

    def current(self, topic: str, channel: str) -> Claim | None:
        """The newest claim of the channel (None: never claimed)."""
        seqs = self._seqs(topic, channel)
        if not seqs:
            return None
        raw = self._read(f"{self._dir(topic, channel)}/{seqs[-1]:010d}.json")
        if raw is None:  # pruned between the listing and the read: a newer one exists
            return self.current(topic, channel)
        data = json.loads(raw)
        shares: dict[int, Holder] = {}
        if "shares" in data:
            # One object per holder, however many shares it holds (a node keeps the claims
            # of every channel it serves).
            holders: dict[Holder, Holder] = {}
            for lane, held in data["shares"].items():
                holder = Holder(
                    held["lane"], held["token"], held["http_url"], bool(held.get("pinned"))
                )
                shares[int(lane)] = holders.setdefault(holder, holder)
        elif data.get("lane") is not None:
            holder = Holder(data["lane"], data["token"], data.get("http_url") or "")
            shares = dict.fromkeys(range(LANES), holder)
        return Claim(seqs[-1], data.get("lane"), data.get("token"), data.get("http_url"), shares)

    def claim(self, topic: str, channel: str, after: Claim | None, node: NodeRecord | None) -> bool:
        """Create the claim following ``after`` naming ``node`` (None: a release); False if
        another claim took that number first."""
        seq = 0 if after is None else after.seq + 1
        body: dict[str, Any] = {
            "lane": None if node is None else node.lane,
            "token": None if node is None else node.token,
            "http_url": None if node is None else node.http_url,
            "at": time.time(),
        }
        return self._create_next(topic, channel, seq, body)

    def claim_shares(self, topic: str, channel: str, after: Claim | None, shares: Shares) -> bool:
        """Create the claim following ``after`` naming ``shares``' holders; False if another
        claim took that number first."""
        seq = 0 if after is None else after.seq + 1
        body: dict[str, Any] = {
            "shares": {
                str(lane): {
                    "lane": h.lane,
                    "token": h.token,
                    "http_url": h.http_url,
                    "pinned": h.pinned,
                }
                for lane, h in sorted(shares.items())
            },
            "at": time.time(),
        }
        return self._create_next(topic, channel, seq, body)

    def _create_next(self, topic: str, channel: str, seq: int, body: dict[str, Any]) -> bool:
        data = json.dumps(body).encode()
        target = f"{self._dir(topic, channel)}/{seq:010d}.json"
        if not self._create(target, data):
            return False
        # A reader that stalled could create a number already pruned: then it is not newest.
        newest = self._seqs(topic, channel)
        if newest and newest[-1] != seq:
            return False
        for old in self._seqs(topic, channel)[:-_KEEP]:
            self._delete(f"{self._dir(topic, channel)}/{old:010d}.json")
        return True

    def forget(self, topic: str, channel: str | None = None) -> None:
        """Remove the claims of a deleted channel (or of every channel of a deleted topic)."""
        base = f"{self.root}/{self._directory}/{path_segment(topic)}"
        delete_tree(base if channel is None else f"{base}/{path_segment(channel)}")

    # -- storage ---------------------------------------------------------------------------

    def _seqs(self, topic: str, channel: str) -> list[int]:
        directory = self._dir(topic, channel)
        if self._remote:
            import obstore

            from queue_engine.store.storage.object_store import store_and_key

            store, key = store_and_key(directory)
            names = [
                str(meta["path"]).rsplit("/", 1)[-1]
                for chunk in obstore.list(store, prefix=f"{key}/")
                for meta in chunk
            ]
        else:
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                return []
        return sorted(int(n[:10]) for n in names if len(n) == 15 and n.endswith(".json"))

    def _read(self, path: str) -> bytes | None:
        if self._remote:
            from queue_engine.store.storage.object_store import read_object

            return read_object(path)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _create(self, path: str, data: bytes) -> bool:
        if self._remote:
            import obstore
            from obstore.exceptions import AlreadyExistsError, PreconditionError

            from queue_engine.store.storage.object_store import store_and_key

            store, key = store_and_key(path)
            try:
                obstore.put(store, key, data, mode="create")
            except (AlreadyExistsError, PreconditionError):
                return False
            return True
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        staging = f"{directory}/.{uuid.uuid4().hex}.tmp"
        with open(staging, "wb") as f:
            f.write(data)
            f.flush()
            os.fdatasync(f.fileno())
        if move_if_absent(staging, path):
            sync_directory(directory)
            return True
        os.unlink(staging)
        return False

    def _delete(self, path: str) -> None:
        if self._remote:
            import obstore

            from queue_engine.store.storage.object_store import store_and_key

            store, key = store_and_key(path)
            obstore.delete(store, key)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
