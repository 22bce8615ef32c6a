"""Where the ranks sit: nodes of `ranks_per_node` consecutive ranks (paper section 5.3).

Links inside a node (NVLink, PCIe, shared memory) are much faster than links between nodes
(InfiniBand, Ethernet). The "twolevel" tree decode reduces inside each node first, so only one
rank per node -- its leader, the node's lowest rank -- talks across nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from treeattn.parallel import comm


@dataclass(frozen=True)
class Topology:
    """Ranks r of a group live on node r // ranks_per_node (the layout torchrun uses).

    Args:
        ranks_per_node: ranks per node, >= 1. None: the LOCAL_WORLD_SIZE environment variable
            (torchrun sets it), else every rank of the group on one node.

    Example (8 ranks, 2 per node)::

        >>> import treeattn as ta
        >>> topology = ta.Topology(ranks_per_node=2)
        >>> topology.leaders(8), topology.node_ranks(5, 8)
        ([0, 2, 4, 6], [4, 5])
    """

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        k = self.ranks_per_node
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"Topology: ranks_per_node must be a positive int or None, got {k!r}")

    def resolve(self, world_size: int) -> int:
        """ranks_per_node for a group of `world_size` ranks; ValueError if it does not divide it."""
        k = self.ranks_per_node
        source = "ranks_per_node"
        if k is None and os.environ.get("LOCAL_WORLD_SIZE"):
            source = "LOCAL_WORLD_SIZE"
            try:
                k = int(os.environ["LOCAL_WORLD_SIZE"])
            except ValueError:
                raise ValueError(f"Topology: LOCAL_WORLD_SIZE must be an int, got {os.environ['LOCAL_WORLD_SIZE']!r}") from None
        if k is None:
            return world_size
        if k < 1 or world_size % k != 0:
            raise ValueError(f"Topology: the group's world size {world_size} must be a multiple of {source}, got {k}")
        return k

    def node_ranks(self, rank: int, world_size: int) -> list[int]:
        """Group ranks on the node of `rank`, leader first."""
        k = self.resolve(world_size)
        first = rank // k * k
        return list(range(first, first + k))

    def leaders(self, world_size: int) -> list[int]:
        """Group rank of every node's leader."""
        return list(range(0, world_size, self.resolve(world_size)))


@dataclass
class NodeGroups:
    """Process groups for two-level communication: this rank's node, and the node leaders."""

    node: dist.ProcessGroup | None  # None when a node holds one rank
    leaders: dist.ProcessGroup | None  # None on non-leaders, or when there is one node
    node_ranks: list[int]  # group ranks of this node, leader first
    leader_ranks: list[int]  # group ranks of the leaders


# (id(group), ranks_per_node) -> (group, NodeGroups). The group is kept alive by the entry so its
# id cannot be reused for another group.
_NODE_GROUPS: dict[tuple[int, int], tuple[object, NodeGroups]] = {}


def node_groups(group: dist.ProcessGroup | None, ranks_per_node: int) -> NodeGroups:
    """The node and leader subgroups of `group`, created on first use and cached.

    torch requires every rank of the default (world) group to call ``dist.new_group`` for every
    subgroup, in the same order. So `group` must span the whole world and every rank must make its
    first two-level call with a given ranks_per_node at the same point of the program, as it must
    for any collective. A proper subgroup of the world is refused with a ValueError.
    """
    group = comm.process_group(group)
    world_group = dist.GroupMember.WORLD if group is None else group
    key = (id(world_group), ranks_per_node)
    cached = _NODE_GROUPS.get(key)
    if cached is not None:
        return cached[1]
    p = comm.group_size(group)
    if p != dist.get_world_size():
        raise ValueError(
            f"method='twolevel' needs a group spanning all {dist.get_world_size()} ranks of the world "
            f"(torch creates subgroups collectively over the world), got a group of {p}"
        )
    me = comm.group_rank(group)
    to_global = [comm.global_rank(group, r) for r in range(p)]
    leader_ranks = list(range(0, p, ranks_per_node))
    node_group = None
    for first in leader_ranks:  # every rank creates every node group, in the same order
        members = list(range(first, first + ranks_per_node))
        created = dist.new_group([to_global[r] for r in members]) if ranks_per_node > 1 else None
        if me in members:
            node_group, node_ranks = created, members
    leaders = dist.new_group([to_global[r] for r in leader_ranks]) if len(leader_ranks) > 1 else None
    result = NodeGroups(
        node=node_group,
        leaders=leaders if me in leader_ranks else None,
        node_ranks=node_ranks,
        leader_ranks=leader_ranks,
    )
    _NODE_GROUPS[key] = (world_group, result)
    return result
