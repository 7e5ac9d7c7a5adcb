"""This node among the warehouse's nodes: the shares of channels it holds, who holds the rest.

Every node serves every channel, each its shares (queue_engine.shares: one per id lane), as
the channel's claims say (store.coordination.ownership: claims put-if-absent, a holder's lane is the
lease). A node alone on its warehouse (tests, embedded use: no ``Node``) serves every
share without claiming any.
"""

from __future__ import annotations

import logging

from queue_engine.errors import ErrorCode, QueueError
from queue_engine.shares import Holder, plan
from queue_engine.store.coordination import Claim, Node, NodeDirectory, NodeRecord, Ownership

log = logging.getLogger(__name__)

JOURNAL_CLAIMS_DIR = "_deltaq/journal_claims"


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
        # Who holds each share of the channels, as last read (for redirects and /stats).
        self.holders: dict[tuple[str, str], dict[int, Holder]] = {}
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
        """Remember ``nodes`` as the live ones; True if a node seen before is gone or one
        joined."""
        now = {lane: n.token for lane, n in nodes.items()}
        moved = now != self._seen
        self._seen = now
        return moved

    def claim_of(self, topic: str, channel: str) -> Claim | None:
        """The channel's newest claim (blocking: claims are objects in the store)."""
        assert self._ownership is not None
        claim = self._ownership.current(topic, channel)
        self.holders[(topic, channel)] = dict(claim.shares) if claim is not None else {}
        return claim

    def plan(
        self, topic: str, channel: str, nodes: dict[int, NodeRecord] | None = None
    ) -> tuple[Claim | None, dict[int, Holder]]:
        """The channel's newest claim and the shares as this node should claim them next
        (queue_engine.shares.plan). ``nodes``: a view of the live nodes to start from (read
        afresh when the claim names a node it lacks: a node that made a claim joined before
        it, so a fresh view names it if it still lives)."""
        assert self._directory is not None
        me = self.me
        assert me is not None
        claim = self.claim_of(topic, channel)
        view = nodes if nodes is not None else self._directory.current()
        if claim is not None and any(h.live(view) is None for h in claim.shares.values()):
            view = self._directory.fresh()
        return claim, plan(claim.shares if claim is not None else {}, view, me)

    def write(
        self, topic: str, channel: str, claim: Claim | None, shares: dict[int, Holder]
    ) -> bool:
        """Claim ``shares`` after ``claim``; False if another node claimed first."""
        assert self._ownership is not None
        me = self.me
        assert me is not None
        if not self._ownership.claim_shares(topic, channel, claim, shares):
            return False
        before = claim.shares if claim is not None else {}
        self.holders[(topic, channel)] = dict(shares)
        taken = sorted(
            lane
            for lane, h in shares.items()
            if h.is_node(me) and not (lane in before and before[lane].is_node(me))
        )
        if taken:
            if all(lane in before and before[lane].lane == me.lane for lane in taken):
                self._taken_back += 1  # this lane's earlier process held them: a restart
                log.debug("node %d took back %s/%s lanes %s", me.lane, topic, channel, taken)
            else:
                log.info("node %d took channel %s/%s lanes %s", me.lane, topic, channel, taken)
        return True

    def elsewhere(self, topic: str, channel: str, lane: int) -> NodeRecord | None:
        """The live node other than this one that holds the channel's share ``lane``, as
        last read."""
        holder = self.holders.get((topic, channel), {}).get(lane)
        me = self.me
        if holder is None or me is None or holder.is_node(me):
            return None
        assert self._directory is not None
        return holder.live(self._directory.current())

    def served_elsewhere(self, topic: str, channel: str) -> str | None:
        """The URL of a node serving shares of the channel, other than this one (for /stats
        when this node serves none)."""
        me = self.me
        for holder in self.holders.get((topic, channel), {}).values():
            if me is None or not holder.is_node(me):
                return holder.http_url
        return None

    def target(self, lane: int) -> NodeRecord:
        """The live node in ``lane`` (INVALID_NODE if none; or if this node is alone)."""
        if self._directory is None:
            raise QueueError(ErrorCode.INVALID_NODE, "this node is alone on its warehouse")
        target = self._directory.fresh().get(lane)
        if target is None:
            raise QueueError(ErrorCode.INVALID_NODE, f"no live node in lane {lane}", param="node")
        return target

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
