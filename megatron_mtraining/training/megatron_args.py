"""Megatron's arguments for a run: the entry point's defaults, Megatron's own parsing and
validation, and the plugin's settings carried in them.

The attention config travels in the arguments (:data:`ARGS_ATTRIBUTE`, a plain dict) and so
does the iteration its attention type started at (:data:`START_ATTRIBUTE`): Megatron saves
its arguments with every checkpoint, so a resume finds both.
"""

from __future__ import annotations

import importlib.util
import os

from ..megatron.config import MTrainingAttentionConfig
from .documents import check_document_options
from .yaml_config import ConfigError, RunConfig

ARGS_ATTRIBUTE = "mtraining_attention"
# The iteration at which this attention type started (MSA warmup counts from there).
START_ATTRIBUTE = "mtraining_attention_start"

# Megatron argument defaults (argparse dests) for a CPU run: gloo, CPU initialisation, no
# fused kernels (they need Apex, Transformer Engine or CUDA), and no RNG state on load: the
# CPU RNG tracker holds no states, and Megatron refuses a checkpoint whose tracker states are
# empty (training/checkpointing.py, load_checkpoint).
CPU_MEGATRON_ARGUMENTS = {
    "distributed_backend": "gloo",
    "use_cpu_initialization": True,
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
    "no_persist_layer_norm": True,
    "no_load_rng": True,
}


def attention_from_args(args) -> MTrainingAttentionConfig:
    return MTrainingAttentionConfig.from_dict(getattr(args, ARGS_ATTRIBUTE))


def resolve_megatron_args(run_config: RunConfig, defaults: dict, world_size: int | None = None):
    """Megatron's arguments from the config, parsed and validated by Megatron itself (with
    ``defaults``, dest -> value, for keys the config leaves out), for ``world_size`` ranks
    (the launcher's ``WORLD_SIZE`` when None); no globals are set."""
    import sys
    from unittest import mock

    from megatron.training.arguments import parse_args, validate_args

    values = {**{k: v for k, v in defaults.items() if k not in run_config.megatron}, **run_config.megatron}
    sources = {**{f"megatron.{k}": "the entry point's defaults" for k in defaults}, **run_config.sources}
    argv = RunConfig(values, run_config.attention, run_config.path, sources).megatron_argv()
    env = {} if world_size is None else {"WORLD_SIZE": str(world_size), "RANK": "0"}
    with mock.patch.object(sys, "argv", [sys.argv[0], *argv]), mock.patch.dict(os.environ, env):
        args = parse_args()
        try:
            validate_args(args, {})
        except AssertionError as err:
            raise ConfigError(f"{run_config.path}: Megatron rejected the arguments: {err}") from err
    try:
        check_document_options(args)
    except ValueError as err:
        raise ConfigError(f"{run_config.path}: {err}") from err
    if args.deterministic_mode:
        from megatron.training.determinism import apply_determinism_env

        # validate_args set NCCL_ALGO and CUBLAS_WORKSPACE_CONFIG in the environment the
        # patch.dict above has just restored; NCCL and cuBLAS read them later, at their start.
        apply_determinism_env(os.environ)
    setattr(args, ARGS_ATTRIBUTE, run_config.attention_dict())
    setattr(args, START_ATTRIBUTE, 0)
    return args


def parse_megatron_args(run_config: RunConfig, defaults: dict):
    """:func:`resolve_megatron_args` for this process's launch, set as Megatron's globals."""
    from megatron.training.global_vars import set_global_variables

    args = resolve_megatron_args(run_config, defaults)
    set_global_variables(args)
    return args


def megatron_defaults(cpu: bool) -> dict:
    """The Megatron arguments the entry point sets where the config does not: what this
    machine's Megatron install can build, and with ``cpu`` :data:`CPU_MEGATRON_ARGUMENTS`."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    # Without Transformer Engine only the local spec exists, its torch norms cannot persist and
    # Megatron's fused RoPE is TE's.
    defaults = (
        {} if HAVE_TE else {"transformer_impl": "local", "no_persist_layer_norm": True, "apply_rope_fusion": False}
    )
    # The plugin's attention is causal by its index and never reads a mask; Megatron's default
    # dataset would build a dense [S, S] one per sample (1 GiB at 32K, 256 GiB at 512K).
    defaults["create_attention_mask_in_dataloader"] = False
    # Megatron defaults to fusing the weight-gradient accumulation into the GEMM, which the local
    # spec's linears take from Apex's CUDA extension; without it they refuse to build.
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        defaults["gradient_accumulation_fusion"] = False
    if cpu:
        defaults.update(CPU_MEGATRON_ARGUMENTS)
    return defaults
