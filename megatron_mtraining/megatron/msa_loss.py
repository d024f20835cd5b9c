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
  single-device loss and gradient (:func:`msa_layer_kl`). The index keys travel the ring
  and the KL runs where the queries live (``context_parallel/msa_kl.py``): no rank gathers
  the whole sequence's keys.
* Values are recorded per layer in :func:`get_attention_metrics_tracker`, a Megatron
  ``MoEMetricsTracker`` of the plugin's own (summed over the CP group, averaged over DP on
  ``report``), so MoE's tracker keeps only MoE metrics. The layer hands :func:`msa_layer_kl`
  a callback (``on_value``) that records: the fused KL kernels skip the forward and compute
  the value in the backward, which runs once per microbatch before Megatron's ``report``
  (under activation recompute too, where the forward runs twice), and so does the
  context-parallel ring on either backend; the single-device PyTorch path calls it in the
  forward.
* Warmup counts training iterations: the training loop calls :func:`set_training_iteration`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

from ..context_parallel.layout import ContextParallelLayout
from ..context_parallel.msa_kl import ring_msa_kl
from ..patterns.msa import KL_METRIC
from ..sparse.msa import msa_kl_loss, msa_kl_objective
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
    on the fused kernels and under context parallelism, in the backward.

    q ``[B, L, Hq, D]``, k ``[B, L, Hkv, D]``, q_idx ``[B, L, Hkv, d_idx]``, k_idx
    ``[B, L, 1, d_idx]`` hold this rank's tokens; ``index`` is the global selection
    (``BlockTopKIndex``, or ``DenseIndex`` in warmup); ``lse`` the main pass's logsumexp of
    this rank's rows ``[B, Hq, L]``, which normalises the teacher. Without a layout (one
    rank), given ``lse``, this is ``msa_kl_objective``: on CUDA the fused kernels
    (``dispatch.kl_kernel``), whose result is a zero scalar carrying the gradient; without
    ``lse``, ``msa_kl_loss``. With a layout, ``lse`` is required (``ring_attention``'s) and
    this is ``context_parallel.msa_kl.ring_msa_kl``: the index keys travel the ring (no rank
    gathers the whole sequence's keys), the KL of this rank's query rows is computed here,
    divided by the whole sequence's row count, and the result is a zero scalar carrying
    the gradient (the value reaches ``on_value`` in the backward, on the kernels and on
    PyTorch alike).
    """
    if layout is None or layout.cp_size == 1:
        if lse is not None:
            return msa_kl_objective(q, k, q_idx, k_idx, index, lse, softmax_scale, on_value, backend)
        kl = msa_kl_loss(q, k, q_idx, k_idx, index, softmax_scale)
        if on_value is not None:
            on_value(kl.detach().float())
        return kl
    if lse is None:
        fail("lse", None, "the main pass's logsumexp of this rank's rows [B, Hq, L] under context parallelism")
    return ring_msa_kl(q, k, q_idx, k_idx, index, lse, layout, cp_group, softmax_scale, on_value, backend)


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
