"""Patch of ``rope_utils._apply_rotary_pos_emb_bshd``: RoPE in one pass on CUDA.

Without Transformer Engine, Megatron applies RoPE (plain and YaRN) as several elementwise
passes over q and k in each direction. On CUDA tensors, with Triton installed, the
replacement runs ``megatron_mtraining.megatron.fused_rope.FusedRoPE`` for the
non-interleaved bshd case it serves (what the recipes use); every other call, and every call
on a CPU, goes to Megatron's function unchanged.
"""

from __future__ import annotations

from megatron_mtraining.sparse.kernels import triton_available

from ._guard import FunctionPatch


def _build(choice):
    def _apply_rotary_pos_emb_bshd(
        t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0, multi_latent_attention=None
    ):
        """Megatron's bshd RoPE, in one Triton pass where it serves the call (see
        ``megatron_mtraining.patches.fused_rope``)."""
        plain = not (rotary_interleaved or mla_rotary_interleaved or multi_latent_attention)
        if plain and t.is_cuda and triton_available():
            from megatron_mtraining.megatron.fused_rope import FusedRoPE, serves

            if serves(t, freqs):
                return FusedRoPE.apply(t, freqs, mscale)
        return PATCH.original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, multi_latent_attention)

    return _apply_rotary_pos_emb_bshd


PATCH = FunctionPatch(
    module="megatron.core.models.common.embeddings.rope_utils",
    name="_apply_rotary_pos_emb_bshd",
    # The replacement reproduces both: the rotation and _rotate_half's non-interleaved halves.
    fingerprints={"_apply_rotary_pos_emb_bshd": "4a54b66e47ae8722", "_rotate_half": "de7b8b4e63615eb8"},
    import_sites=("megatron/core/models/common/embeddings/rotary_pos_embedding.py",),
    build=_build,
)
