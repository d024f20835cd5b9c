"""Public attention entry points: ``sparse_attention`` and ``merge_attention_outputs``."""

from __future__ import annotations

import torch

from .dispatch import attention_kernel, backend_choice, log_decision
from .index import SparseIndex
from .kernels.block_bar.tables import tile_tables
from .kernels.dense_backends import flash_attn, sdpa
from .kernels.varlen_blocks.attention import VarlenBlockAttention
from .reference import ReferenceSparseAttention, combine
from .validation import check_qkv, check_softmax_scale, check_tensor, fail


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal softmax attention restricted to ``index``.

    q ``[B, S, Hq, D]``, k and v ``[B, S, Hkv, D]`` (Hq a multiple of Hkv). Returns
    ``out [B, S, Hq, D]`` in q's dtype and ``lse [B, Hq, S]`` float32. A row with no
    visible key gives zeros and ``lse = -inf``. Differentiable in q, k, v (and
    through ``lse``).

    ``backend``: ``"auto"`` (default), ``"reference"``, ``"triton"``, ``"flash_attn"``,
    ``"sdpa"`` or ``"varlen_blocks"``; the environment variable ``MTRAINING_ATTENTION_BACKEND`` sets the default,
    e.g. ``reference`` to rule the kernels out while debugging. Which implementation runs,
    and why, is ``dispatch.attention_kernel``'s decision.
    """
    check_qkv(q, k, v)
    if not isinstance(index, SparseIndex):
        fail("index", type(index).__name__, "a sparse index (DenseIndex, VerticalSlashIndex, BlockTopKIndex)")
    b, s, hq, d = q.shape
    index.check_compatible(b, hq, s, k.shape[2], q.device)
    scale = check_softmax_scale(softmax_scale, d)
    decision = attention_kernel(q, index, backend)
    log_decision(decision, "sparse_attention")
    if decision.kernel == "flash_attn":
        return flash_attn.FlashAttention.apply(q, k, v, scale)
    if decision.kernel == "sdpa":
        return sdpa.SDPAAttention.apply(q, k, v, scale)
    if decision.kernel == "varlen_blocks":
        return VarlenBlockAttention.apply(q, k, v, index, scale)
    if decision.kernel == "kv_outer":
        from .kernels.kv_outer.attention import KVOuterAttention  # imports Triton

        return KVOuterAttention.apply(q, k, v, index, scale)
    if decision.kernel == "reference":
        return ReferenceSparseAttention.apply(q, k, v, index, scale)
    from .kernels.block_bar.attention import TritonBlockBarAttention  # imports Triton

    return TritonBlockBarAttention.apply(q, k, v, tile_tables(index), scale)


def merge_attention_outputs(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines attention over two disjoint key sets into attention over their union.

    ``out_*`` ``[B, S, H, D]``, ``lse_*`` ``[B, H, S]``; ``lse = log(e^lse_a + e^lse_b)``,
    ``out = w_a out_a + w_b out_b`` with ``w_i = e^(lse_i - lse)``. Rows empty on both
    sides stay zero with ``lse = -inf``; no NaN appears in values or gradients.
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(name, t, ndim=4)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, t, ndim=3)
    if out_b.shape != out_a.shape:
        fail("out_b.shape", tuple(out_b.shape), f"the shape of out_a {tuple(out_a.shape)}")
    bsz, seq, heads, _ = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != (bsz, heads, seq):
            fail(f"{name}.shape", tuple(t.shape), f"[B, H, S] = {[bsz, heads, seq]} to match out_a")
    if backend_choice(out_a) == "triton":
        # One fused pass instead of ``combine``'s ~8 elementwise passes and their autograd graph.
        from .kernels.shared.combine import FusedCombine  # imports Triton

        out, lse = FusedCombine.apply(out_a, lse_a.float(), out_b, lse_b.float())
    else:
        out, lse = combine(out_a, lse_a.float(), out_b, lse_b.float())
    return out.to(out_a.dtype), lse.float()
