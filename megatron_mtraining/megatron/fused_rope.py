"""Rotary position embedding in one pass (Triton), for Megatron without Transformer Engine.

Megatron's own RoPE without Transformer Engine (``rope_utils._apply_rotary_pos_emb_bshd``)
runs as five elementwise passes over q and k (cos, sin, two products and the concatenations
of ``_rotate_half``) in the forward and as many in the backward; Megatron's fused kernel is
Transformer Engine's, and YaRN (the long-context recipes) never uses it. ``FusedRoPE`` reads
each row once and writes it once, in either direction, for plain and YaRN RoPE alike
(``mscale``). The angles are applied in fp32 and rounded once (Megatron rounds cos and sin to
the input dtype first), so results differ from the unfused path by the input dtype's
rounding. ``megatron_mtraining.patches.fused_rope`` puts it in Megatron's place on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, f_ptr, y_ptr,
    B, H, D, HALF,
    sxs, sxb, sxh, sfs, sys_, syb, syh,
    mscale,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    # One program per (token, batch row): every head of it. y1 = x1 c1 - x2 s1 and
    # y2 = x2 c2 + x1 s2 with (c, s) of the angles of the first and second half; the
    # backward applies the transpose (the sines' signs swap sides).
    row = tl.program_id(0)
    s, b = row // B, row % B
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_R)[None, :]
    mask = (heads < H) & (cols < HALF)
    f1 = tl.load(f_ptr + s * sfs + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    f2 = tl.load(f_ptr + s * sfs + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    c1, s1 = tl.cos(f1) * mscale, tl.sin(f1) * mscale
    c2, s2 = tl.cos(f2) * mscale, tl.sin(f2) * mscale
    x = x_ptr + s * sxs + b * sxb + heads * sxh
    y = y_ptr + s * sys_ + b * syb + heads * syh
    x1 = tl.load(x + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y + cols, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y + HALF + cols, y2.to(y_ptr.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:  # dimensions past the rotary ones pass through
        rest = 2 * HALF + tl.arange(0, BLOCK_P)[None, :]
        keep = (heads < H) & (rest < D)
        tl.store(y + rest, tl.load(x + rest, mask=keep, other=0.0), mask=keep)


def _launch(x: torch.Tensor, freqs: torch.Tensor, mscale: float, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    s, b, h, d = x.shape
    half = freqs.shape[-1] // 2
    out = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    rest = d - 2 * half
    _rope_kernel[(s * b,)](
        x, freqs, out, b, h, d, half,
        x.stride(0), x.stride(1), x.stride(2), freqs.stride(0), out.stride(0), out.stride(1), out.stride(2),
        float(mscale),
        BACKWARD=backward, BLOCK_H=triton.next_power_of_2(h), BLOCK_R=triton.next_power_of_2(half),
        BLOCK_P=triton.next_power_of_2(rest) if rest else 0, num_warps=4,
    )  # fmt: skip
    return out


class FusedRoPE(torch.autograd.Function):
    """``t [s, b, h, d]`` rotated by ``freqs [s, 1, 1, r]`` (``r <= d`` even, the angles of
    the two halves; dimensions past ``r`` pass through), times ``mscale``."""

    @staticmethod
    def forward(ctx, t, freqs, mscale: float):
        ctx.save_for_backward(freqs)
        ctx.mscale = mscale
        return _launch(t, freqs, mscale, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _launch(grad, freqs, ctx.mscale, backward=True), None, None


def serves(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether ``FusedRoPE`` computes Megatron's non-interleaved bshd RoPE of these inputs."""
    return (
        t.dim() == 4
        and freqs.dim() == 4
        and freqs.shape[1] == freqs.shape[2] == 1
        and freqs.shape[0] == t.shape[0]
        and freqs.shape[-1] % 2 == 0
        and freqs.shape[-1] <= t.shape[-1]
        and freqs.stride(-1) == 1
        and freqs.dtype == torch.float32
    )
