"""Inner and outer process groups of the hierarchical context-parallel ring.

``ring_attention(..., hierarchy=(inner_group, outer_group))`` numbers the CP group's ranks
``node * inner_size + local``: the inner group is ``inner_size`` consecutive CP ranks (one
node, fast links), the outer group the ranks with the same ``local`` across nodes. CP ranks
follow global rank order (``torch.distributed.new_group`` sorts its ranks).

Two sources:

* Megatron's ``hierarchical_context_parallel_sizes=[inner, outer]``
  (``initialize_model_parallel`` / ``--hierarchical-context-parallel-sizes``). Its level-0
  groups are consecutive CP ranks and its level-1 groups take one rank from each, which is the
  order the ring needs; :func:`hierarchy_from_megatron` checks it and returns the pair.
* An explicit inner size, or one derived from the ranks per node
  (:func:`inner_size_from_nodes`, ``LOCAL_WORLD_SIZE`` under torchrun): :func:`new_hierarchy`
  creates the groups.
"""

from __future__ import annotations

import os
from collections import Counter

import torch.distributed as dist

from ..sparse.validation import check_int, fail


def _members(cp_group) -> list[int]:
    return dist.get_process_group_ranks(cp_group) if cp_group is not None else list(range(dist.get_world_size()))


def _check_order(inner, outer, cp_group, name: str) -> None:
    members = _members(cp_group)
    inner_ranks, outer_ranks = dist.get_process_group_ranks(inner), dist.get_process_group_ranks(outer)
    if len(inner_ranks) * len(outer_ranks) != len(members):
        fail(
            name, [len(inner_ranks), len(outer_ranks)], f"[inner, outer] with inner x outer == cp_size ({len(members)})"
        )
    if dist.get_rank() not in members:
        fail("cp_group", members, f"a group holding this rank ({dist.get_rank()})")
    node, local = divmod(members.index(dist.get_rank()), len(inner_ranks))
    want_inner = members[node * len(inner_ranks) : (node + 1) * len(inner_ranks)]
    want_outer = members[local :: len(inner_ranks)]
    if inner_ranks != want_inner or outer_ranks != want_outer:
        fail(
            name,
            f"groups with inner ranks {inner_ranks}, outer ranks {outer_ranks}",
            f"inner ranks {want_inner} (consecutive CP ranks) and outer ranks {want_outer} (same local rank) "
            f"for global rank {dist.get_rank()} of the CP group {members}",
        )


def hierarchy_from_megatron(hcp_groups=None, cp_group=None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(inner_group, outer_group) from Megatron's hierarchical CP groups.

    ``hcp_groups``: the groups of ``hierarchical_context_parallel_sizes`` (e.g.
    ``pg_collection.hcp``), by default ``parallel_state``'s; ``cp_group``: the CP group they
    split, by default ``parallel_state``'s. Raises ``ValueError`` naming
    ``hierarchical_context_parallel_sizes`` when there are none, more than two levels, or
    ranks in an order the ring cannot use.
    """
    from megatron.core import parallel_state

    name = "hierarchical_context_parallel_sizes"
    if hcp_groups is None:
        hcp_groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    if not hcp_groups:
        fail(name, None, "[inner, outer] passed to initialize_model_parallel (none were created)")
    if len(hcp_groups) != 2:
        fail(name, [g.size() for g in hcp_groups], "two sizes [inner, outer] (the ring has two levels)")
    inner, outer = hcp_groups
    _check_order(inner, outer, cp_group, name)
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
    members = _members(cp_group)
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
    mine = (tuple(_members(cp_group)), inner_size)
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
