"""Launches of the sparse KL kernels and the autograd function that skips the KL forward.

:class:`FusedMSAKL` computes only ``LSE_idx`` in its forward and returns a zero scalar
that carries the graph: the loss is there to be differentiated, and its value, which the
backward computes for free from the same probabilities, is handed to ``on_value`` in
the backward (a 0-dim fp32 tensor on the device, never read by the host here). It runs a
:class:`KLOrder`: :class:`UnionOfTiles` (this module's launches) or the KV-outer order of a
sparse top-k index (``kv_loss.KVOuterKL``); ``dispatch.kl_kernel`` picks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import triton

from ...dispatch import kl_backward_passes, log_decision
from ..block_bar.attention import _documents, _positions, _row_selection
from ..block_bar.tables import TileTables
from ..shared import buffers
from ..shared.kernels import LOG2E
from .kernels import _dk_kl_kernel, _dq_kl_kernel, _index_lse_kernel

CONFIG_ENV = "MTRAINING_KL_CONFIG"


@dataclass(frozen=True)
class LaunchConfig:
    """``block_m`` query rows per program (LSE, dQ) or per step (dK, fused); ``block_n`` keys
    per step (LSE, dQ) or per program (dK, fused); each is capped at the tile size."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The table, per kernel: the fastest of ``scripts/bench_msa_kl.py --sweep`` on an H200
# summed over the dense (warmup) and top-k indices (docs/benchmarks.md).
# * lse: 128 rows, 64-key steps (one index product a step).
# * dq: 32 rows of one group, 128-key steps; each key step runs the G heads' products
#   [32, D] @ [D, 128] with the head's queries loop-invariant (in registers or L1).
# * dk: 128 keys a program, 64 query rows a step, the G heads' products streamed; one
#   stage (unpipelined): a pipelined stage would hold all G heads' queries.
# * fused (the one-pass backward, the dK kernel adding dq_idx by atomics): dk's 128 keys a
#   program, but 32 query rows a step and 4 warps, the fastest of a sweep on both indices.
#   Its step adds the product ds^T @ k_idx on operands the step holds already and the
#   atomics' [rows, d_idx] fp32 tile; one stage for dk's reason.
# Each entry fits an A100's shared memory for 16-bit inputs (scripts/compile_kernels.py);
# fp32 inputs of head dim 128 do not (``--dtype fp32``): they need smaller blocks through
# MTRAINING_KL_CONFIG.
DEFAULT_CONFIGS: dict[str, LaunchConfig] = {
    "lse": LaunchConfig(128, 64, 8, 2),
    "dq": LaunchConfig(32, 128, 8, 2),
    "dk": LaunchConfig(64, 128, 8, 1),
    "fused": LaunchConfig(32, 128, 4, 1),
}
# Pipeline stages of the dq and dk kernels' loop over a group's heads (``kernels._teacher``'s
# ``STAGES``; 0 unrolls it).
TEACHER_STAGES = 0


def parse_table(text: str | None, names, fields: tuple[str, ...], where: str) -> dict[str, tuple[int, ...]]:
    """``"name:1,2,...;name:..."`` as ``{name: the integers}``, ``name`` one of ``names`` and
    the integers one per ``fields`` (the syntax of this module's and ``kv_loss``'s launch
    overrides); an empty text is no override. ``where`` names the setting in errors."""
    out = {}
    for part in (text or "").replace(" ", "").split(";"):
        if not part:
            continue
        name, _, values = part.partition(":")
        numbers = values.split(",")
        if name not in names or len(numbers) != len(fields) or not all(n.isdigit() for n in numbers):
            raise ValueError(
                f"{where}: {part!r} is not name:{','.join(fields)} (name {'|'.join(names)}, non-negative integers)"
            )
        out[name] = tuple(int(n) for n in numbers)
    return out


def parse_configs(text: str | None) -> dict[str, LaunchConfig]:
    """``"dq:64,64,8,3;dk:64,64,8,1"`` (any of ``lse``, ``dq``, ``dk``, ``fused``; each
    ``block_m,block_n,num_warps,num_stages``) as a table; an empty text is no override."""
    fields = ("block_m", "block_n", "num_warps", "num_stages")
    out = {name: LaunchConfig(*v) for name, v in parse_table(text, DEFAULT_CONFIGS, fields, CONFIG_ENV).items()}
    for name, cfg in out.items():
        for n in (cfg.block_m, cfg.block_n):
            if n < 16 or n & (n - 1):
                raise ValueError(f"{CONFIG_ENV}: {name}: blocks must be powers of two >= 16, got {n}")
    return out


def launch_config(kernel: str, block: int) -> LaunchConfig:
    """The table's entry for ``kernel`` (``lse``, ``dq``, ``dk`` or ``fused``), overridden by
    ``MTRAINING_KL_CONFIG`` (read at each launch, so a sweep can change it in one process;
    see :func:`parse_configs`), with the blocks capped at the tile size ``block`` (and then
    at most 4 warps)."""
    cfg = parse_configs(os.environ.get(CONFIG_ENV)).get(kernel, DEFAULT_CONFIGS[kernel])
    m, n = min(block, cfg.block_m), min(block, cfg.block_n)
    warps = cfg.num_warps if (m, n) == (cfg.block_m, cfg.block_n) else min(cfg.num_warps, 4)
    return LaunchConfig(m, n, warps, cfg.num_stages)


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
        **_documents(tables),
    }


def index_lse(q_idx: torch.Tensor, k_idx: torch.Tensor, tables: TileTables) -> torch.Tensor:
    """``[B, Hkv, S]`` fp32 logsumexp of ``q_idx . k_idx / sqrt(d_idx)`` over each row's
    visible selected keys (``tables``; keys ``k_idx [B, SK, 1, d_idx]`` may be a ring
    step's chunk); -inf where none."""
    q_idx, k_idx = q_idx.contiguous(), k_idx.contiguous()
    b, s, hkv, di = q_idx.shape
    cfg = launch_config("lse", tables.block)
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
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_idx, dk_idx, per-row KL ``[B, Hkv, S]`` fp32) of ``grad * sum_rows KL / rows``, in
    one pass (:func:`kl_fused`) or two (:func:`kl_dq`, :func:`kl_dk`) as
    ``dispatch.kl_backward_passes`` says.

    q ``[B, S, Hq, D]`` and its main-pass ``lse [B, Hq, S]``; k ``[B, SK, Hkv, D]``;
    q_idx ``[B, S, Hkv, d_idx]`` with ``lse_idx`` from :func:`index_lse` (merged over the
    steps of a ring); k_idx ``[B, SK, 1, d_idx]``; ``grad`` a one-element tensor. The
    gradients in ``dtype``, default the inputs'; a ring step asks for fp32, which it adds up
    over the steps (dq_idx here, dk_idx at the chunk's owner)."""
    args = kl_arguments(q, k, lse, q_idx, k_idx, lse_idx, tables, scale, grad, rows)
    decision = kl_backward_passes()
    log_decision(decision, "msa_kl backward over the union of tiles")
    if decision.kernel == "one_pass":
        return kl_fused(args, dtype)
    dq_idx, kl = kl_dq(args, dtype)
    return dq_idx, kl_dk(args, dtype), kl


def kl_arguments(q, k, lse, q_idx, k_idx, lse_idx, tables: TileTables, scale: float, grad, rows: int) -> dict:
    """What :func:`kl_dq`, :func:`kl_dk` and :func:`kl_fused` take (``kl_backward``'s
    arguments, made contiguous, and the kernels' scalars)."""
    q, k, q_idx, k_idx = (t.contiguous() for t in (q, k, q_idx, k_idx))
    lse, lse_idx = lse.float().contiguous(), lse_idx.float().contiguous()
    hq, d = q.shape[2], q.shape[3]
    hkv, di = q_idx.shape[2], q_idx.shape[3]
    group = hq // hkv
    scalars = {
        "HQ": hq,
        "G": group,  # a constexpr: the teacher's head loop unrolls
        "qk_scale": scale * LOG2E,
        "idx_scale": LOG2E / math.sqrt(di),
        "inv_g": 1.0 / group,
        "grad_scale": 1.0 / (rows * math.sqrt(di)),
        "HEAD_DIM": d,
        "D_PAD": _pad(d),
        **_common(q_idx, k_idx, tables),
    }
    grad = grad.detach().float().reshape(1).contiguous()
    return {"tensors": (q, k, lse, q_idx, k_idx, lse_idx, grad), "tables": tables, "scalars": scalars}


def kl_dq(args: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dQ kernel's launch: (dq_idx in ``dtype``, default q_idx's, per-row KL
    ``[B, Hkv, S]`` fp32). A ring step asks for fp32, which it adds up over the steps."""
    q, k, lse, q_idx, k_idx, lse_idx, grad = args["tensors"]
    tables = args["tables"]
    b, s, hkv, _ = q_idx.shape
    dq_idx = buffers.new_buffer(q_idx.shape, dtype or q_idx.dtype, q.device)
    kl = buffers.new_buffer((b, hkv, s), torch.float32, q.device)
    cfg = launch_config("dq", tables.block)
    n_qb = tables.tiles.shape[2]
    _dq_kl_kernel[(n_qb * (tables.block // cfg.block_m), b * hkv)](
        q, k, lse, q_idx, k_idx, lse_idx, grad, dq_idx, kl, tables.tiles, tables.tile_count,
        NQB=n_qb, T_MAX=tables.tiles.shape[3], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, TEACHER_STAGES=TEACHER_STAGES, **args["scalars"],
    )  # fmt: skip
    return dq_idx, kl


def kl_dk(args: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dK kernel's launch: dk_idx in ``dtype`` (default k_idx's)."""
    return _kv_major(args, "dk", dtype, None, None)


def kl_fused(args: dict, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-pass backward, the dK kernel with ``FUSE_DQ``: (dq_idx, dk_idx in ``dtype``,
    default the index inputs', per-row KL ``[B, Hkv, S]`` fp32). dq_idx and the KL rows are
    fp32 sums of atomic adds, so their last bits vary from run to run."""
    q_idx = args["tensors"][3]
    b, s, hkv, _ = q_idx.shape
    # Zeroed here, not by new_buffer: the kernel adds into them.
    dq_idx = torch.zeros(q_idx.shape, dtype=torch.float32, device=q_idx.device)
    kl = torch.zeros((b, hkv, s), dtype=torch.float32, device=q_idx.device)
    dk_idx = _kv_major(args, "fused", dtype, dq_idx, kl)
    return dq_idx.to(dtype or q_idx.dtype), dk_idx, kl


def _kv_major(args: dict, kernel: str, dtype, dq_idx: torch.Tensor | None, kl: torch.Tensor | None) -> torch.Tensor:
    """``_dk_kl_kernel``'s launch with ``kernel``'s config: dk_idx in ``dtype`` (default
    k_idx's); with ``dq_idx`` and ``kl`` (fp32, zeroed) it adds into them too."""
    q, k, lse, q_idx, k_idx, lse_idx, grad = args["tensors"]
    tables = args["tables"]
    dk_idx = buffers.new_buffer(k_idx.shape, dtype or k_idx.dtype, q.device)
    cfg = launch_config(kernel, tables.block)
    n_kb = tables.tiles_t.shape[2]
    _dk_kl_kernel[(n_kb * (tables.block // cfg.block_n), q_idx.shape[0])](
        q, k, lse, q_idx, k_idx, lse_idx, grad, dk_idx, dq_idx, kl, tables.tiles_t, tables.tile_t_count,
        NKB=n_kb, T_MAX=tables.tiles_t.shape[3], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, FUSE_DQ=dq_idx is not None,
        TEACHER_STAGES=TEACHER_STAGES, **args["scalars"],
    )  # fmt: skip
    return dk_idx


class KLOrder(Protocol):
    """A loop order of the KL kernels: the union of tiles (:class:`UnionOfTiles`) or KV-outer
    (``kv_loss.KVOuterKL``); ``kl_backward`` as the module's, without the tables."""

    def index_lse(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor: ...

    def kl_backward(
        self, q, k, lse, q_idx, k_idx, lse_idx, scale: float, grad, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class UnionOfTiles:
    """The union-of-tiles order: this module's kernels over ``tables``."""

    tables: TileTables

    def index_lse(self, q_idx, k_idx):
        return index_lse(q_idx, k_idx, self.tables)

    def kl_backward(self, q, k, lse, q_idx, k_idx, lse_idx, scale, grad, rows):
        return kl_backward(q, k, lse, q_idx, k_idx, lse_idx, self.tables, scale, grad, rows)


class FusedMSAKL(torch.autograd.Function):
    """``KL(teacher || student)`` averaged over ``rows`` (B * S * Hkv on one device) with the
    forward skipped: returns a zero fp32 scalar whose gradient is the KL's. Gradients reach
    ``q_idx`` and ``k_idx`` only; ``on_value(kl)`` receives the KL in the backward. ``order``
    (a :class:`KLOrder`) runs the kernels."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, lse, order: KLOrder, scale: float, rows: int, on_value):
        lse_idx = order.index_lse(q_idx, k_idx)
        ctx.save_for_backward(q_idx, k_idx, q.detach(), k.detach(), lse.detach(), lse_idx)
        ctx.order, ctx.scale, ctx.rows, ctx.on_value = order, scale, rows, on_value
        return torch.zeros((), dtype=torch.float32, device=q_idx.device)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, q, k, lse, lse_idx = ctx.saved_tensors
        dq_idx, dk_idx, kl = ctx.order.kl_backward(q, k, lse, q_idx, k_idx, lse_idx, ctx.scale, grad, ctx.rows)
        if ctx.on_value is not None:
            ctx.on_value(kl.sum() / ctx.rows)
        return dq_idx, dk_idx, None, None, None, None, None, None, None


def fused_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    order: TileTables | KLOrder,
    scale: float,
    on_value: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """:class:`FusedMSAKL` on one device: the mean over ``B * S * Hkv`` rows; ``order`` a
    :class:`KLOrder`, or tile tables for the union of tiles."""
    b, s, hkv, _ = q_idx.shape
    if isinstance(order, TileTables):
        order = UnionOfTiles(order)
    return FusedMSAKL.apply(q_idx, k_idx, q, k, lse, order, scale, b * s * hkv, on_value)
