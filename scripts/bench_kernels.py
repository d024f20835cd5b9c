"""Kernel benchmark: sparse attention kernels against dense and FlexAttention (one GPU).

    python scripts/bench_kernels.py [--seq-lens 32768 131072] [--density 0.05] [--out results.json]

Qwen2.5-3B attention shape (16 query heads, 2 KV heads, head dim 128), bf16,
batch 1, causal. Forward and backward are timed separately with
``triton.testing.do_bench`` (median). Useful TFLOP/s count the attended area only:
forward ``4 * area * d`` summed over query heads, backward 2.5x that.

Rows:
* dense: SDPA flash and cuDNN backends, and our kernel on a DenseIndex;
* vertical-slash at the requested density: our tile + bar kernel; FlexAttention
  on exactly the same mask (same tiles as full blocks, the diagonal and every
  tile holding a vertical column as masked blocks, ``BLOCK_SIZE`` = our block);
  FlexAttention on the tiles alone (bars dropped: a speed reference only);
* index building: vertical-slash statistics + top-p + tile tables, against the
  sparse forward, as the product builds it (the passes over the keys launched as they
  come, the rest replayed from a CUDA graph) and eagerly (``MTRAINING_INDEX_GRAPHS=0``),
  with the statistics, the top-p selection and the tile tables also timed alone (eager);
  ``--profile-index`` lists the kernels' device times of both builds;
* under the training step's allocator (``training.allocator``: expandable segments unless
  ``PYTORCH_CUDA_ALLOC_CONF`` is set), so rows run one after another do not fragment it;
* peak memory of forward + backward against the q/k/v/o and gradient tensors, the device
  time of each backward kernel, and the shared memory, registers and spills of each
  compiled kernel;
* MSA's block selection (k=16, block 128): the Triton kernel against the chunked PyTorch
  path, time and peak memory;
* MSA (k=16, block 128) and MoBA (chunk 4096, k=12) through ``sparse_attention`` (the
  KV-outer kernels) and, for comparison, through the union-of-tiles kernels with the share
  of their computed tile area that is useful; for MSA also the KV-outer path's peak memory
  and backward kernel times; for MoBA also the varlen library path (``varlen_blocks``, which
  ``auto`` gives it on CUDA) on each library, PyTorch's FlashAttention-2 (``varlen blocks``)
  and, where it serves the inputs (sm90, cudnn-frontend installed), cuDNN's ragged attention
  (``varlen blocks, cuDNN``): its output, LSE and gradients first checked against the union of
  tiles, then timed; then peak memory and backward kernel times on the library ``auto`` picks
  (``varlen_blocks.choose.choice``, printed). ``--patterns moba`` runs
  the MoBA rows and the cuDNN dense row alone, e.g. on an H200::

      python scripts/bench_kernels.py --seq-lens 131072 524288 --dense-max 524288 --patterns moba

``--library-rows-only`` leaves MoBA's KV-outer and union-of-tiles rows out (minutes each at
512K), e.g. for its 512K row on an H100::

      python scripts/bench_kernels.py --seq-lens 131072 524288 --dense-max 131072 \
          --patterns dense moba --no-flex --library-rows-only

``--tune`` first sweeps launch parameters at the first length and keeps the best for the rows:
the block-bar kernels' on the vertical-slash pattern (``TUNE_CANDIDATES``), and MSA's KV-outer
kernels and selection on its structured index (``MSA_TUNE``), e.g.::

      python scripts/bench_kernels.py --seq-lens 131072 --patterns msa --no-flex \
          --tune kv_fwd kv_merge kv_bwd kv_sum_slots kv_reduce msa_select --out tune_msa.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from megatron_mtraining.examples.synthetic import rope
from megatron_mtraining.planning import workload
from megatron_mtraining.sparse import (
    DenseIndex,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    VerticalSlashIndex,
    build_moba_index,
    build_vertical_slash_index,
    msa_select_blocks,
    select_vertical_slash,
    sparse_attention,
    window_statistics,
)
from megatron_mtraining.sparse.cuda_graphs import GRAPHS_ENV
from megatron_mtraining.sparse.kernels.block_bar.tables import block_topk_tables, tile_tables
from megatron_mtraining.training.allocator import use_expandable_segments

HQ, HKV, D = 16, 2, 128
# The training step's allocator, before any CUDA allocation (the benchmarks importing this
# module get it too).
ALLOC_CONF = use_expandable_segments()


def timed(fn, rep_ms: int) -> float:
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def fwd_bwd_ms(forward, q, k, v, rep_ms):
    """Median forward ms, median backward ms (backward replayed on one retained graph)."""
    fwd = timed(lambda: forward(q, k, v), rep_ms)
    out = forward(q, k, v)
    grad = torch.randn_like(out)
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), rep_ms)
    return fwd, bwd


def natural_index(seq: int, block: int, density: float, gen: torch.Generator, device) -> VerticalSlashIndex:
    """The benchmark's vertical-slash index (``planning.workload.natural_index``, which the
    capacity planner's calibration is measured on) on ``device``."""
    return workload.natural_index(seq, block, density, gen, HQ).to(device)


def structured_qk(seq: int, gen: torch.Generator, device="cuda"):
    """q/k with RoPE over a shared mean direction (local attention, as trained models
    have), so neighbouring queries pick similar blocks, as a trained MSA indexer does."""
    mean = torch.randn(1, 1, HKV, D, generator=gen) * 1.5
    k = (mean + torch.randn(1, seq, HKV, D, generator=gen)).to(device)
    q = (mean.repeat_interleave(HQ // HKV, 2) + torch.randn(1, seq, HQ, D, generator=gen)).to(device)
    return rope(q), rope(k)


def msa_selection(q_idx, k_idx, config, seq, rows, rep):
    """MSA's block selection as dispatched (the Triton kernel on CUDA) against the chunked
    PyTorch path (``MTRAINING_ATTENTION_BACKEND=reference``; one warm call timed, it takes
    seconds at 128K), with each one's peak memory above its inputs; and how many rows pick
    the same blocks (the two differ only among equally scored blocks)."""
    from megatron_mtraining.sparse.dispatch import BACKEND_ENV

    results = {}
    for name in ("triton", "reference"):
        with mock.patch.dict(os.environ, {BACKEND_ENV: "reference"} if name == "reference" else {}):
            select = lambda: msa_select_blocks(q_idx, k_idx, config, HQ)  # noqa: E731
            results[name] = select().blocks
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if name == "triton":
                ms = timed(select, rep)
            else:
                start = time.perf_counter()
                select()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 1e3
            extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"  msa selection k{config.topk} b{config.block_size} ({name}): {ms:.2f} ms, peak +{extra_mib:.0f} MiB")
        rows.append({"kernel": f"msa selection ({name})", "seq": seq, "ms": ms, "peak_extra_mib": extra_mib})
    same = (results["triton"] == results["reference"]).all(-1).float().mean().item()
    print(f"    rows with the same selection: {same:.5f}")
    rows[-1]["rows_same_selection"] = same


def msa_index_inputs(sq, sk, gen, msa_index="structured"):
    """MSA's index queries and keys (group-mean queries and mean keys of structured ``sq`` /
    ``sk``, or with ``msa_index="untrained"`` independent random ones) and its config (k=16,
    block 128), as the MSA rows and the MSA sweep build them."""
    q_idx, k_idx = sq.unflatten(2, (HKV, -1)).mean(3), sk.mean(2, keepdim=True)
    if msa_index == "untrained":
        q_idx, k_idx = (torch.randn(t.shape, generator=gen).to(t) for t in (q_idx, k_idx))
    return q_idx, k_idx, MSAConfig(128, 16, D)


def topk_rows(
    seq, q, k, v, gen, rows, cudnn, rep, extra, msa_index="structured", patterns=("msa", "moba"), triton_rows=True
):
    """MSA (k=16, block 128; index = group-mean queries vs mean keys of structured data, or
    with ``msa_index="untrained"`` independent random index queries and keys, whose
    selections spread evenly over each query's visible blocks as an untrained index
    branch's do) and MoBA (chunk 4096, k=12), those of ``patterns``, through the KV-outer kernels
    and the union-of-tiles kernels (its tile tables built in each call, as ``sparse_attention``
    builds them), each called directly; memory and kernel times through ``sparse_attention``, on
    the loop order it picks; MoBA on the varlen library too (``varlen_rows``). Without
    ``triton_rows`` MoBA's KV-outer and union-of-tiles rows are left out (the union still
    checks the library's results), which at 512K take minutes."""
    from megatron_mtraining.sparse.dispatch import kv_outer_preferred

    sq, sk = structured_qk(seq, gen)
    indices = {}
    if "msa" in patterns:
        q_idx, k_idx, msa_config = msa_index_inputs(sq, sk, gen, msa_index)
        # Timed on bf16 index queries and keys, the dtype the index branch gives in training.
        msa_selection(q_idx.bfloat16(), k_idx.bfloat16(), msa_config, seq, rows, rep)
        indices["msa k16 b128"] = msa_select_blocks(q_idx, k_idx, msa_config, HQ)
    if "moba" in patterns:
        indices["moba c4096 k12"] = build_moba_index(sq, sk, MoBAConfig(chunk_size=4096, topk=12))
    for pattern, index in indices.items():
        area = float(index.attended_area().sum())
        if triton_rows or pattern.startswith("msa"):
            triton_topk_rows(seq, q, k, v, index, pattern, area, rows, cudnn, rep)
        if pattern.startswith("msa"):
            for what in (memory, kernel_times):
                try:
                    order = "kv-outer" if kv_outer_preferred(index) else "union of tiles"
                    what(q, k, v, index, seq, extra, f"{pattern} ({order}, as dispatched)")
                except Exception as e:
                    print(f"    {what.__name__} FAILED: {type(e).__name__}: {e}")
        else:
            varlen_rows(seq, q, k, v, index, rows, cudnn, rep, extra, pattern, area)


def triton_topk_rows(seq, q, k, v, index, pattern, area, rows, cudnn, rep):
    """A top-k index through the KV-outer kernels and the union-of-tiles kernels, each called
    directly, with the union's useful share of its computed tile area."""
    from megatron_mtraining.sparse.kernels.block_bar.attention import TritonBlockBarAttention
    from megatron_mtraining.sparse.kernels.kv_outer.attention import KVOuterAttention

    scale = D**-0.5
    kv_outer = lambda a, b, c: KVOuterAttention.apply(a, b, c, index, scale)[0]  # noqa: E731
    union = lambda a, b, c: TritonBlockBarAttention.apply(a, b, c, block_topk_tables(index), scale)[0]  # noqa: E731
    for name, run in ((f"ours {pattern} (kv-outer)", kv_outer), (f"ours {pattern} (union of tiles)", union)):
        measure(name, lambda name=name, run=run: row(name, seq, area, *fwd_bwd_ms(run, q, k, v, rep), cudnn), rows)
    tables = block_topk_tables(index)
    computed = float(tables.tile_count.sum()) * tables.block**2 * (HQ // tables.tiles.shape[1])
    print(f"    union of tiles: useful / computed tile area: {area / computed:.3f}")
    rows[-1]["useful_over_computed"] = area / computed


def varlen_rows(seq, q, k, v, index, rows, cudnn, rep, extra, pattern, area):
    """A top-k index on the varlen library path (``kernels/varlen_blocks``) on each library
    (``varlen_library_rows``): FlashAttention-2 (the ``varlen blocks`` row, as measured before
    cuDNN's was added), then cuDNN's ragged attention where it serves the inputs; then its peak
    memory and backward kernels on the library ``auto`` picks."""
    from megatron_mtraining.sparse.kernels.varlen_blocks import choose, cudnn_library

    for setting, label in (("flash", "varlen blocks"), ("cudnn", "varlen blocks, cuDNN")):
        why_not = cudnn_library.unsupported(q) if setting == "cudnn" else None
        if why_not is not None:
            print(f"    ours {pattern} ({label}) skipped: {why_not}")
            continue
        with mock.patch.dict(os.environ, {choose.LIBRARY_ENV: setting}):
            if not varlen_library_rows(seq, q, k, v, index, rows, cudnn, rep, pattern, area, label):
                return
        if setting == "cudnn" and cudnn_library.DECLINED:  # those calls ran on FlashAttention-2
            print(f"    cuDNN declined graphs (run on FlashAttention-2): {cudnn_library.DECLINED}")
            rows[-1]["cudnn_declined"] = [f"{key}: {why}" for key, why in cudnn_library.DECLINED.items()]
    print(f"    {pattern} (varlen blocks) memory and backward kernels on {choose.choice(q)[1]}")
    for what in (memory, kernel_times):
        try:
            what(q, k, v, index, seq, extra, f"{pattern} (varlen blocks)", backend="varlen_blocks")
        except Exception as e:
            print(f"    {what.__name__} FAILED: {type(e).__name__}: {e}")


def varlen_library_rows(seq, q, k, v, index, rows, cudnn, rep, pattern, area, label) -> bool:
    """A top-k index on the varlen library path, called directly on the library
    ``MTRAINING_VARLEN_LIBRARY`` names: its output, LSE and dq / dk / dv of one random output
    gradient checked first against the union of tiles (the Triton path MoBA took at 128K
    before), relative to each tensor's largest entry (bf16's tolerance of the tests for the
    values, 1e-3 for the fp32 LSE); then timed, with its forward's kernels. Whether it ran."""
    from megatron_mtraining.sparse.kernels.block_bar.attention import TritonBlockBarAttention
    from megatron_mtraining.sparse.kernels.varlen_blocks.attention import VarlenBlockAttention

    name, scale = f"ours {pattern} ({label})", D**-0.5
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    check = {}
    for key, fn in (("varlen", VarlenBlockAttention.apply), ("union", TritonBlockBarAttention.apply)):
        out, lse = fn(q, k, v, index if key == "varlen" else block_topk_tables(index), scale)
        check[key] = (out, lse, *torch.autograd.grad(out, (q, k, v), grad))
        del out, lse
    errors = {}
    for part, got, want in zip(("out", "lse", "dq", "dk", "dv"), *check.values(), strict=True):
        errors[part] = (got.float() - want.float()).abs().max().item() / max(1.0, want.float().abs().max().item())
    del check
    print(f"    {name} against the union of tiles, max error relative to max(1, |largest|): "
          + ", ".join(f"{part} {err:.2e}" for part, err in errors.items()))  # fmt: skip
    tolerance = {"out": 4e-2, "lse": 1e-3, "dq": 8e-2, "dk": 8e-2, "dv": 8e-2}  # bf16 values, fp32 LSEs
    wrong = {part: err for part, err in errors.items() if err > tolerance[part]}
    if wrong:
        print(f"{name:<34} FAILED: differs from the union of tiles: {wrong}", flush=True)
        rows.append({"kernel": name, "error": f"differs from the union of tiles: {wrong}"})
        return False
    run = lambda a, b, c: VarlenBlockAttention.apply(a, b, c, index, scale)[0]  # noqa: E731
    measure(name, lambda: row(name, seq, area, *fwd_bwd_ms(run, q, k, v, rep), cudnn), rows)
    if "error" in rows[-1]:
        return False
    rows[-1]["error_vs_union"] = errors
    # Where the forward's time goes: the library's kernels against the layout's sorts, gathers and merges.
    rows[-1]["fwd_kernel_ms"] = profile_kernels(lambda: run(q, k, v), f"{name} forward, GPU time per kernel")
    # Where the device waits on the host, in the forward and in the backward.
    out = run(q, k, v)
    grad = torch.randn_like(out)
    rows[-1]["idle"] = {
        "forward": idle_report(lambda: run(q, k, v), f"{name} forward"),
        "backward": idle_report(
            lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), f"{name} backward"
        ),
    }
    return True


def flex_block_mask(index: VerticalSlashIndex, with_bars: bool):
    from torch.nn.attention.flex_attention import BlockMask

    bs, n = index.block_size, index.num_blocks
    dev = index.device
    active = index.active_diagonals()[0]  # [H, n]
    qb = torch.arange(n, device=dev).view(-1, 1)
    kb = torch.arange(n, device=dev).view(1, -1)
    diag = (qb - kb).clamp(min=0)
    tile = active[:, diag] & (kb <= qb)  # [H, n, n]
    full = tile & (kb < qb)
    is_vertical = torch.zeros(HQ, index.seq_len, dtype=torch.bool, device=dev)
    vert = index.vertical[0].long()
    is_vertical.scatter_(1, vert.clamp(min=0), vert >= 0)
    partial = (kb == qb).expand_as(tile).clone()
    if with_bars:
        has_bar = is_vertical.view(HQ, n, bs).any(-1)  # [H, n]
        partial |= has_bar[:, None, :] & (kb <= qb)
    partial &= ~full

    def to_lists(m):
        counts = m.sum(-1).to(torch.int32)
        order = torch.sort(m.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return counts.unsqueeze(0).contiguous(), order.unsqueeze(0).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        d = (q_idx // bs - kv_idx // bs).clamp(min=0)
        hit = active[h, d]
        if with_bars:
            hit = hit | is_vertical[h, kv_idx]
        return (kv_idx <= q_idx) & hit

    kv_num, kv_idx = to_lists(partial)
    full_num, full_idx = to_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=mask_mod)


def row(name, seq, area, fwd, bwd, baseline=None):
    flops = 4 * area * D
    r = {
        "kernel": name,
        "seq": seq,
        "density": area / (HQ * seq * (seq + 1) / 2),
        "fwd_ms": fwd,
        "bwd_ms": bwd,
        "fwd_tflops": flops / fwd / 1e9,
        "bwd_tflops": 2.5 * flops / bwd / 1e9,
    }
    if baseline:
        r["speedup_vs_cudnn_fwd_bwd"] = (baseline["fwd_ms"] + baseline["bwd_ms"]) / (fwd + bwd)
    return r


def measure(name, fn, rows):
    try:
        rows.append(fn())
        r = rows[-1]
        print(
            f"{r['kernel']:<34} {r['seq']:>7} {r['density']:>8.4f} {r['fwd_ms']:>9.2f} {r['bwd_ms']:>9.2f} "
            f"{r['fwd_tflops']:>8.1f} {r['bwd_tflops']:>8.1f} {r.get('speedup_vs_cudnn_fwd_bwd', float('nan')):>8.2f}",
            flush=True,
        )
    except Exception as e:  # keep the other measurements of this run
        print(f"{name:<34} FAILED: {type(e).__name__}: {e}", flush=True)
        rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"})


def bench_seq(seq, args, gen, rows, extra):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    dev = "cuda"
    q = torch.randn(1, seq, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, seq, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, seq, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dense_area = HQ * seq * (seq + 1) / 2
    rep = args.rep_ms

    def sdpa(backend):
        def fwd(a, b, c):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

        return fwd

    cudnn = {}
    if seq <= args.dense_max:
        measure("sdpa cudnn (dense)", lambda: row("sdpa cudnn (dense)", seq, dense_area,
                *fwd_bwd_ms(sdpa(SDPBackend.CUDNN_ATTENTION), qt, kt, vt, rep)), rows)  # fmt: skip
        cudnn = rows[-1] if "error" not in rows[-1] else {}
    if seq <= args.dense_max and "dense" in args.patterns:
        measure("sdpa flash (dense)", lambda: row("sdpa flash (dense)", seq, dense_area,
                *fwd_bwd_ms(sdpa(SDPBackend.FLASH_ATTENTION), qt, kt, vt, rep), cudnn), rows)  # fmt: skip
        dense = DenseIndex(1, HQ, seq, device=q.device)
        measure("ours dense (triton)", lambda: row("ours dense (triton)", seq, dense_area,
                *fwd_bwd_ms(lambda a, b, c: sparse_attention(a, b, c, dense, backend="triton")[0], q, k, v, rep),
                cudnn), rows)  # fmt: skip
    if seq > args.dense_max:
        # Dense cuDNN time extrapolated as S^2 from the longest measured length, marked as such.
        cudnn = extra.get("cudnn_scaled", lambda s: {})(seq)

    topk = [p for p in ("msa", "moba") if "topk" in args.patterns or p in args.patterns]
    if topk:
        topk_rows(seq, q, k, v, gen, rows, cudnn, rep, extra, args.msa_index, topk, not args.library_rows_only)
    if "vertical_slash" not in args.patterns:
        return
    index = natural_index(seq, args.block, args.density, gen, dev)
    area = float(index.attended_area().sum())
    ours = lambda a, b, c: sparse_attention(a, b, c, index, backend="triton")[0]  # noqa: E731
    measure("ours vertical-slash (triton)", lambda: row("ours vertical-slash (triton)", seq, area,
            *fwd_bwd_ms(ours, q, k, v, rep), cudnn), rows)  # fmt: skip
    ours_row = rows[-1]

    flex = torch.compile(flex_attention, dynamic=False)
    flex_rows = () if args.no_flex else ((True, "flex, same mask"), (False, "flex, tiles only (bars dropped)"))
    for with_bars, name in flex_rows:

        def run_flex(with_bars=with_bars, name=name):
            bm = flex_block_mask(index, with_bars)
            f = lambda a, b, c: flex(a, b, c, block_mask=bm, enable_gqa=True)  # noqa: E731
            flex_area = (
                area
                if with_bars
                else float(
                    VerticalSlashIndex(index.vertical[:, :, :0], index.slash, seq, index.block_size)
                    .attended_area()
                    .sum()
                )
            )
            r = row(name, seq, flex_area, *fwd_bwd_ms(f, qt, kt, vt, rep), cudnn)
            if "error" not in ours_row:
                r["ours_speedup_fwd_bwd"] = (r["fwd_ms"] + r["bwd_ms"]) / (ours_row["fwd_ms"] + ours_row["bwd_ms"])
            return r

        measure(name, run_flex, rows)
        if "ours_speedup_fwd_bwd" in rows[-1]:
            print(f"    ours is {rows[-1]['ours_speedup_fwd_bwd']:.2f}x faster (fwd+bwd) than {name}")

    # Index building against the sparse forward, and its parts. The product path runs the passes
    # over the keys and replays the rest (statistics, selection, tile tables) from a CUDA graph; the
    # eager build is shown beside it.
    cfg = VerticalSlashConfig(block_size=args.block)
    build = lambda: tile_tables(build_vertical_slash_index(q, k, cfg))  # noqa: E731
    with torch.no_grad():
        build_ms = timed(build, rep)
        with mock.patch.dict(os.environ, {GRAPHS_ENV: "0"}):
            eager_build_ms = timed(build, rep)
        statistics_ms = timed(lambda: window_statistics(q, k, cfg), rep)
        stats = window_statistics(q, k, cfg)
        selection_ms = timed(lambda: select_vertical_slash(stats, cfg, seq), rep)
        tables_ms = timed(lambda: tile_tables(index), rep)
    extra.setdefault("index", []).append(
        {
            "seq": seq,
            "build_index_plus_tables_ms": build_ms,
            "eager_build_index_plus_tables_ms": eager_build_ms,
            "statistics_only_ms": statistics_ms,
            "selection_only_ms": selection_ms,
            "tables_only_ms": tables_ms,
            "sparse_fwd_ms": ours_row.get("fwd_ms"),
        }  # fmt: skip
    )
    print(f"    index build+tables {build_ms:.2f} ms (graphed; eager {eager_build_ms:.2f} ms: statistics "
          f"{statistics_ms:.2f}, top-p selection {selection_ms:.2f}, tables alone {tables_ms:.2f} ms) vs sparse "
          f"fwd {ours_row.get('fwd_ms', float('nan')):.2f} ms")  # fmt: skip

    if args.profile_index:
        record = extra["index"][-1]
        record["graphed_kernels_ms"] = profile_kernels(build, "index build (as run: graphed), GPU time per kernel")
        with mock.patch.dict(os.environ, {GRAPHS_ENV: "0"}):
            record["eager_kernels_ms"] = profile_kernels(build, "index build (eager), GPU time per kernel")

    # Peak memory of one forward + backward, against the tensors themselves.
    for what in (memory, kernel_times, kernel_resources):
        try:
            what(q, k, v, index, seq, extra)
        except Exception as e:
            print(f"    {what.__name__} FAILED: {type(e).__name__}: {e}")


def device_times(fn, calls: int = 1) -> list[tuple[float, int, str]]:
    """(device ms per call, launches per call, kernel) of ``fn``'s kernels, the longest
    first, after one call that compiles and warms up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted(
        (
            (e.device_time_total / calls / 1e3, e.count // calls, e.key)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ),
        reverse=True,
    )


def idle_report(fn, title: str, top: int = 6) -> dict:
    """Where the device waited in one call of ``fn`` (after a warm call): the step report's
    idle gaps (``training.step_report.idle_gaps``: each gap with the kernels around it and the
    runtime calls the host made meanwhile), printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_mtraining.training.step_report import device_and_host_events, idle_gaps

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events, host = device_and_host_events(prof)
    device = [(e.start_ns(), e.end_ns(), e.name()) for e in events]
    report = idle_gaps(device, host, top)
    span = (max(e for _, e, _ in device) - min(s for s, _, _ in device)) / 1e6 if device else 0.0
    print(f"    {title}: {span:.3f} ms from first to last device event, {report['gaps_ms']:.3f} ms idle in "
          f"{report['gaps']} gaps, {report['events']} events")  # fmt: skip
    for gap in report["longest"]:
        print(f"      {gap['ms']:7.3f} ms at {gap['at_ms']:8.3f}  after {gap['after'][:40]}  before {gap['before'][:40]}"
              f"  host: {', '.join(gap['host'])[:160]}")  # fmt: skip
    return report


def profile_kernels(fn, title: str, calls: int = 5, top: int = 12) -> float:
    """Prints the device time per call of ``fn``'s kernels, the longest first; returns their sum."""
    with torch.no_grad():
        times = device_times(fn, calls)
    total = sum(ms for ms, _, _ in times)
    print(f"    {title}: {total:.3f} ms in {sum(n for _, n, _ in times)} kernels a call")
    for ms, n, key in times[:top]:
        print(f"      {ms:7.3f} ms  x{n:<3d} {key[:90]}")
    return total


def memory(q, k, v, index, seq, extra, name="vertical-slash", backend="triton"):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = sparse_attention(q, k, v, index, backend=backend)[0]
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    inputs = nbytes((q, k, v))
    tensors = inputs + nbytes((out, out, *grads))  # q, k, v, o, do, dq, dk, dv
    ratio = (inputs + peak) / tensors
    extra.setdefault("memory", []).append(
        {"seq": seq, "index": name, "peak_bytes": inputs + peak, "tensor_bytes": tensors}
    )
    print(f"    {name}: peak fwd+bwd memory {(inputs + peak) / 2**30:.2f} GiB vs q/k/v/o/do/dq/dk/dv "
          f"{tensors / 2**30:.2f} GiB: ratio {ratio:.2f}")  # fmt: skip
    del out, grads


def kernel_times(q, k, v, index, seq, extra, name="vertical-slash", backend="triton"):
    """Device time of each kernel (summed over its launches) in one backward."""
    out = sparse_attention(q, k, v, index, backend=backend)[0]
    grad = torch.ones_like(out)
    times = device_times(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    extra.setdefault("bwd_kernel_ms", {})[seq if name == "vertical-slash" else f"{seq} {name}"] = {
        key: ms for ms, _, key in times
    }
    print(f"    {name} bwd kernels: " + ", ".join(f"{key[:40]} {n}x {ms:.2f} ms" for ms, n, key in times[:14]))


class _Recorded:
    """A Triton kernel whose compiled variant is kept."""

    def __init__(self, kernel, seen: dict, name: str):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            compiled = launch(*args, **kwargs)
            self.seen[self.name] = compiled
            return compiled

        return run


def kernel_resources(q, k, v, index, seq, extra):
    """Shared memory, registers and spills of the kernels of a forward and a backward (an
    A100 gives a block at most 163 KiB of shared memory)."""
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    seen = {}
    names = ("_fwd_kernel", "_dq_kernel", "_bar_dkdv_kernel", "_tile_dkdv_kernel")
    recorded = {name: _Recorded(getattr(block_bar, name), seen, name.strip("_")) for name in names}
    with mock.patch.multiple(block_bar, **recorded):
        out = sparse_attention(q, k, v, index, backend="triton")[0]
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    for name, compiled in seen.items():
        r = {"shared_bytes": compiled.metadata.shared, "registers": compiled.n_regs, "spills": compiled.n_spills}
        extra.setdefault("kernel_resources", {})[name] = r
        print(f"    {name:<34} shared {r['shared_bytes'] / 1024:6.1f} KiB  registers {r['registers']:>4}  "
              f"spills {r['spills']}")  # fmt: skip


# (block_n, num_warps, num_stages, block_m) tried per kernel by --tune, the defaults first.
# The 128-key four-stage tile dK/dV shapes exceed an A100's shared memory. The 4-warp
# shapes use few enough registers and shared memory for two programs to share an H100 /
# H200 multiprocessor, where one's softmax can overlap the other's matrix products.
TUNE_CANDIDATES = {
    "fwd": [
        (64, 8, 3, 128),
        (64, 4, 3, 64),
        (64, 4, 4, 64),
        (32, 4, 3, 64),
        (64, 4, 2, 64),
        (64, 8, 4, 128),
        (128, 8, 3, 128),
        (128, 8, 3, 64),
    ],
    "dq": [
        (64, 8, 3, 128),
        (64, 4, 3, 64),
        (64, 4, 4, 64),
        (32, 4, 3, 64),
        (64, 4, 2, 64),
        (64, 8, 4, 128),
        (128, 8, 3, 64),
    ],
    **dict.fromkeys(
        ("bar_dkdv", "tile_dkdv"),
        [(128, 8, 3, 64), (128, 8, 4, 64), (128, 8, 4, 32), (64, 4, 4, 32), (128, 8, 2, 64), (64, 4, 3, 64)],
    ),
}


def tune(args) -> dict:
    """The sweeps of the kernels ``--tune`` names (none named: all), block-bar kernels first:
    per kernel its best config, device time, worst time and every candidate's time."""
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    names = args.tune or [*block_bar.KERNELS, *MSA_TUNE]
    best = {}
    if any(name in block_bar.KERNELS for name in names):
        best |= tune_block_bar(args, [name for name in names if name in block_bar.KERNELS])
    if any(name in MSA_TUNE for name in names):
        best |= tune_msa(args, [name for name in names if name in MSA_TUNE])
    return best


def tune_block_bar(args, names) -> dict:
    """Coordinate sweep of the launch configs on the vertical-slash pattern at the first
    length: each kernel in turn, the others at their current best. Its index comes from a
    generator of its own, so that the timed rows see the same index as untuned runs."""
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    seq = args.seq_lens[0]
    q, k, v = (
        torch.randn(1, seq, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)
    )
    index = natural_index(seq, args.block, args.density, torch.Generator().manual_seed(args.seed + 1), "cuda")
    best = {}
    for name in names:
        results = []
        for bn, warps, stages, bm in TUNE_CANDIDATES[name]:
            if bn > args.block:
                continue
            cfg = block_bar.LaunchConfig(bn, warps, stages, bm)
            block_bar.OVERRIDES[name] = cfg
            try:
                out = sparse_attention(q, k, v, index, backend="triton")[0]
                if name == "fwd":
                    ms = timed(lambda: sparse_attention(q, k, v, index, backend="triton"), args.rep_ms // 2)
                else:
                    g = torch.randn_like(out)
                    ms = timed(
                        lambda o=out, g=g: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), args.rep_ms // 2
                    )
                results.append((ms, cfg))
                print(f"    {name} {cfg}: {ms:.3f} ms", flush=True)
            except Exception as e:  # out of shared memory, registers
                print(f"    {name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if not results:
            block_bar.OVERRIDES.pop(name)
            print(f"tuned {name}: every candidate failed, default kept", flush=True)
            continue
        results.sort(key=lambda r: r[0])
        block_bar.OVERRIDES[name] = results[0][1]
        best[name] = {"config": vars(results[0][1]), "ms": results[0][0], "worst_ms": results[-1][0],
                      "candidates": [{"config": vars(cfg), "ms": ms} for ms, cfg in results]}  # fmt: skip
        print(f"tuned {name}: {results[0][1]} {results[0][0]:.3f} ms (worst {results[-1][0]:.3f} ms)", flush=True)
    return best


# MSA's kernels by --tune name: the ``kv_outer.attention.OVERRIDES`` entry each sets (None:
# ``msa_index.LAUNCH``), the Triton kernels whose device time decides (a bwd candidate of 64-key
# steps hands the dQ products to ``_dq_kernel``), and the candidates, fields in the config's
# order (PassConfig: block_m, block_n, num_warps, num_stages, tiles_per_item; RowConfig: rows,
# num_warps, num_stages; SelectLaunch: block_m, block_n, num_warps, num_stages), tried after
# the default. Plain Triton launch parameters, nothing sm90-only, so that a winner can be the
# default on an A100 too once ``scripts/compile_kernels.py`` finds that it fits there. The
# per-row kernels are memory-bound: rows a program and warps set how many loads are in flight.
# The selection is bound by its products: tile shapes, warps and pipelining.
_ROW_CANDIDATES = [(rows, warps, 3) for rows in (8, 16, 32, 64) for warps in (2, 4, 8)] + [(32, 4, 2), (32, 4, 4)]
MSA_TUNE = {
    "kv_fwd": ("fwd", ("_fwd_kernel",), [
        (64, 128, 4, 3, 8), (64, 128, 8, 2, 8), (64, 128, 4, 1, 8), (32, 128, 4, 2, 8), (128, 128, 8, 2, 8),
        (64, 64, 4, 2, 8), (64, 64, 4, 3, 8), (64, 128, 4, 2, 4), (64, 128, 4, 2, 16),
    ]),
    "kv_merge": ("merge", ("_merge_kernel",), _ROW_CANDIDATES),
    "kv_bwd": ("bwd", ("_bwd_kernel", "_dq_kernel"), [
        (64, 128, 8, 1, 8), (64, 128, 8, 3, 8), (64, 128, 4, 2, 8), (32, 128, 4, 2, 8), (32, 128, 8, 2, 8),
        (128, 128, 8, 2, 8), (64, 128, 8, 2, 4), (64, 128, 8, 2, 16), (64, 64, 8, 2, 8),
    ]),
    "kv_sum_slots": ("sum_slots", ("_sum_slots_kernel",), _ROW_CANDIDATES),
    "kv_reduce": ("reduce", ("_reduce_kernel",), _ROW_CANDIDATES),
    "msa_select": (None, ("_block_select_kernel",), [
        (block_m, block_n, warps, stages)
        for block_m in (128, 64) for block_n in (64, 32, 128) for warps in (8, 4) for stages in (2, 3, 4)
    ]),
}  # fmt: skip


def tune_msa(args, names) -> dict:
    """Coordinate sweep of MSA's KV-outer kernels and selection (``MSA_TUNE``) on the MSA rows'
    index (``--msa-index``) at the first length, each named kernel in turn, the others at their
    current best, which stays set for the rows. A candidate's time is its kernels' device time
    in one pass (the profiler's, as ``device_times``; the pass's other kernels only add noise,
    which the memory-bound kernels' differences would drown in); the pass's device time is
    recorded beside it. Candidates that fail (shared memory, registers) are skipped; so are
    selection tiles the GPU cannot hold, rather than run with fewer rows as the product does."""
    from megatron_mtraining.sparse.kernels.index_build import msa_index
    from megatron_mtraining.sparse.kernels.kv_outer import attention as kv

    seq = args.seq_lens[0]
    gen = torch.Generator().manual_seed(args.seed + 1)
    q, k, v = (
        torch.randn(1, seq, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)
    )
    q_idx, k_idx, config = msa_index_inputs(*structured_qk(seq, gen), gen, args.msa_index)
    index = msa_select_blocks(q_idx, k_idx, config, HQ)
    q_idx, k_idx = q_idx.bfloat16(), k_idx.bfloat16()  # the index branch's dtype in training
    scale = D**-0.5

    def forward():
        return kv.KVOuterAttention.apply(q, k, v, index, scale)[0]

    def backward():
        out = forward()
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    def select():
        with torch.no_grad():
            msa_select_blocks(q_idx, k_idx, config, HQ)

    selection = msa_index.LAUNCH
    select_fields = ("block_m", "block_n", "num_warps", "num_stages")

    def candidate(entry, values):
        if entry is None:
            return dataclasses.replace(selection, **dict(zip(select_fields, values, strict=True)))
        return type(kv.DEFAULTS[entry])(*values)

    def install(entry, cfg):
        """Sets ``cfg`` for the kernel of ``entry`` (None: the selection); ``cfg`` None: its default."""
        if entry is None:
            msa_index.LAUNCH = cfg or selection
        elif cfg is None:
            kv.OVERRIDES.pop(entry, None)
        else:
            kv.OVERRIDES[entry] = cfg

    best = {}
    no_retry = mock.patch.object(msa_index, "with_fewer_rows", lambda launch, rows, smallest=16: launch(rows))
    for name in names:
        entry, kernels, values = MSA_TUNE[name]
        default = selection if entry is None else kv.DEFAULTS[entry]
        configs = [default] + [c for c in (candidate(entry, v) for v in values) if c != default]
        results = []
        for cfg in configs:
            install(entry, cfg)
            try:
                # A backward candidate runs on a graph of its own, through the forward at its current best.
                run = {None: select, "fwd": forward, "merge": forward}.get(entry) or backward()
                with no_retry:
                    times = device_times(run, calls=3)
                if not any(key in kernels for _, _, key in times):
                    raise RuntimeError(f"no launch of {' or '.join(kernels)} was profiled")
                ms = sum(t for t, _, key in times if key in kernels)
                results.append((ms, sum(t for t, _, _ in times), cfg))
                print(f"    {name} {cfg}: {ms:.3f} ms (pass {results[-1][1]:.3f} ms)", flush=True)
            except Exception as e:  # out of shared memory, registers
                print(f"    {name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if not results:
            install(entry, None)
            print(f"tuned {name}: every candidate failed, default kept", flush=True)
            continue
        results.sort(key=lambda r: r[0])
        install(entry, None if results[0][2] == default else results[0][2])
        best[name] = {"config": vars(results[0][2]), "ms": results[0][0], "pass_ms": results[0][1],
                      "worst_ms": results[-1][0], "default": vars(default),
                      "candidates": [{"config": vars(cfg), "ms": ms, "pass_ms": pass_ms}
                                     for ms, pass_ms, cfg in results]}  # fmt: skip
        print(f"tuned {name}: {results[0][2]} {results[0][0]:.3f} ms (worst {results[-1][0]:.3f} ms)", flush=True)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--dense-max", type=int, default=131072, help="longest length to time dense kernels at")
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--tune",
        nargs="*",
        default=None,
        metavar="KERNEL",
        choices=[*TUNE_CANDIDATES, *MSA_TUNE],
        help="sweep the launch configs of these kernels (none named: all) first and use the best: the block-bar "
        "kernels (fwd, dq, bar_dkdv, tile_dkdv) on the vertical-slash pattern, MSA's KV-outer kernels (kv_fwd, "
        "kv_merge, kv_bwd, kv_sum_slots, kv_reduce) and selection (msa_select) on its structured index",
    )
    p.add_argument(
        "--msa-index",
        choices=["structured", "untrained"],
        default="structured",
        help="MSA's selection: from structured data (local, as a trained indexer), or independent random "
        "index queries and keys (spread evenly, as an untrained indexer at the start of training)",
    )
    p.add_argument("--no-flex", action="store_true", help="leave out the FlexAttention rows (slow to compile)")
    p.add_argument(
        "--library-rows-only",
        action="store_true",
        help="MoBA on the varlen library only: leave out its KV-outer and union-of-tiles rows (minutes at 512K)",
    )
    p.add_argument("--profile-index", action="store_true", help="print the index build's device time per kernel")
    p.add_argument(
        "--patterns",
        nargs="+",
        default=["dense", "vertical_slash", "topk"],
        choices=["dense", "vertical_slash", "topk", "msa", "moba"],
        help="topk: MSA and MoBA; msa or moba: one of them (the cuDNN dense row always runs up to --dense-max)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(args.seed)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  capability "
          f"{torch.cuda.get_device_capability()}  allocator {ALLOC_CONF}")  # fmt: skip
    print(f"{'kernel':<34} {'seq':>7} {'density':>8} {'fwd_ms':>9} {'bwd_ms':>9} {'fwd_TF':>8} {'bwd_TF':>8} "
          f"{'x cuDNN':>8}")  # fmt: skip
    rows, extra = [], {}
    start = time.time()
    if args.tune is not None:
        extra["tuned"] = tune(args)
    for seq in args.seq_lens:
        bench_seq(seq, args, gen, rows, extra)
        measured = [r for r in rows if r.get("kernel") == "sdpa cudnn (dense)" and "error" not in r]
        if measured:
            ref = measured[-1]
            extra["cudnn_scaled"] = lambda s, ref=ref: {
                "fwd_ms": ref["fwd_ms"] * (s / ref["seq"]) ** 2, "bwd_ms": ref["bwd_ms"] * (s / ref["seq"]) ** 2}  # fmt: skip
    extra.pop("cudnn_scaled", None)
    print(f"total {time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, **extra, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "allocator": ALLOC_CONF}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
