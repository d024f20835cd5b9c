"""Hugging Face Qwen2 / Llama checkpoints <-> Megatron GPTModel checkpoints (with YaRN RoPE scaling)."""

from .hf_export import checkpoint_folder, checkpoint_spec, export_hf, load_megatron_checkpoint
from .hf_import import (
    build_megatron_model,
    import_hf,
    load_hf_weights,
    megatron_transformer_config,
    read_hf_checkpoint,
    save_megatron_checkpoint,
)
from .hf_mapping import (
    ConversionError,
    ModelSpec,
    YarnSpec,
    hf_to_megatron,
    megatron_to_hf,
    spec_from_hf_config,
    spec_from_megatron_args,
)

__all__ = [
    "ConversionError",
    "ModelSpec",
    "YarnSpec",
    "build_megatron_model",
    "checkpoint_folder",
    "checkpoint_spec",
    "export_hf",
    "hf_to_megatron",
    "import_hf",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "megatron_to_hf",
    "megatron_transformer_config",
    "read_hf_checkpoint",
    "save_megatron_checkpoint",
    "spec_from_hf_config",
    "spec_from_megatron_args",
]
