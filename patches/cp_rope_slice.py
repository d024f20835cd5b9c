"""Patch of ``rope_utils.get_pos_emb_on_this_cp_rank``: the RoPE rows of a CP rank.

Megatron's rotary embeddings (``RotaryEmbedding``, ``MultimodalRotaryEmbedding``,
``YarnRotaryEmbedding``) build the table for the whole sequence and keep the rows of this
rank's zigzag chunks. The replacement keeps the rows at ``ContextParallelLayout.positions``
of the chosen layout, in that order, so every token of the batch split by
``cp_batch_split`` is rotated by its global position. It selects on the table's own device,
so it needs neither pinned memory nor CUDA.

``RotaryEmbedding.forward`` caches its result per (module, length, CP group);
installing and removing the patch clears that cache, and so does a batch split with other
documents under ``balanced`` (whose rows follow the micro-batch's documents, those the split
recorded: Megatron calls this slice with no batch at hand). Rotary modules that keep their
own tables (YaRN's cos/sin cache) must be built after
:func:`megatron_mtraining.patches.apply_patches`.

Packed sequences (THD) are split over the CP ranks as one sequence in the same layout
(``cp_batch_split``), their documents and all; Megatron would split each document in zigzag
order instead. ``THD_PATCH`` rotates each of this rank's tokens by its offset inside its
document (``cu_seqlens`` holds global positions), which is Megatron's THD RoPE on one rank
and its meaning under every layout (``balanced`` placing the tokens by these ``cu_seqlens``).
"""

from __future__ import annotations

from megatron_mtraining.sparse.documents import packed_documents

from ._guard import FunctionPatch
from ._layout import clear_rope_caches, split_documents


def _build(choice):
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """Megatron's per-CP-rank RoPE slice in the token order of the ``megatron_mtraining``
        layout (see ``megatron_mtraining.patches.cp_rope_slice``)."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        index = choice.positions(
            cp_group.size(),
            pos_emb.shape[seq_dim],
            cp_group.rank(),
            pos_emb.device,
            f"pos_emb.shape[{seq_dim}]",
            split_documents(),
        )
        return pos_emb.index_select(seq_dim, index)

    return get_pos_emb_on_this_cp_rank


def _build_thd(choice):
    def _apply_rotary_pos_emb_thd(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        mla_rotary_interleaved=False,
        mscale=1.0,
        cp_group=None,
        multi_latent_attention=None,
    ):
        """Megatron's THD RoPE for this rank's tokens of a packed sequence in the
        ``megatron_mtraining`` layout (see ``megatron_mtraining.patches.cp_rope_slice``)."""
        from megatron.core.models.common.embeddings import rope_utils

        cp_size, rank = (cp_group.size(), cp_group.rank()) if cp_group is not None else (1, 0)
        # Validates the boundaries against the whole sample (this rank's tokens x CP) and
        # gives each position's document start; the lengths come from the host copy.
        documents = packed_documents(cu_seqlens, t.shape[0] * cp_size, t.device)
        positions = choice.positions(cp_size, documents.seq_len, rank, t.device, "cu_seqlens[-1]", documents)
        offsets = positions - documents.starts[positions].long()
        longest = max(documents.lengths())
        if freqs.shape[0] < longest:
            raise ValueError(
                f"RoPE table of {freqs.shape[0]} positions for a document of {longest} "
                "tokens: set PackedSeqParams.max_seqlen_q to the longest document"
            )
        interleaved = mla_rotary_interleaved or bool(multi_latent_attention)
        rotated = rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs.index_select(0, offsets), rotary_interleaved, interleaved, mscale
        )
        return rotated.squeeze(1)

    return _apply_rotary_pos_emb_thd


PATCH = FunctionPatch(
    module="megatron.core.models.common.embeddings.rope_utils",
    name="get_pos_emb_on_this_cp_rank",
    fingerprints={"get_pos_emb_on_this_cp_rank": "ab7c5cb71dce22a9"},
    import_sites=(
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py",
        "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py",
    ),
    build=_build,
    on_swap=clear_rope_caches,
)

THD_PATCH = FunctionPatch(
    module="megatron.core.models.common.embeddings.rope_utils",
    name="_apply_rotary_pos_emb_thd",
    fingerprints={"_apply_rotary_pos_emb_thd": "99798acffbb2e50c"},
    import_sites=("megatron/core/models/common/embeddings/rotary_pos_embedding.py",),
    build=_build_thd,
)
