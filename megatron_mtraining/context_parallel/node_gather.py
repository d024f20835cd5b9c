"""The hierarchical exchange that gathers K/V inside a node and rings across nodes
(``ring_attention(..., hierarchy, kv_exchange="allgather")``).

Ranks are ``r = node * G + local`` (``G`` ranks a node, ``O`` nodes). Each rank's own chunk
travels the outer ring of its local index, as the hierarchical ring's do; at outer step ``o``
the ``G`` ranks of a node hold the chunks of node ``node - o``, which they all-gather over
the node's fast links, so that every rank attends its queries to the whole node's K/V in one
piece: ``O`` steps of ``G`` chunks each rather than ``O * G`` steps of one.

Why: a step's time is its busiest rank's, and a rank's work against one chunk is lumpy (a
packed sample's documents put their few near diagonals on a few ranks of a few steps; the
residual of the flat ring's balance sits in such light steps). Against a whole node's chunks
the work of ``G`` ring steps is summed per rank before any rank waits for another. With the
layout's ranks numbered node-major (``ContextParallelLayout.node_size``: flat rank ``local * O +
node``), outer step ``o`` holds the flat ring's steps ``s = o (mod O)``, so every block
diagonal of the attention lands on one outer step for every rank, as striping puts it on one
ring step (``docs/benchmarks.md``, "All-gather inside a node, ring across nodes").

Transfers: the outer ring's chunk of step ``o + 1`` is received during step ``o - 1`` (the
first during the index build), and its node gather is posted before step ``o``'s kernel, so
both overlap compute; the gathered chunks are kept for the backward (the whole sequence's
K/V, as the all-gather exchange keeps), which moves no K/V. Backward: each step's dK/dV of
the node's chunks are reduce-scattered inside the node (posted, awaited after the next
step's kernel); each rank's share, its chunk's part, joins an accumulator that rides the outer
ring one node a step behind the chunk's forward journey and reaches the owner after the last.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..sparse.reference import compute_dtype
from .comm import RingExchange
from .kv_allgather import GatheredKV, OwnersShare
from .layout import ContextParallelLayout, TokenPositions

Chunk = list[torch.Tensor]


def node_members(node: int, node_size: int) -> tuple[int, ...]:
    """The group ranks of node ``node`` (``node * G + local``), in local order."""
    return tuple(range(node * node_size, (node + 1) * node_size))


class NodeGatherSchedule:
    """One rank's view of the exchange for one pass over ``inner`` (the node's global ranks,
    in local order; ``inner_group`` their process group) and ``outer`` (the global ranks of
    this local index on every node, in node order): the same interface as
    ``ring_schedule.RingSchedule``, one inner step an outer step. ``kept``: the forward's
    gathered chunks, which the backward's pass yields again."""

    def __init__(
        self,
        inner: list[int],
        outer: list[int],
        inner_group,
        layout: ContextParallelLayout,
        timer=None,
        phase: str = "fwd",
        kept: list[Chunk] | None = None,
    ):
        self.inner, self.outer, self.group, self.layout = inner, outer, inner_group, layout
        self.g, self.node, self.n_outer = len(inner), outer.index(dist.get_rank()), len(outer)
        self.timer, self.phase = timer, phase
        self.outer_x = RingExchange(outer, timer, phase)
        self.kept: list[Chunk] = [] if kept is None else kept
        self._first: GatheredKV | None = None

    def node_ranks(self, o: int) -> tuple[int, ...]:
        """The group ranks whose chunks this rank holds at outer step ``o``: node ``node - o``'s."""
        return node_members((self.node - o) % self.n_outer, self.g)

    def keys(self, o: int, i: int, layout: ContextParallelLayout, device) -> TokenPositions:
        """The positions of the K/V held at step ``(o, i)`` (``i`` is 0): the node's, ascending."""
        return layout.gathered(self.node_ranks(o), device).keys

    def _gather(self, o: int, chunk: Chunk) -> GatheredKV:
        return GatheredKV(*chunk, self.layout.gathered(self.node_ranks(o), chunk[0].device), self.group)

    def post_first(self, own: Chunk) -> None:
        """Posts the gather of the node's own chunks and sends this rank's chunk one node on
        (that node's chunk of outer step 1), before the index build, which they then overlap."""
        self._first = self._gather(0, own)
        if self.n_outer > 1:
            self.outer_x.start(own)

    def chunks(self, own: Chunk) -> Iterator[tuple[int, int, Chunk]]:
        """``(o, 0, kv)`` for every outer step in order, ``kv`` the node's gathered K/V."""
        if self.phase == "bwd":
            for o, kv in enumerate(self.kept):
                yield o, 0, kv
            return
        gathering = self._first if self._first is not None else self._gather(0, own)
        for o in range(self.n_outer):
            following = None
            if o + 1 < self.n_outer:
                chunk = self.outer_x.wait()  # step o + 1's, received during the step before
                if o + 2 < self.n_outer:
                    self.outer_x.start(chunk)
                following = self._gather(o + 1, chunk)
            kv = list(gathering.wait(self.timer, self.phase))
            self.kept.append(kv)
            yield o, 0, kv
            gathering = following

    def backward(self) -> NodeGatherSchedule:
        """The backward's pass: the forward's chunks again, no K/V moved."""
        return NodeGatherSchedule(self.inner, self.outer, self.group, self.layout, self.timer, "bwd", kept=self.kept)

    def accumulators(self, zeros) -> NodeAccumulators:
        return NodeAccumulators(self, zeros)


class NodeAccumulators:
    """The backward's dK/dV of one rank over ``NodeGatherSchedule``'s steps: ``add(0, grads)``
    after each step's kernel (its part of the node's chunks held then), ``own()`` at the end:
    this rank's own chunk's dK/dV, every rank's parts added."""

    def __init__(self, schedule: NodeGatherSchedule, zeros):
        self.s, self.zeros = schedule, zeros
        self.outer_x = RingExchange(schedule.outer, schedule.timer, "bwd")
        self.step = 0
        self.pending: OwnersShare | None = None
        self.riding = False  # an accumulator is on the outer ring

    def add(self, i: int, grads: Chunk) -> None:
        tokens = self.s.layout.gathered(self.s.node_ranks(self.step), grads[0].device)
        share = OwnersShare([g.to(compute_dtype(g.dtype)) for g in grads], tokens, self.s.group)
        if self.pending is not None:  # the step before's, reduced while this step's kernel ran
            self._ride(self.pending.wait(self.s.timer))
        self.pending, self.step = share, self.step + 1

    def _ride(self, part: Chunk) -> None:
        """Adds this node's part of the chunk to the accumulator from the node before (none at
        the first step) and passes it on."""
        before = self.outer_x.wait() if self.riding else self.zeros()
        self.outer_x.start([a + b for a, b in zip(before, part, strict=True)])
        self.riding = True

    def own(self) -> Chunk:
        """This rank's own chunk's dK/dV, after the last ``add``: the accumulator the node
        before passes after its last step."""
        self._ride(self.pending.wait(self.s.timer))
        return self.outer_x.wait()
