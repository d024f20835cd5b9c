"""Per-GPU memory estimate of a run, from its validated Megatron arguments and attention config.

Printed by ``--dry-run`` and at the start of every real run; ``tests/test_configs.py`` checks
the parameter count against a real ``GPTModel`` built from the plugin's spec (exact) and that
every recipe in ``configs/`` fits its GPU.

Sources of the formulas:

* Parameters: the modules of Megatron's GPT layer spec (``megatron.core.models.gpt``): RMSNorm /
  LayerNorm weights, ``linear_qkv`` of ``(Hq + 2 Hkv) d`` outputs (GQA), ``linear_proj``, SwiGLU's
  doubled ``fc1``, the MSA index branch (``patterns/msa.py``: ``h -> Hkv d_idx`` and ``h -> d_idx``,
  no bias), the embedding and the untied output layer. Column/row-parallel linears and the
  vocabulary are split over TP; norms and the index branch are replicated.
* Weights, gradients, optimizer: Megatron's mixed precision with Adam keeps bf16/fp16 weights,
  gradients in the parameter dtype (fp32 with ``accumulate_allreduce_grads_in_fp32``) and
  12 bytes per parameter of fp32 master weight + two moments, plus an fp32 copy of the
  gradients (4 bytes) when they are 16-bit (Megatron's distributed-optimizer table: 16 / d
  for 16-bit gradients, 12 / d for fp32 ones). The distributed optimizer shards those bytes
  over the data-parallel group *with* context parallelism (Megatron's
  ``intra_distributed_optimizer_instance_group`` is the DP x CP group).
* Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (2022), Sec. 4: ``s b h (34 + 5 a s / h)`` bytes per layer, divided by ``t`` with
  sequence parallelism. We redo their per-tensor count for this model family: no dropout
  (the sparse attention has none; their masks vanish), RMSNorm, GQA and SwiGLU with
  ``ffn_hidden_size f``, and attention kernels that keep only q, k, v, the output and an fp32
  LSE (flash-style), so their ``5 a s^2 b`` term is absent. Per layer, in 2-byte elements:
  two norm inputs (2 h), the QKV input (h), q/k/v ``(Hq + 2 Hkv) d``, the projection input
  (``Hq d``), the MLP input (h), fc1's output (2 f) and SwiGLU's output (f); plus the LSE
  (4 bytes x Hq). ``s`` is the *local* sequence, ``seq_length / cp``.
  Full recompute keeps only each layer's input and index (kept for the recompute) plus one
  layer's working set; selective recompute (``core_attn``) drops the attention's LSE.
* Attention's own memory: sparse attention keeps O(S) state plus its index; the MSA / MoBA
  top-k index rows span the whole sequence on every rank (docs/ARCHITECTURE.md, "Current
  limits"), int64 ``S_global x heads x k``; vertical-slash indices are O(heads x cap).
* All-gathered K/V: where the attention gathers the whole sequence's K/V (``kv_exchange``;
  ``auto`` on a flat CP group inside a node), one layer at a time holds them in the compute
  dtype and, in its backward, their gradients in fp32 before the reduce-scatter. Gathered
  inside nodes (``allgather`` with a hierarchy), it keeps the whole sequence's K/V as well, and
  the gradients of two outer steps' node chunks.
* Logits and loss: at TP 1 (no MuP) the training step takes the fused linear + cross entropy
  (``linear_cross_entropy``, chosen by ``chunked_loss``): one chunk's logits in the compute
  dtype (2 bytes per element, overwritten by their gradient) with fp32 row statistics, and the
  gradients its forward computes and keeps until the backward: the hidden states' ``s b h`` in
  the compute dtype and the output weight's ``V h`` in fp32 (in the backward, with its
  compute-dtype copy in place of the logits chunk). Otherwise Megatron's output layer and
  cross entropy run on chunks of rows: logits in the compute dtype plus the two fp32 buffers
  of Megatron's vocab-parallel cross-entropy, the logits less their maximum and their
  exponentials (the softmax kept for the backward): 10 bytes per element, all live at once
  at the loss, for one chunk's ``rows x b x V / t`` logits, not the last stage's ``s b V / t``.

Checked against a memory snapshot (``scripts/memory_snapshot_report.py``) of a 12-layer
Qwen2.5-3B-shaped run at 32K tokens on one GPU (docs/benchmarks.md): weights, gradients and
optimizer exact; activations + logits 5% above the measured transient, because the estimate
adds the recomputed layer's working set to the loss's peak, which come at different times.
All figures are allocated tensors; ``OVERHEAD_GIB`` covers the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..planning.hardware import gpu, gpu_names
from .chunked_loss import fused_loss_bytes, fused_loss_settings, logits_elements

GIB = 1024**3
# Allocator fragmentation (3.0 GiB measured with expandable segments, which the entry point
# turns on: 12.6 GiB without) plus the CUDA context, NCCL buffers and kernel workspaces.
OVERHEAD_GIB = 4.0
# The GPUs a recipe's ``cluster.gpu`` may name (planning/calibration/hardware.json).
GPU_MEMORY_GIB = {name: gpu(name).memory_gb * 1e9 / GIB for name in gpu_names()}


def padded_vocab_size(args) -> int:
    """The embedding's rows: ``padded_vocab_size`` when set (a recipe's, or the tokenizer's once
    Megatron built it), else ``vocab_size`` padded as Megatron pads it."""
    if args.padded_vocab_size is not None:
        return args.padded_vocab_size
    if args.vocab_size is None:
        raise ValueError(
            "the memory estimate needs megatron.padded_vocab_size (the checkpoint's embedding rows, e.g. 151936) "
            "or megatron.vocab_size"
        )
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil(args.vocab_size / multiple) * multiple


@dataclass
class ParameterCount:
    """Parameter counts of the whole model (``total``) and of the largest rank's shard."""

    embedding: int
    layer: int
    final_norm: int
    output: int
    num_layers: int
    per_rank: int = field(default=0)

    @property
    def total(self) -> int:
        return self.embedding + self.num_layers * self.layer + self.final_norm + self.output


def count_parameters(args, attention) -> ParameterCount:
    """Parameters of Megatron's GPT with the plugin's spec for these arguments (exact for the
    local and TE specs: TE fuses the input norm into ``linear_qkv`` with the same weights)."""
    h, t = args.hidden_size, args.tensor_model_parallel_size
    hq, hkv, d = args.num_attention_heads, args.num_query_groups or args.num_attention_heads, args.kv_channels
    f = args.ffn_hidden_size
    norm = h if args.normalization == "RMSNorm" else 2 * h
    linear_bias = args.add_bias_linear
    qkv_out = (hq + 2 * hkv) * d
    qkv = h * qkv_out + (qkv_out if (args.add_qkv_bias or linear_bias) else 0)
    proj = hq * d * h + (h if linear_bias else 0)
    fc1_out = 2 * f if args.swiglu else f
    fc1 = h * fc1_out + (fc1_out if linear_bias else 0)
    fc2 = f * h + (h if linear_bias else 0)
    qk_norm = (2 * d if args.normalization == "RMSNorm" else 4 * d) if args.qk_layernorm else 0
    index = attention.pattern_class.index_parameters(attention.settings, h, hkv)
    layer = 2 * norm + qkv + proj + fc1 + fc2 + qk_norm + index
    vocab = padded_vocab_size(args)
    embedding = vocab * h + (
        args.max_position_embeddings * h if args.position_embedding_type == "learned_absolute" else 0
    )
    output = vocab * h if args.untie_embeddings_and_output_weights else 0
    count = ParameterCount(embedding, layer, norm, output, args.num_layers)
    # Largest shard: the first pipeline stage (embedding) or, with PP 1, the whole stack.
    layers_per_stage = math.ceil(args.num_layers / args.pipeline_model_parallel_size)
    replicated_layer = 2 * norm + qk_norm + index + (h if linear_bias else 0) * 2
    sharded_layer = layer - replicated_layer
    stage = layers_per_stage * (sharded_layer / t + replicated_layer) + embedding / t
    if args.pipeline_model_parallel_size == 1:
        stage += norm + output / t
    count.per_rank = math.ceil(stage)
    return count


@dataclass
class MemoryEstimate:
    """Per-GPU memory in bytes by part; :meth:`report` prints it in GiB."""

    params: ParameterCount
    parts: dict[str, float]
    gpu_memory_gib: float | None
    notes: list[str]

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values()) / GIB + OVERHEAD_GIB

    def fits(self) -> bool | None:
        return None if self.gpu_memory_gib is None else self.total_gib <= self.gpu_memory_gib

    def report(self) -> str:
        lines = [
            f"[mtraining] memory estimate per GPU (parameters: {self.params.total:,} total, "
            f"{self.params.per_rank:,} on the largest rank)"
        ]
        lines += [f"  {name:<34s} {value / GIB:8.2f} GiB" for name, value in self.parts.items()]
        lines.append(f"  {'overhead (context, NCCL, fragments)':<34s} {OVERHEAD_GIB:8.2f} GiB")
        total = f"  {'total':<34s} {self.total_gib:8.2f} GiB"
        if self.gpu_memory_gib is not None:
            total += f" of {self.gpu_memory_gib:.1f} GiB: {'fits' if self.fits() else 'DOES NOT FIT'}"
        lines.append(total)
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def layer_activation_bytes(args, local_seq: int) -> float:
    """Saved activations of one transformer layer for one micro-batch at ``local_seq`` tokens
    (no recompute; see the module docstring for the per-tensor count)."""
    h, t, b = args.hidden_size, args.tensor_model_parallel_size, args.micro_batch_size
    hq, hkv, d = args.num_attention_heads, args.num_query_groups or args.num_attention_heads, args.kv_channels
    f = args.ffn_hidden_size
    fc1_out = 2 * f if args.swiglu else f
    elements = 2 * h + h + (hq + 2 * hkv) * d + hq * d + h + fc1_out + f
    # With sequence parallelism every saved tensor is split over TP; without it only the
    # tensor-parallel ones (q/k/v, projection input, fc1/fc2 activations) are.
    if not args.sequence_parallel:
        elements = 4 * h + ((hq + 2 * hkv) * d + hq * d + fc1_out + f) / t
    else:
        elements /= t
    return local_seq * b * (2 * elements + 4 * hq / t)


def attention_state_bytes(args, attention, local_seq: int) -> float:
    """The attention's own saved state per layer beyond q/k/v/out/LSE: its index."""
    hq = args.num_attention_heads
    hkv = args.num_query_groups or hq
    return attention.pattern_class.index_state_bytes(
        attention.settings, args.micro_batch_size, hq, hkv, args.seq_length, local_seq
    )


def loss_bytes(args, local_seq: int) -> float:
    """The output layer's and loss's memory at the last stage (see the module docstring)."""
    b, h, t = args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    vocab = padded_vocab_size(args)
    if fused_loss_settings(t, args):
        return fused_loss_bytes(local_seq * b, vocab, h, 2 if (args.bf16 or args.fp16) else 4)
    sp = t if args.sequence_parallel else 1
    return logits_elements(local_seq // sp, b, vocab // t, sp) * 10


def kv_exchange(attention, cp: int, tp: int, gpus_per_node: int | None) -> str:
    """How K/V reach the queries: ``single`` (no CP), ``hierarchical``, ``node_allgather``
    (an explicit ``allgather`` with a hierarchy: gathered inside nodes, ``node_gather``),
    ``ring`` or ``allgather``: ``ring_attention``'s ``auto`` takes the all-gather on a flat
    group whose ranks share a host (a CP group spans ``cp x tp`` consecutive ranks); without
    ``gpus_per_node`` only an explicit ``allgather`` counts."""
    if cp == 1:
        return "single"
    if attention.hierarchy and attention.hierarchy < cp:
        return "node_allgather" if attention.kv_exchange == "allgather" else "hierarchical"
    if attention.kv_exchange != "auto":
        return attention.kv_exchange
    return "allgather" if gpus_per_node and cp * tp <= gpus_per_node else "ring"


def estimate_memory(
    args, attention, gpu_memory_gib: float | None = None, gpus_per_node: int | None = None
) -> MemoryEstimate:
    """Per-GPU memory of a training step under ``args`` (validated Megatron arguments) on
    nodes of ``gpus_per_node`` GPUs (which decides whether K/V are all-gathered)."""
    params = count_parameters(args, attention)
    n = params.per_rank
    cp, t = args.context_parallel_size, args.tensor_model_parallel_size
    low_precision = args.bf16 or args.fp16
    weight_bytes = 2 if low_precision else 4
    grad_bytes = 4 if (args.accumulate_allreduce_grads_in_fp32 or not low_precision) else 2
    # fp32 copies of the weights and of 16-bit gradients (mixed precision only) + Adam's two moments.
    fp32_copy_bytes = (4 + (4 if grad_bytes == 2 else 0)) if low_precision else 0
    optimizer_bytes = fp32_copy_bytes + (8 if args.optimizer == "adam" else 4)
    shards = args.data_parallel_size * cp if args.use_distributed_optimizer else 1
    local_seq = args.seq_length // cp
    layers = math.ceil(args.num_layers / args.pipeline_model_parallel_size)
    layer = layer_activation_bytes(args, local_seq)
    attn_state = attention_state_bytes(args, attention, local_seq)
    b, h = args.micro_batch_size, args.hidden_size
    layer_input = local_seq * b * h * 2 / (t if args.sequence_parallel else 1)
    notes = []
    if args.recompute_granularity == "full":
        recomputed = args.recompute_num_layers if args.recompute_method == "block" else layers
        kept = layers - min(recomputed, layers)
        # Checkpointed layers keep their input and their index (``megatron/kept_indexes.py``);
        # one layer's working set is rebuilt at a time.
        activations = kept * (layer + attn_state) + min(recomputed, layers) * (layer_input + attn_state) + layer
        notes.append(f"full recompute ({args.recompute_method}, {recomputed} of {layers} layers)")
    elif args.recompute_granularity == "selective":
        lse = local_seq * b * 4 * args.num_attention_heads / t
        activations = layers * (layer - lse + attn_state)
        notes.append("selective recompute (core attention)")
    else:
        activations = layers * (layer + attn_state)
    # Pipeline: the first stage holds up to PP micro-batches in flight (1F1B).
    activations *= min(args.pipeline_model_parallel_size, _microbatches(args))
    logits = loss_bytes(args, local_seq)
    parts = {
        "weights": n * weight_bytes,
        "gradients": n * grad_bytes,
        f"optimizer (sharded /{shards})": n * optimizer_bytes / shards,
        f"activations (local seq {local_seq})": activations,
        "logits + loss": logits,
    }
    exchange = kv_exchange(attention, cp, t, gpus_per_node)
    # One layer's whole-sequence K/V in the compute dtype, and in its backward their dK/dV in
    # fp32 before the reduce-scatter: all of them (context_parallel/kv_allgather.py), or a
    # node's chunks of two outer steps, one being reduced while the next is computed
    # (context_parallel/node_gather.py).
    kv_tokens_bytes = b * 2 * ((args.num_query_groups or args.num_attention_heads) // t) * args.kv_channels
    if exchange == "allgather":
        parts["all-gathered K/V (whole sequence)"] = args.seq_length * kv_tokens_bytes * (2 + 4)
    elif exchange == "node_allgather":
        node_tokens = args.seq_length // (cp // attention.hierarchy)
        parts["node-gathered K/V (whole sequence kept)"] = (2 * args.seq_length + 2 * 4 * node_tokens) * kv_tokens_bytes
    notes.append(f"attention index state per layer: {attn_state / GIB:.3f} GiB ({attention.type})")
    return MemoryEstimate(params, parts, gpu_memory_gib, notes)


def _microbatches(args) -> int:
    return max(1, args.global_batch_size // (args.micro_batch_size * args.data_parallel_size))
