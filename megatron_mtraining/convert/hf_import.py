"""Hugging Face Qwen2 / Llama checkpoint (a local directory) -> Megatron GPTModel -> Megatron checkpoint.

:func:`read_hf_checkpoint` reads ``config.json`` and the safetensors (one file or a sharded
index). :func:`build_megatron_model` builds Megatron's ``GPTModel`` with the plugin's decoder
spec for any attention type, :func:`load_hf_weights` copies the weights in (MSA's index branch
has no Hugging Face counterpart and keeps its initialisation), and :func:`save_megatron_checkpoint`
writes the layout Megatron's ``load_checkpoint`` reads: ``<dir>/release/`` (torch_dist, via
``dist_checkpointing.save``) and ``latest_checkpointed_iteration.txt`` holding ``release``.
A release checkpoint loads with iteration 0 and no optimizer or RNG state, the way Megatron
starts a run from converted weights, so ``megatron.load=<dir>`` needs no ``finetune``.

Megatron's model-parallel state must be initialised (one process is enough; see
``scripts/convert_hf_to_megatron.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch

from .hf_mapping import ConversionError, ModelSpec, hf_to_megatron, spec_from_hf_config

# The common-state key holding the Hugging Face config the checkpoint came from (for the export).
HF_CONFIG_KEY = "hf_config"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
# Where megatron_mtraining.training.megatron_args stores the attention section in Megatron's args.
ATTENTION_ARG = "mtraining_attention"


def read_hf_checkpoint(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a local Hugging Face checkpoint directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{directory} has no config.json")
    config = json.loads(config_path.read_text())
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{directory} has no *.safetensors files (PyTorch .bin checkpoints are not read)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(directory / name))
    return config, state


def megatron_transformer_config(spec: ModelSpec, attention=None, params_dtype=torch.float32, **overrides):
    """A ``TransformerConfig`` for ``spec`` on this process's parallel state, with the plugin's
    ``attention`` (an ``MTrainingAttentionConfig``, default dense) attached."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from ..megatron import MTrainingAttentionConfig, attach_attention_config

    kwargs = dict(
        spec.transformer_config_kwargs(),
        params_dtype=params_dtype,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    for name, value in spec.yarn_config_attributes().items():
        setattr(config, name, value)
    attach_attention_config(config, attention or MTrainingAttentionConfig.from_dict({"type": "dense"}))
    return config


def build_megatron_model(spec: ModelSpec, config, padded_vocab_size: int | None = None, backend: str = "local"):
    """Megatron's ``GPTModel`` for ``spec`` with the plugin's decoder spec (as the training entry
    point builds it); ``config`` from :func:`megatron_transformer_config`."""
    from megatron.core.models.gpt import GPTModel

    from ..megatron import get_gpt_decoder_block_spec

    vocab = padded_vocab_size or spec.vocab_size
    if vocab < spec.vocab_size:
        raise ConversionError(f"padded_vocab_size = {vocab} is smaller than the vocabulary {spec.vocab_size}")
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, backend=backend),
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="yarn" if spec.yarn else "rope",
        rotary_percent=1.0,
        rotary_base=spec.rotary_base,
        rope_scaling=spec.llama3_factor is not None,
        rope_scaling_factor=spec.llama3_factor or 8.0,
    )


def load_hf_weights(model, spec: ModelSpec, hf_state: dict[str, torch.Tensor]) -> list[str]:
    """Copies a Hugging Face state dict into ``model`` (a GPTModel for ``spec``); returns the
    model's parameter names left at their initialisation (MSA's index branch). Vocabulary rows
    beyond ``spec.vocab_size`` (padding) are zeroed."""
    own = model.state_dict()
    converted = hf_to_megatron(spec, hf_state, set(own))
    with torch.no_grad():
        for name, value in converted.items():
            if name not in own:
                raise ConversionError(f"the Megatron model has no parameter {name!r} (is the layer spec a GPT one?)")
            target = own[name]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                target.zero_()
                target = target[: value.shape[0]]
            if target.shape != value.shape:
                raise ConversionError(
                    f"{name}: Hugging Face shape {tuple(value.shape)} != Megatron {tuple(target.shape)}"
                )
            target.copy_(value)
    params = {name for name, _ in model.named_parameters()}
    return sorted(params - set(converted))


def megatron_checkpoint_args(spec: ModelSpec, padded_vocab_size: int | None = None, **extra) -> argparse.Namespace:
    """The ``args`` stored with the checkpoint: the model's Megatron arguments plus the parallel
    sizes it was written with (Megatron's loader compares them)."""
    return argparse.Namespace(
        **spec.megatron_args(),
        padded_vocab_size=padded_vocab_size or spec.vocab_size,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        **extra,
    )


def save_megatron_checkpoint(
    model, spec: ModelSpec, directory: str | Path, padded_vocab_size: int | None = None, attention: dict | None = None
):
    """Writes ``model`` as a Megatron release checkpoint under ``directory`` (see the module
    docstring for the layout); returns the path of the checkpoint folder. ``attention`` (the
    plugin's attention section) is stored where the training entry point looks for the
    checkpoint's attention; without it the checkpoint counts as dense."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    checkpoint = directory / "release"
    checkpoint.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.sharded_state_dict(),
        "args": megatron_checkpoint_args(spec, padded_vocab_size, **({ATTENTION_ARG: attention} if attention else {})),
        "checkpoint_version": 3.0,
        "iteration": 0,
        HF_CONFIG_KEY: spec.hf_config(),
    }
    dist_checkpointing.save(state, str(checkpoint))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (directory / TRACKER_FILE).write_text("release")
    return checkpoint


def import_hf(
    hf_dir: str | Path,
    attention=None,
    padded_vocab_size: int | None = None,
    params_dtype=torch.float32,
    backend: str = "local",
    **config_overrides,
):
    """(model, spec) from a Hugging Face checkpoint directory: the GPTModel with the weights copied in."""
    config, state = read_hf_checkpoint(hf_dir)
    spec = spec_from_hf_config(config)
    transformer_config = megatron_transformer_config(spec, attention, params_dtype, **config_overrides)
    model = build_megatron_model(spec, transformer_config, padded_vocab_size, backend)
    load_hf_weights(model, spec, state)
    return model, spec


@contextlib.contextmanager
def single_process_megatron(seed: int = 1234):
    """Megatron's parallel state on one gloo process (what the conversion needs: tensor, pipeline
    and context parallel sizes 1), set up unless a process group exists and torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from ..patches import apply_cpu_patches

    owned = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if owned:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            apply_cpu_patches()
            parallel_state.initialize_model_parallel()
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if owned:
                dist.destroy_process_group()
