"""Context-parallel attention over all-gathered K/V (``ring_attention(kv_exchange="allgather")``).

Every rank gathers the whole sequence's K/V, attends its own queries to it in one
piece (one kernel launch, under one set of tile tables: tiles and vertical columns), and returns
the K/V gradients to their owners with one reduce-scatter. Under GQA the K/V are a
small share of the activations (Qwen2.5-3B: 2 of 16 heads), so holding them whole is
cheap. What it buys over the ring: one piece per rank, each program with its query
block's whole work, as on one device, and keys that are their own positions (the
kernels skip the key-position arithmetic, ``block_bar``'s ``HAS_KPOS``). On 2 H200s its
forward reaches 0.95 of the single GPU's throughput at 256K tokens (the ring's 0.82-0.84)
and 0.97 at 512K (``docs/benchmarks.md``). What it gives up: the transfer overlaps the index
build and the host's tile-table work instead of attention kernels, the gathered K/V grow
with the group, and the backward's reduce-scatter is exposed: across nodes, where
those bytes cross the slow link, ``auto`` keeps the ring. On 8 H200s of one node at
512K it was 0.79 of the single GPU's forward throughput against the ring's 0.58.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sparse.reference import compute_dtype
from .imbalance import KernelTimer, timed
from .layout import ContextParallelLayout
from .pieces import Piece, nothing_attended

# torch 2.13 renamed the tensor collectives (the old names warn); the GPU image's 2.11 has
# only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GatheredKV:
    """K and V of every rank, gathered asynchronously: posted when constructed (before the
    index build, which the transfer then overlaps), awaited by ``wait``, which returns
    them in global token order."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, layout: ContextParallelLayout, group):
        self.layout, self.group = layout, group
        # [W * B, L, H, D], rank-major: the shape every backend gathers into. Posted without
        # autograd (the gradient is ``AllGatherAttention``'s), as ``wait`` runs inside it.
        with torch.no_grad():
            self.buffers = [x.new_empty((layout.cp_size * x.shape[0], *x.shape[1:])) for x in (k, v)]
            self.work = [
                _all_gather(buf, x.contiguous(), group=group, async_op=True)
                for buf, x in zip(self.buffers, (k, v), strict=True)
            ]

    def wait(self, timer: KernelTimer | None) -> tuple[torch.Tensor, torch.Tensor]:
        with timed(timer, "fwd"):
            for w in self.work:
                w.wait()
        # [W * B, L, H, D] -> [B, W * L, H, D] (a view for B = 1), then one gather into order.
        inverse, w = self.layout.global_order(self.buffers[0].device), self.layout.cp_size
        return tuple(
            buf.unflatten(0, (w, -1)).movedim(0, 1).flatten(1, 2).index_select(1, inverse) for buf in self.buffers
        )


def reduce_scatter_to_owners(grads, layout: ContextParallelLayout, group, timer: KernelTimer | None):
    """Each rank's share of the sum over ranks of whole-sequence gradients ``grads``
    (``[B, S, H, D]`` each, in global order), in its own token order."""
    order = layout.rank_major_order(grads[0].device)
    posted = []
    for g in grads:
        # [B, S, ...] -> [W * B, L, ...]: rank r's tokens, in its order, r-th.
        stacked = g.index_select(1, order).unflatten(1, (layout.cp_size, layout.local_len)).movedim(1, 0)
        mine = g.new_empty((g.shape[0], layout.local_len, *g.shape[2:]))
        posted.append((mine, _reduce_scatter(mine, stacked.flatten(0, 1).contiguous(), group=group, async_op=True)))
    with timed(timer, "bwd"):
        for _, w in posted:
            w.wait()
    return [mine for mine, _ in posted]


class AllGatherAttention(torch.autograd.Function):
    """A rank's queries over the gathered K/V, in one piece: the whole index over the whole
    sequence's keys (on the kernels one set of tile tables, tiles and vertical columns, as on one
    device).

    Backward: the piece's gradients over the whole sequence are reduce-scattered to the
    owners; the gathered K/V are kept from the forward (2 x the rank's K/V), not
    gathered again."""

    @staticmethod
    def forward(ctx, q, k, v, gathered: GatheredKV, piece: Piece, scale: float, comm_timer):
        k_all, v_all = gathered.wait(comm_timer)
        result = piece.forward(q, k_all, v_all, scale, None, True)
        out, lse = result if result is not None else nothing_attended(q)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.piece, ctx.scale = piece, scale
        ctx.layout, ctx.group, ctx.comm_timer = gathered.layout, gathered.group, comm_timer
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, grads, _ = ctx.piece.backward(q, k_all, v_all, ctx.scale, out, lse, dout, dlse, None, True)
        dt = compute_dtype(q.dtype)
        dk, dv = reduce_scatter_to_owners([g.to(dt) for g in grads], ctx.layout, ctx.group, ctx.comm_timer)
        dq = torch.zeros_like(q) if dq is None else dq.to(q.dtype)
        return dq, dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None, None
