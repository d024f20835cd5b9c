"""Autograd function launching the tile + bar Triton kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...validation import fail
from ..shared import arch, buffers
from ..shared.kernels import LOG2E
from .kernels import _bar_dkdv_kernel, _dq_kernel, _fwd_kernel, _tile_dkdv_kernel
from .tables import TileTables


@dataclass(frozen=True)
class LaunchConfig:
    # Keys per step (forward, dQ) or per program (dK/dV), and query rows per program
    # (forward, dQ) or per step (dK/dV); each divides the index block (block_m is capped at it).
    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 128


KERNELS = ("fwd", "dq", "bar_dkdv", "tile_dkdv")
# Per-kernel overrides, e.g. from a benchmark sweep; empty means the defaults below.
OVERRIDES: dict[str, LaunchConfig] = {}


def launch_config(kernel: str, block: int, head_dim: int, major: int | None = None) -> LaunchConfig:
    """Default launch parameters on a GPU of compute capability ``major`` (None: the
    interpreter), from per-kernel device times at 128K tokens on an H200:
    * forward, dQ: a query block's rows against 64-key steps, three pipeline stages
      (two stages: 13-14% slower);
    * dK/dV: 128 keys a program against 64-row steps, three stages. Their transposed
      scores then have 128 rows, a 64-row half for each warp group of sm90's matrix unit;
      64-key programs of 8 warps ran 1.7-2.1x slower there. On Ampere, whose matrix
      instructions are a warp's, dK/dV programs take 64 keys (8 warps): with 128, ptxas
      caps the kernel at 128 registers or fewer and spills 2-6 KB a thread (a top-k index's
      wholesale, at 32 registers), where 64 keys spill none. Chosen by those compile-time
      counts (``scripts/compile_kernels.py``): no A100 has timed either.
    All fit an A100's 164 KiB of shared memory. ``scripts/bench_kernels.py --tune`` sweeps
    alternatives."""
    if kernel in OVERRIDES:
        return OVERRIDES[kernel]
    if kernel in ("fwd", "dq"):
        return LaunchConfig(min(block, 64), 8 if block >= 128 or head_dim > 64 else 4, 3)
    keys = min(block, 64 if major == 8 else 128)
    return LaunchConfig(keys, 8 if block >= 128 else 4, 3, 64)


def _opts(kernel: str, tables: TileTables, q: torch.Tensor) -> dict:
    cfg = launch_config(kernel, tables.block, q.shape[-1], arch.major(q.device))
    return {
        "BLOCK_N": cfg.block_n,
        "BLOCK_M": min(cfg.block_m, tables.block),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def _row_selection(tables: TileTables) -> dict:
    """Kernel arguments of the per-row block filter (a placeholder pointer when absent)."""
    sel = tables.rowsel
    return {
        "ROWSEL": tables.tile_count if sel is None else sel,
        "K_SEL": 1 if sel is None else sel.shape[-1],
        "RATIO": tables.rowsel_ratio,
        "HAS_ROWSEL": sel is not None,
        "K_PAD": 2 if sel is None else max(2, triton.next_power_of_2(sel.shape[-1])),
    }


def _positions(tables: TileTables) -> dict:
    """Global block ids of the query and key blocks, for context-parallel steps (each side
    its own: all-gathered keys are their own positions). Absent ids get a placeholder
    pointer, never read: the tile count table, whose entries outnumber the blocks."""
    return {
        "QBLK": tables.query_blocks if tables.query_blocks is not None else tables.tile_count,
        "KBLK": tables.key_blocks if tables.key_blocks is not None else tables.tile_t_count,
        "HAS_QPOS": tables.query_blocks is not None,
        "HAS_KPOS": tables.key_blocks is not None,
    }


def _bars(tables: TileTables, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Kernel arguments of the bar pass (placeholders without bars).

    Each query head's vertical K/V rows are gathered once per call into contiguous
    ``[B, Hq, V, D]`` copies, with the columns' positions: the bar loops then load rows
    at addresses that follow from the loop counter, which Triton pipelines, instead of
    gathering through an index loaded in the same step. The copies hold at most
    ``vertical_cap`` rows per head; the backward gathers them again rather than keep
    them alive between the passes."""
    if not tables.has_bars:
        t = tables.tile_count
        return {"KBAR": k, "VBAR": v, "BAR_POS": t, "BAR_CNT": t, "BAR_START": t, "ACTIVE": t, "ACT_OFF": t,
                "V_MAX": 1, "N_ACTIVE": 1, "HAS_BARS": False}  # fmt: skip
    vertical = tables.vertical
    b, h, _ = vertical.shape
    cols = vertical.clamp(min=0).long()
    batch = torch.arange(b, device=k.device).view(-1, 1, 1)
    kv_head = (torch.arange(h, device=k.device) // (h // k.shape[2])).view(1, -1, 1)
    return {
        "KBAR": k[batch, cols, kv_head],
        "VBAR": v[batch, cols, kv_head],
        "BAR_POS": vertical if tables.bar_positions is None else tables.bar_positions,
        "BAR_CNT": tables.bar_count,
        "BAR_START": tables.bar_count if tables.bar_start is None else tables.bar_start,
        "ACTIVE": tables.active,
        "ACT_OFF": tables.bar_count if tables.active_offset is None else tables.active_offset,
        "V_MAX": vertical.shape[-1],
        "N_ACTIVE": tables.active.shape[-1],
        "HAS_BARS": True,
    }


def _documents(tables: TileTables) -> dict:
    """The rows' document starts (a placeholder pointer, never read, without documents)."""
    return {
        "DOC_START": tables.tile_count if tables.doc_start is None else tables.doc_start,
        "HAS_DOCS": tables.doc_start is not None,
    }


def _document_ends(tables: TileTables) -> torch.Tensor:
    """The dK/dV kernels' document ends (a placeholder pointer, never read, without documents)."""
    return tables.tile_count if tables.doc_end is None else tables.doc_end


def _common(q: torch.Tensor, k: torch.Tensor, tables: TileTables) -> dict:
    b, s, h, d = q.shape
    return {
        "S": s,
        "SK": k.shape[1],
        "H": h,
        "HKV": k.shape[2],
        "TB": tables.tiles.shape[0],
        "TH": tables.tiles.shape[1],
        "HEAD_DIM": d,
        "D_PAD": max(16, triton.next_power_of_2(d)),
        "BLOCK": tables.block,
        # fp32 inputs get exact fp32 products; 16-bit inputs use the tensor cores as they are.
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        **_row_selection(tables),
        **_positions(tables),
        **_documents(tables),
    }


@dataclass(frozen=True)
class ColumnKeys:
    """Key / value rows attended as bars apart from the tiles' keys: gathered vertical
    columns ``k`` / ``v`` ``[B, V, Hkv, D]`` and their bars-only ``tables`` over the same
    query rows (a context-parallel rank's column piece). Attending them in the launch of
    a ring step's tiles keeps tiles and bars in one program per query block, as on one
    device: in programs of their own, they cost 15% more (one rank's pieces on an H100)."""

    k: torch.Tensor
    v: torch.Tensor
    tables: TileTables


def _bar_source(tables: TileTables, k, v, columns: ColumnKeys | None) -> tuple[TileTables, torch.Tensor, torch.Tensor]:
    """(tables, k, v) of the bars: ``columns``' where given, else the tiles' own."""
    if columns is None:
        return tables, k, v
    if tables.has_bars:
        fail("tables", "tables with bars", "tiles-only tables when the bars come from `columns`")
    return columns.tables, columns.k.contiguous(), columns.v.contiguous()


def _outputs(name: str, running: torch.Tensor | None, shape, dtype: torch.dtype, device) -> tuple:
    """(the buffer a kernel stores to, the running buffer it reads, whether it reads one).
    Without ``running``: a new buffer in ``dtype``, passed for both (the running one then
    unread). With it: ``running`` itself where ``dtype`` is fp32, else a new buffer."""
    if running is None:
        out = buffers.new_buffer(shape, dtype, device)
        return out, out, False
    if running.dtype != torch.float32 or tuple(running.shape) != tuple(shape) or not running.is_contiguous():
        fail(
            name,
            f"{running.dtype} {tuple(running.shape)}",
            f"a contiguous torch.float32 tensor of shape {tuple(shape)}",
        )
    return (running if dtype == torch.float32 else buffers.new_buffer(shape, dtype, device)), running, True


def kernel_forward(
    q, k, v, tables: TileTables, scale: float, running=None, out_dtype: torch.dtype | None = None, columns=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse fp32) of q over k/v under ``tables``; k/v may be another length (a
    context-parallel chunk, gathered columns). ``out_dtype``: q's unless given.
    ``columns``: ``ColumnKeys`` attended as bars besides the tiles of ``tables``.

    ``running``: an fp32 (out, lse) of the same rows over other keys. The result is then
    attention over both key sets, merged in the kernel (each row's running values are
    read where its result is stored), and is written over ``running`` (the out too when
    ``out_dtype`` is fp32)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, s, h, d = q.shape
    n_qb = tables.tiles.shape[2]
    run_out, run_lse = (None, None) if running is None else running
    out, run_out, accumulate = _outputs("running[0]", run_out, q.shape, out_dtype or q.dtype, q.device)
    lse, run_lse, _ = _outputs("running[1]", run_lse, (b, h, s), torch.float32, q.device)
    opts = _opts("fwd", tables, q)
    _fwd_kernel[(n_qb * (tables.block // opts["BLOCK_M"]), b * h)](
        q, k, v, out, lse, run_out, run_lse, tables.tiles, tables.tile_count, **_bars(*_bar_source(tables, k, v, columns)),
        NQB=n_qb, T_MAX=tables.tiles.shape[3], qk_scale=scale * LOG2E, ACCUMULATE=accumulate,
        IN_PLACE=accumulate and out is run_out, **_common(q, k, tables), **opts,
    )  # fmt: skip
    return out, lse


def kernel_backward(
    q, k, v, tables: TileTables, scale: float, out, lse, dout, dlse, dq_running=None, dq_dtype=None, columns=None
):
    """(dq, dk, dv), dk / dv in k / v's dtype, given each row's *final* out and lse (so the
    partials of several K/V chunks add up); ``dlse`` may be None. ``dq_running``: an fp32
    sum of the rows' dQ over other keys, to which this dQ is added in the kernel (written
    over it when ``dq_dtype`` is fp32); ``dq_dtype``: q's unless given. With ``columns``
    (as for ``kernel_forward``), (dq, dk, dv, dk of the columns, dv of the columns)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, s, h, d = q.shape
    out, dout, lse = out.contiguous(), dout.to(q.dtype).contiguous(), lse.float().contiguous()
    delta = buffers.new_buffer(lse.shape, torch.float32, q.device)  # written by the dQ kernel
    common = _common(q, k, tables)
    n_qb = tables.tiles.shape[2]
    bar_tables, bar_k, bar_v = _bar_source(tables, k, v, columns)
    bars = _bars(bar_tables, bar_k, bar_v)
    bar_common = common if columns is None else _common(q, bar_k, bar_tables)

    dq, dq_run, accumulate = _outputs("dq_running", dq_running, q.shape, dq_dtype or q.dtype, q.device)
    dq_opts = _opts("dq", tables, q)
    _dq_kernel[(n_qb * (tables.block // dq_opts["BLOCK_M"]), b * h)](
        q, k, v, out, dout, lse, lse if dlse is None else dlse.float().contiguous(), delta, dq, dq_run,
        tables.tiles, tables.tile_count, **bars,
        NQB=n_qb, T_MAX=tables.tiles.shape[3], qk_scale=scale * LOG2E, sm_scale=scale,
        HAS_DLSE=dlse is not None, ACCUMULATE=accumulate, IN_PLACE=accumulate and dq is dq_run, **common,
        **dq_opts,
    )  # fmt: skip

    partials = None
    if bar_tables.has_bars:
        v_max = bar_tables.vertical.shape[-1]
        partials = buffers.new_buffer((2, b * h, v_max, bar_common["D_PAD"]), torch.float32, q.device)
        bar_opts = _opts("bar_dkdv", bar_tables, q)
        _bar_dkdv_kernel[(b * h, triton.cdiv(v_max, bar_opts["BLOCK_N"]))](
            q, dout, lse, delta, bars["KBAR"], bars["VBAR"], bars["BAR_POS"], bar_tables.active, bars["ACT_OFF"],
            partials[0], partials[1], bar_common["QBLK"], bar_common["DOC_START"],
            _document_ends(bar_tables), S=s, H=h, NQB=n_qb,
            N_ACTIVE=bar_tables.active.shape[-1], V_MAX=v_max, qk_scale=scale * LOG2E, HEAD_DIM=d,
            D_PAD=bar_common["D_PAD"], BLOCK=bar_tables.block, HAS_QPOS=bar_common["HAS_QPOS"],
            HAS_DOCS=bar_common["HAS_DOCS"], PRECISION=bar_common["PRECISION"], **bar_opts,
        )  # fmt: skip
    if columns is None:
        return dq, *_key_grads(q, k, v, tables, common, dout, lse, delta, partials, scale)
    return (
        dq,
        *_key_grads(q, k, v, tables, common, dout, lse, delta, None, scale),
        *_key_grads(q, bar_k, bar_v, bar_tables, bar_common, dout, lse, delta, partials, scale),
    )


def _key_grads(q, k, v, tables: TileTables, common: dict, dout, lse, delta, partials, scale: float):
    """(dk, dv) of ``k`` / ``v``: over the tiles of ``tables`` (KV-major), plus, with
    ``partials`` (the bar dK/dV kernel's ``[2, B * Hq, V, D_PAD]``), the partials of
    the vertical columns of ``tables``, which are rows of ``k`` / ``v``."""
    b, _, h, d = q.shape
    n_kb = tables.tiles_t.shape[2]
    if partials is None:
        v_max, bar_dk, bar_dv, vert, vptr = 1, delta, delta, tables.tile_count, tables.tile_count
    else:
        v_max, (bar_dk, bar_dv), vert, vptr = tables.vertical.shape[-1], partials, tables.vertical, tables.vertical_ptr
    dk, dv = buffers.new_buffer(k.shape, k.dtype, k.device), buffers.new_buffer(v.shape, v.dtype, v.device)
    opts = _opts("tile_dkdv", tables, q)
    _tile_dkdv_kernel[(n_kb * (tables.block // opts["BLOCK_N"]), b * k.shape[2])](
        q, k, v, dout, lse, delta, dk, dv, tables.tiles_t, tables.tile_t_count, bar_dk, bar_dv, vert, vptr,
        DOC_END=_document_ends(tables), NKB=n_kb, T_MAX=tables.tiles_t.shape[3], V_MAX=v_max,
        qk_scale=scale * LOG2E, sm_scale=scale, HAS_BARS=partials is not None, FOLD=32, **common, **opts,
    )  # fmt: skip
    return dk, dv


class TritonBlockBarAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tables: TileTables, scale: float):
        out, lse = kernel_forward(q, k, v, tables, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tables, ctx.scale = tables, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*kernel_backward(q, k, v, ctx.tables, ctx.scale, out, lse, dout, dlse), None, None)
