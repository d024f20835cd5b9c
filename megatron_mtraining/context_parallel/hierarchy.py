"""Inner and outer process groups of the hierarchical ring, and the rank order it needs.

``ring_attention(..., hierarchy=(inner_group, outer_group))`` numbers the CP group's ranks
``node * inner_size + local``: the inner group is ``inner_size`` consecutive CP ranks (one
node, fast links), the outer group the ranks with the same ``local`` across nodes. CP ranks
follow global rank order (``torch.distributed.new_group`` sorts its ranks).
:func:`hierarchy_ranks` checks a pair of groups against that order (the ring and the
Megatron adapter share it); :func:`new_hierarchy` creates the groups for an inner size,
which :func:`inner_size_from_nodes` can derive from the ranks per node.
"""

from __future__ import annotations

import os
from collections import Counter

import torch.distributed as dist

from ..sparse.validation import check_int, fail


def group_members(group) -> list[int]:
    """Global ranks of ``group`` (None: the whole world)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def hierarchy_ranks(members: list[int], rank: int, hierarchy, name: str = "hierarchy") -> tuple[list[int], list[int]]:
    """Global ranks of the inner and outer groups of ``hierarchy = (inner_group,
    outer_group)`` for group rank ``rank`` of a CP group with global ranks ``members``,
    after checking they are the ring's (errors name ``name``)."""
    if not (isinstance(hierarchy, tuple | list) and len(hierarchy) == 2):
        fail(name, hierarchy, "None (flat ring) or a pair (inner_group, outer_group)")
    inner = dist.get_process_group_ranks(hierarchy[0])
    outer = dist.get_process_group_ranks(hierarchy[1])
    if len(inner) * len(outer) != len(members):
        fail(name, f"inner {len(inner)} x outer {len(outer)}", f"inner_size x outer_size == cp_size ({len(members)})")
    node, local = divmod(rank, len(inner))
    want_inner = members[node * len(inner) : (node + 1) * len(inner)]
    want_outer = members[local :: len(inner)]
    if inner != want_inner or outer != want_outer:
        fail(
            name,
            f"inner ranks {inner}, outer ranks {outer}",
            f"for cp group rank {rank} of {members}: inner {want_inner} (its node), consecutive CP ranks, "
            f"and outer {want_outer} (same local rank)",
        )
    return inner, outer


def inner_size_from_nodes(cp_group=None, ranks_per_node: int | None = None) -> int:
    """The number of this CP group's ranks on one node, for :func:`new_hierarchy`.

    Global rank ``r`` is on node ``r // ranks_per_node`` (torchrun's numbering);
    ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE``. Every node must hold the same
    number of the group's ranks.
    """
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None or not env.isdigit():
            fail("ranks_per_node", env, "an integer, or LOCAL_WORLD_SIZE set by the launcher")
        ranks_per_node = int(env)
    check_int("ranks_per_node", ranks_per_node, minimum=1)
    members = group_members(cp_group)
    per_node = Counter(r // ranks_per_node for r in members)
    if len(set(per_node.values())) != 1:
        fail(
            "ranks_per_node",
            ranks_per_node,
            f"a node size that puts the same number of CP ranks on every node (CP ranks {members} "
            f"fall on nodes {dict(per_node)})",
        )
    return next(iter(per_node.values()))


def new_hierarchy(inner_size: int, cp_group=None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Creates (inner_group, outer_group) of ``inner_size`` x ``cp_size // inner_size`` for
    ``cp_group`` (default: the whole world).

    A collective over the default group: every rank calls it, each with its own CP group
    (Megatron's CP groups partition the world) and the same ``inner_size``. The ranks first
    exchange their CP groups so that each creates every group, in one order; a bad value
    fails on every rank alike.
    """
    mine = (tuple(group_members(cp_group)), inner_size)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    sizes = sorted({size for _, size in everyone}, key=repr)
    if len(sizes) != 1:
        fail("inner_size", inner_size, f"the same value on every rank (got {sizes})")
    check_int("inner_size", inner_size, minimum=1)
    groups = sorted({members for members, _ in everyone})
    covered = sorted(r for members in groups for r in members)
    if covered != list(range(len(everyone))) or any(r not in members for r, (members, _) in enumerate(everyone)):
        fail("cp_group", list(mine[0]), f"CP groups that partition the world, each holding its caller (got {groups})")
    for members in groups:
        if len(members) % inner_size:
            fail("inner_size", inner_size, f"a divisor of cp_size ({len(members)}): inner x outer == cp_size")
    rank = dist.get_rank()
    inner = outer = None
    for members in groups:
        for start in range(0, len(members), inner_size):
            group = dist.new_group(list(members[start : start + inner_size]))
            if rank in members[start : start + inner_size]:
                inner = group
        for local in range(inner_size):
            group = dist.new_group(list(members[local::inner_size]))
            if rank in members[local::inner_size]:
                outer = group
    return inner, outer
