"""Inner and outer process groups of the hierarchical ring from Megatron's settings.

The ring's rank order and the group construction are the context-parallel layer's
(``context_parallel.hierarchy``). Two sources:

* Megatron's ``hierarchical_context_parallel_sizes=[inner, outer]``
  (``initialize_model_parallel`` / ``--hierarchical-context-parallel-sizes``). Its level-0
  groups are consecutive CP ranks and its level-1 groups take one rank from each, which is the
  order the ring needs; :func:`hierarchy_from_megatron` checks it and returns the pair.
* An explicit inner size, or one derived from the ranks per node
  (``inner_size_from_nodes``, ``LOCAL_WORLD_SIZE`` under torchrun): ``new_hierarchy``
  creates the groups (both re-exported here from ``context_parallel.hierarchy``).
"""

from __future__ import annotations

import torch.distributed as dist

from ..context_parallel.hierarchy import group_members, hierarchy_ranks, inner_size_from_nodes, new_hierarchy
from ..sparse.validation import fail

__all__ = ["hierarchy_from_megatron", "inner_size_from_nodes", "new_hierarchy"]


def _check_order(inner, outer, cp_group, name: str) -> None:
    members = group_members(cp_group)
    if dist.get_rank() not in members:
        fail("cp_group", members, f"a group holding this rank ({dist.get_rank()})")
    hierarchy_ranks(members, members.index(dist.get_rank()), (inner, outer), name)


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
