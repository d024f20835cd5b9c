"""The plugin's line for each of Megatron's evaluations (``eval_interval`` / ``eval_iters``):

    [mtraining] validation iteration        6 | lm_loss: 3.8285684585571289 | attended_fraction: 0.8262 |

Megatron's ``evaluate`` runs the model in eval mode on the validation split (at the end of
training also on the test split; Megatron calls both lines "validation loss" and so does
this one) and prints its own "validation loss at iteration N" line, rounded. After it this
line gives the loss at full precision and the attended fraction of the evaluated samples,
per layer and averaged, from a tracker of its own: the training metrics never see an
evaluation's values, and an evaluation never reads or clears theirs. Both go to
TensorBoard / W&B under ``validation/``.

An evaluation starts with its first micro-batch (:meth:`ValidationMetrics.begin_micro_batch`,
from the forward step of a model in eval mode) and ends when the model goes back to training
mode, which ``evaluate`` does last (the layers call :meth:`ValidationMetrics.end`). Its wall
time is left out of the training interval's tokens/s and of the step report's iteration
times, and it never falls in the profiled step.
"""

from __future__ import annotations

import functools
import time

from megatron.training import get_tensorboard_writer, get_wandb_writer

from ..megatron.msa_loss import AttentionMetricsTracker, set_training_iteration
from ..patterns.base import FRACTION_METRIC
from .attention_metrics import collect_evaluation_metrics
from .megatron_args import START_ATTRIBUTE
from .run_state import STATE
from .step_metrics import METRICS, TokenLoss, write_scalars

PREFIX = "validation/"


class _Prefixed:
    """A TensorBoard or W&B writer whose tags start with :data:`PREFIX`."""

    def __init__(self, writer):
        self.writer = writer

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.writer.add_scalar(PREFIX + tag, value, step)

    def log(self, values: dict, step: int) -> None:
        self.writer.log({PREFIX + k: v for k, v in values.items()}, step)


def _prefixed(writer):
    return None if writer is None else _Prefixed(writer)


class ValidationMetrics:
    """The LM loss and attended fraction of one evaluation at a time."""

    def __init__(self):
        self.loss = TokenLoss()
        self.tracker = AttentionMetricsTracker()
        self.start = None  # while an evaluation runs: when it began
        self.iteration = None
        self.micro_batches = 0

    def begin_micro_batch(self, config, args) -> None:
        """Called with each micro-batch of an evaluation, before its forward."""
        if self.start is None:
            self.start = time.perf_counter()
            if STATE.step_report is not None:
                STATE.step_report.begin_evaluation()
            self.iteration = METRICS.completed_iterations(args)
        # The attention the next training step runs (MSA warmup's phase); the training loop
        # sets its own iteration before each step, so nothing carries over.
        set_training_iteration(config, max(0, self.iteration - getattr(args, START_ATTRIBUTE)))
        self.micro_batches += 1
        collect_evaluation_metrics(config, self.tracker, functools.partial(self.end, config))

    def end(self, config) -> None:
        """Prints and writes the evaluation's figures (on every rank: collectives); nothing
        when no evaluation runs, so only the first layer switching back to training reports."""
        from megatron.training.utils.common_utils import print_rank_last

        if self.start is None:
            return
        scalars = {}
        loss = self.loss.mean()
        if loss is not None:
            scalars["lm_loss"] = loss
        write_scalars(scalars, self.iteration, PREFIX)
        line = f"lm_loss: {loss!r} |" if loss is not None else ""
        if FRACTION_METRIC in self.tracker.metrics:
            line += self.tracker.report(
                loss_scale=1.0 / self.micro_batches,
                iteration=self.iteration,
                writer=_prefixed(get_tensorboard_writer()),
                wandb_writer=_prefixed(get_wandb_writer()),
                per_layer_logging=True,
                num_layers=config.num_layers,
                track_names=[FRACTION_METRIC],
            )
        print_rank_last(f"[mtraining] validation iteration {self.iteration:8d} | {line}")
        if STATE.step_report is not None:
            STATE.step_report.end_evaluation()
        METRICS.exclude(time.perf_counter() - self.start)
        self.start, self.micro_batches = None, 0


VALIDATION = ValidationMetrics()
