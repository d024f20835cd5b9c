"""flash-attn 2 behind ``sparse_attention`` for whole causal attention (a ``DenseIndex``),
where it is installed (optional: the project's GPU machines do not have it).

``unsupported`` says why a call cannot run on it (``attention.dense_backend`` decides with
it); ``FlashAttention`` is the autograd function. flash-attn's own (``flash_attn_func``)
returns the LSE but drops its gradient, which merging partial results needs
(``merge_attention_outputs``, the ring's callers), so this one calls flash-attn's forward and
backward directly and sends a backward with an LSE gradient to the dense Triton kernels,
whose softmax gradient takes it: ``dS = P * (dP - rowsum(dO * O) + dLSE)``. flash-attn's
backward computes ``rowsum(dO * O)`` itself from the ``out`` it is given, with no input
for ``dLSE``.
"""

from __future__ import annotations

import functools
import re
from types import ModuleType

import torch

from ...index import DenseIndex, SparseIndex
from .. import triton_available
from ..block_bar.tables import tile_tables

# flash-attn 2.7 gave ``_flash_attn_forward`` / ``_flash_attn_backward`` the signatures
# called below (split window sizes, four forward results); earlier versions differ.
MIN_VERSION = (2, 7)
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
REQUIREMENTS = (
    "a DenseIndex on CUDA fp16/bf16 inputs whose head dim is a multiple of 8 up to 256, with flash-attn >= 2.7 "
    "and Triton installed"
)


@functools.cache
def interface() -> tuple[ModuleType | None, str]:
    """(flash-attn's ``flash_attn_interface`` module, "") where it imports at a version whose
    functions this module calls correctly, else (None, why not). Cached, since a missing
    package would otherwise be searched for on every attention call."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError as e:
        return None, f"flash-attn is not installed here ({e})"
    version = str(getattr(flash_attn, "__version__", "of unknown version"))
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < MIN_VERSION:
        return None, f"flash-attn {version} is installed"
    return flash_attn_interface, ""


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device, where flash-attn's kernels run. A predicate of its
    own so that the CPU tests can run the adapter against a stand-in flash-attn."""
    return t.is_cuda


def unsupported(q: torch.Tensor, index: SparseIndex) -> str | None:
    """Why flash-attn cannot compute ``sparse_attention(q, k, v, index)``, or None when it
    can. Only a ``DenseIndex`` qualifies: telling that another index covers the whole
    causal triangle would read it on the host. Head dims are those flash-attn's kernels
    take without padding. Triton is required because the LSE gradient's backward runs on
    the dense kernels."""
    if not isinstance(index, DenseIndex):
        return f"got a {type(index).__name__}"
    if index.documents is not None:
        return "got packed documents (cu_seqlens), which this backend is not given"
    module, why_not = interface()
    if module is None:
        return why_not
    if not on_cuda(q):
        return f"got inputs on {q.device}"
    if q.dtype not in DTYPES:
        return f"got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
        return f"got head dim {q.shape[-1]}"
    if not triton_available():
        return "Triton is not installed here"
    return None


# Arguments that make flash-attn compute what ``sparse_attention`` promises: causal, exact
# (no dropout, soft-capping, ALiBi or sliding window).
_EXACT_CAUSAL = {
    "dropout_p": 0.0,
    "causal": True,
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
}


class FlashAttention(torch.autograd.Function):
    """``(q, k, v, scale) -> (out, lse fp32 [B, Hq, S])`` of causal attention on flash-attn,
    differentiable in both outputs (see the module docstring). Callers check ``unsupported``
    first."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        out, lse, _, _ = interface()[0]._flash_attn_forward(
            q, k, v, softmax_scale=scale, return_softmax=False, **_EXACT_CAUSAL
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        # An unused output's gradient then arrives as None rather than zeros, so a caller
        # that ignores the LSE (Megatron's core attention) gets flash-attn's backward.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dlse is None:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            # Deterministic, as the Triton kernels' backward is: ``auto`` picks flash-attn for
            # dense attention, and that must not cost a run its bitwise reproducibility.
            interface()[0]._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=ctx.scale, deterministic=True, **_EXACT_CAUSAL
            )
            return dq, dk, dv, None
        from ..block_bar.attention import kernel_backward  # imports Triton

        if dout is None:  # only the LSE reached the loss
            dout = torch.zeros_like(out)
        b, s, h, _ = q.shape
        tables = tile_tables(DenseIndex(b, h, s, device=q.device))
        return *kernel_backward(q, k, v, tables, ctx.scale, out, lse, dout, dlse), None
