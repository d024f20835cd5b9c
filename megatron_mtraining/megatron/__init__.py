"""Megatron-Core adaptation: layer specs, the sparse core attention, MSA's KL loss plumbing,
the plugin config that travels with a ``TransformerConfig``, and CPU compatibility."""

from .config import MTrainingAttentionConfig, attach_attention_config, get_attention_config
from .core_attention import MSASelfAttention, SparseCoreAttention
from .cpu_compat import apply_cpu_compat
from .layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_spec, with_sparse_attention
from .msa_loss import MSALossAutoScaler, get_attention_metrics_tracker, msa_layer_kl, set_training_iteration

__all__ = [
    "MSALossAutoScaler",
    "MSASelfAttention",
    "MTrainingAttentionConfig",
    "SparseCoreAttention",
    "apply_cpu_compat",
    "attach_attention_config",
    "get_attention_config",
    "get_attention_metrics_tracker",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_spec",
    "msa_layer_kl",
    "set_training_iteration",
    "with_sparse_attention",
]
