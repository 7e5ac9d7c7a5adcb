"""A channel's shares: one per id lane, each served by one node at a time (pure).

A message id carries the lane of the node that published it (``IdAllocator``), so a channel's
messages split into ``LANES`` shares. Each share has one holder, named in the channel's claim
(store.coordination.ownership); a node serves exactly the shares the newest claim names it
for, so one channel is served by every node at once and each message by one node. Who should
hold what (``plan``), as nsqd's "each node serves what was published to it":

- a live node holds its own lane's share;
- a share whose lane has no live node (its publisher is gone, or never ran) goes to the first
  live node that claims it (so a dead node's messages are served again);
- a node holding another live node's share hands it back, unless an admin pinned it there
  (``/channel/move``).

A holder only ever gives a share away itself, after it stopped serving it; a share is taken
from a node only once that node is no longer live. So two nodes never serve one share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from queue_engine.message import LANES

_HEX = "0123456789abcdef"
ALL_LANES = frozenset(range(LANES))


def lane_of(message_id: str) -> int:
    """The lane of a message id (16 hex chars): its last hex digit, as ids are spaced LANES
    apart within a lane."""
    return int(message_id[-1], 16) % LANES


def in_lanes(ids: pa.Array | pa.ChunkedArray, lanes: frozenset[int]) -> pa.Array:
    """A mask: which of ``ids`` are in ``lanes``, without a Python object per id."""
    last = pc.utf8_slice_codeunits(ids, -1)
    return pc.is_in(last, value_set=pa.array([_HEX[lane] for lane in sorted(lanes)], pa.string()))


def keep_lanes(table: pa.Table, lanes: frozenset[int] | None) -> pa.Table:
    """The rows of ``table`` whose ``id`` is in ``lanes`` (None: every row)."""
    if lanes is None or lanes == ALL_LANES or table.num_rows == 0:
        return table
    return table.filter(in_lanes(table["id"], lanes))


class NodeRecord(Protocol):
    """A live node as the claims name it (store.coordination.NodeRecord is one)."""

    @property
    def lane(self) -> int: ...

    @property
    def token(self) -> str: ...

    @property
    def http_url(self) -> str: ...


Node = TypeVar("Node", bound=NodeRecord)


@dataclass(frozen=True)
class Holder:
    """The node a claim names for a share."""

    lane: int
    token: str
    http_url: str
    # Put there by an admin's move: not handed back to the share's own lane.
    pinned: bool = False

    @classmethod
    def of(cls, node: NodeRecord, *, pinned: bool = False) -> Holder:
        return cls(node.lane, node.token, node.http_url, pinned)

    def is_node(self, node: NodeRecord) -> bool:
        return self.lane == node.lane and self.token == node.token

    def live(self, nodes: Mapping[int, Node]) -> Node | None:
        node = nodes.get(self.lane)
        return node if node is not None and node.token == self.token else None


Shares = Mapping[int, Holder]


def served_by(shares: Shares, node: NodeRecord) -> frozenset[int]:
    """The lanes ``shares`` names ``node`` for."""
    return frozenset(lane for lane, holder in shares.items() if holder.is_node(node))


def plan(shares: Shares, nodes: Mapping[int, Node], me: Node) -> dict[int, Holder]:
    """The shares as ``me`` should claim them next, given the live ``nodes`` (``me``
    included): it takes its own lane's share and the free shares of lanes without a live
    node, and hands back other live nodes' shares it holds unpinned. Shares held by other
    live nodes are left as they are."""
    nodes = {**nodes, me.lane: me}
    after = dict(shares)
    for lane in range(LANES):
        holder = shares.get(lane)
        if holder is None or holder.live(nodes) is None:
            if lane == me.lane or lane not in nodes:
                after[lane] = Holder.of(me)
            else:
                after.pop(lane, None)  # that live node takes its own share
        elif holder.is_node(me) and lane != me.lane and lane in nodes and not holder.pinned:
            after[lane] = Holder.of(nodes[lane])
    return after


def changed(before: Shares, after: Shares) -> bool:
    return dict(before) != dict(after)
