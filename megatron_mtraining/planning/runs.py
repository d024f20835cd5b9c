"""A :class:`~.model.Run` from a config: Megatron's validated arguments (the dry run's
``resolve``), the attention config and the ``cluster:`` section."""

from __future__ import annotations

import contextlib
import io

from ..training.dry_run import resolve
from ..training.memory import count_parameters, padded_vocab_size
from ..training.yaml_config import ConfigError, RunConfig
from .hardware import default_network, gpu
from .model import Run

RECOMPUTE_MODULES = ("mlp", "core_attn")


def resolve_quietly(run_config: RunConfig, world_size: int | None = None):
    """``dry_run.resolve`` without Megatron's printout of every argument."""
    with contextlib.redirect_stdout(io.StringIO()):
        return resolve(run_config, world_size)


def recompute_policy(args) -> tuple[str, int | None]:
    """(policy, recomputed layers) of Megatron's recomputation arguments."""
    if args.recompute_granularity is None:
        return "none", None
    if args.recompute_granularity == "full":
        return "full", args.recompute_num_layers if args.recompute_method == "block" else None
    modules = tuple(args.recompute_modules or ("core_attn",))
    if len(modules) != 1 or modules[0] not in RECOMPUTE_MODULES:
        raise ConfigError(
            f"megatron.recompute_modules={list(modules)}: the planner models one of {', '.join(RECOMPUTE_MODULES)}"
        )
    return modules[0], None


def run_from_args(
    args, run_config: RunConfig, gpu_name: str | None = None, network: str | None = None, sources: tuple = ()
) -> Run:
    """The cost model's view of a run whose arguments Megatron validated."""
    if args.pipeline_model_parallel_size != 1:
        raise ConfigError(
            f"megatron.pipeline_model_parallel_size={args.pipeline_model_parallel_size}: the planner models "
            "pipeline parallelism 1 only (every recipe's)"
        )
    cluster = run_config.cluster
    name = gpu_name or cluster.get("gpu") or "H100-80GB"
    recompute, recomputed = recompute_policy(args)
    low_precision = args.bf16 or args.fp16
    return Run(
        hidden=args.hidden_size,
        ffn=args.ffn_hidden_size,
        heads=args.num_attention_heads,
        kv_heads=args.num_query_groups or args.num_attention_heads,
        head_dim=args.kv_channels,
        layers=args.num_layers,
        vocab=padded_vocab_size(args),
        seq=args.seq_length,
        params=count_parameters(args, run_config.attention).per_rank,
        tp=args.tensor_model_parallel_size,
        cp=args.context_parallel_size,
        dp=args.data_parallel_size,
        micro_batch=args.micro_batch_size,
        global_batch=args.global_batch_size,
        recompute=recompute,
        recomputed_layers=recomputed,
        grad_bytes=4 if (args.accumulate_allreduce_grads_in_fp32 or not low_precision) else 2,
        distributed_optimizer=args.use_distributed_optimizer,
        sequence_parallel=args.sequence_parallel,
        log_interval=args.log_interval,
        attention=run_config.attention,
        sources=tuple(sources),
        backend=run_config.attention.backend or "auto",
        gpu=gpu(name),
        gpus_per_node=cluster.get("gpus_per_node", 8),
        network=network or cluster.get("network") or default_network(name),
    )
