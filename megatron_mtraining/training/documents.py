"""Document boundaries of a packed micro-batch, for Megatron's ``PackedSeqParams``.

Megatron's GPT datasets pack documents separated by EOD into one sample. With
``reset_attention_mask`` a token must not attend across an EOD (the EOD closes its own
document); with ``reset_position_ids`` its RoPE position restarts at each document. Megatron
builds an ``S x S`` mask for the first (which fused attention ignores) and position ids for the
second (which RoPE never reads). The plugin turns both into the flash-attn varlen convention
instead: ``cu_seqlens`` (int32, global positions of the whole sample, ``[0, ..., S]``) in a
``PackedSeqParams`` that Megatron carries to every attention layer.

* ``qkv_format="thd"`` when positions restart: Megatron's attention then rotates each
  document from position 0 (``patches.cp_rope_slice`` does it in the plugin's CP layout).
* ``qkv_format="sbhd"`` when only the attention is masked: RoPE keeps the sample's positions
  and only the plugin's core attention reads the boundaries.

The sample is split over the context-parallel ranks as a whole (the layout's positions),
documents and all, so the boundaries stay global and the ring masks by position.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..sparse.validation import fail


def check_document_options(args) -> None:
    """Refuses option combinations the packed path cannot honour, naming the option."""
    if args.reset_attention_mask and args.micro_batch_size != 1:
        fail(
            "megatron.micro_batch_size",
            args.micro_batch_size,
            "1 with megatron.reset_attention_mask=true: documents are packed as one sequence per "
            "micro-batch (the THD convention); raise the global batch size instead",
        )
    if args.reset_attention_mask and args.pipeline_model_parallel_size > 1:
        fail(
            "megatron.pipeline_model_parallel_size",
            args.pipeline_model_parallel_size,
            "1 with megatron.reset_attention_mask=true: the document boundaries come from the "
            "tokens, which only the first pipeline stage reads",
        )
    if args.reset_position_ids and not args.reset_attention_mask:
        fail(
            "megatron.reset_position_ids",
            True,
            "false unless megatron.reset_attention_mask=true: RoPE positions restart per document "
            "only together with document-masked attention",
        )


def document_bounds(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``cu_seqlens`` of a packed sample ``tokens [1, S]``: a document ends after each EOD
    (Megatron's ``reset_attention_mask`` rule) and at ``S``."""
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        fail("tokens.shape", tuple(tokens.shape), "[1, S]: one packed sample per micro-batch")
    seq = tokens.shape[1]
    ends = torch.nonzero(tokens[0, :-1] == eod).flatten() + 1
    edges = torch.tensor([0, seq], dtype=ends.dtype, device=tokens.device)
    return torch.cat([edges[:1], ends, edges[1:]]).to(torch.int32)


def packed_seq_params(tokens: torch.Tensor, eod: int, reset_position_ids: bool) -> PackedSeqParams:
    """The ``PackedSeqParams`` of a packed sample ``tokens [1, S]`` (before the CP split)."""
    cu_seqlens = document_bounds(tokens, eod)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if reset_position_ids else tokens.shape[1]
    return PackedSeqParams(
        qkv_format="thd" if reset_position_ids else "sbhd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        # Megatron sizes the RoPE table from these: the longest document when positions
        # restart, the whole sample when they do not.
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
