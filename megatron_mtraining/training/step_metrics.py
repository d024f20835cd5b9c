"""The plugin's per-interval training metrics, printed as the ``[mtraining] iteration`` line
(``metrics_line`` reads it back) and written through Megatron's TensorBoard / W&B writers;
the full-precision LM loss (:class:`TokenLoss`) and the writing (:func:`write_scalars`)
serve the evaluations' line too (``validation_metrics``)."""

from __future__ import annotations

import functools
import time

import torch
from megatron.core import parallel_state
from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

from ..megatron.msa_loss import get_attention_metrics_tracker
from .attention_metrics import collect_attention_metrics
from .megatron_args import attention_from_args
from .run_state import STATE, device


class TokenLoss:
    """An LM loss over several micro-batches at full precision: each micro-batch's loss sum
    and token count (this rank's tokens) added in fp64 where they are. On the device: a
    copy to the host would wait for the micro-batch's forward, between it and its backward."""

    def __init__(self):
        self.sums: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, num_tokens: torch.Tensor) -> None:
        sums = torch.stack([loss.detach().double(), num_tokens.detach().double()])
        self.sums = sums if self.sums is None else self.sums + sums

    def mean(self) -> float | None:
        """The loss per token over every DP x CP rank's tokens since the last call (None: no
        token), a collective of that group; starts the next sum."""
        sums = torch.zeros(2, dtype=torch.float64, device=device()) if self.sums is None else self.sums
        self.sums = None
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        # The one read of the interval: the line prints the value.
        total, tokens = sums.tolist()
        return total / tokens if tokens > 0 else None


def write_scalars(scalars: dict[str, float], iteration: int, prefix: str = "mtraining/") -> None:
    """``scalars`` to Megatron's TensorBoard and W&B writers (where configured), tagged
    ``prefix + name``."""
    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    for name, value in scalars.items():
        if writer is not None:
            writer.add_scalar(f"{prefix}{name}", value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({f"{prefix}{name}": value}, iteration)


class StepMetrics:
    """The plugin's per-interval metrics, reported at the end of each training step's
    forward and backward (a wrapper around ``config.finalize_model_grads_func``, which
    Megatron's schedules call once per step on every rank). Every ``log_interval`` steps it
    prints and writes (TensorBoard / W&B through Megatron's writers) the LM loss averaged
    over the interval's tokens at full precision, tokens/s, and the tracker's per-layer
    metrics with their mean: MSA's KL and block / score recall, attended fraction, index
    recall, ring imbalance degrees."""

    def __init__(self):
        self.iteration = None
        self.start = None
        self.steps = 0
        self.weight = 0
        self.loss = TokenLoss()

    def begin_step(self, config, args) -> None:
        """Called with each training micro-batch: the micro-batches of the last step of each
        interval record the attention metrics; the first of a step hooks the step's end."""
        if args.curr_iteration != self.iteration:
            if STATE.step_report is not None:
                STATE.step_report.begin_iteration(args.curr_iteration, args.train_iters)
            self.iteration = args.curr_iteration
            if self.start is None:
                self.start = time.perf_counter()
            self.weight = args.log_interval if (self.iteration + 1) % args.log_interval == 0 else 0
            self._hook_step_end(config)
        collect_attention_metrics(config, self.weight, seed=self.iteration)

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

    def completed_iterations(self, args) -> int:
        """Training iterations done: those of this process's run, else the loaded checkpoint's."""
        return args.iteration if self.iteration is None else self.iteration + 1

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` (an evaluation) out of the interval's tokens/s."""
        if self.start is not None:
            self.start += seconds

    def report(self, config, args) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.utils.common_utils import print_rank_last

        self.steps += 1
        iteration = args.curr_iteration + 1  # Megatron's number for the step being finished
        if iteration % args.log_interval:
            return
        scalars = {}
        loss = self.loss.mean()
        if loss is not None:
            scalars["lm_loss"] = loss
        elapsed = time.perf_counter() - self.start
        scalars["tokens_per_second"] = self.steps * args.global_batch_size * args.seq_length / elapsed
        write_scalars(scalars, iteration)
        line = f"lm_loss: {scalars['lm_loss']!r} | " if "lm_loss" in scalars else ""
        line += f"tokens/s: {scalars['tokens_per_second']:.1f} |"
        tracker = get_attention_metrics_tracker()
        names = [n for n in attention_from_args(args).pattern_class.metrics if n in tracker.metrics]
        if names:
            # KL values add up over every micro-batch of the interval; the attention metrics
            # are recorded once per interval with the interval's weight.
            line += tracker.report(
                loss_scale=1.0 / (get_num_microbatches() * args.log_interval),
                iteration=iteration,
                writer=get_tensorboard_writer(),
                wandb_writer=get_wandb_writer(),
                per_layer_logging=True,
                num_layers=config.num_layers,
                track_names=names,
            )
        print_rank_last(f"[mtraining] iteration {iteration:8d} | {line}")
        self.start, self.steps = time.perf_counter(), 0


METRICS = StepMetrics()
