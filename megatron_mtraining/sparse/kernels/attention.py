"""Autograd function launching the tile + bar Triton kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..validation import fail
from .block_bar import LOG2E, _bar_dkdv_kernel, _delta_kernel, _dq_kernel, _fwd_kernel, _tile_dkdv_kernel
from .layout import KernelLayout


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output is allocated here (uninitialised); tests poison it."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class LaunchConfig:
    # Keys per step (forward, dQ) or per program (dK/dV), and query rows per program
    # (forward, dQ) or per step (dK/dV); each divides the index block (block_m is capped at it).
    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 128


# ``*_fast``: the dK/dV kernels of the fast backward (``FUSED_DQ``), compiled and tuned apart.
KERNELS = ("fwd", "dq", "bar_dkdv", "tile_dkdv", "bar_dkdv_fast", "tile_dkdv_fast")
# Per-kernel overrides, e.g. from a benchmark sweep; empty means the defaults below.
OVERRIDES: dict[str, LaunchConfig] = {}


def launch_config(kernel: str, block: int, head_dim: int) -> LaunchConfig:
    """Default launch parameters, from per-kernel device times at 128K tokens on an H200:
    * forward, dQ: a query block's rows against 64-key steps, three pipeline stages
      (two stages: 13-14% slower);
    * dK/dV: 128 keys a program against 64-row steps, three stages. Their transposed
      scores then have 128 rows, a 64-row half for each warp group of the matrix unit;
      64-key programs of 8 warps ran 1.7-2.1x slower. The fast backward's dK/dV kernels
      (``*_fast``) take the same shapes: at 128K on an H100, two stages instead of three
      were within 3%, 32-row steps 8-13% and 64-key programs of 4 warps 20-54% slower.
    All fit an A100's 164 KiB of shared memory (compiled for sm80, the fast dK/dV kernels
    take 145 KiB; for sm90, 193 KiB). ``scripts/bench_kernels.py --tune`` sweeps
    alternatives."""
    if kernel in OVERRIDES:
        return OVERRIDES[kernel]
    if kernel in ("fwd", "dq"):
        return LaunchConfig(min(block, 64), 8 if block >= 128 or head_dim > 64 else 4, 3)
    return LaunchConfig(min(block, 128), 8 if block >= 128 else 4, 3, 64)


def _opts(kernel: str, layout: KernelLayout, q: torch.Tensor) -> dict:
    cfg = launch_config(kernel, layout.block, q.shape[-1])
    return {
        "BLOCK_N": cfg.block_n,
        "BLOCK_M": min(cfg.block_m, layout.block),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def _row_selection(layout: KernelLayout) -> dict:
    """Kernel arguments of the per-row block filter (a placeholder pointer when absent)."""
    sel = layout.rowsel
    return {
        "ROWSEL": layout.tile_count if sel is None else sel,
        "K_SEL": 1 if sel is None else sel.shape[-1],
        "RATIO": layout.rowsel_ratio,
        "HAS_ROWSEL": sel is not None,
        "K_PAD": 2 if sel is None else max(2, triton.next_power_of_2(sel.shape[-1])),
    }


def _positions(layout: KernelLayout) -> dict:
    """Global positions of the query rows and key columns, for context-parallel steps."""
    has = layout.query_positions is not None
    return {
        "QPOS": layout.query_positions if has else layout.tile_count,
        "KPOS": layout.key_positions if has else layout.tile_count,
        "HAS_POS": has,
    }


def _bars(layout: KernelLayout, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Kernel arguments of the bar pass (placeholders without bars).

    Each query head's vertical K/V rows are gathered once per call into contiguous
    ``[B, Hq, V, D]`` copies, with the columns' positions: the bar loops then load rows
    at addresses that follow from the loop counter, which Triton pipelines, instead of
    gathering through an index loaded in the same step. The copies hold at most
    ``vertical_cap`` rows per head; the backward gathers them again rather than keep
    them alive between the passes."""
    if not layout.has_bars:
        t = layout.tile_count
        return {"KBAR": k, "VBAR": v, "BAR_POS": t, "BAR_CNT": t, "ACTIVE": t, "V_MAX": 1, "N_ACTIVE": 1,
                "HAS_BARS": False}  # fmt: skip
    vertical = layout.vertical
    b, h, _ = vertical.shape
    cols = vertical.clamp(min=0).long()
    batch = torch.arange(b, device=k.device).view(-1, 1, 1)
    kv_head = (torch.arange(h, device=k.device) // (h // k.shape[2])).view(1, -1, 1)
    kpos = layout.key_positions
    return {
        "KBAR": k[batch, cols, kv_head],
        "VBAR": v[batch, cols, kv_head],
        "BAR_POS": vertical if kpos is None else torch.where(vertical >= 0, kpos[cols], -1),
        "BAR_CNT": layout.bar_count,
        "ACTIVE": layout.active,
        "V_MAX": vertical.shape[-1],
        "N_ACTIVE": layout.active.shape[-1],
        "HAS_BARS": True,
    }


def _common(q: torch.Tensor, k: torch.Tensor, layout: KernelLayout) -> dict:
    b, s, h, d = q.shape
    return {
        "S": s,
        "SK": k.shape[1],
        "H": h,
        "HKV": k.shape[2],
        "LB": layout.tiles.shape[0],
        "LH": layout.tiles.shape[1],
        "HEAD_DIM": d,
        "D_PAD": max(16, triton.next_power_of_2(d)),
        "BLOCK": layout.block,
        # fp32 inputs get exact fp32 products; 16-bit inputs use the tensor cores as they are.
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        **_row_selection(layout),
        **_positions(layout),
    }


def _outputs(name: str, running: torch.Tensor | None, shape, dtype: torch.dtype, device) -> tuple:
    """(the buffer a kernel stores to, the running buffer it reads, whether it reads one).
    Without ``running``: a new buffer in ``dtype``, passed for both (the running one then
    unread). With it: ``running`` itself where ``dtype`` is fp32, else a new buffer."""
    if running is None:
        out = new_buffer(shape, dtype, device)
        return out, out, False
    if running.dtype != torch.float32 or tuple(running.shape) != tuple(shape) or not running.is_contiguous():
        fail(
            name,
            f"{running.dtype} {tuple(running.shape)}",
            f"a contiguous torch.float32 tensor of shape {tuple(shape)}",
        )
    return (running if dtype == torch.float32 else new_buffer(shape, dtype, device)), running, True


def kernel_forward(
    q, k, v, layout: KernelLayout, scale: float, running=None, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse fp32) of q over k/v under ``layout``; k/v may be another length (a
    context-parallel chunk, gathered columns). ``out_dtype``: q's unless given.

    ``running``: an fp32 (out, lse) of the same rows over other keys. The result is then
    attention over both key sets, merged in the kernel (each row's running values are
    read where its result is stored), and is written over ``running`` (the out too when
    ``out_dtype`` is fp32)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, s, h, d = q.shape
    n_qb = layout.tiles.shape[2]
    run_out, run_lse = (None, None) if running is None else running
    out, run_out, accumulate = _outputs("running[0]", run_out, q.shape, out_dtype or q.dtype, q.device)
    lse, run_lse, _ = _outputs("running[1]", run_lse, (b, h, s), torch.float32, q.device)
    opts = _opts("fwd", layout, q)
    _fwd_kernel[(n_qb * (layout.block // opts["BLOCK_M"]), b * h)](
        q, k, v, out, lse, run_out, run_lse, layout.tiles, layout.tile_count, **_bars(layout, k, v),
        NQB=n_qb, T_MAX=layout.tiles.shape[3], qk_scale=scale * LOG2E, ACCUMULATE=accumulate,
        **_common(q, k, layout), **opts,
    )  # fmt: skip
    return out, lse


def dq_scratch_heads(heads: int, dq_dtype: torch.dtype) -> int:
    """Query heads per launch of the fast backward without a running dQ: whole heads whose
    fp32 dQ accumulator takes at most an eighth of dQ's bytes, at least one. (The issue's
    memory target is fwd+bwd within 1.2x of q/k/v/o/dO/dQ/dK/dV; an fp32 dQ for all heads
    alone would put a GQA 8:1 model at 1.44x.)"""
    return max(1, heads * dq_dtype.itemsize // (8 * 4))


def head_chunks(heads: int, kv_heads: int, per_launch: int) -> list[tuple[int, int, int, int]]:
    """The launches of the fast backward as (first KV head, KV heads, first group member,
    group members), at most ``per_launch`` query heads each: whole GQA groups of
    consecutive KV heads, or, where a group is larger than that, consecutive members of
    one group. Either way a launch's query heads are consecutive."""
    group = heads // kv_heads
    if per_launch >= group:
        n = min(kv_heads, per_launch // group)
        return [(kv0, min(n, kv_heads - kv0), 0, group) for kv0 in range(0, kv_heads, n)]
    return [(kv, 1, g0, min(per_launch, group - g0)) for kv in range(kv_heads) for g0 in range(0, group, per_launch)]


# Rows per program of the fast bar kernel, in BLOCK_M steps. The deterministic kernel walks
# all rows after a column chunk in one program; with the dQ fused in, launches cover few
# heads, so the rows are split for enough programs to fill the device.
BAR_SEGMENT_STEPS = 32


def kernel_backward(
    q, k, v, layout: KernelLayout, scale: float, out, lse, dout, dlse, dq_running=None, dq_dtype=None,
    deterministic: bool | None = None,
):  # fmt: skip
    """(dq, dk, dv), dk / dv in k / v's dtype, given each row's *final* out and lse (so the
    partials of several K/V chunks add up); ``dlse`` may be None. ``dq_running``: an fp32
    sum of the rows' dQ over other keys, to which this dQ is added in the kernels (written
    over it when ``dq_dtype`` is fp32); ``dq_dtype``: q's unless given.

    ``deterministic`` (None: ``torch.are_deterministic_algorithms_enabled()``): the
    bitwise-reproducible backward (a dQ pass, then the dK/dV passes; no atomics). Otherwise
    the fast one: the dK/dV kernels also compute dQ and add it into an fp32 accumulator with
    atomics (5 matmuls per attended pair instead of 7). The accumulator is ``dq_running``
    where given, or the fp32 dQ output itself; otherwise a scratch buffer bounded by
    ``dq_scratch_heads``, one launch per ``head_chunks`` entry, each cast into dQ's heads."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, s, h, d = q.shape
    hkv, group = k.shape[2], h // k.shape[2]
    out, dout, lse = out.contiguous(), dout.to(q.dtype).contiguous(), lse.float().contiguous()
    dlse_t = lse if dlse is None else dlse.float().contiguous()
    delta = new_buffer(lse.shape, torch.float32, q.device)
    common = _common(q, k, layout)
    n_qb, n_kb = layout.tiles.shape[2], layout.tiles_t.shape[2]
    scales = {"qk_scale": scale * LOG2E, "sm_scale": scale}

    bars = _bars(layout, k, v)
    dq, dq_run, accumulate = _outputs("dq_running", dq_running, q.shape, dq_dtype or q.dtype, q.device)
    if deterministic:
        dq_opts = _opts("dq", layout, q)
        _dq_kernel[(n_qb * (layout.block // dq_opts["BLOCK_M"]), b * h)](
            q, k, v, out, dout, lse, dlse_t, delta, dq, dq_run, layout.tiles, layout.tile_count, **bars,
            NQB=n_qb, T_MAX=layout.tiles.shape[3], HAS_DLSE=dlse is not None, ACCUMULATE=accumulate,
            **scales, **common, **dq_opts,
        )  # fmt: skip
    else:
        _delta_kernel[(triton.cdiv(s, 64), b * h)](
            out, dout, dlse_t, delta, S=s, H=h, HEAD_DIM=d, D_PAD=common["D_PAD"], BLOCK_M=64,
            HAS_DLSE=dlse is not None, num_warps=4,
        )  # fmt: skip

    fast = "" if deterministic else "_fast"
    bar_opts, tile_opts = _opts("bar_dkdv" + fast, layout, q), _opts("tile_dkdv" + fast, layout, q)
    if layout.has_bars:
        v_max = layout.vertical.shape[-1]
        bar_dk = new_buffer((b * h, v_max, common["D_PAD"]), torch.float32, q.device)
        bar_dv = new_buffer(bar_dk.shape, torch.float32, q.device)
        if not deterministic:  # the row segments add their partials
            bar_dk.zero_()
            bar_dv.zero_()
        vert, vptr = layout.vertical, layout.vertical_ptr
        seg = s if deterministic else BAR_SEGMENT_STEPS * bar_opts["BLOCK_M"]
    else:
        v_max, bar_dk, bar_dv, vert, vptr = 1, delta, delta, layout.tile_count, layout.tile_count
    dk, dv = new_buffer(k.shape, k.dtype, k.device), new_buffer(v.shape, v.dtype, v.device)

    def dkdv(kv0, n_kv, g0, n_g, dq_acc, kv_run=(dk, dv)):
        """The dK/dV kernels over KV heads ``kv0 ..`` x group members ``g0 ..``; the tile
        kernel adds to / stores in the fp32 ``kv_run`` where other launches share its KV heads."""
        heads = {"KV0": kv0, "NKV": n_kv, "G0": g0, "NG": n_g}
        if layout.has_bars:
            _bar_dkdv_kernel[(b * n_kv * n_g, triton.cdiv(v_max, bar_opts["BLOCK_N"]), triton.cdiv(s, seg))](
                q, dout, lse, delta, bars["KBAR"], bars["VBAR"], bars["BAR_POS"], layout.active, bar_dk, bar_dv,
                dq_acc, common["QPOS"], S=s, H=h, HKV=hkv, **heads, N_ACTIVE=layout.active.shape[-1], V_MAX=v_max,
                SEG=seg, **scales, HEAD_DIM=d, D_PAD=common["D_PAD"], BLOCK=layout.block,
                HAS_POS=common["HAS_POS"], PRECISION=common["PRECISION"], FUSED_DQ=not deterministic, **bar_opts,
            )  # fmt: skip
        _tile_dkdv_kernel[(n_kb * (layout.block // tile_opts["BLOCK_N"]), b * n_kv)](
            q, k, v, dout, lse, delta, dk, dv, *kv_run, dq_acc, layout.tiles_t, layout.tile_t_count,
            bar_dk, bar_dv, vert, vptr, **heads, NKB=n_kb, T_MAX=layout.tiles_t.shape[3], V_MAX=v_max, **scales,
            HAS_BARS=layout.has_bars, FOLD=32,
            FUSED_DQ=not deterministic, KV_RUN_IN=g0 > 0, KV_RUN_OUT=g0 + n_g < group, **common, **tile_opts,
        )  # fmt: skip

    if deterministic:
        dkdv(0, hkv, 0, group, delta)
    elif accumulate or dq.dtype == torch.float32:
        # An fp32 accumulator over all heads is there already: one launch adds into it.
        if not accumulate:
            dq_run = dq.zero_()
        dkdv(0, hkv, 0, group, dq_run)
        if dq is not dq_run:
            dq.copy_(dq_run)
    else:
        chunks = head_chunks(h, hkv, dq_scratch_heads(h, dq.dtype))
        scratch = new_buffer((b * s * max(n_kv * n_g for _, n_kv, _, n_g in chunks) * d,), torch.float32, q.device)
        # Partial groups: one KV head per launch, its dK/dV summed in fp32 over the group's launches.
        kv_run = (dk, dv)
        if chunks[0][3] < group:
            kv_run = tuple(new_buffer((b, k.shape[1], 1, d), torch.float32, k.device) for _ in range(2))
        for kv0, n_kv, g0, n_g in chunks:
            acc = scratch[: b * s * n_kv * n_g * d].view(b, s, n_kv * n_g, d).zero_()
            dkdv(kv0, n_kv, g0, n_g, acc, kv_run)
            first = kv0 * group + g0
            dq[:, :, first : first + n_kv * n_g].copy_(acc)
    return dq, dk, dv


class TritonBlockBarAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: KernelLayout, scale: float, deterministic: bool):
        out, lse = kernel_forward(q, k, v, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.deterministic = layout, scale, deterministic
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = kernel_backward(q, k, v, ctx.layout, ctx.scale, out, lse, dout, dlse, deterministic=ctx.deterministic)
        return (*grads, None, None, None)
