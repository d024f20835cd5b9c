"""MSA's KL alignment loss inside Megatron: backward hook, loss scale, logging, warmup.

* The per-layer KL never joins the language-model loss. :class:`MSALossAutoScaler` attaches
  it to the attention output and, in the backward, feeds it the gradient Megatron's main loss
  would get (Megatron's ``MoEAuxLossAutoScaler`` trick). Megatron's schedules pass that scale
  every microbatch to ``config.experimental_attention_variant_loss_scale_func``
  (``pipeline_parallel/schedules.py``, ``forward_step_calc_loss``), which
  ``attach_attention_config`` points at :meth:`MSALossAutoScaler.set_loss_scale`.
* Under context parallelism each rank attaches its share of the KL: the sum over its
  query rows divided by the whole sequence's row count. Megatron scales auxiliary losses by
  ``cp_size`` and averages gradients over the CP ranks, so the shares add up to the
  single-device loss and gradient (:func:`msa_layer_kl`).
* Values are recorded per layer in :func:`get_attention_metrics_tracker`, a Megatron
  ``MoEMetricsTracker`` of the plugin's own (summed over the CP group, averaged over DP on
  ``report``), so MoE's tracker keeps only MoE metrics. The layer hands :func:`msa_layer_kl`
  a callback (``on_value``) that records: the fused KL kernels skip the forward and compute
  the value in the backward, which runs once per microbatch before Megatron's ``report``
  (under activation recompute too, where the forward runs twice); the PyTorch path calls
  it in the forward.
* Warmup counts training iterations: the training loop calls :func:`set_training_iteration`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

from ..context_parallel.layout import ContextParallelLayout
from ..context_parallel.step_index import StepIndex
from ..patterns.msa import KL_METRIC
from ..sparse.msa import _MSAKLLoss, msa_kl_loss, msa_kl_objective
from ..sparse.validation import check_int, fail

ITERATION_ATTRIBUTE = "mtraining_iteration"


class AttentionMetricsTracker(MoEMetricsTracker):
    """Megatron's per-layer metrics tracker, printing four significant digits (Megatron's
    two decimals show a KL of 3e-4 as 0.00) and keeping the last reported means
    (``last``) for the step report."""

    def __init__(self):
        super().__init__()
        self.last: dict[str, float] = {}

    def _format(self, scalars) -> str:
        self.last = {name: float(value) for name, value in scalars.items()}
        return "".join(f" {name}: {value:.4g} |" for name, value in self.last.items())


_TRACKER: AttentionMetricsTracker | None = None


class MSALossAutoScaler(torch.autograd.Function):
    """Returns ``output`` unchanged; its backward gives ``aux_loss`` the gradient
    ``main_loss_backward_scale`` (set by Megatron's schedules through the config hook)."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MSALossAutoScaler.main_loss_backward_scale
        scale = 1.0 if scale is None else scale.to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The hook for ``config.experimental_attention_variant_loss_scale_func``: the scale of
        the main loss's gradient (``loss_scale * cp_size / num_microbatches`` in Megatron)."""
        MSALossAutoScaler.main_loss_backward_scale = torch.as_tensor(scale).detach().reshape(())


class _GatherSequence(torch.autograd.Function):
    """Every rank's tokens ``[B, L, ...]`` -> the whole sequence ``[B, S, ...]`` in global
    order; the backward sums the gradient over the group and returns this rank's tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: ContextParallelLayout, group):
        ctx.layout, ctx.group = layout, group
        x = x.contiguous()  # gloo needs contiguous buffers
        parts = [torch.empty_like(x) for _ in range(layout.cp_size)]
        dist.all_gather(parts, x, group=group)
        return layout.unshard(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return ctx.layout.shard(grad, dist.get_rank(ctx.group), dim=1), None, None


def msa_layer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index,
    softmax_scale: float,
    layout: ContextParallelLayout | None = None,
    cp_group=None,
    lse: torch.Tensor | None = None,
    on_value: Callable[[torch.Tensor], None] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """This rank's share of a layer's MSA KL loss (``msa_kl_loss`` on the whole sequence), to
    back-propagate; its value goes to ``on_value`` (a 0-dim fp32 tensor), in the forward or,
    on the fused kernels, in the backward.

    q ``[B, L, Hq, D]``, k ``[B, L, Hkv, D]``, q_idx ``[B, L, Hkv, d_idx]``, k_idx
    ``[B, L, 1, d_idx]`` hold this rank's tokens; ``index`` is the global selection
    (``BlockTopKIndex``, or ``DenseIndex`` in warmup). Without a layout (one rank), given
    ``lse`` (the main pass's ``[B, Hq, L]``), this is ``msa_kl_objective``: on CUDA the fused
    kernels (``dispatch.kl_kernel``), whose result is a zero scalar carrying the gradient;
    without ``lse``, ``msa_kl_loss``. With a layout, the keys and index keys of the whole
    sequence are gathered (the index keys with autograd, so each owner gets the gradient of
    every rank's rows) and the KL runs over this rank's query rows, divided by the whole
    sequence's row count (the PyTorch path; ``lse`` is not read).
    """
    if layout is None or layout.cp_size == 1:
        if lse is not None:
            return msa_kl_objective(q, k, q_idx, k_idx, index, lse, softmax_scale, on_value, backend)
        kl = msa_kl_loss(q, k, q_idx, k_idx, index, softmax_scale)
    else:
        rank = dist.get_rank(cp_group)
        k_all = _GatherSequence.apply(k.detach(), layout, cp_group)
        k_idx_all = _GatherSequence.apply(k_idx, layout, cp_group)
        rows = StepIndex(index, layout.positions(rank), torch.arange(layout.seq_len))
        local_mean = _MSAKLLoss.apply(q_idx, k_idx_all, q.detach(), k_all, rows, softmax_scale)
        kl = local_mean * (layout.local_len / layout.seq_len)
    if on_value is not None:
        on_value(kl.detach().float())
    return kl


def get_attention_metrics_tracker() -> AttentionMetricsTracker:
    """The plugin's per-layer metrics (``msa_kl_loss``): ``record`` in the forward or the
    backward (the fused KL computes its value there), then ``report(loss_scale=
    1/num_microbatches, iteration, writer, wandb_writer, num_layers=...)`` once per step,
    after the step's backward passes, as for Megatron's MoE metrics."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = AttentionMetricsTracker()
    return _TRACKER


def record_kl(value: torch.Tensor, layer_number: int, num_layers: int, cp_group) -> None:
    """Records a layer's KL share; ``report`` sums the shares over the CP group."""
    group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
    get_attention_metrics_tracker().record(KL_METRIC, value, layer_number, num_layers, reduce_group=group)


def set_training_iteration(config, iteration: int) -> None:
    """Tells the attention modules built from ``config`` the current training iteration (MSA
    indexer warmup counts iterations, not microbatches). The training loop calls it before
    each step."""
    check_int("iteration", iteration, minimum=0)
    setattr(config, ITERATION_ATTRIBUTE, iteration)


def training_iteration(config) -> int:
    iteration = getattr(config, ITERATION_ATTRIBUTE, None)
    if iteration is None:
        fail(
            f"TransformerConfig.{ITERATION_ATTRIBUTE}",
            None,
            "the training iteration, set with set_training_iteration(config, iteration) (MSA warmup counts "
            "iterations; set MSAConfig.warmup_steps=0 to train without warmup)",
        )
    return iteration
