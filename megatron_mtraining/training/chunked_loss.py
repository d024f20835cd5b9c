"""The language-model loss over chunks of the sequence, so that the logits never exist whole.

At long context the output layer's logits dominate a GPU's memory: Megatron materialises the
``s x V / t`` logits in the compute dtype plus two fp32 buffers of its vocab-parallel cross
entropy, 10 bytes per element (most of an A100-40GB for Qwen2.5-3B at 16K tokens per GPU).
:func:`chunked_lm_loss` is a ``GPTModel`` output processor
(the ``output_processor`` argument of Megatron's ``GPTModel.forward``) that runs Megatron's own
output layer and loss on chunks of rows under activation checkpointing: the forward keeps
each chunk's per-token loss only, and the backward recomputes one chunk's logits at a time.
Losses and gradients are Megatron's (the same operations on the same rows); the price is one
more output-layer GEMM per chunk in the backward and Megatron's cross entropy run again.

With sequence parallelism the output layer all-gathers its input over TP, so a chunk of each
rank's shard becomes rows from every rank's part of the sequence: the labels are gathered in
that order and the losses put back in sequence order.

Where it applies (TP 1, so no sequence parallelism; no output bias; no MuP logit scaling; the
loss mask given), the loss is :func:`~.linear_cross_entropy.linear_cross_entropy` instead: one
autograd function that computes the gradients chunk by chunk in its forward, so the backward
neither recomputes the logits nor runs Megatron's cross entropy again. Its weight gradient
assumes that the per-token losses reach the loss as ``sum(losses * loss_mask)`` times a scalar
(what ``forward_step.loss_func`` does). It computes the same loss as Megatron's fused and unfused
cross entropy, so ``cross_entropy_loss_fusion`` does not choose between the paths.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..megatron.profiler_ranges import part_range
from .linear_cross_entropy import chunk_rows_for, linear_cross_entropy

# Logits elements per chunk (per GPU) on the checkpointed path: 2.5 GiB at 10 bytes each.
CHUNK_ELEMENTS = 1 << 28


def chunk_rows(micro_batch: int, vocab_per_rank: int, tp: int) -> int:
    """Rows of this rank's sequence shard per chunk: the output layer sees ``tp`` times as many
    with sequence parallelism, and every row carries ``micro_batch x vocab_per_rank`` logits."""
    return max(1, CHUNK_ELEMENTS // (micro_batch * vocab_per_rank * tp))


def logits_elements(local_rows: int, micro_batch: int, vocab_per_rank: int, tp: int) -> int:
    """Logits elements alive at once: one chunk's, or all of them when they fit one chunk."""
    rows = min(local_rows, chunk_rows(micro_batch, vocab_per_rank, tp))
    return rows * tp * micro_batch * vocab_per_rank


def fused_loss_bytes(tokens: int, vocab: int, hidden: int, dtype_bytes: int) -> int:
    """Peak memory of the fused loss for ``tokens`` rows. Alive from the loss's forward to its
    backward: ``grad_x [tokens, h]`` in the compute dtype, the fp32 ``grad_W [V, h]`` and per
    token the fp32 loss and mask and the int64 label. On top of them, the larger of one chunk's
    logits in the compute dtype with its fp32 LSE (forward) and the compute-dtype copy of
    ``grad_W`` that the backward returns (none for fp32 weights)."""
    rows = min(tokens, chunk_rows_for(vocab))
    kept = tokens * (16 + hidden * dtype_bytes) + vocab * hidden * 4
    return kept + max(rows * (vocab * dtype_bytes + 4), vocab * hidden * dtype_bytes if dtype_bytes != 4 else 0)


def fused_loss_settings(tp_size: int, settings) -> bool:
    """Whether the run's settings (Megatron's arguments or its ``TransformerConfig``) allow the
    fused linear + cross entropy: TP 1, logits unscaled (no MuP), and the embedding's weight
    gradient not deferred to the pipeline schedule. The memory estimate asks this too."""
    return (
        tp_size == 1
        and not getattr(settings, "use_mup", False)
        and not getattr(settings, "defer_embedding_wgrad_compute", False)
    )


def fused_loss_applies(output_layer, loss_mask, config) -> bool:
    """Whether :func:`chunked_lm_loss` takes the fused linear + cross entropy: the settings
    allow it (:func:`fused_loss_settings`), the output layer is Megatron's own column-parallel
    one (not TE's MXFP8 one) without bias, and the loss mask is given (its weight gradient
    needs it)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return (
        loss_mask is not None
        and config is not None
        and isinstance(output_layer, ColumnParallelLinear)
        and fused_loss_settings(output_layer.tp_group.size(), config)
        and output_layer.bias is None
    )


def chunked_lm_loss(
    *,
    hidden_states,
    output_layer,
    output_weight,
    labels,
    compute_language_model_loss,
    scale_logits,
    runtime_gather_output=None,
    loss_mask=None,
    config=None,
    **_,
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of ``hidden_states`` ``[s_local, b, h]`` (the sequence shard
    of this TP rank under sequence parallelism), as ``GPTModel._postprocess`` computes it."""
    if labels is None:
        raise ValueError("chunked_lm_loss computes the training loss: call the model with labels")
    if fused_loss_applies(output_layer, loss_mask, config):
        weight = output_layer.weight if output_weight is None else output_weight
        with part_range("loss"):
            return linear_cross_entropy(
                hidden_states, weight, labels, loss_mask, chunk_rows=chunk_rows_for(weight.shape[0])
            )

    def loss_of(hidden, chunk_labels):
        with part_range("loss"):
            logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return compute_language_model_loss(chunk_labels, scale_logits(logits))

    chunks = row_chunks(hidden_states, labels, output_layer, output_layer.output_size_per_partition)
    if len(chunks) == 1:
        return loss_of(hidden_states, labels)
    return sequence_order([checkpoint(loss_of, *chunk, use_reentrant=False) for chunk in chunks], output_layer)


def _row_ranks(output_layer) -> int:
    """The TP ranks whose rows the output layer gathers (sequence parallelism), else 1."""
    return output_layer.tp_group.size() if output_layer.sequence_parallel else 1


def row_chunks(hidden_states, labels, output_layer, vocab_per_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``hidden_states`` ``[s_local, b, h]`` in chunks of rows whose logits (``vocab_per_rank``
    per row) fit :data:`CHUNK_ELEMENTS`, each with its labels ``[b, rows]`` in the order the
    output layer emits the chunk's rows. With sequence parallelism the output layer gathers a
    chunk's rows ``[r0, r1)`` from every TP rank's shard, rank-major."""
    rows, batch = hidden_states.shape[:2]
    tp = _row_ranks(output_layer)
    step = chunk_rows(batch, vocab_per_rank, tp)
    shards = labels.view(batch, tp, rows)
    return [(hidden_states[r0 : r0 + step], shards[:, :, r0 : r0 + step].flatten(1)) for r0 in range(0, rows, step)]


def sequence_order(per_chunk: list[torch.Tensor], output_layer) -> torch.Tensor:
    """Per-row results ``[b, rows]`` of :func:`row_chunks`'s chunks back as ``[b, s]`` in the
    labels' order."""
    batch, tp = per_chunk[0].shape[0], _row_ranks(output_layer)
    return torch.cat([result.view(batch, tp, -1) for result in per_chunk], dim=2).flatten(1)
