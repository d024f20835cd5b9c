"""The pieces ``megatron.training.pretrain`` calls back: model provider, forward step, dataset
provider, and the plugin's per-interval metrics.

* :func:`model_provider` builds Megatron's ``GPTModel`` from the parsed Megatron arguments,
  with the plugin's decoder-block spec; the attention config travels in the arguments
  (``args.mtraining_attention``, a plain dict), so Megatron saves it with every checkpoint.
* :func:`forward_step` takes a micro-batch through Megatron's TP broadcast and CP split
  (``get_batch_on_this_cp_rank``, which ``megatron_mtraining.patches`` makes follow the
  configured layout) and returns Megatron's per-token loss triple. It also tells the model
  the training iteration (MSA warmup) and reports the plugin's metrics once per step.
* :func:`train_valid_test_datasets_provider`: Megatron's GPT datasets (``mock_data`` or an
  indexed ``data_path``).
* :func:`check_checkpoint` compares the checkpoint being loaded with this run: a changed
  learning-rate schedule stops the run with a named error; an attention switch is logged and
  Megatron's loader made to accept new MSA parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import time
import types
from functools import partial
from typing import NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tensorboard_writer, get_tokenizer, get_wandb_writer
from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.utils.common_utils import get_blend_and_blend_per_split, print_rank_0

from ..megatron.config import MTrainingAttentionConfig, attach_attention_config
from ..megatron.layer_specs import get_gpt_decoder_block_spec
from ..megatron.msa_loss import KL_METRIC, get_attention_metrics_tracker, set_training_iteration
from ..megatron.profiler_ranges import part_range
from .attention_metrics import METRICS as ATTENTION_METRICS
from .attention_metrics import collect_attention_metrics, measured
from .chunked_loss import chunked_lm_loss
from .dry_run import check_attention
from .finite_guard import check_losses, install_finite_guard
from .step_report import StepReport, annotate_model
from .yaml_config import ConfigError, RunConfig

ARGS_ATTRIBUTE = "mtraining_attention"
# Megatron loader strictness modes that fail (or, for the default, crash) on model keys the
# checkpoint lacks; see megatron.core.dist_checkpointing.validation.StrictHandling.
_STRICT_ABOUT_NEW_KEYS = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
# The iteration at which this attention type started (MSA warmup counts from there).
START_ATTRIBUTE = "mtraining_attention_start"
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def attention_from_args(args) -> MTrainingAttentionConfig:
    return MTrainingAttentionConfig.from_dict(getattr(args, ARGS_ATTRIBUTE))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's GPT with the plugin's attention in every layer (called by ``get_model``)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    attach_attention_config(config, attention_from_args(args))
    backend = "te" if args.transformer_impl == "transformer_engine" else "local"
    spec = measured(get_gpt_decoder_block_spec(config, backend=backend, vp_stage=vp_stage))
    model = GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if _STEP_REPORT is not None:
        annotate_model(model)
    if _CHECK_FINITE:
        install_finite_guard(model, attention_from_args(args).type)
    return model


def _get_batch(data_iterator) -> dict:
    """This rank's micro-batch: TP rank 0 reads it, Megatron broadcasts it over TP and splits it
    over CP (in the plugin's layout once the patches are applied)."""
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0 and data_iterator is not None:
        batch = next(data_iterator)
        batch = {k: batch[k].to(_device(), non_blocking=True) if batch.get(k) is not None else None for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(),
    )
    # Looked up at call time: the patches replace the function in megatron.core.utils.
    from megatron.core import utils as core_utils

    return core_utils.get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
    )


def loss_func(loss_mask: torch.Tensor, training: bool, output_tensor: torch.Tensor):
    """Megatron's per-token loss triple: (loss sum, token count, report) over this rank's
    tokens; training losses also go to the plugin's metrics."""
    losses = output_tensor.view(-1).float()
    if _CHECK_FINITE:
        check_losses(losses)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    if training:
        _METRICS.add_loss(loss, num_tokens)
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch forward; Megatron's schedules call the returned loss function."""
    args = get_args()
    config = get_attr_wrapped_model(model, "config")
    if model.training:
        _METRICS.begin_step(config, args)
        # MSA warmup counts from the iteration this attention type started (a switch on load).
        set_training_iteration(config, max(0, args.curr_iteration - getattr(args, START_ATTRIBUTE)))
    with part_range("other") if _STEP_REPORT is not None else contextlib.nullcontext():
        batch = _get_batch(data_iterator)
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch["attention_mask"],
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            output_processor=chunked_lm_loss,
        )
    return output, partial(loss_func, batch["loss_mask"], model.training)


def _dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def _built_on_this_rank() -> bool:
    first_or_last = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    return first_or_last and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(num_samples):
    """Megatron's GPT datasets: random tokens with ``mock_data``, else the indexed ``data_path``."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test datasets")
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, _built_on_this_rank, _dataset_config(args)).build()


# Every rank calls the provider (Megatron then builds the data loaders where a dataset exists).
train_valid_test_datasets_provider.is_distributed = True


class _Metrics:
    """The plugin's per-interval metrics, reported at the end of each training step's
    forward and backward (a wrapper around ``config.finalize_model_grads_func``, which
    Megatron's schedules call once per step on every rank). Every ``log_interval`` steps it
    prints and writes (TensorBoard / W&B through Megatron's writers) the LM loss averaged
    over the interval's tokens at full precision, tokens/s, and the tracker's per-layer
    metrics with their mean: MSA's KL, attended fraction, ring imbalance degrees."""

    def __init__(self):
        self.iteration = None
        self.start = None
        self.steps = 0
        self.micro_batches = 0
        self.weight = 0
        self.loss = torch.zeros(2, dtype=torch.float64)  # loss sum, token count

    def begin_step(self, config, args) -> None:
        """Called with each training micro-batch: the micro-batches of the last step of each
        interval record the attention metrics; the first of a step hooks the step's end."""
        self.micro_batches += 1
        if args.curr_iteration != self.iteration:
            if _STEP_REPORT is not None:
                _STEP_REPORT.begin_iteration(args.curr_iteration, args.train_iters)
            self.iteration = args.curr_iteration
            if self.start is None:
                self.start = time.perf_counter()
            self.weight = args.log_interval if (self.iteration + 1) % args.log_interval == 0 else 0
            self._hook_step_end(config)
        collect_attention_metrics(config, self.weight, self.micro_batches)

    def _hook_step_end(self, config) -> None:
        finalize = config.finalize_model_grads_func
        if finalize is not None and not getattr(finalize, "_mtraining_metrics", False):

            @functools.wraps(finalize)
            def finalize_and_report(*a, **k):
                result = finalize(*a, **k)
                self.report(config, get_args())
                return result

            finalize_and_report._mtraining_metrics = True
            config.finalize_model_grads_func = finalize_and_report

    def add_loss(self, loss: torch.Tensor, num_tokens: torch.Tensor) -> None:
        self.loss += torch.stack([loss.detach().double().cpu(), num_tokens.detach().double().cpu()])

    def report(self, config, args) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.utils.common_utils import print_rank_last

        self.steps += 1
        iteration = args.curr_iteration + 1  # Megatron's number for the step being finished
        if iteration % args.log_interval:
            return
        writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
        scalars = {}
        loss = self.loss.to(_device())
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if loss[1] > 0:
            scalars["lm_loss"] = float(loss[0] / loss[1])
        elapsed = time.perf_counter() - self.start
        scalars["tokens_per_second"] = self.steps * args.global_batch_size * args.seq_length / elapsed
        for name, value in scalars.items():
            if writer is not None:
                writer.add_scalar(f"mtraining/{name}", value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({f"mtraining/{name}": value}, iteration)
        line = f"lm_loss: {scalars['lm_loss']!r} | " if "lm_loss" in scalars else ""
        line += f"tokens/s: {scalars['tokens_per_second']:.1f} |"
        tracker = get_attention_metrics_tracker()
        names = [n for n in (KL_METRIC, *ATTENTION_METRICS) if n in tracker.metrics]
        if names:
            # KL values add up over every micro-batch of the interval; the attention metrics
            # are recorded once per interval with the interval's weight.
            line += tracker.report(
                loss_scale=1.0 / (get_num_microbatches() * args.log_interval),
                iteration=iteration,
                writer=writer,
                wandb_writer=wandb_writer,
                per_layer_logging=True,
                num_layers=config.num_layers,
                track_names=names,
            )
        print_rank_last(f"[mtraining] iteration {iteration:8d} | {line}")
        self.loss.zero_()
        self.start, self.steps = time.perf_counter(), 0


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


_METRICS = _Metrics()
# Set by ``run(step_report=...)``: the step timer and profile of ``--step-report``.
_STEP_REPORT: StepReport | None = None
# Set by ``run(check_finite=...)``: ``--check-finite``.
_CHECK_FINITE = False


def check_checkpoint(args) -> None:
    """Compares the checkpoint ``args.load`` names with this run: its learning-rate schedule
    (:func:`_check_schedule`) and its attention.

    A switch is logged, and MSA warmup counts from the iteration of the switch
    (``args.mtraining_attention_start``, saved with the arguments so a later resume keeps
    it). MSA's index projections exist only in MSA models, so across a switch to or from MSA
    the checkpoint's optimizer state does not fit: unless the run already sets ``finetune``
    or ``no_load_optim``, the optimizer starts fresh, as with Megatron's ``no_load_optim``
    (the iteration count and LR schedule continue). Towards MSA, Megatron's loader must also
    accept model keys the checkpoint lacks (``dist_ckpt_strictness``); the projections keep
    their fresh initialisation.
    """
    found = _read_checkpoint(args)
    if found is None:
        return
    _check_schedule(args, found.common.get("opt_param_scheduler"), found.release)
    saved, saved_start, iteration = found.attention, found.attention_start, found.iteration
    attention = attention_from_args(args)
    saved_type = saved.get("type", "dense")
    if saved_type == attention.type:
        setattr(args, START_ATTRIBUTE, saved_start)
    else:
        setattr(args, START_ATTRIBUTE, 0 if args.finetune else iteration)
    current = getattr(args, ARGS_ATTRIBUTE)
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if not changed:
        return
    what = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
    print_rank_0(
        f"[mtraining] attention switch on load from {args.load} (iteration {iteration}): {saved_type!r} -> "
        f"{attention.type!r}; changed settings: {what}"
    )
    if (attention.type == "msa") == (saved_type == "msa"):
        return
    if attention.type == "msa" and args.dist_ckpt_strictness in _STRICT_ABOUT_NEW_KEYS:
        print_rank_0(
            f"[mtraining] dist_ckpt_strictness {args.dist_ckpt_strictness!r} -> 'log_unexpected': the MSA index "
            "projections are not in the checkpoint and keep their fresh initialisation"
        )
        args.dist_ckpt_strictness = "log_unexpected"
    if not (args.finetune or args.no_load_optim):
        print_rank_0(
            "[mtraining] no_load_optim -> True: the checkpoint's optimizer state does not cover the MSA index "
            "projections; the optimizer starts fresh"
        )
        args.no_load_optim = True


def _check_schedule(args, saved: dict | None, release: bool) -> None:
    """A resume whose learning-rate or weight-decay schedule differs from the checkpoint's
    stops here, naming what differs and the two ways out: Megatron's scheduler asserts it
    only inside the checkpoint load, after every process has started. The comparison is
    Megatron's own, on a scheduler built as its training loop builds one."""
    from unittest import mock

    from megatron.training import training as megatron_training

    loads = not (release or args.finetune or args.no_load_optim)
    chooses = args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler
    if saved is None or not loads or chooses:
        return
    optimizer = types.SimpleNamespace(param_groups=[{}])
    with mock.patch.object(megatron_training, "get_args", lambda: copy.copy(args)):
        scheduler = megatron_training.get_optimizer_param_scheduler(optimizer)
    try:
        scheduler.load_state_dict(saved)
    except AssertionError as err:
        raise ConfigError(
            f"megatron.load={args.load!r}: this run's learning-rate schedule is not the checkpoint's ({err}; "
            "the schedule follows lr, min_lr, lr_decay_style, lr_decay_iters or train_iters, the warmup and the "
            "weight decay). Accepted: the checkpoint's settings, or megatron.use_checkpoint_opt_param_scheduler=true "
            "to continue the checkpoint's schedule, or megatron.override_opt_param_scheduler=true to take this run's"
        ) from None


class _Checkpoint(NamedTuple):
    attention: dict  # a checkpoint without the plugin's settings (plain Megatron) is dense
    attention_start: int  # the iteration that attention type started
    iteration: int
    release: bool
    common: dict  # the checkpoint's common (unsharded) state


def _read_checkpoint(args) -> _Checkpoint | None:
    """What a run needs to know of the checkpoint ``args.load`` names before loading it, or
    None when there is none."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    if not args.load or args.ckpt_format != "torch_dist":
        return None
    tracker = get_checkpoint_tracker_filename(args.load)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    release = text == "release"
    iteration = args.ckpt_step if args.ckpt_step is not None else (0 if release else int(text))
    name = get_checkpoint_name(args.load, iteration, release, return_base_dir=True)
    if not dist_checkpointing.check_is_distributed_checkpoint(name):
        return None
    common = dist_checkpointing.load_common_state_dict(name)
    saved_args = common.get("args")
    attention = dict(getattr(saved_args, ARGS_ATTRIBUTE, None) or {"type": "dense"})
    return _Checkpoint(attention, getattr(saved_args, START_ATTRIBUTE, 0), iteration, release, common)


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
    setattr(args, ARGS_ATTRIBUTE, run_config.attention_dict())
    setattr(args, START_ATTRIBUTE, 0)
    return args


def parse_megatron_args(run_config: RunConfig, defaults: dict):
    """:func:`resolve_megatron_args` for this process's launch, set as Megatron's globals."""
    from megatron.training.global_vars import set_global_variables

    args = resolve_megatron_args(run_config, defaults)
    set_global_variables(args)
    return args


def _megatron_defaults(cpu: bool) -> dict:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    from ..megatron.cpu_compat import CPU_MEGATRON_ARGUMENTS

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


def memory_report(args, run_config: RunConfig) -> str:
    """The memory estimate of ``megatron_mtraining.training.memory`` for these arguments,
    against the config's ``cluster.gpu`` when it names one."""
    from .memory import GPU_MEMORY_GIB, estimate_memory

    gpu = run_config.cluster.get("gpu")
    return estimate_memory(args, run_config.attention, GPU_MEMORY_GIB.get(gpu)).report()


def run(
    run_config: RunConfig,
    step_report: str | None = None,
    profile_step: int | None = None,
    check_finite: bool = False,
) -> None:
    """The whole training job of ``python -m megatron_mtraining.pretrain`` on a loaded
    config (``load_config``, which the entry point has already read and checked); with
    ``step_report``, rank 0 writes the step report there (``step_report.py``), profiling
    iteration ``profile_step`` (0-based; default the second to last); ``check_finite``
    guards every layer against non-finite values (``finite_guard.py``)."""
    global _STEP_REPORT, _CHECK_FINITE
    _CHECK_FINITE = check_finite
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    from ..megatron.cpu_compat import apply_cpu_compat
    from ..patches import apply_patches

    # Megatron's validate_args requires 1 for TP / CP > 1 (kernel order for comm-compute
    # overlap) and refuses 1 with FSDP; a launcher's value wins.
    if not any(run_config.megatron.get(k) for k in ("use_torch_fsdp2", "use_megatron_fsdp")):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # The logits-sized blocks of long sequences fragment the default allocator (12.6 GiB
    # reserved beyond the allocated peak at 32K tokens, 3.0 GiB with expandable segments:
    # docs/benchmarks.md); read at the first CUDA allocation, so set before any.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _single_process_rendezvous()
    _use_prebuilt_dataset_helpers()
    defaults = _megatron_defaults(cpu=apply_cpu_compat(training=True))
    # Before the model exists, so Megatron's batch split and RoPE slice follow the layout.
    apply_patches(run_config.attention.layout, run_config.attention.stripe)
    args = parse_megatron_args(run_config, defaults)
    check_attention(run_config, args)
    print_rank_0(memory_report(args, run_config))
    check_checkpoint(args)
    container = pretrain_cfg_container_from_args(args)
    _record_memory_history(container)
    if step_report is not None:
        _STEP_REPORT = StepReport(step_report, profile_step)
    pretrain(
        container,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
    if _STEP_REPORT is not None and torch.distributed.get_rank() == 0:
        _STEP_REPORT.metrics = dict(get_attention_metrics_tracker().last)
        report = _STEP_REPORT.write(args)
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


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships the compiled dataset helpers but no Makefile, so the
    ``make`` Megatron runs at start-up (``initialize._compile_dependencies``) fails: use the
    prebuilt module when it imports."""
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def _single_process_rendezvous() -> None:
    """Started without torchrun: one process, rendezvous on a free local port."""
    import socket

    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
