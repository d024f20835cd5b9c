"""Autograd function launching the tile + bar Triton kernels."""

from __future__ import annotations

import torch
import triton

from .block_bar import LOG2E, _bar_dkdv_kernel, _dq_kernel, _fwd_kernel, _tile_dkdv_kernel
from .layout import KernelLayout


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output is allocated here (uninitialised); tests poison it."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_options(block: int) -> dict:
    return {"num_warps": 8 if block >= 128 else 4, "num_stages": 2}


def _common(q: torch.Tensor, k: torch.Tensor, layout: KernelLayout) -> dict:
    b, s, h, d = q.shape
    return {
        "S": s,
        "H": h,
        "HKV": k.shape[2],
        "LB": layout.tiles.shape[0],
        "LH": layout.tiles.shape[1],
        "HEAD_DIM": d,
        "D_PAD": max(16, triton.next_power_of_2(d)),
        "BLOCK": layout.block,
        # fp32 inputs get exact fp32 products; 16-bit inputs use the tensor cores as they are.
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


class TritonBlockBarAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: KernelLayout, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, s, h, d = q.shape
        n_qb = layout.tiles.shape[2]
        out = new_buffer(q.shape, q.dtype, q.device)
        lse = new_buffer((b, h, s), torch.float32, q.device)
        cols = layout.columns if layout.has_bars else layout.tiles
        col_cnt = layout.column_count if layout.has_bars else layout.tile_count
        _fwd_kernel[(n_qb, b * h)](
            q, k, v, out, lse, layout.tiles, layout.tile_count, cols, col_cnt,
            NQB=n_qb, T_MAX=layout.tiles.shape[3], C_MAX=cols.shape[-1], qk_scale=scale * LOG2E,
            HAS_BARS=layout.has_bars, **_common(q, k, layout), **_launch_options(layout.block),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        b, s, h, d = q.shape
        hkv = k.shape[2]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse
        delta = delta.contiguous()
        common = _common(q, k, layout)
        opts = _launch_options(layout.block)
        n_qb, n_kb = layout.tiles.shape[2], layout.tiles_t.shape[2]
        cols = layout.columns if layout.has_bars else layout.tiles
        col_cnt = layout.column_count if layout.has_bars else layout.tile_count

        dq = new_buffer(q.shape, q.dtype, q.device)
        _dq_kernel[(n_qb, b * h)](
            q, k, v, dout, lse, delta, dq, layout.tiles, layout.tile_count, cols, col_cnt,
            NQB=n_qb, T_MAX=layout.tiles.shape[3], C_MAX=cols.shape[-1], qk_scale=scale * LOG2E, sm_scale=scale,
            HAS_BARS=layout.has_bars, **common, **opts,
        )  # fmt: skip

        if layout.has_bars:
            v_max = layout.vertical.shape[-1]
            bar_dk = new_buffer((b * h, v_max, common["D_PAD"]), torch.float32, q.device)
            bar_dv = new_buffer(bar_dk.shape, torch.float32, q.device)
            _bar_dkdv_kernel[(triton.cdiv(v_max, layout.block), b * h)](
                q, k, v, dout, lse, delta, layout.vertical, layout.active, bar_dk, bar_dv,
                S=s, H=h, HKV=hkv, NQB=n_qb, V_MAX=v_max, qk_scale=scale * LOG2E, sm_scale=scale,
                HEAD_DIM=d, D_PAD=common["D_PAD"], BLOCK=layout.block, PRECISION=common["PRECISION"], **opts,
            )  # fmt: skip
            vert, vptr = layout.vertical, layout.vertical_ptr
        else:
            v_max, bar_dk, bar_dv, vert, vptr = 1, delta, delta, layout.tile_count, layout.tile_count

        dk, dv = new_buffer(k.shape, k.dtype, k.device), new_buffer(v.shape, v.dtype, v.device)
        _tile_dkdv_kernel[(n_kb, b * hkv)](
            q, k, v, dout, lse, delta, dk, dv, layout.tiles_t, layout.tile_t_count, bar_dk, bar_dv, vert, vptr,
            NKB=n_kb, T_MAX=layout.tiles_t.shape[3], V_MAX=v_max, qk_scale=scale * LOG2E, sm_scale=scale,
            HAS_BARS=layout.has_bars, **common, **opts,
        )  # fmt: skip
        return dq, dk, dv, None, None
