"""Patch of ``rope_utils.get_pos_emb_on_this_cp_rank``: the RoPE rows of a CP rank.

Megatron's rotary embeddings (``RotaryEmbedding``, ``MultimodalRotaryEmbedding``,
``YarnRotaryEmbedding``) build the table for the whole sequence and keep the rows of this
rank's zigzag chunks. The replacement keeps the rows at ``ContextParallelLayout.positions``
of the chosen layout, in that order, so every token of the batch split by
``cp_batch_split`` is rotated by its global position. It selects on the table's own device,
so it needs neither pinned memory nor CUDA.

``RotaryEmbedding.forward`` caches its result per (module, length, CP group);
installing and removing the patch clears that cache. Rotary modules that keep their own
tables (YaRN's cos/sin cache) must be built after :func:`megatron_mtraining.patches.apply_patches`.

Packed sequences slice RoPE per document in zigzag order (``_get_thd_freqs_on_this_cp_rank``
here, Transformer Engine's fused kernels elsewhere), which the plugin's layouts do not
describe: ``THD_PATCH`` makes that path an error for every layout but zigzag.
"""

from __future__ import annotations

import sys

from ._guard import FunctionPatch

_ROPE_MODULES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YarnRotaryEmbedding",
}


def _clear_rope_caches() -> None:
    for module_name, class_name in _ROPE_MODULES.items():
        module = sys.modules.get(module_name)
        if module is not None:
            getattr(module, class_name).forward.cache_clear()


def _build(choice):
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """Megatron's per-CP-rank RoPE slice in the token order of the ``megatron_mtraining``
        layout (see ``megatron_mtraining.patches.cp_rope_slice``)."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        index = choice.positions(
            cp_group.size(), pos_emb.shape[seq_dim], cp_group.rank(), pos_emb.device, f"pos_emb.shape[{seq_dim}]"
        )
        return pos_emb.index_select(seq_dim, index)

    return get_pos_emb_on_this_cp_rank


def _build_thd(choice):
    def _get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs, offset=0):
        """Megatron's per-document RoPE slice, allowed for the zigzag layout only."""
        if cp_size > 1 and choice.kind != "zigzag":
            raise ValueError(
                f"packed sequences (THD RoPE) are not supported with the {choice.kind!r} context-parallel "
                "layout: use layout 'zigzag' (Megatron's own split) or unpacked sequences"
            )
        return THD_PATCH.original(cp_rank, cp_size, x, freqs, offset)

    return _get_thd_freqs_on_this_cp_rank


PATCH = FunctionPatch(
    module="megatron.core.models.common.embeddings.rope_utils",
    name="get_pos_emb_on_this_cp_rank",
    fingerprints={"get_pos_emb_on_this_cp_rank": "ab7c5cb71dce22a9"},
    import_sites=(
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py",
        "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py",
    ),
    build=_build,
    on_swap=_clear_rope_caches,
)

THD_PATCH = FunctionPatch(
    module="megatron.core.models.common.embeddings.rope_utils",
    name="_get_thd_freqs_on_this_cp_rank",
    fingerprints={"_get_thd_freqs_on_this_cp_rank": "28d5f5013d0508e9"},
    import_sites=(),
    build=_build_thd,
)
