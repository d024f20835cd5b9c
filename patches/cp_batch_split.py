"""Patch of ``megatron.core.utils.get_batch_on_this_cp_rank``: the batch split per CP rank.

Megatron splits every micro-batch over the context-parallel ranks in its zigzag order. The
replacement gives each rank the tokens ``ContextParallelLayout.positions(rank)`` of the
chosen layout instead, so the whole model (embeddings, MLP, loss) runs in that layout's
token order and the attention ring needs no reordering per layer. The batch dict keeps
Megatron's semantics: every tensor is split on its sequence dimension (dim 2 for
``attention_mask``, whose key dimension stays whole; dim 1 otherwise), None values and the
metadata keys pass through, and the dict is updated in place and returned. Per-token loss
sums are order-free, so the loss and its reduction over the CP group are unchanged.

A packed sample (``cu_seqlens`` set, batch 1) is split the same way, as one sequence: its
documents are not split one by one (Megatron's per-document zigzag), and ``cu_seqlens``
keeps the global positions the plugin's attention and RoPE (``cp_rope_slice``) read. The
``balanced`` layout places the tokens by those documents: the split reads
``batch["cu_seqlens"]`` (absent: one document, the striped order) and records what it used
(``_layout.record_split_documents``) for the RoPE slice and the core attention's check.
"""

from __future__ import annotations

import torch.distributed as dist

from ._guard import FunctionPatch
from ._layout import record_split_documents

# Keys Megatron's per-sequence split leaves whole: they describe the batch, not tokens.
METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def _build(choice):
    def get_batch_on_this_cp_rank(
        batch, is_hybrid_cp, cp_group=None, hybrid_cp_group_func=None, use_per_sequence_balancing=False
    ):
        """Megatron's CP batch split in the token order of the ``megatron_mtraining`` layout
        (see ``megatron_mtraining.patches.cp_batch_split``)."""
        cp_size = dist.get_world_size(cp_group)
        if cp_size == 1:
            return batch
        rank = dist.get_rank(cp_group)
        documents = None
        if choice.kind == "balanced":
            cu_seqlens = batch.get("cu_seqlens")
            if cu_seqlens is not None:
                # One host read; the layout validates the bounds against each tensor's length.
                documents = tuple(cu_seqlens.flatten().tolist())
            record_split_documents(documents)
        for key, value in batch.items():
            if key in METADATA_KEYS or value is None:
                continue
            dim = 2 if key == "attention_mask" else 1
            what = f"batch[{key!r}].shape[{dim}]"
            index = choice.positions(cp_size, value.shape[dim], rank, value.device, what, documents)
            batch[key] = value.index_select(dim, index)
        return batch

    return get_batch_on_this_cp_rank


PATCH = FunctionPatch(
    module="megatron.core.utils",
    name="get_batch_on_this_cp_rank",
    fingerprints={
        "get_batch_on_this_cp_rank": "525b656b7b42565c",
        # The replacement reproduces this helper's choice of keys and dimensions.
        "_get_batch_on_this_cp_rank_per_sequence_balancing": "75cd4acd55a2e24b",
    },
    import_sites=(
        "megatron/core/models/mimo/partition/utils.py",
        "megatron/core/models/multimodal/llava_model.py",
        "megatron/training/training.py",
    ),
    build=_build,
)
