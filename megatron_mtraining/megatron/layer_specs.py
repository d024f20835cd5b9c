"""GPT layer and decoder-block specs with the plugin's attention.

Each spec is Megatron's own (``get_gpt_layer_local_spec`` or, where Transformer Engine is
installed, ``get_gpt_layer_with_transformer_engine_spec``) with the attention slot changed:
``core_attention`` becomes :class:`SparseCoreAttention` for the requested type, and for MSA
the ``SelfAttention`` module becomes :class:`MSASelfAttention`. Norms, projections, MLP/MoE
and the bias-dropout-add are untouched, so a dense Megatron checkpoint of the same model has
the same parameter names (MSA adds ``self_attention.core_attention.index_branch.*``).
"""

from __future__ import annotations

import dataclasses

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import patterns
from ..sparse.validation import check_choice, fail
from .config import ATTENTION_TYPES, get_attention_config
from .core_attention import MSASelfAttention, SparseCoreAttention

SPEC_BACKENDS = ("local", "te")


def _check_backend(backend: str) -> None:
    check_choice("backend", backend, SPEC_BACKENDS)
    if backend == "te" and not HAVE_TE:
        fail("backend", "te", "'local' (Transformer Engine is not installed here)")


def with_sparse_attention(layer_spec: ModuleSpec, attention: str) -> ModuleSpec:
    """A copy of a Megatron ``TransformerLayer`` spec whose self-attention uses the plugin's
    core attention for ``attention`` (the input spec is left as it was)."""
    check_choice("attention", attention, ATTENTION_TYPES)
    attn = layer_spec.submodules.self_attention
    if not isinstance(attn, ModuleSpec) or attn.module is not SelfAttention:
        name = getattr(getattr(attn, "module", attn), "__name__", type(attn).__name__)
        fail("self_attention", name, "Megatron's SelfAttention (multi-latent attention is not supported)")
    core = ModuleSpec(module=SparseCoreAttention, params={"attention": attention})
    self_attention = dataclasses.replace(
        attn,
        module=MSASelfAttention if patterns.get(attention).has_index_branch else SelfAttention,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=core),
    )
    submodules = dataclasses.replace(layer_spec.submodules, self_attention=self_attention)
    return dataclasses.replace(layer_spec, submodules=submodules)


def get_gpt_layer_spec(attention: str = "dense", backend: str = "local", **megatron_spec_kwargs) -> ModuleSpec:
    """Megatron's GPT layer spec for ``backend`` (``"local"``: ``get_gpt_layer_local_spec``;
    ``"te"``: ``get_gpt_layer_with_transformer_engine_spec``), called with
    ``megatron_spec_kwargs``, with the attention of type ``attention``
    (``dense``, ``mtraining``, ``msa`` or ``moba``; pattern parameters come from the
    ``MTrainingAttentionConfig`` attached to the model's ``TransformerConfig``)."""
    _check_backend(backend)
    if backend == "te":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**megatron_spec_kwargs)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**megatron_spec_kwargs)
    return with_sparse_attention(spec, attention)


def get_gpt_decoder_block_spec(config, attention: str | None = None, backend: str = "local", **megatron_spec_kwargs):
    """Megatron's ``get_gpt_decoder_block_spec`` (dense and MoE layers as ``config`` says,
    this pipeline stage's layers) with the plugin's attention in every layer. ``attention``
    defaults to the type of the config attached to ``config``; ``normalization`` to
    ``config.normalization``. Other keywords (``qk_l2_norm``, ``vp_stage``, ``pp_rank``) go
    to Megatron."""
    _check_backend(backend)
    if attention is None:
        attention = get_attention_config(config).type
    megatron_spec_kwargs.setdefault("normalization", config.normalization)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=backend == "te", **megatron_spec_kwargs
    )
    layer_specs = [with_sparse_attention(spec, attention) for spec in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layer_specs)
