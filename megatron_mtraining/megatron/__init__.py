"""Megatron-Core adaptation: layer specs, the sparse core attention, MSA's KL loss plumbing,
and the plugin config that travels with a ``TransformerConfig``. Changes to Megatron's own
functions (and the CPU stand-ins) are in ``megatron_mtraining.patches``."""

from .config import MTrainingAttentionConfig, attach_attention_config, get_attention_config
from .core_attention import MSASelfAttention, SparseCoreAttention
from .layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_spec, with_sparse_attention
from .msa_loss import MSALossAutoScaler, get_attention_metrics_tracker, msa_layer_kl, set_training_iteration

__all__ = [
    "MSALossAutoScaler",
    "MSASelfAttention",
    "MTrainingAttentionConfig",
    "SparseCoreAttention",
    "attach_attention_config",
    "get_attention_config",
    "get_attention_metrics_tracker",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_spec",
    "msa_layer_kl",
    "set_training_iteration",
    "with_sparse_attention",
]
