"""MiniMax Sparse Attention (MSA): index branch, block selection and KL alignment loss.

* Index branch: one index query head per GQA group and one shared index key
  head, computed from the *detached* layer input, so only the KL loss trains it.
* Selection: block score = max over the causally visible keys of the block of
  ``q_idx . k_idx / sqrt(d_idx)``; per (query, group) the query's own block plus
  the top ``topk - 1`` other visible blocks, shared by the group's query heads.
* KL loss: teacher = mean over the group's heads of the main-branch softmax on
  the selected tokens (no gradient); student = softmax of the index scores on
  the same tokens; ``KL(teacher || student)`` averaged over query positions,
  groups and batch. Gradient reaches q_idx and k_idx only. ``msa_kl_loss`` is the
  PyTorch reference (value and gradient); training takes ``msa_kl_objective``, which on
  the kernels (``dispatch.kl_kernel``) skips the KL forward, builds the teacher from the
  main pass's LSE and hands the value over in the backward (``kernels/msa_kl``);
  :func:`msa_attention` runs the main attention and that objective together, and where both
  run KV-outer the KL's teacher comes from the attention's backward.
* Warmup: for the first ``warmup_steps`` steps the main branch is dense and the
  KL spans every visible token (pass a ``DenseIndex``).
* Packed documents (``cu_seqlens``): a block's score is the max over the keys of the
  query's document only (from its start to the query), so a block wholly before the
  document scores -inf and is never chosen; the index carries the documents, so the
  attention and the KL see only those keys.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .attention import sparse_attention
from .dispatch import backend_choice, kl_kernel, log_decision
from .documents import packed_documents
from .index import BlockTopKIndex, DenseIndex, SparseIndex, select_topk_blocks
from .reference import chunks, compute_dtype, finite_or_zero, flat_kv, to_rows, unflat_kv
from .validation import (
    ValidatedConfig,
    check_index_qk,
    check_int,
    check_positive_float,
    check_power_of_two,
    check_qk,
    check_softmax_scale,
    check_tensor,
    fail,
    setting,
)


@dataclass(frozen=True)
class MSAConfig(ValidatedConfig):
    block_size: int = setting(128, check_power_of_two, minimum=16)
    topk: int = setting(16, check_int, minimum=1)
    index_head_dim: int = setting(128, check_int, minimum=1)
    # The KL gradient reaches only the index projections, so under Adam its scale
    # mostly matters for logging and for the share of the global grad norm
    # (clipping); 0.1 keeps the indexer from dominating the clip.
    kl_coeff: float = setting(0.1, check_positive_float)
    # Paper: warm up the indexer before sparse routing (~10% of continued pretraining).
    warmup_steps: int = setting(1000, check_int, minimum=0)

    def in_warmup(self, step: int) -> bool:
        """Dense main branch (and dense KL) at this training step."""
        return step < self.warmup_steps


class IndexBranch(nn.Module):
    """The MSA index projections of one layer: ``W_q_idx`` (one head per GQA group)
    and the shared ``W_k_idx``."""

    def __init__(self, hidden_size: int, num_kv_heads: int, config: MSAConfig, init_std: float = 0.02):
        super().__init__()
        check_int("hidden_size", hidden_size, minimum=1)
        check_int("num_kv_heads", num_kv_heads, minimum=1)
        self.num_kv_heads, self.head_dim = num_kv_heads, config.index_head_dim
        self.linear_q = nn.Linear(hidden_size, num_kv_heads * config.index_head_dim, bias=False)
        self.linear_k = nn.Linear(hidden_size, config.index_head_dim, bias=False)
        for lin in (self.linear_q, self.linear_k):
            nn.init.normal_(lin.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, S, hidden]`` -> (q_idx ``[B, S, Hkv, d_idx]``, k_idx ``[B, S, 1, d_idx]``)."""
        check_tensor("x", x, ndim=3)
        if x.shape[-1] != self.linear_q.in_features:
            fail("x.shape[2]", x.shape[-1], f"the hidden size {self.linear_q.in_features}")
        x = x.detach()  # the KL must not train the backbone (MSA paper, B.3)
        q_idx = self.linear_q(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return q_idx, self.linear_k(x).unsqueeze(2)


def block_max_scores(
    q_idx: torch.Tensor,
    query_positions: torch.Tensor,
    k_idx: torch.Tensor,
    key_positions: torch.Tensor,
    n_blocks: int,
    block_size: int,
    doc_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, Hkv, nq, n_blocks]`` max over the given, causally visible keys of each block of
    ``q_idx . k_idx / sqrt(d_idx)`` (fp32; -inf where the block has no such key). Max is
    exact and order-free, so maxima over key subsets (ring steps) combine to the whole.
    ``doc_starts`` (``[S]`` by global position, packed documents): keys before the start of
    the query's document are not visible."""
    scores = torch.einsum("bqrd,bkd->brqk", q_idx.float(), k_idx[:, :, 0].float()) / math.sqrt(q_idx.shape[-1])
    hidden = key_positions.view(1, -1) > query_positions.view(-1, 1)
    if doc_starts is not None:
        hidden |= key_positions.view(1, -1) < doc_starts[query_positions.long()].view(-1, 1)
    scores.masked_fill_(hidden, float("-inf"))
    out = scores.new_full((*scores.shape[:3], n_blocks), float("-inf"))
    blocks = (key_positions // block_size).expand_as(scores)
    return out.scatter_reduce_(-1, blocks, scores, "amax", include_self=True)


@torch.no_grad()
def msa_select_blocks(
    q_idx: torch.Tensor, k_idx: torch.Tensor, config: MSAConfig, num_heads: int, cu_seqlens: torch.Tensor | None = None
) -> BlockTopKIndex:
    """Top-k key blocks per (query, GQA group); ``num_heads`` is the query head count;
    ``cu_seqlens``: packed documents (each query scores only its document's keys).

    Where the kernels run (``dispatch.backend_choice``: CUDA inputs, not ruled out by
    ``MTRAINING_ATTENTION_BACKEND=reference``) and ``topk`` fits its register-resident set,
    one Triton launch scores and selects with no token-level scores in memory
    (``kernels/index_build/msa_index.py``; ties go to the lower block id). Otherwise the rows go in
    chunks through :func:`block_max_scores` and ``select_topk_blocks``, the reference."""
    check_index_qk(q_idx, k_idx, config.index_head_dim)
    bsz, seq, groups, d = q_idx.shape
    check_int("num_heads", num_heads, minimum=1)
    if num_heads % groups:
        fail("num_heads", num_heads, f"a multiple of the index query head count {groups} (one per GQA group)")
    bs = config.block_size
    documents = packed_documents(cu_seqlens, seq, q_idx.device)
    starts = None if documents is None else documents.starts
    if backend_choice(q_idx) == "triton":
        from .kernels.index_build import msa_index  # imports Triton

        if config.topk <= msa_index.MAX_TOPK:
            documented = {} if starts is None else {"doc_starts": starts}
            blocks = msa_index.select_blocks(q_idx, k_idx, bs, config.topk, **documented)
            return BlockTopKIndex(blocks=blocks, block_size=bs, num_heads=num_heads, documents=documents)
    n_blocks = -(-seq // bs)
    rows_per_chunk = max(bs, (1 << 22) // max(seq, 1) // bs * bs)
    positions = torch.arange(seq, device=q_idx.device)
    blocks = torch.empty(bsz, seq, groups, config.topk, dtype=torch.int32, device=q_idx.device)
    for q0 in range(0, seq, rows_per_chunk):
        q1 = min(q0 + rows_per_chunk, seq)
        rows = positions[q0:q1]
        # No row of the chunk sees a key before the document start of its first row.
        k0 = 0 if documents is None else documents.bounds[bisect.bisect_right(documents.bounds, q0) - 1]
        block_max = block_max_scores(q_idx[:, q0:q1], rows, k_idx[:, k0:q1], positions[k0:q1], n_blocks, bs, starts)
        blocks[:, q0:q1] = select_topk_blocks(block_max, rows // bs, config.topk).permute(0, 2, 1, 3)
    return BlockTopKIndex(blocks=blocks, block_size=bs, num_heads=num_heads, documents=documents)


class _MSAKLLoss(torch.autograd.Function):
    """Chunked KL forward; the backward recomputes per chunk and returns the
    analytic gradient ``(p_student - p_teacher) / (B S Hkv)`` of the index logits."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, index, scale):
        ctx.save_for_backward(q_idx, k_idx, q, k)
        ctx.index, ctx.scale = index, scale
        total = sum(part.sum() for part, *_ in _kl_chunks(q_idx, k_idx, q, k, index, scale))
        return total / _kl_rows(q_idx)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, q, k = ctx.saved_tensors
        dt = compute_dtype(q_idx.dtype)
        dq_idx = torch.empty(q_idx.shape, dtype=dt, device=q_idx.device)
        dk_flat = torch.zeros_like(_index_keys_flat(k_idx, q_idx.shape[2]))
        inv_sqrt_d = 1.0 / math.sqrt(q_idx.shape[-1])
        for _, c, teacher, student, qh_idx, kk_idx in _kl_chunks(q_idx, k_idx, q, k, ctx.index, ctx.scale):
            ds = (student - teacher).unsqueeze(2) * (grad / _kl_rows(q_idx))
            dq_idx[:, c.q0 : c.q1] = to_rows(c.weighted_values(ds, kk_idx) * inv_sqrt_d)
            c.scatter_add(dk_flat, c.key_grad(ds, qh_idx) * inv_sqrt_d)
        groups = q_idx.shape[2]
        dk_idx = unflat_kv(dk_flat, k_idx.expand(-1, -1, groups, -1)).sum(2, keepdim=True)
        return dq_idx.to(q_idx.dtype), dk_idx.to(k_idx.dtype), None, None, None, None


def _kl_rows(q_idx: torch.Tensor) -> int:
    return q_idx.shape[0] * q_idx.shape[1] * q_idx.shape[2]


def _index_keys_flat(k_idx: torch.Tensor, groups: int) -> torch.Tensor:
    return flat_kv(k_idx.expand(-1, -1, groups, -1), compute_dtype(k_idx.dtype))


def _kl_chunks(q_idx, k_idx, q, k, index, scale):
    """Yields, per chunk of query rows: the per-row KL ``[B, G, nq]``, the chunk, the
    teacher and student probabilities ``[B, G, nq, nk]``, and the index queries
    and gathered index keys (for the backward)."""
    dt = compute_dtype(q.dtype)
    k_flat = flat_kv(k, dt)
    kidx_flat = _index_keys_flat(k_idx, q_idx.shape[2])
    inv_sqrt_d = 1.0 / math.sqrt(q_idx.shape[-1])
    for c in chunks(index, q, k):
        main = c.scores(c.heads(q).to(dt) * scale, c.gather(k_flat))
        lse = torch.logsumexp(main, dim=-1, keepdim=True)
        teacher = torch.exp(main - finite_or_zero(lse)).mean(dim=2)
        qh_idx = c.heads(q_idx).to(dt)
        kk_idx = c.gather(kidx_flat)
        log_student = torch.log_softmax(c.scores(qh_idx * inv_sqrt_d, kk_idx), dim=-1).squeeze(2)
        visible = c.valid.squeeze(2).expand_as(teacher)
        terms = torch.xlogy(teacher, teacher) - teacher * torch.where(visible, log_student, 0.0)
        yield terms.sum(-1), c, teacher, torch.exp(log_student), qh_idx, kk_idx


def kl_index_lse(q_idx: torch.Tensor, k_idx: torch.Tensor, index: SparseIndex) -> torch.Tensor:
    """``[B, Hkv, Sq]`` logsumexp of ``q_idx . k_idx / sqrt(d_idx)`` over each row's visible
    selected keys, -inf where none (compute dtype): the PyTorch counterpart of the kernels'
    ``index_lse`` for any index, a context-parallel ring step's ``StepIndex`` included
    (``k_idx [B, SK, 1, d_idx]`` then the step's chunk; the steps' LSEs merge by logaddexp)."""
    dt = compute_dtype(q_idx.dtype)
    b, s, groups, di = q_idx.shape
    kidx_flat = _index_keys_flat(k_idx, groups)
    lse = torch.full((b, groups, s), float("-inf"), dtype=dt, device=q_idx.device)
    for c in chunks(index, q_idx, k_idx.expand(-1, -1, groups, -1)):
        z = c.scores(c.heads(q_idx).to(dt) / math.sqrt(di), c.gather(kidx_flat))
        lse[:, :, c.q0 : c.q1] = torch.logsumexp(z, dim=-1).flatten(1, 2)
    return lse


def kl_backward_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    lse_idx: torch.Tensor,
    index: SparseIndex,
    scale: float,
    grad: torch.Tensor,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_idx, dk_idx, per-row KL ``[B, Hkv, Sq]``) in the compute dtype of ``grad * sum_rows
    KL / rows`` restricted to the keys of ``index`` (for a ring step's ``StepIndex``, the chunk
    k ``[B, SK, Hkv, D]`` / k_idx ``[B, SK, 1, d_idx]``): the PyTorch counterpart of the
    kernels' ``kl_backward``. ``lse [B, Hq, Sq]`` (the main pass's) and ``lse_idx [B, Hkv, Sq]``
    (:func:`kl_index_lse`, merged over the steps) are over every key of the rows, so the
    steps' parts add up to the whole."""
    dt = compute_dtype(q_idx.dtype)
    groups, di = q_idx.shape[2], q_idx.shape[3]
    inv_sqrt_d = 1.0 / math.sqrt(di)
    k_flat, kidx_flat = flat_kv(k, dt), _index_keys_flat(k_idx, groups)
    dq_idx = torch.zeros(q_idx.shape, dtype=dt, device=q_idx.device)
    dk_flat = torch.zeros_like(kidx_flat)
    kl = torch.zeros(lse_idx.shape, dtype=dt, device=q_idx.device)
    grad_scale = grad.to(dt).reshape(()) / rows
    lse_rows = lse.transpose(1, 2).unsqueeze(-1)
    for c in chunks(index, q, k):
        main = c.scores(c.heads(q).to(dt) * scale, c.gather(k_flat))
        main_lse = finite_or_zero(c.heads(lse_rows).squeeze(-1).to(dt)).unsqueeze(-1)
        teacher = torch.exp(main - main_lse).mean(dim=2)
        qh_idx, kk_idx = c.heads(q_idx).to(dt), c.gather(kidx_flat)
        z = c.scores(qh_idx * inv_sqrt_d, kk_idx).squeeze(2)
        log_student = z - finite_or_zero(lse_idx[:, :, c.q0 : c.q1].to(dt)).unsqueeze(-1)
        visible = c.valid.squeeze(2).expand_as(teacher)
        terms = torch.xlogy(teacher, teacher) - teacher * torch.where(visible, log_student, 0.0)
        kl[:, :, c.q0 : c.q1] = terms.sum(-1)
        ds = (torch.exp(log_student) - teacher).unsqueeze(2) * grad_scale
        dq_idx[:, c.q0 : c.q1] = to_rows(c.weighted_values(ds, kk_idx) * inv_sqrt_d)
        c.scatter_add(dk_flat, c.key_grad(ds, qh_idx) * inv_sqrt_d)
    dk_idx = unflat_kv(dk_flat, k_idx.expand(-1, -1, groups, -1), dt).sum(2, keepdim=True)
    return dq_idx, dk_idx, kl


def msa_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """KL(teacher || index distribution) over the tokens ``index`` selects, a scalar.

    ``index`` is the ``BlockTopKIndex`` from :func:`msa_select_blocks` (sparse
    phase) or a ``DenseIndex`` (warmup: KL over all visible tokens). Only q_idx
    and k_idx receive gradient. The PyTorch reference, value and gradient; training
    with the main pass's LSE at hand takes :func:`msa_kl_objective`.
    """
    scale = _check_kl_inputs(q, k, q_idx, k_idx, index, softmax_scale)
    return _MSAKLLoss.apply(q_idx, k_idx, q.detach(), k.detach(), index, scale)


def msa_kl_objective(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index: SparseIndex,
    lse: torch.Tensor,
    softmax_scale: float | None = None,
    on_value: Callable[[torch.Tensor], None] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """MSA's KL loss to train with, given ``lse [B, Hq, S]``, the logsumexp the main pass
    returned (``sparse_attention``'s second output): back-propagate the result, read the
    KL through ``on_value`` (called once with a 0-dim fp32 tensor on q's device).

    ``dispatch.kl_kernel`` decides where it runs. On the fused kernels (``kernels/msa_kl``,
    KV-outer for a sparse top-k index as the attention, else over the union of tiles)
    the KL forward is skipped: the result is a zero scalar that carries the KL's gradient,
    and ``on_value`` receives the KL in the backward, which computes it for free. Otherwise
    this is :func:`msa_kl_loss` (the result is the KL) and ``on_value`` receives its value
    at once. The teacher's normaliser is ``lse``: the main branch attends exactly the
    selected tokens (every visible one under a ``DenseIndex``), so it is the teacher's."""
    scale = _check_kl_inputs(q, k, q_idx, k_idx, index, softmax_scale)
    b, s, hq, _ = q.shape
    check_tensor("lse", lse, ndim=3)
    if lse.shape != (b, hq, s):
        fail("lse.shape", tuple(lse.shape), f"[B, Hq, S] = {[b, hq, s]}, the main pass's logsumexp")
    decision = kl_kernel(q, q_idx, index, backend)
    log_decision(decision, "msa_kl_objective")
    if decision.kernel == "msa_kl":
        from .kernels.block_bar.tables import tile_tables
        from .kernels.msa_kl.loss import fused_kl  # imports Triton

        return fused_kl(q.detach(), k.detach(), lse.detach(), q_idx, k_idx, tile_tables(index), scale, on_value)
    if decision.kernel == "msa_kl_kv_outer":
        from .kernels.msa_kl.kv_loss import KVOuterKL
        from .kernels.msa_kl.loss import fused_kl  # imports Triton

        order = KVOuterKL(index, q.numel() * q.element_size())
        return fused_kl(q.detach(), k.detach(), lse.detach(), q_idx, k_idx, order, scale, on_value)
    kl = _MSAKLLoss.apply(q_idx, k_idx, q.detach(), k.detach(), index, scale)
    if on_value is not None:
        on_value(kl.detach().float())
    return kl


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    on_value: Callable[[torch.Tensor], None] | None = None,
    backend: str | None = None,
    kl_scope: Callable[[], AbstractContextManager] = nullcontext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MSA's main branch and KL loss to train with, on one device: (out, lse, kl) as
    ``sparse_attention(q, k, v, index)`` and :func:`msa_kl_objective` with that ``lse``
    (run inside ``kl_scope()``: a profiler range, say). Where ``dispatch.kl_kernel(...,
    with_attention=True)`` says ``msa_kl_with_attention`` (a sparse top-k index on the
    KV-outer kernels) one autograd function runs both (``kernels/msa_kl/kv_attention``): the
    attention's backward computes the KL's teacher for it, and ``lse`` is then not
    differentiable."""
    scale = _check_kl_inputs(q, k, q_idx, k_idx, index, softmax_scale)
    decision = kl_kernel(q, q_idx, index, backend, with_attention=True)
    log_decision(decision, "msa_attention")
    if decision.kernel == "msa_kl_with_attention":
        from .kernels.msa_kl.kv_attention import kv_outer_msa  # imports Triton

        return kv_outer_msa(q, k, v, q_idx, k_idx, index, scale, on_value)
    out, lse = sparse_attention(q, k, v, index, softmax_scale=scale, backend=backend)
    with kl_scope():
        kl = msa_kl_objective(q, k, q_idx, k_idx, index, lse, scale, on_value, backend)
    return out, lse, kl


def _check_kl_inputs(q, k, q_idx, k_idx, index, softmax_scale, seq_len: int | None = None) -> float:
    """Checks the KL loss's arguments; returns the softmax scale. ``seq_len``: the index's
    sequence (the whole sequence under context parallelism; q's length by default)."""
    check_qk(q, k)
    check_index_qk(q_idx, k_idx)
    bsz, seq, hq, d = q.shape
    hkv = k.shape[2]
    if q_idx.shape[:3] != (bsz, seq, hkv):
        fail(
            "q_idx.shape",
            tuple(q_idx.shape),
            f"[B, S, Hkv, d_idx] = [{bsz}, {seq}, {hkv}, d_idx] (one head per GQA group)",
        )
    if q_idx.device != q.device:
        fail("q_idx.device", str(q_idx.device), f"the device of q ({q.device})")
    if not isinstance(index, (BlockTopKIndex, DenseIndex)):
        fail("index", type(index).__name__, "a BlockTopKIndex from msa_select_blocks, or a DenseIndex (warmup)")
    index.check_compatible(bsz, hq, seq if seq_len is None else seq_len, hkv, q.device)
    if index.selection_heads not in (1, hkv):
        fail("index selection heads", index.selection_heads, f"{hkv} (one per GQA group), as msa_select_blocks builds")
    return check_softmax_scale(softmax_scale, d)
