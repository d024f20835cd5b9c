"""Megatron GPTModel (in memory or a torch_dist checkpoint) -> Hugging Face safetensors + config.json.

:func:`load_megatron_checkpoint` rebuilds the model from the arguments a checkpoint stores
(one written by :mod:`.hf_import`, or by training) and loads it with
``dist_checkpointing.load``; :func:`export_hf` writes ``model.safetensors`` and ``config.json``.
The weights are copied unchanged (only cast to ``dtype``), so import -> export reproduces the
original tensors bit for bit, and a YaRN model's ``rope_scaling`` is written back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .hf_import import HF_CONFIG_KEY, TRACKER_FILE, build_megatron_model, megatron_transformer_config
from .hf_mapping import ConversionError, ModelSpec, megatron_to_hf, spec_from_hf_config, spec_from_megatron_args


def checkpoint_folder(directory: str | Path) -> Path:
    """The folder of the latest checkpoint in a Megatron save directory (as ``load_checkpoint`` picks it)."""
    directory = Path(directory)
    tracker = directory / TRACKER_FILE
    if not tracker.is_file():
        raise ConversionError(f"{directory} has no {TRACKER_FILE}; is it a Megatron save directory?")
    text = tracker.read_text().strip()
    return directory / ("release" if text == "release" else f"iter_{int(text):07d}")


def checkpoint_spec(folder: str | Path, model_type: str | None = None, vocab_size: int | None = None) -> ModelSpec:
    """The architecture of a torch_dist checkpoint folder: from the Hugging Face config it was
    imported from, or else from its Megatron arguments (then ``model_type`` names the
    Hugging Face architecture and ``vocab_size`` the unpadded vocabulary, default the padded one)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(folder))
    if HF_CONFIG_KEY in common and model_type is None:
        return spec_from_hf_config(common[HF_CONFIG_KEY])
    args = common.get("args")
    if args is None:
        raise ConversionError(f"{folder} stores no Megatron arguments")
    return spec_from_megatron_args(args, vocab_size or args.padded_vocab_size, model_type or "qwen2")


def load_megatron_checkpoint(directory: str | Path, attention=None, spec: ModelSpec | None = None):
    """(model, spec): the GPTModel of a Megatron save directory, weights loaded. MSA index
    parameters a checkpoint lacks keep their initialisation; parameters the model lacks are ignored."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    folder = checkpoint_folder(directory)
    spec = spec or checkpoint_spec(folder)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    padded = getattr(common.get("args"), "padded_vocab_size", None)
    model = build_megatron_model(spec, megatron_transformer_config(spec, attention), padded)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(folder), strict=StrictHandling.LOG_UNEXPECTED
    )
    model.load_state_dict(loaded["model"], strict=False)
    return model, spec


def export_hf(model, spec: ModelSpec, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Writes ``model`` (a GPTModel for ``spec``) as a Hugging Face checkpoint directory;
    ``dtype`` defaults to the ``torch_dtype`` the imported config named, else the model's."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    hf_state = megatron_to_hf(spec, state)
    config = spec.hf_config()
    named = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and isinstance(named, str):
        dtype = getattr(torch, named)
    if dtype is not None:
        hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
        # transformers 5 writes "dtype", earlier versions "torch_dtype"; keep the key the source used.
        config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
    # safetensors refuses views into shared storage; contiguous copies own their memory.
    save_file({k: v.detach().contiguous().clone() for k, v in hf_state.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
