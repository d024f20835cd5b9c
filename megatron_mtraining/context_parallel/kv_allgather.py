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
from .layout import GatheredTokens
from .pieces import Piece, nothing_attended

# torch 2.13 renamed the tensor collectives (the old names warn); the GPU image's 2.11 has
# only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GatheredKV:
    """K and V of the ranks of ``group`` (the CP group, or a node's ranks), gathered
    asynchronously: posted when constructed (before what the transfer then overlaps: the
    index build, or the step before), awaited by ``wait``, which returns them in ascending
    global order (``tokens``: the layout's ``gathered`` of the group's ranks)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, tokens: GatheredTokens, group):
        self.tokens, self.group, self.size = tokens, group, dist.get_world_size(group)
        # [size * B, L, H, D], rank-major: the shape every backend gathers into. Posted without
        # autograd (the gradient is the caller's), as ``wait`` runs inside its forward.
        with torch.no_grad():
            self.buffers = [x.new_empty((self.size * x.shape[0], *x.shape[1:])) for x in (k, v)]
            self.work = [
                _all_gather(buf, x.contiguous(), group=group, async_op=True)
                for buf, x in zip(self.buffers, (k, v), strict=True)
            ]

    def wait(self, timer: KernelTimer | None, phase: str = "fwd") -> tuple[torch.Tensor, torch.Tensor]:
        with timed(timer, phase):
            for w in self.work:
                w.wait()
        # [size * B, L, H, D] -> [B, size * L, H, D] (a view for B = 1), then one gather into order.
        order = self.tokens.to_ascending
        return tuple(
            buf.unflatten(0, (self.size, -1)).movedim(0, 1).flatten(1, 2).index_select(1, order) for buf in self.buffers
        )


class OwnersShare:
    """Each rank's share of the sum over the ranks of ``group`` of gradients ``grads`` (``[B,
    size * L, H, D]`` each, over ``tokens``' keys, ascending), in its own token order: posted
    when constructed, awaited by ``wait``."""

    def __init__(self, grads, tokens: GatheredTokens, group):
        size = dist.get_world_size(group)
        self.posted = []
        for g in grads:
            # [B, size * L, ...] -> [size * B, L, ...]: rank r's tokens, in its order, r-th.
            stacked = g.index_select(1, tokens.to_rank_major).unflatten(1, (size, -1)).movedim(1, 0)
            mine = g.new_empty(stacked.shape[1:])
            work = _reduce_scatter(mine, stacked.flatten(0, 1).contiguous(), group=group, async_op=True)
            self.posted.append((mine, work))

    def wait(self, timer: KernelTimer | None) -> list[torch.Tensor]:
        with timed(timer, "bwd"):
            for _, w in self.posted:
                w.wait()
        return [mine for mine, _ in self.posted]


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
        ctx.tokens, ctx.group, ctx.comm_timer = gathered.tokens, gathered.group, comm_timer
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, grads, _ = ctx.piece.backward(q, k_all, v_all, ctx.scale, out, lse, dout, dlse, None, True)
        dt = compute_dtype(q.dtype)
        dk, dv = OwnersShare([g.to(dt) for g in grads], ctx.tokens, ctx.group).wait(ctx.comm_timer)
        dq = torch.zeros_like(q) if dq is None else dq.to(q.dtype)
        return dq, dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None, None
