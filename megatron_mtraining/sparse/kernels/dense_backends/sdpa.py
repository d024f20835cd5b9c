"""PyTorch's fused attention behind ``sparse_attention`` for whole causal attention (a
``DenseIndex``): cuDNN's kernels on Hopper and later, PyTorch's FlashAttention-2 on Ampere
(sm80), and on a CPU PyTorch's flash kernel for the CPU (for tests; ``auto`` keeps the
reference path there).

This is what a user who picks ``dense`` gets on a GPU without context parallelism, so that
choosing the plugin never loses to plain PyTorch attention: the plugin's Triton kernel serves
the calls these cannot (ring steps, which need token positions).

The fused ops return the LSE but do not differentiate it, and merging partial results
(``merge_attention_outputs``) needs that gradient. ``SDPAAttention`` therefore builds the op's
own autograd graph inside its forward and replays it in the backward when only ``out``
carries a gradient (the usual case: Megatron's core attention drops the LSE); with an LSE
gradient the backward runs on the dense Triton kernels, whose softmax gradient takes it
(as ``flash_attn`` does).
"""

from __future__ import annotations

import torch

from ...index import DenseIndex, SparseIndex
from .. import triton_available
from ..block_bar.tables import tile_tables

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
REQUIREMENTS = "a DenseIndex on fp16/bf16 inputs whose head dim is a multiple of 8 up to 256"
# cuDNN's fused attention beats PyTorch's FlashAttention-2 on Hopper by ~1.7x (the project's
# ANCHORS.md); on Ampere FlashAttention-2 is the proven kernel.
CUDNN_MIN_CAPABILITY = (9, 0)


def unsupported(q: torch.Tensor, index: SparseIndex) -> str | None:
    """Why PyTorch's fused attention cannot compute ``sparse_attention(q, k, v, index)``, or
    None when it can."""
    if not isinstance(index, DenseIndex):
        return f"got a {type(index).__name__}"
    if index.documents is not None:
        return "got packed documents (cu_seqlens), which this backend is not given"
    if q.dtype not in DTYPES:
        return f"got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
        return f"got head dim {q.shape[-1]}"
    return None


def fused_kernel(q: torch.Tensor) -> str:
    """Which fused op runs for ``q``: ``cudnn``, ``flash`` (CUDA) or ``flash_cpu``."""
    if not q.is_cuda:
        return "flash_cpu"
    if torch.cuda.get_device_capability(q.device) >= CUDNN_MIN_CAPABILITY and torch.backends.cudnn.is_available():
        return "cudnn"
    return "flash"


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[B, S, Hq, D]``, lse fp32 ``[B, Hq, S]``) of causal attention through PyTorch's
    fused op, differentiable in ``out`` by the op's registered derivative."""
    b, s, hq, _ = q.shape
    group = hq // k.shape[2]
    if group > 1:
        # The fused ops take as many K/V heads as query heads; a query head's group is
        # head // group (Megatron's GQA order), which repeat_interleave reproduces.
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kind = fused_kernel(q)
    if kind == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, True, False, scale=scale
        )[:2]
    elif kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, True, scale=scale)
    return out.transpose(1, 2), lse.reshape(b, hq, s).float()


class SDPAAttention(torch.autograd.Function):
    """``(q, k, v, scale) -> (out, lse fp32 [B, Hq, S])`` of causal attention on PyTorch's
    fused op, differentiable in both outputs (see the module docstring). Callers check
    ``unsupported`` first."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        needs_grad = any(ctx.needs_input_grad[:3])
        with torch.enable_grad() if needs_grad else torch.no_grad():
            inputs = tuple(t.detach().requires_grad_(needs_grad) for t in (q, k, v))
            out, lse = _fused(*inputs, scale)
        if needs_grad:
            # The op's graph, replayed by the backward; kept on ctx because saved tensors
            # cannot carry a graph.
            ctx.graph = (inputs, out)
            ctx.save_for_backward(q, k, v, out.detach(), lse)
            ctx.scale = scale
        ctx.set_materialize_grads(False)
        return out.detach(), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        inputs, graph_out = ctx.graph
        q, k, v, out, lse = ctx.saved_tensors
        if dlse is None:
            grads = torch.autograd.grad(graph_out, inputs, dout)
            del ctx.graph
            return *grads, None
        del ctx.graph
        if not triton_available():
            raise RuntimeError("a gradient through the LSE of the 'sdpa' backend needs the Triton kernels")
        from ..block_bar.attention import kernel_backward  # imports Triton

        if dout is None:  # only the LSE reached the loss
            dout = torch.zeros_like(out)
        b, s, h, _ = q.shape
        tables = tile_tables(DenseIndex(b, h, s, device=q.device))
        return *kernel_backward(q, k, v, tables, ctx.scale, out, lse, dout, dlse), None
