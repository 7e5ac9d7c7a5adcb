"""This node among the warehouse's nodes: which channels it owns, and who owns the rest.

A channel is served by one node at a time, its owner (queue_engine.store.ownership: claims
put-if-absent, the owner's lane is the lease). A node alone on its warehouse (tests, embedded
use: no ``Node``) owns every channel without claiming any.
"""

from __future__ import annotations

import logging

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.store.nodes import Node, NodeDirectory, NodeRecord
from queue_engine.store.ownership import Ownership

log = logging.getLogger(__name__)

JOURNAL_CLAIMS_DIR = "_deltaq/journal_claims"

# A channel claim that raced another node's is decided again this many times.
_RACE_RETRIES = 20


class Membership:
    """The live nodes as this one sees them, and the channel claims it makes."""

    def __init__(self, warehouse: str, node: Node | None) -> None:
        self.node = node
        self._directory = NodeDirectory(warehouse) if node is not None else None
        self._ownership = Ownership(warehouse) if node is not None else None
        # Claims of dead processes' journals: one node recovers each.
        self._journals = Ownership(warehouse, JOURNAL_CLAIMS_DIR) if node is not None else None
        # Live nodes (lane -> token) as last seen, to notice one dying.
        self._seen: dict[int, str] = {}
        # Channels other nodes own, and where (for /stats and redirects).
        self.elsewhere: dict[tuple[str, str], str] = {}
        # Channels re-claimed from this lane's earlier process (counted, not logged one by one).
        self._taken_back = 0

    @property
    def alone(self) -> bool:
        return self.node is None

    @property
    def me(self) -> NodeRecord | None:
        return self.node.record if self.node is not None else None

    @property
    def url(self) -> str | None:
        """This node's HTTP URL (None when alone)."""
        me = self.me
        return me.http_url if me is not None else None

    def live(self) -> dict[int, NodeRecord]:
        """The warehouse's live nodes, read now."""
        return self._directory.fresh() if self._directory is not None else {}

    def seen(self, nodes: dict[int, NodeRecord]) -> bool:
        """Remember ``nodes`` as the live ones; True if a node seen before is gone."""
        now = {lane: n.token for lane, n in nodes.items()}
        died = any(now.get(lane) != token for lane, token in self._seen.items())
        self._seen = now
        return died

    def owner(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None = None
    ) -> NodeRecord | None:
        """The live node that owns the channel if not this one; else this node owns it now,
        having claimed it if no live node did (blocking: claims are objects in the store).
        ``nodes``: a view of the live nodes to start from (refreshed when the claim names a
        node it lacks)."""
        if self.node is None or self._ownership is None or self._directory is None:
            return None
        me = self.node.record
        assert me is not None
        for _ in range(_RACE_RETRIES):
            claim = self._ownership.current(topic, channel)
            if claim is not None and claim.lane is not None:
                if claim.lane == me.lane and claim.token == me.token:
                    self.elsewhere.pop((topic, channel), None)
                    return None
                # The live nodes are read after the claim: a node that made the claim joined
                # before it, so a fresh view names it if it still lives.
                holder = claim.held_by(nodes if nodes is not None else self._directory.current())
                if holder is None:
                    holder = claim.held_by(self._directory.fresh())
                if holder is not None:
                    self.elsewhere[(topic, channel)] = holder.http_url
                    return holder
            if self._ownership.claim(topic, channel, claim, me):
                if claim is not None and claim.lane == me.lane:
                    # This lane's earlier process served it: a restart, summed up once.
                    self._taken_back += 1
                    log.debug("node %d took back channel %s/%s", me.lane, topic, channel)
                else:
                    log.info("node %d took channel %s/%s", me.lane, topic, channel)
                self.elsewhere.pop((topic, channel), None)
                return None
        raise QueueError(ErrorCode.INTERNAL_ERROR, f"could not take {topic}/{channel}")

    def target(self, lane: int) -> NodeRecord:
        """The live node in ``lane`` (INVALID_NODE if none; or if this node is alone)."""
        if self._directory is None:
            raise QueueError(ErrorCode.INVALID_NODE, "this node is alone on its warehouse")
        target = self._directory.fresh().get(lane)
        if target is None:
            raise QueueError(ErrorCode.INVALID_NODE, f"no live node in lane {lane}", param="node")
        return target

    def hand_over(self, topic: str, channel: str, target: NodeRecord) -> bool:
        """Claim the channel for ``target`` (this node owns it: no other claim comes first)."""
        assert self._ownership is not None
        claim = self._ownership.current(topic, channel)
        moved = self._ownership.claim(topic, channel, claim, target)
        if moved:
            self.elsewhere[(topic, channel)] = target.http_url
        return moved

    def forget(self, topic: str, channel: str | None = None) -> None:
        """The claims of a deleted topic (every channel) or channel (blocking)."""
        if self._ownership is not None:
            self._ownership.forget(topic, channel)

    def dead_journals(self, tokens: list[str], nodes: dict[int, NodeRecord]) -> list[str]:
        """Of the journals named by ``tokens`` (read before ``nodes``), those of processes that
        are gone and that this node may recover now: alone, every one but its own; with other
        nodes, those it claimed (a claim as a channel's: another live node's claim wins)."""
        me = self.me
        live = {n.token for n in nodes.values()} | ({me.token} if me is not None else set())
        dead = [t for t in tokens if t not in live]
        if self._journals is None or me is None:
            return dead
        mine = []
        for token in dead:
            claim = self._journals.current(token, "journal")
            holder = claim.held_by(nodes) if claim is not None else None
            if holder is not None and holder.token != me.token:
                continue
            if (holder is not None) or self._journals.claim(token, "journal", claim, me):
                mine.append(token)
        return mine

    def journal_recovered(self, token: str) -> None:
        if self._journals is not None:
            self._journals.forget(token)

    def log_taken_back(self) -> None:
        if self._taken_back:
            log.info("took back %d channels this node's lane served before", self._taken_back)
            self._taken_back = 0
