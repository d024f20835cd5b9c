"""The whole training job of ``python -m megatron_mtraining.pretrain``: :func:`run` prepares
the process (:func:`start_process`: rendezvous, CPU stand-ins, Megatron patches, arguments,
checks; the evaluation shares it) and hands Megatron's ``pretrain`` the plugin's callbacks
(``forward_step``, ``datasets``)."""

from __future__ import annotations

import os

import torch
from megatron.training.utils.common_utils import print_rank_0

from ..megatron.msa_loss import get_attention_metrics_tracker
from .allocator import use_expandable_segments
from .checkpoint_checks import check_checkpoint
from .datasets import train_valid_test_datasets_provider
from .dry_run import check_attention
from .forward_step import forward_step, model_provider
from .megatron_args import megatron_defaults, parse_megatron_args
from .run_state import STATE
from .step_report import StepReport
from .yaml_config import RunConfig


def memory_report(args, run_config: RunConfig) -> str:
    """The memory estimate of ``megatron_mtraining.training.memory`` for these arguments,
    against the config's ``cluster.gpu`` when it names one."""
    from .memory import GPU_MEMORY_GIB, estimate_memory

    gpu = run_config.cluster.get("gpu")
    return estimate_memory(args, run_config.attention, GPU_MEMORY_GIB.get(gpu)).report()


def start_process(run_config: RunConfig):
    """What a process of a program on Megatron's training library (training, evaluation) sets
    up before Megatron's own initialisation: the environment, a rendezvous when started
    without torchrun, the CPU stand-ins (without CUDA), the layout patches, Megatron's
    arguments (set as its globals, writers included) and the attention checked against the
    model. Returns the arguments."""
    from ..patches import (
        apply_cpu_patches,
        apply_patches,
        use_atomic_checkpoint_tracker,
        use_prebuilt_dataset_helpers,
    )

    # Megatron's validate_args requires 1 for TP / CP > 1 (kernel order for comm-compute
    # overlap) and refuses 1 with FSDP; a launcher's value wins.
    if not any(run_config.megatron.get(k) for k in ("use_torch_fsdp2", "use_megatron_fsdp")):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Read at the first CUDA allocation, so set before any.
    use_expandable_segments()
    _single_process_rendezvous()
    use_prebuilt_dataset_helpers()
    use_atomic_checkpoint_tracker()
    defaults = megatron_defaults(cpu=apply_cpu_patches(training=True))
    # Before the model exists, so Megatron's batch split and RoPE slice follow the layout.
    attention = run_config.attention
    apply_patches(attention.layout, attention.stripe, attention.layout_node_size)
    args = parse_megatron_args(run_config, defaults)
    check_attention(run_config, args)
    return args


def run(
    run_config: RunConfig,
    step_report: str | None = None,
    profile_step: int | None = None,
    check_finite: bool = False,
    step_trace: str | None = None,
    step_stacks: bool = False,
) -> None:
    """The whole training job of ``python -m megatron_mtraining.pretrain`` on a loaded
    config (``load_config``, which the entry point has already read and checked); with
    ``step_report``, rank 0 writes the step report there (``step_report.py``), profiling
    iteration ``profile_step`` (0-based; default the second to last), and that step's trace to
    ``step_trace`` if given, its host sampled if ``step_stacks``; ``check_finite``
    guards every layer against non-finite values (``finite_guard.py``)."""
    STATE.check_finite = check_finite
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    args = start_process(run_config)
    print_rank_0(memory_report(args, run_config))
    check_checkpoint(args)
    container = pretrain_cfg_container_from_args(args)
    _record_memory_history(container)
    if step_report is not None:
        STATE.step_report = StepReport(step_report, profile_step, step_trace, step_stacks)
    pretrain(
        container,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
    if STATE.step_report is not None and torch.distributed.get_rank() == 0:
        STATE.step_report.metrics = dict(get_attention_metrics_tracker().last)
        report = STATE.step_report.write(args)
        print_rank_0(
            f"[mtraining] step report written to {step_report}: {report['steady_s_per_iteration']} s/iteration"
        )


def _record_memory_history(container) -> None:
    """Honours ``record_memory_history``: Megatron starts the allocator trace only when it
    builds the model from a config container's model section, which this argument-driven
    path does not have, so its snapshots would hold no history. Megatron's 100k events cover
    less than two steps of a 12-layer model; 1M keep the whole step for
    ``scripts/memory_snapshot_report.py`` (host memory only)."""
    profiling = container.profiling
    if profiling is None or not profiling.record_memory_history or not torch.cuda.is_available():
        return
    if profiling.profile_ranks and torch.distributed.get_rank() not in profiling.profile_ranks:
        return
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=1_000_000, trace_alloc_record_context=True)


def _single_process_rendezvous() -> None:
    """Started without torchrun: one process, rendezvous on a free local port."""
    import socket

    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
