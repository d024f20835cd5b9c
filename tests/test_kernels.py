"""Triton kernels against fp64 dense attention and the reference path.

On a machine without CUDA they run in Triton's interpreter (fp32/fp16; its bf16 is
broken), so CI checks the kernel logic; on a GPU the same tests run natively with
bf16 too, plus larger shapes. Kernel outputs are poisoned with NaN before each run.
"""

import functools
import os

import pytest
import torch
from dense_reference import assert_close_rel, check_index_attention, dense_attention, finite

from megatron_mtraining.sparse import (
    DenseIndex,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    VerticalSlashIndex,
    build_moba_index,
    build_vertical_slash_index,
    msa_select_blocks,
    sparse_attention,
)

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs CUDA or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("poisoned_outputs"),
]


def make_inputs(rng, b, s, hq, hkv, d, dtype, device):
    def t(h):
        return torch.randn(b, s, h, d, generator=rng).to(device, dtype).requires_grad_()

    return t(hq), t(hkv), t(hkv)


def make_index(kind, q, k, block):
    b, s, hq, _ = q.shape
    if kind == "dense":
        return DenseIndex(b, hq, s, device=q.device)
    if kind == "msa":  # index projections stand-in: the group's mean query, and the keys
        q_idx = q.detach().float().unflatten(2, (k.shape[2], -1)).mean(3)
        k_idx = k.detach().float().mean(2, keepdim=True)
        return msa_select_blocks(q_idx, k_idx, MSAConfig(block_size=block, topk=3, index_head_dim=q.shape[-1]), hq)
    if kind == "moba":  # chunks of two tiles: exercises the block-to-tile ratio
        return build_moba_index(q, k, MoBAConfig(chunk_size=2 * block if block < 128 else block, topk=2))
    cfg = VerticalSlashConfig(
        last_q=32, vertical_topp=0.6, slash_topp=0.6, block_size=block, sink_tokens=3, vertical_cap=200
    )
    return build_vertical_slash_index(q, k, cfg)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def check(q, k, v, index, rng):
    return check_index_attention(q, k, v, index, rng, TOLERANCE[q.dtype], backend="triton")


@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "msa", "moba"])
@pytest.mark.parametrize(
    "b,s,hq,hkv,d",
    [(1, 100, 4, 1, 32), (2, 83, 6, 2, 24), (1, 70, 3, 3, 16)],
    ids=["gqa4-d32-ragged", "gqa3-d24-b2", "mha-d16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernels_match_dense(kind, b, s, hq, hkv, d, dtype, rng, kdevice):
    q, k, v = make_inputs(rng, b, s, hq, hkv, d, dtype, kdevice)
    check(q, k, v, make_index(kind, q, k, block=16), rng)


def planted_empty_rows_index(device):
    """Two heads over 64 tokens, blocks of 16. Head 0: no tiles, columns 20 and 40 (rows
    0-19 see nothing, later rows only bars); head 1: block diagonal 2 and column 40 (rows
    0-31 see nothing, 32-39 only tiles)."""
    return VerticalSlashIndex(
        vertical=torch.tensor([[[20, 40], [40, -1]]], dtype=torch.int32),
        slash=torch.tensor([[[-1], [2]]], dtype=torch.int32),
        seq_len=64,
        block_size=16,
    ).to(device)


def test_empty_rows_and_unused_bars(rng, kdevice):
    """Rows that see nothing give zeros / -inf; a column no row of a block can see is skipped."""
    q, k, v = make_inputs(rng, 1, 64, 2, 1, 16, torch.float32, kdevice)
    out, lse, _ = check(q, k, v, planted_empty_rows_index(kdevice), rng)
    assert torch.equal(out[0, :20, 0], torch.zeros_like(out[0, :20, 0]))
    assert torch.isneginf(lse[0, 0, :20]).all()


def test_future_keys_far_above_the_visible_ones(rng, kdevice):
    """Logits growing by 20 per key position: within a diagonal tile, a row's future keys
    score up to 300 above its visible ones, so exp of a future logit against the row's
    visible maximum overflows fp32. The masked maxima must leave them out."""
    b, s, d = 1, 48, 16
    u = torch.nn.functional.normalize(torch.randn(d, generator=rng), dim=0)
    q = (u + 0.05 * torch.randn(b, s, 2, d, generator=rng)).to(kdevice).requires_grad_()
    growth = 20 * d**0.5 * torch.arange(s, dtype=torch.float32).view(1, s, 1, 1)
    k = (u * growth + torch.randn(b, s, 1, d, generator=rng)).to(kdevice).requires_grad_()
    v = torch.randn(b, s, 1, d, generator=rng).to(kdevice).requires_grad_()
    # Logits near 1e3 (natural-log units) carry fp32 rounding of ~1e-4, relative error of
    # every probability on a GPU's exponentials: on an H200, 89 of 15400 seeds missed the
    # default 2e-5 by up to 1.29x (dV). An exponential that overflows gives inf / NaN.
    top = float((torch.einsum("bqhd,bkhd->bqhk", q.detach().cpu(), k.detach().cpu()).abs().max()) / d**0.5)
    tol = max(TOLERANCE[torch.float32], top * 2**-23)
    check_index_attention(q, k, v, DenseIndex(b, 2, s, device=kdevice), rng, tol, backend="triton")


def tiles_and_bars(index: VerticalSlashIndex, positions: bool = False):
    """A vertical-slash index's tile tables split into two over disjoint key sets: its
    tiles alone, and its bars alone (columns inside attended tiles still skipped). With
    ``positions``, the tables carry the global block ids of the query and key blocks (the
    block indices themselves) and the bars' positions, as context-parallel steps do."""
    import dataclasses

    from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables

    whole = tile_tables(index)
    if positions:
        blocks = torch.arange(whole.tiles.shape[2], dtype=torch.int32, device=index.device)
        whole = dataclasses.replace(whole, query_blocks=blocks, key_blocks=blocks, bar_positions=index.vertical)
    tiles = dataclasses.replace(whole, vertical=None, bar_count=None, vertical_ptr=None, active=None)
    bars = dataclasses.replace(
        whole, tile_count=torch.zeros_like(whole.tile_count), tile_t_count=torch.zeros_like(whole.tile_t_count)
    )
    return {"tiles": tiles, "bars": bars}


@pytest.mark.parametrize("shape", ["planted-empty-rows", "gqa3-d24-b2", "gqa3-d24-b2-positions"])
@pytest.mark.parametrize("first", ["tiles", "bars"])
@pytest.mark.parametrize("final", ["inputs-dtype", "fp32-in-place"])
# fp16 through Triton's interpreter is the slowest repeat of the fp32 cases on a CPU: -m slow.
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16],
    ids=["fp32", "fp16", "bf16"],
)
def test_accumulation_over_a_key_split(shape, first, final, dtype, rng, kdevice):
    """The accumulate modes: a key set split in two kernel calls (a vertical-slash index's
    tiles and its bars), the first writing an fp32 (out, lse) and the second merging its
    own into it in the kernel, and the dQ of the second added to the first's fp32 dQ. The
    second call writes in the inputs' dtype or over the fp32 running buffers. Equal to
    fp64 dense attention over the union (gradients through out and lse), rows that see
    no key in either part included; ``-positions``: with global block ids given, as
    context-parallel steps give them."""
    from megatron_mtraining.sparse.kernels.block_bar.attention import kernel_backward, kernel_forward

    if dtype == torch.bfloat16 and kdevice.type == "cpu":
        pytest.skip("Triton's interpreter mishandles bf16")
    if shape == "planted-empty-rows":
        q, k, v = (t.detach() for t in make_inputs(rng, 1, 64, 2, 1, 16, dtype, kdevice))
        index = planted_empty_rows_index(kdevice)
    else:
        q, k, v = (t.detach() for t in make_inputs(rng, 2, 83, 6, 2, 24, dtype, kdevice))
        index = make_index("vertical_slash", q, k, block=16)
    parts = tiles_and_bars(index, positions=shape.endswith("-positions"))
    part_a, part_b = parts[first], parts[{"tiles": "bars", "bars": "tiles"}[first]]
    out_dtype = dtype if final == "inputs-dtype" else torch.float32
    scale = q.shape[-1] ** -0.5

    running = kernel_forward(q, k, v, part_a, scale, out_dtype=torch.float32)
    out, lse = kernel_forward(q, k, v, part_b, scale, running=running, out_dtype=out_dtype)
    assert out.dtype == out_dtype and lse.dtype == torch.float32

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_attention(*leaves, index.to_dense_mask(q.shape[1]), scale)
    tol = TOLERANCE[dtype]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close_rel(out, ref_out, tol, "out")
    assert_close_rel(finite(lse), finite(ref_lse), max(tol, 1e-5), "lse")

    g_out = torch.randn(out.shape, generator=rng).to(kdevice)
    g_lse = torch.randn(lse.shape, generator=rng).to(kdevice)
    want = torch.autograd.grad((ref_out * g_out.double()).sum() + (finite(ref_lse) * g_lse.double()).sum(), leaves)
    dlse = torch.where(torch.isinf(lse), 0.0, g_lse)
    dq_a, dk_a, dv_a = kernel_backward(q, k, v, part_a, scale, out, lse, g_out, dlse, dq_dtype=torch.float32)
    dq, dk_b, dv_b = kernel_backward(q, k, v, part_b, scale, out, lse, g_out, dlse, dq_running=dq_a, dq_dtype=out_dtype)
    assert dq.dtype == out_dtype
    got = (dq, dk_a.double() + dk_b.double(), dv_a.double() + dv_b.double())
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not a.isnan().any(), f"{name} has NaN (unwritten?)"
        assert_close_rel(a, e, 2 * tol, name)


def test_accumulation_needs_fp32_running_buffers(rng, kdevice):
    from megatron_mtraining.sparse.kernels.block_bar.attention import kernel_backward, kernel_forward
    from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables

    q, k, v = (t.detach() for t in make_inputs(rng, 1, 32, 2, 1, 16, torch.float16, kdevice))
    tables = tile_tables(DenseIndex(1, 2, 32, device=kdevice))
    out, lse = kernel_forward(q, k, v, tables, 0.25)
    with pytest.raises(ValueError, match=r"running\[0\]='torch.float16 \(1, 32, 2, 16\)'.*contiguous torch.float32"):
        kernel_forward(q, k, v, tables, 0.25, running=(out, lse))
    with pytest.raises(ValueError, match=r"running\[1\]='torch.float32 \(1, 2, 16\)'.*shape \(1, 2, 32\)"):
        kernel_forward(q, k, v, tables, 0.25, running=(out.float(), lse[..., :16].contiguous()))
    with pytest.raises(ValueError, match=r"dq_running='torch.float16"):
        kernel_backward(q, k, v, tables, 0.25, out, lse, out, None, dq_running=q)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "msa", "moba"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("heads", [(16, 2), (8, 8)], ids=["gqa8", "mha"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernels_on_gpu_shapes(kind, d, block, heads, dtype, rng, device):
    if device.type != "cuda":
        pytest.skip("GPU shapes")
    q, k, v = make_inputs(rng, 1, 1000, heads[0], heads[1], d, dtype, device)
    check(q, k, v, make_index(kind, q, k, block), rng)


@pytest.mark.gpu
def test_backward_is_deterministic(rng, device):
    if device.type != "cuda":
        pytest.skip("GPU only")
    q, k, v = make_inputs(rng, 1, 4096, 16, 2, 128, torch.bfloat16, device)
    index = make_index("vertical_slash", q, k, 64)
    g = torch.randn(q.shape, generator=rng).to(device, torch.bfloat16)
    runs = [torch.autograd.grad(sparse_attention(q, k, v, index, backend="triton")[0], (q, k, v), g) for _ in range(3)]
    for again in runs[1:]:
        for a, e in zip(runs[0], again, strict=True):
            assert torch.equal(a, e)


def test_auto_backend_uses_kernels_only_on_cuda(rng, device, monkeypatch):
    from megatron_mtraining.sparse import attention

    calls = []
    real = attention.ReferenceSparseAttention.apply
    monkeypatch.setattr(attention.ReferenceSparseAttention, "apply", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_inputs(rng, 1, 32, 2, 1, 16, torch.float32, device)
    sparse_attention(q, k, v, DenseIndex(1, 2, 32, device=device))
    assert bool(calls) == (device.type == "cpu")
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    calls.clear()
    sparse_attention(q, k, v, DenseIndex(1, 2, 32, device=device))
    assert calls


def test_backend_errors_name_the_choice(rng):
    q, k, v = make_inputs(rng, 1, 32, 2, 1, 16, torch.float64, "cpu")
    with pytest.raises(ValueError, match="backend='fast'.*auto, reference, triton"):
        sparse_attention(q, k, v, DenseIndex(1, 2, 32), backend="fast")
    with pytest.raises(ValueError, match="backend='triton'.*torch.float64"):
        sparse_attention(q, k, v, DenseIndex(1, 2, 32), backend="triton")


def test_sub_tiles_narrower_than_the_block(rng, kdevice, block_bar_steps):
    """Key sub-tiles (BLOCK_N) and query-row steps of the dK/dV kernels (BLOCK_M) narrower
    than the index block: same results."""
    block_bar_steps(16)
    q, k, v = make_inputs(rng, 1, 150, 4, 2, 16, torch.float32, kdevice)
    check(q, k, v, make_index("vertical_slash", q, k, block=32), rng)
    check(q, k, v, make_index("dense", q, k, block=32), rng)


# Vertical-slash window statistics (megatron_mtraining.sparse.kernels.index_build.window_stats).


@pytest.fixture
def stats_kernels(kdevice, monkeypatch):
    """Statistics on the kernels (``MTRAINING_ATTENTION_BACKEND=triton``), with tiles small
    enough that tiny inputs span several key tiles, chunks, row tiles and mass blocks."""
    from megatron_mtraining.sparse.kernels.index_build import window_stats

    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(
        window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, chunk_blocks=2, block_mass=16)
    )
    return kdevice


def statistics(q_window, k, positions, seq, cfg, device):
    """``window_statistics_from_parts`` on ``device``, results on the CPU."""
    from megatron_mtraining.sparse.vertical_slash import window_statistics_from_parts

    scale = q_window.shape[-1] ** -0.5
    args = (q_window.to(device), k.to(device), positions.to(device))
    stats = window_statistics_from_parts(*args, seq, cfg, scale)
    return stats.vertical.cpu(), stats.slash.cpu()


@pytest.mark.parametrize("keys", ["all", "striped-shard"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 1, 64), (2, 2, 128)], ids=["gqa8-d64", "mha-d128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_window_statistics_kernels_match_fp64_reference(keys, hq, hkv, d, dtype, rng, stats_kernels, monkeypatch):
    """Column and block-diagonal mass of the kernels against the fp64 reference on the same
    keys: 100 tokens (not a multiple of any tile), a 24-row window (longer than a key tile),
    and either all keys or rank 0's stripes of 8 of a 2-way split (keys out of position order
    in their tiles, blocks half held)."""
    if dtype == torch.bfloat16 and stats_kernels.type == "cpu":
        pytest.skip("Triton's interpreter mishandles bf16")
    seq, w = 100, 24
    q = (torch.randn(1, seq, hq, d, generator=rng) * 1.5).to(dtype)
    k = (torch.randn(1, seq, hkv, d, generator=rng) * 1.5).to(dtype)
    positions = torch.arange(seq)
    if keys == "striped-shard":
        positions = torch.cat([positions[s : s + 8] for s in range(0, seq, 16)])
    cfg = VerticalSlashConfig(last_q=w, block_size=16)
    got = statistics(q[:, seq - w :], k[:, positions], positions, seq, cfg, stats_kernels)
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    want = statistics(q[:, seq - w :], k[:, positions], positions, seq, cfg, "cpu")
    for name, a, e in zip(("vertical", "slash"), got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("documents", [False, True], ids=["one-window", "documents"])
def test_window_statistics_kernels_add_up_over_a_key_split(documents, rng, stats_kernels):
    """Partial statistics of a striped 2-way key split (stripes of 4: every mass block half
    held), reduced as the context-parallel builder does, equal those of all keys: no term
    depends on the split and the sums across tiles and devices are fp64. With documents
    (one of one token, one shorter than the window ending on a stripe edge, random cuts),
    each rank finds each document's keys among its own (none, for some)."""
    from megatron_mtraining.context_parallel import ContextParallelLayout
    from megatron_mtraining.sparse.kernels.index_build.window_stats import WindowKernels
    from megatron_mtraining.sparse.vertical_slash import ObservationWindows

    seq, w = 96, 20
    q = torch.randn(1, seq, 4, 32, generator=rng).half().to(stats_kernels)
    k = torch.randn(1, seq, 2, 32, generator=rng).half().to(stats_kernels)
    layout = ContextParallelLayout("striped", 2, seq, stripe=4)
    bounds = [(0, seq)]
    if documents:
        cuts = sorted(set(torch.randint(9, seq - 1, (3,), generator=rng).tolist()))
        bounds = list(zip([0, 1, 8, *cuts], [1, 8, *cuts, seq], strict=True))

    def parts(keys, positions):
        windows = ObservationWindows.of_documents(bounds, w, seq, positions)
        rows = torch.tensor(windows.row_positions(), device=q.device)
        return WindowKernels(q[:, rows], keys, positions.to(k.device), windows, 0.2, 16)

    ranks = [parts(layout.shard(k, r), layout.positions(r)) for r in (0, 1)]
    whole = parts(k, torch.arange(seq))
    row_max = whole.row_max()
    assert torch.equal(torch.maximum(*(p.row_max() for p in ranks)), row_max)
    row_sum = whole.row_sum(row_max)
    torch.testing.assert_close(sum(p.row_sum(row_max) for p in ranks), row_sum, rtol=1e-14, atol=0)
    split = [p.totals(*p.mass(row_max, row_sum)) for p in ranks]
    for i, full in enumerate(whole.totals(*whole.mass(row_max, row_sum))):
        torch.testing.assert_close((split[0][i] + split[1][i]).float(), full.float(), rtol=0, atol=0)


@pytest.mark.parametrize("seq,w,block_size", [(2100, 24, 16), (2100, 40, 512), (100, 24, 32)])
@pytest.mark.parametrize("documents", [False, True], ids=["one-window", "documents"])
def test_pool_kernel_equals_the_torch_pooling(seq, w, block_size, documents, rng, stats_kernels):
    """The mass pass's runs added up and pooled into block diagonals in one launch, against
    their sum pooled by ``_pool_diagonals`` (the reference's pooling): random runs, nonzero
    outside the window that holds the token diagonals too, lengths that are no multiple of
    the block, several programs, a block wider than a program's usual span. With documents
    (one of one token, a few shorter than the window), each pools its own region of the
    runs: its key blocks and row tiles, after those of the documents before it."""
    from megatron_mtraining.sparse.kernels.index_build.window_stats import WindowKernels
    from megatron_mtraining.sparse.vertical_slash import ObservationWindows, _pool_diagonals

    bounds = [(0, seq)]
    if documents:
        cuts = sorted(set(torch.randint(2, seq - 1, (6,), generator=rng).tolist()))
        bounds = list(zip([0, 1, *cuts], [1, *cuts, seq], strict=True))
    windows = ObservationWindows.of_documents(bounds, w, seq)
    q = torch.randn(1, len(windows.row_positions()), 4, 16, generator=rng).half().to(stats_kernels)
    k = torch.randn(1, seq, 2, 16, generator=rng).half().to(stats_kernels)
    parts = WindowKernels(q, k, None, windows, 0.3, block_size)
    runs = torch.rand(1, 4, parts.n_tiles * 2, parts.run_len, generator=rng, dtype=torch.float64).to(stats_kernels)
    vertical = torch.rand(1, 4, seq, generator=rng).to(stats_kernels)
    want, region = [], 0
    for length, rows in zip(windows.lengths, windows.rows, strict=True):
        n_blocks = -(-length // parts.block)
        start = region + n_blocks * parts.block - length + rows - 1  # the document's token diagonal 0
        want.append(_pool_diagonals(runs[..., start : start + length].sum(2), block_size))
        region += (n_blocks + parts.n_tiles) * parts.block
    assert region == parts.run_len
    got_vertical, got = parts.totals(vertical, runs, parts.tables)
    assert got_vertical is vertical
    torch.testing.assert_close(got, torch.cat(want, -1), rtol=1e-13, atol=0)


def dense_block_masses(q_rows, k, seq, block_size, bounds, scale):
    """fp64 brute force: each of the last ``R`` rows' softmax over its document's keys (up to
    itself) under a boolean mask, summed per ``block_size`` block of keys, ``[B, Hq, R,
    n_blocks]``."""
    n_rows, hq, hkv = q_rows.shape[1], q_rows.shape[2], k.shape[2]
    logits = torch.einsum(
        "brhd,bshd->bhrs", q_rows.double().cpu(), k.double().cpu().repeat_interleave(hq // hkv, dim=2)
    )
    rows, keys = torch.arange(seq - n_rows, seq), torch.arange(seq)
    starts = torch.tensor([max(a for a in bounds[:-1] if a <= i) for i in rows.tolist()])
    allowed = (keys.view(1, -1) <= rows.view(-1, 1)) & (keys.view(1, -1) >= starts.view(-1, 1))
    probs = torch.softmax((logits * scale).masked_fill(~allowed, float("-inf")), dim=-1)
    n_blocks = -(-seq // block_size)
    probs = torch.nn.functional.pad(probs, (0, n_blocks * block_size - seq))
    return probs.unflatten(-1, (n_blocks, block_size)).sum(-1)


def split_block_masses(q_rows, k, seq, block_size, bounds, scale, holders):
    """The block masses from the window passes (``window_parts``: the kernels or the
    reference, as the backend setting says) of each holder of some keys (``holders``: their
    global positions, ascending), combined as ``msa_recall_from_parts`` combines them under
    context parallelism: the row maxima by max, then the block sums by sum."""
    from megatron_mtraining.sparse.vertical_slash import ObservationWindows, window_parts

    n_rows = q_rows.shape[1]
    parts = []
    for positions in holders:
        windows = ObservationWindows.of_rows(range(seq - n_rows, seq), bounds, seq, positions)
        on = positions.to(k.device)
        parts.append(window_parts(q_rows, k[:, on], on, windows, scale, block_size))
    row_max = functools.reduce(torch.maximum, [part.row_max() for part in parts])
    sums = sum(part.block_sums(row_max) for part in parts)
    assert sums.dtype == torch.float64 and not sums.isnan().any()
    return (sums / sums.sum(-1, keepdim=True)).cpu()


@pytest.mark.parametrize(
    "hq,hkv,keys,documents",
    [(3, 3, "all", True), (6, 2, "all", False), (3, 3, "striped-shards", False), (6, 2, "striped-shards", True)],
    ids=["group1-documents", "group3", "group1-striped", "group3-striped-documents"],
)
def test_block_sums_equal_the_dense_softmax_per_block(hq, hkv, keys, documents, rng, stats_kernels, monkeypatch):
    """MSA's block masses (``block_sums`` after ``row_max``: each row's softmax mass per key
    block, no ``[.., R, keys]`` tensor) on the kernels and on the fp64 reference, against a
    brute-force dense softmax under the boolean mask: 100 tokens (not a multiple of the
    16-token blocks), 20 window rows from a block's start, a head dim that is no power of
    two. Keys all on one holder, or split between two holders in stripes of 12 (blocks held
    in part by each, a stripe boundary inside a block), combined as under context
    parallelism. With documents: a random one ending inside the window, in the block where
    the last (of one or two blocks) starts, with more window rows than the last; so the
    last's padding rows, were they stored, would land on the next head's first rows in that
    shared block, after those rows' own values (the interpreter runs items in order)."""
    seq, n_rows, bs, d = 100, 20, 16, 24
    q = (torch.randn(2, n_rows, hq, d, generator=rng) * 1.5).half()
    k = (torch.randn(2, seq, hkv, d, generator=rng) * 1.5).half()
    bounds = [0, seq]
    if documents:
        bounds = [0, *(int(torch.randint(lo, hi, (1,), generator=rng)) for lo, hi in ((10, 60), (91, 96))), seq]
    holders = [torch.arange(seq)]
    if keys == "striped-shards":
        holders = [torch.arange(seq)[torch.arange(seq) // 12 % 2 == r] for r in (0, 1)]
    scale = d**-0.5
    want = dense_block_masses(q, k, seq, bs, bounds, scale)
    got = split_block_masses(q.to(stats_kernels), k.to(stats_kernels), seq, bs, bounds, scale, holders)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    reference = split_block_masses(q, k, seq, bs, bounds, scale, holders)
    torch.testing.assert_close(reference, want, rtol=1e-12, atol=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("keys", ["all", "striped-shards"])
def test_block_sums_at_the_default_tiles(keys, rng, kdevice, monkeypatch):
    """``block_sums`` on the default launch (128-row tiles, several key tiles per block,
    items past the row tiles), head dim 64, 64 window rows of 8 heads a group over 700
    tokens in 64-token blocks, five documents, keys on one holder or three (stripes of 40)."""
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    seq, n_rows, bs, d = 700, 64, 64, 64
    q = torch.randn(1, n_rows, 16, d, generator=rng).half()
    k = torch.randn(1, seq, 2, d, generator=rng).half()
    bounds = [0, 200, 610, 650, 690, seq]
    holders = [torch.arange(seq)]
    if keys == "striped-shards":
        holders = [torch.arange(seq)[torch.arange(seq) // 40 % 3 == r] for r in range(3)]
    want = dense_block_masses(q, k, seq, bs, bounds, d**-0.5)
    got = split_block_masses(q.to(kdevice), k.to(kdevice), seq, bs, bounds, d**-0.5, holders)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 2), (8, 8)], ids=["gqa8", "mha"])
def test_block_sums_on_gpu_shapes(heads, rng, device, monkeypatch):
    """Default tiles, bf16, head dim 128, 128-token blocks, a 64-row window over 5000 tokens
    in three documents: the block masses close to the fp64 brute force and bitwise
    repeatable."""
    if device.type != "cuda":
        pytest.skip("GPU shapes")
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    seq, n_rows, bs = 5000, 64, 128
    q = torch.randn(1, n_rows, heads[0], 128, generator=rng).to(device, torch.bfloat16)
    k = torch.randn(1, seq, heads[1], 128, generator=rng).to(device, torch.bfloat16)
    bounds = [0, 3000, 4950, seq]
    holders = [torch.arange(seq), torch.arange(seq)]  # the same keys twice: every sum doubles
    runs = [split_block_masses(q, k, seq, bs, bounds, 128**-0.5, holders[:1]) for _ in range(3)]
    assert all(torch.equal(runs[0], again) for again in runs[1:])
    torch.testing.assert_close(runs[0], dense_block_masses(q, k, seq, bs, bounds, 128**-0.5), rtol=2e-5, atol=1e-10)
    torch.testing.assert_close(split_block_masses(q, k, seq, bs, bounds, 128**-0.5, holders), runs[0])


def test_window_statistics_kernels_give_the_reference_index(rng, stats_kernels, monkeypatch):
    """On a planted pattern (two columns, one diagonal; scores far apart) the kernels'
    statistics select exactly the reference's index."""
    from test_vertical_slash import planted_qk

    q, k = planted_qk(300, 70, [5, 180], rng)
    cfg = VerticalSlashConfig(last_q=40, vertical_topp=0.9, slash_topp=0.9, block_size=16, sink_tokens=2)
    got = build_vertical_slash_index(q.half().to(stats_kernels), k.half().to(stats_kernels), cfg).to("cpu")
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    want = build_vertical_slash_index(q.half(), k.half(), cfg)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 2), (8, 8)], ids=["gqa8", "mha"])
def test_window_statistics_kernels_on_gpu_shapes(heads, rng, device, monkeypatch):
    """Default tiles, bf16, head dim 128, a 64-row window over 5000 tokens: close to the
    fp64 reference and bitwise repeatable."""
    if device.type != "cuda":
        pytest.skip("GPU shapes")
    seq = 5000
    q = torch.randn(1, seq, heads[0], 128, generator=rng).to(device, torch.bfloat16)
    k = torch.randn(1, seq, heads[1], 128, generator=rng).to(device, torch.bfloat16)
    positions = torch.arange(seq)
    cfg = VerticalSlashConfig(last_q=64, block_size=64)
    runs = [statistics(q[:, -64:], k, positions, seq, cfg, device) for _ in range(3)]
    for again in runs[1:]:
        assert all(torch.equal(a, e) for a, e in zip(runs[0], again, strict=True))
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    want = statistics(q[:, -64:], k, positions, seq, cfg, device)
    for a, e in zip(runs[0], want, strict=True):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=1e-10)
