"""Launches of the sparse KL kernels and the autograd function that skips the KL forward.

:class:`FusedMSAKL` computes only ``LSE_idx`` in its forward and returns a zero scalar
that carries the graph: the loss is there to be differentiated, and its value, which the
dQ kernel computes for free from the same probabilities, is handed to ``on_value`` in
the backward (a 0-dim fp32 tensor on the device, never read by the host here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ..block_bar.attention import _positions, _row_selection
from ..block_bar.tables import TileTables
from ..shared import buffers
from ..shared.kernels import LOG2E
from .kernels import _dk_kl_kernel, _dq_kl_kernel, _index_lse_kernel


@dataclass(frozen=True)
class LaunchConfig:
    """``block_m`` query rows per program (LSE, dQ) or per step (dK); ``block_n`` keys per
    step (LSE, dQ) or per program (dK); each is capped at the tile size."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_config(kernel: str, block: int, group_pad: int) -> LaunchConfig:
    """Rows x heads of about 128 in the packed teacher product (64 rows without GQA, whose
    dq_idx accumulator then stays small; at least 16 rows, the smallest ``tl.dot``, so
    wide groups pack more, with 32-key steps), else 64-key steps; two pipeline stages (a K
    and an index-K tile a stage: 32 KiB at head dims 128 in 16 bits, within an A100's
    shared memory). Chosen, not yet tuned on a GPU."""
    if kernel == "lse":
        return LaunchConfig(min(block, 128), min(block, 64), 8 if block >= 128 else 4, 2)
    rows = min(block, 64 if group_pad == 1 else max(16, 128 // group_pad))
    packed = rows * group_pad
    return LaunchConfig(rows, min(block, 32 if packed > 128 else 64), 8 if packed >= 128 else 4, 2)


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _common(q_idx: torch.Tensor, k_idx: torch.Tensor, tables: TileTables) -> dict:
    b, s, hkv, di = q_idx.shape
    return {
        "S": s,
        "SK": k_idx.shape[1],
        "HKV": hkv,
        "TB": tables.tiles.shape[0],
        "TH": tables.tiles.shape[1],
        "DI": di,
        "DI_PAD": _pad(di),
        "BLOCK": tables.block,
        "PRECISION": "ieee" if q_idx.dtype == torch.float32 else "tf32",
        **_row_selection(tables),
        **_positions(tables),
    }


def index_lse(q_idx: torch.Tensor, k_idx: torch.Tensor, tables: TileTables) -> torch.Tensor:
    """``[B, Hkv, S]`` fp32 logsumexp of ``q_idx . k_idx / sqrt(d_idx)`` over each row's
    visible selected keys (``tables``; keys ``k_idx [B, SK, 1, d_idx]`` may be a ring
    step's chunk); -inf where none."""
    q_idx, k_idx = q_idx.contiguous(), k_idx.contiguous()
    b, s, hkv, di = q_idx.shape
    cfg = launch_config("lse", tables.block, 1)
    lse = buffers.new_buffer((b, hkv, s), torch.float32, q_idx.device)
    n_qb = tables.tiles.shape[2]
    _index_lse_kernel[(n_qb * (tables.block // cfg.block_m), b * hkv)](
        q_idx, k_idx, lse, tables.tiles, tables.tile_count,
        NQB=n_qb, T_MAX=tables.tiles.shape[3], idx_scale=LOG2E / math.sqrt(di), BLOCK_N=cfg.block_n,
        BLOCK_M=cfg.block_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_common(q_idx, k_idx, tables),
    )  # fmt: skip
    return lse


def kl_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    lse_idx: torch.Tensor,
    tables: TileTables,
    scale: float,
    grad: torch.Tensor,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_idx, dk_idx, per-row KL ``[B, Hkv, S]`` fp32) of ``grad * sum_rows KL / rows``.

    q ``[B, S, Hq, D]`` and its main-pass ``lse [B, Hq, S]``; k ``[B, SK, Hkv, D]``;
    q_idx ``[B, S, Hkv, d_idx]`` with ``lse_idx`` from :func:`index_lse` (merged over the
    steps of a ring); k_idx ``[B, SK, 1, d_idx]``; ``grad`` a one-element tensor."""
    q, k, q_idx, k_idx = (t.contiguous() for t in (q, k, q_idx, k_idx))
    lse, lse_idx = lse.float().contiguous(), lse_idx.float().contiguous()
    b, s, hq, d = q.shape
    hkv, di = q_idx.shape[2], q_idx.shape[3]
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    scalars = {
        "HQ": hq,
        "G": group,
        "qk_scale": scale * LOG2E,
        "idx_scale": LOG2E / math.sqrt(di),
        "inv_g": 1.0 / group,
        "grad_scale": 1.0 / (rows * math.sqrt(di)),
        "HEAD_DIM": d,
        "D_PAD": _pad(d),
        "G_PAD": g_pad,
        **_common(q_idx, k_idx, tables),
    }
    grad = grad.detach().float().reshape(1).contiguous()
    dq_idx = buffers.new_buffer(q_idx.shape, q_idx.dtype, q.device)
    kl = buffers.new_buffer((b, hkv, s), torch.float32, q.device)
    cfg = launch_config("dq", tables.block, g_pad)
    n_qb = tables.tiles.shape[2]
    _dq_kl_kernel[(n_qb * (tables.block // cfg.block_m), b * hkv)](
        q, k, lse, q_idx, k_idx, lse_idx, grad, dq_idx, kl, tables.tiles, tables.tile_count,
        NQB=n_qb, T_MAX=tables.tiles.shape[3], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **scalars,
    )  # fmt: skip
    dk_idx = buffers.new_buffer(k_idx.shape, k_idx.dtype, q.device)
    cfg = launch_config("dk", tables.block, g_pad)
    n_kb = tables.tiles_t.shape[2]
    _dk_kl_kernel[(n_kb * (tables.block // cfg.block_n), b)](
        q, k, lse, q_idx, k_idx, lse_idx, grad, dk_idx, tables.tiles_t, tables.tile_t_count,
        NKB=n_kb, T_MAX=tables.tiles_t.shape[3], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **scalars,
    )  # fmt: skip
    return dq_idx, dk_idx, kl


class FusedMSAKL(torch.autograd.Function):
    """``KL(teacher || student)`` averaged over ``rows`` (B * S * Hkv on one device) with the
    forward skipped: returns a zero fp32 scalar whose gradient is the KL's. Gradients reach
    ``q_idx`` and ``k_idx`` only; ``on_value(kl)`` receives the KL in the backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, lse, tables: TileTables, scale: float, rows: int, on_value):
        lse_idx = index_lse(q_idx, k_idx, tables)
        ctx.save_for_backward(q_idx, k_idx, q.detach(), k.detach(), lse.detach(), lse_idx)
        ctx.tables, ctx.scale, ctx.rows, ctx.on_value = tables, scale, rows, on_value
        return torch.zeros((), dtype=torch.float32, device=q_idx.device)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, q, k, lse, lse_idx = ctx.saved_tensors
        dq_idx, dk_idx, kl = kl_backward(q, k, lse, q_idx, k_idx, lse_idx, ctx.tables, ctx.scale, grad, ctx.rows)
        if ctx.on_value is not None:
            ctx.on_value(kl.sum() / ctx.rows)
        return dq_idx, dk_idx, None, None, None, None, None, None, None


def fused_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    tables: TileTables,
    scale: float,
    on_value: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """:class:`FusedMSAKL` on one device: the mean over ``B * S * Hkv`` rows."""
    b, s, hkv, _ = q_idx.shape
    return FusedMSAKL.apply(q_idx, k_idx, q, k, lse, tables, scale, b * s * hkv, on_value)
