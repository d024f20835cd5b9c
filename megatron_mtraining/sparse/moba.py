"""MoBA baseline: mixture of block attention with a mean-pooled key gate.

Per query head and query token: score each earlier chunk by ``q . mean(k over the
chunk)``, then attend the query's own chunk (causally) plus the top
``topk - 1`` earlier chunks.

Packed documents (``cu_seqlens``): a query scores only the chunks that hold keys of its
own document, each by the mean of those keys alone. Chunks wholly before the document
score -inf (never chosen); an earlier chunk wholly inside it pools as before; the one
that straddles the document's start pools only the keys from the start on (its "head").
No earlier chunk can straddle the document's end, which lies after the query. The
query's own chunk is attended from its document's start (the index carries the documents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dispatch import backend_choice
from .documents import Documents, packed_documents
from .index import BlockTopKIndex, select_topk_blocks, single_device
from .validation import ValidatedConfig, check_int, check_power_of_two, check_qk, setting


@dataclass(frozen=True)
class MoBAConfig(ValidatedConfig):
    chunk_size: int = setting(4096, check_power_of_two, minimum=16)
    topk: int = setting(12, check_int, minimum=1)


@torch.no_grad()
def build_moba_index(
    q: torch.Tensor, k: torch.Tensor, config: MoBAConfig, cu_seqlens: torch.Tensor | None = None
) -> BlockTopKIndex:
    """The MoBA index of q ``[B, S, Hq, D]`` and k ``[B, S, Hkv, D]``, one selection per query
    head; ``cu_seqlens``: packed documents."""
    check_qk(q, k)
    documents = packed_documents(cu_seqlens, q.shape[1], q.device)
    positions = torch.arange(q.shape[1], device=q.device)
    blocks = moba_select_from_parts(q, positions, k, positions, q.shape[1], config, documents=documents)
    return BlockTopKIndex(blocks=blocks, block_size=config.chunk_size, num_heads=q.shape[2], documents=documents)


def moba_select_from_parts(
    q: torch.Tensor,
    query_positions: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor,
    seq_len: int,
    config: MoBAConfig,
    all_reduce_sum=single_device,
    documents: Documents | None = None,
) -> torch.Tensor:
    """MoBA chunk choices ``[B, Lq, Hq, topk]`` of some queries, from some of the keys
    (both with global positions); ``all_reduce_sum`` adds the chunk sums of the other
    key holders (identity on one device). fp64 sums and gate scores make the choice
    independent of how the keys are split; the choice ranks them rounded to fp32 (a rounding of
    the same value on every split), ties to the earlier chunk (``select_topk_blocks``), so the
    top-k runs on 32-bit values and keys. Where the kernels run (``dispatch.backend_choice``)
    and the chunks are at most ``topk_blocks.MAX_BLOCKS``, one Triton launch makes the same
    choice (``kernels/index_build/topk_blocks.py``) from the unmasked fp64 gate and the causal
    and document limits, in place of ``torch.topk`` on millions of short rows, the masking
    and the fp32 copy. ``documents``: packed documents (module docstring); the sums of the
    documents' heads, ``[B, n_documents, Hkv, D]``, are reduced too."""
    bsz, _, hq, _ = q.shape
    hkv = k.shape[2]
    cs = config.chunk_size
    n_chunks = -(-seq_len // cs)
    sums = torch.zeros(bsz, n_chunks, hkv, k.shape[-1], dtype=torch.float64, device=k.device)
    sums.index_add_(1, key_positions // cs, k.double())
    sums = all_reduce_sum(sums)
    counts = torch.clamp(seq_len - torch.arange(n_chunks, device=k.device) * cs, max=cs).double()
    pooled = sums / counts.view(1, -1, 1, 1)
    qg = q.double().unflatten(2, (hkv, hq // hkv))
    gate = torch.einsum("bskgd,bckd->bkgsc", qg, pooled).flatten(1, 2)
    own = query_positions // cs
    first = None
    if documents is not None:
        first = documents.starts[query_positions.long()].long() // cs  # the chunk of the query's document start
        head = _document_heads(k, key_positions, documents, cs, all_reduce_sum)
        head_gate = torch.einsum("bskgd,bskd->bkgs", qg, head[:, documents.ids[query_positions.long()].long()])
        at_head = torch.arange(n_chunks, device=q.device) == first.view(-1, 1)
        gate = torch.where(at_head, head_gate.flatten(1, 2).unsqueeze(-1), gate)
    if backend_choice(q) == "triton":
        from .kernels.index_build import topk_blocks  # imports Triton

        if n_chunks <= topk_blocks.MAX_BLOCKS:
            # The earlier chunks (from the document's first) as limits, read with the fp64 gate.
            blocks = torch.empty(bsz, q.shape[1], hq, config.topk, dtype=torch.int32, device=q.device)
            topk_blocks.select_topk_blocks(gate, own, config.topk, True, first, out=blocks.permute(0, 2, 1, 3))
            return blocks
    chunks = torch.arange(n_chunks, device=q.device).view(1, -1)
    earlier = chunks < own.view(-1, 1)
    if first is not None:
        earlier &= chunks >= first.view(-1, 1)
    # In place: the gate is [B, Hq, Lq, chunks] fp64, whose copy would be as large.
    scores = gate.masked_fill_(~earlier, float("-inf")).float()
    del gate
    blocks = select_topk_blocks(scores, own, config.topk)  # [B, Hq, Lq, k]
    return blocks.permute(0, 2, 1, 3).contiguous()


def _document_heads(
    k: torch.Tensor, key_positions: torch.Tensor, documents: Documents, cs: int, all_reduce_sum
) -> torch.Tensor:
    """``[B, n_documents, Hkv, D]`` fp64: the mean of each document's keys in the chunk of its
    start (from the start to the chunk's or the document's end), from the keys at
    ``key_positions`` and the other holders' sums (``all_reduce_sum``). Keys outside their
    document's head add zero (a weight, not a selection, so nothing is read on the host)."""
    cu = documents.cu_seqlens.long()
    head_end = torch.minimum((cu[:-1] // cs + 1) * cs, cu[1:])
    doc = documents.ids[key_positions.long()].long()
    in_head = (key_positions < head_end[doc]).to(torch.float64).view(1, -1, 1, 1)
    sums = torch.zeros(k.shape[0], documents.count, *k.shape[2:], dtype=torch.float64, device=k.device)
    sums.index_add_(1, doc, k.double() * in_head)
    sums = all_reduce_sum(sums)
    return sums / (head_end - cu[:-1]).double().view(1, -1, 1, 1)
