"""``python -m megatron_mtraining.pretrain --config X.yaml [overrides] --dry-run``.

Validates a config through the same code as a real run (the YAML checks, Megatron's own
``parse_args`` / ``validate_args``, the attention config against the resulting
``TransformerConfig``) for the world size the recipe is written for, then prints the resolved
Megatron arguments, the parallel layout and the memory estimate. Needs no GPU, starts no
process group and reads no data, checkpoint or tokenizer file: the data and checkpoint paths a
real run would reject here are listed, not rejected, since a recipe names another machine's.
"""

from __future__ import annotations

import os
import re
from unittest import mock

from ..context_parallel.layout import STRIPED_KINDS
from ..planning.hardware import gpu
from .yaml_config import ConfigError, RunConfig, culprits, explain_rejection, load_config


def world_size_of(run_config: RunConfig) -> int:
    """The recipe's world size: ``cluster.nodes x cluster.gpus_per_node``, else TP x PP x CP
    (data-parallel size 1)."""
    cluster = run_config.cluster
    if "nodes" in cluster or "gpus_per_node" in cluster:
        return cluster.get("nodes", 1) * cluster.get("gpus_per_node", 1)
    m = run_config.megatron
    return (
        m.get("tensor_model_parallel_size", 1)
        * m.get("pipeline_model_parallel_size", 1)
        * m.get("context_parallel_size", 1)
    )


def check_attention(run_config: RunConfig, args) -> None:
    """The attention config against the model's ``TransformerConfig`` built from Megatron's
    resolved ``args``: a dry run and a real run (before any process group) check the same."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    try:
        run_config.attention.validate_for(core_transformer_config_from_args(args))
    except (ValueError, AssertionError) as err:
        # The settings the error names, wherever the config set them.
        named = [key for key in run_config.sources if re.search(rf"\b{key.rpartition('.')[2]}\b", str(err))]
        raise ConfigError(f"{culprits(run_config.sources, named, run_config.path)}: {err}") from err


def resolve(run_config: RunConfig, world_size: int | None = None):
    """Megatron's validated arguments for ``run_config`` on ``world_size`` ranks (the recipe's
    by default), with the attention config checked against the model's ``TransformerConfig``."""
    from megatron.training import arguments

    from .megatron_args import megatron_defaults, resolve_megatron_args

    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size {world_size}: not a number of ranks (accepted: a positive integer)")
    world_size = world_size or world_size_of(run_config)
    # Megatron's validate_args asks the GPU's compute capability (CUDA_DEVICE_MAX_CONNECTIONS
    # rule for TP / CP > 1); a dry run answers for the recipe's GPU (an sm80 one without).
    name = run_config.cluster.get("gpu")
    arch = gpu(name).compute_capability // 10 if name else 8
    with (
        mock.patch.object(arguments, "get_device_arch_version", lambda: arch),
        mock.patch.dict(os.environ, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ):
        try:
            args = resolve_megatron_args(run_config, megatron_defaults(cpu=False), world_size)
        except ConfigError as err:
            raise explain_rejection(err, run_config) from None
    check_attention(run_config, args)
    gpus_per_node = run_config.cluster.get("gpus_per_node")
    hierarchy = run_config.attention.hierarchy
    if hierarchy and gpus_per_node and args.context_parallel_size > 1:
        # Megatron orders ranks TP fastest, then CP: an inner ring of `hierarchy` CP ranks spans
        # hierarchy x TP consecutive ranks, which must stay inside one node to use its links.
        span = hierarchy * args.tensor_model_parallel_size
        if gpus_per_node % span:
            raise ConfigError(
                f"{run_config.path}: attention.hierarchy={hierarchy} x tensor_model_parallel_size="
                f"{args.tensor_model_parallel_size} = {span} ranks does not divide cluster.gpus_per_node={gpus_per_node}"
            )
    return args


def layout_report(args, run_config: RunConfig) -> str:
    attention = run_config.attention
    cp = args.context_parallel_size
    lines = [
        f"[mtraining] parallel layout: world {args.world_size} = TP {args.tensor_model_parallel_size} x "
        f"PP {args.pipeline_model_parallel_size} x CP {cp} x DP {args.data_parallel_size}",
        f"  attention: {attention.type}; CP layout {attention.layout}"
        + (f" (stripe {attention.stripe})" if attention.layout in STRIPED_KINDS else ""),
        f"  sequence {args.seq_length} tokens, {args.seq_length // cp} per CP rank; micro-batch "
        f"{args.micro_batch_size}, global batch {args.global_batch_size} "
        f"({args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)} accumulation steps)",
    ]
    if attention.hierarchy and cp > 1:
        span = attention.hierarchy * args.tensor_model_parallel_size
        lines.append(
            f"  hierarchical ring: {attention.hierarchy} inner x {cp // attention.hierarchy} outer "
            f"(an inner ring spans {span} consecutive ranks: TP {args.tensor_model_parallel_size} x {attention.hierarchy})"
        )
    else:
        lines.append("  flat ring" if cp > 1 else "  no context parallelism")
    cluster = run_config.cluster
    if cluster:
        lines.append(
            f"  cluster: {cluster.get('nodes', 1)} node(s) x {cluster.get('gpus_per_node', '?')} GPUs per node"
            + (f", {cluster['gpu']}" if "gpu" in cluster else "")
        )
    return "\n".join(lines)


def dry_run(config_path, overrides=(), world_size: int | None = None) -> tuple[str, object]:
    """(the report, the estimate) of a config; raises :class:`ConfigError` on any problem."""
    from .memory import GPU_MEMORY_GIB, estimate_memory

    run_config = load_config(config_path, overrides)
    args = resolve(run_config, world_size)
    try:
        estimate = estimate_memory(
            args,
            run_config.attention,
            GPU_MEMORY_GIB.get(run_config.cluster.get("gpu")),
            run_config.cluster.get("gpus_per_node"),
        )
    except ValueError as err:
        raise ConfigError(f"{run_config.path}: {err}") from None
    # A recipe names the paths of the machines it is written for; a real run here stops on them.
    missing = [f"[mtraining] not on this machine: {text}" for text in run_config.missing_paths()]
    report = "\n".join(
        [
            f"[mtraining] dry run of {run_config.path}: valid (Megatron printed the resolved arguments above)",
            f"[mtraining] attention: {run_config.attention_dict()}",
            layout_report(args, run_config),
            estimate.report(),
            *missing,
        ]
    )
    return report, estimate
