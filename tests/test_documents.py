"""Packed documents (``cu_seqlens``): no row attends a key of another document.

Every pattern's index built with fresh random boundaries (documents of one token, of
exactly one block, a boundary on a block edge, many short ones, a long one) is checked
against an independent block-diagonal causal mask written here from the boundaries: its
mask stays inside, its attention (reference path and Triton kernels, in the interpreter on
a CPU) equals fp64 dense attention under its mask, gradients included, and its attended
area agrees with the mask. The per-document builders are checked against the same build
on each document alone (vertical-slash) and against brute force (MSA, MoBA).
"""

import collections
import dataclasses
import os
import weakref
from collections import OrderedDict

import pytest
import torch
from cp_workers import (
    MSA_KL_RANDOM_DOCUMENT_CASES,
    check_document_statistics_reduced_once,
    check_msa_kl_ring,
    check_ring_with_documents,
)
from dense_reference import assert_close_rel, check_index_attention, dense_attention, finite
from documents_reference import block_diagonal, random_boundaries
from gloo import run, run_on_device

from megatron_mtraining import patterns
from megatron_mtraining.context_parallel.distributed_index import build_index
from megatron_mtraining.sparse import (
    BlockTopKIndex,
    DenseIndex,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    VerticalSlashIndex,
    attention_recall,
    build_vertical_slash_index,
    dispatch,
    packed_documents,
)
from megatron_mtraining.sparse import documents as documents_module
from megatron_mtraining.sparse.index import VerticalSlashPart, compact
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables, transpose_sorted, transpose_tiles

KERNELS = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET"
)
BLOCK = 16
VS_CONFIG = VerticalSlashConfig(
    last_q=16, vertical_topp=0.5, slash_topp=0.5, block_size=BLOCK, sink_tokens=2, dense_below=32
)
MSA_CONFIG = MSAConfig(block_size=BLOCK, topk=3, index_head_dim=16)
MOBA_CONFIG = MoBAConfig(chunk_size=32, topk=3)


def inputs(rng, seq, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu"):
    def t(h):
        return torch.randn(1, seq, h, d, generator=rng).to(device, dtype).requires_grad_()

    return t(hq), t(hkv), t(hkv)


def index_of(kind: str, q, k, cu, block: int = BLOCK):
    """The pattern's index of q/k with documents ``cu``, through the pattern API (MoBA's
    chunks are two blocks, so tiles and chunks differ)."""
    if kind == "dense":
        return patterns.get("dense")().local_index(q, k, 1.0, cu)
    if kind == "mtraining":
        config = dataclasses.replace(VS_CONFIG, block_size=block)
        return patterns.get("mtraining")(config).local_index(q.detach(), k.detach(), q.shape[-1] ** -0.5, cu)
    if kind == "msa":  # index projections stand-in: the group's mean query, and the mean key
        q_idx = q.detach().float().unflatten(2, (k.shape[2], -1)).mean(3)
        k_idx = k.detach().float().mean(2, keepdim=True)
        config = dataclasses.replace(MSA_CONFIG, block_size=block, index_head_dim=q.shape[-1])
        return patterns.get("msa")(config).with_inputs(q_idx, k_idx).local_index(q, k, 1.0, cu)
    config = dataclasses.replace(MOBA_CONFIG, chunk_size=2 * block)
    return patterns.get("moba")(config).local_index(q.detach(), k.detach(), 1.0, cu)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2}


def check_attention(q, k, v, index, backend, rng):
    """``sparse_attention`` under ``index`` against fp64 dense attention under its mask."""
    check_index_attention(q, k, v, index, rng, TOLERANCE[q.dtype], backend)


KINDS = ["dense", "mtraining", "msa", "moba"]


@pytest.mark.parametrize("kind", KINDS)
def test_reference_path_within_documents(kind, rng):
    seq = 160
    cu = random_boundaries(rng, seq)
    q, k, v = inputs(rng, seq)
    index = index_of(kind, q, k, cu)
    mask = index.to_dense_mask(seq)
    allowed = block_diagonal(cu, seq)
    assert not (mask & ~allowed).any(), "a row attends a key outside its document"
    assert mask[0, 0].diagonal().all(), "every row attends itself"
    if kind == "dense":
        assert torch.equal(mask, allowed.expand_as(mask))
    assert index.causal_area() == int(allowed.sum())
    assert index.density() == pytest.approx(mask.double().sum().item() / mask.shape[1] / int(allowed.sum()))
    check_attention(q, k, v, index, "reference", rng)


@KERNELS
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernels_within_documents(kind, dtype, rng, kdevice):
    seq = 160 if dtype == torch.float32 else 100  # also a ragged last block
    cu = random_boundaries(rng, seq)
    q, k, v = inputs(rng, seq, dtype=dtype, device=kdevice)
    index = index_of(kind, q, k, cu.to(kdevice))
    assert not (index.to_dense_mask(seq).cpu() & ~block_diagonal(cu, seq)).any()
    check_attention(q, k, v, index, "triton", rng)


@KERNELS
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_sub_tiles_within_documents(kind, rng, kdevice, block_bar_steps):
    """Blocks of 32 walked 16 keys / rows a step: document starts inside a step's keys."""
    block_bar_steps(16)
    seq = 224
    cu = random_boundaries(rng, seq, block=32)
    q, k, v = inputs(rng, seq, hq=2, hkv=1, d=32, device=kdevice)
    index = index_of(kind, q, k, cu.to(kdevice), block=32)
    assert not (index.to_dense_mask(seq).cpu() & ~block_diagonal(cu, seq)).any()
    check_attention(q, k, v, index, "triton", rng)


def columns_in_every_document(rng, cu: torch.Tensor, heads: int, block: int) -> VerticalSlashIndex:
    """A per-document vertical-slash index whose columns lie in every document (its first
    and last token and a few between), so that a bar dK/dV chunk of the ascending list holds
    several documents' columns, some of them in one row step; each document keeps diagonal
    0 and one more of those it spans."""
    seq, bounds = int(cu[-1]), cu.tolist()
    docs = packed_documents(cu, seq)
    spans = docs.spans(block).tolist()
    vertical, slash = [], []
    for _ in range(heads):
        cols = set()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            cols |= {a, b - 1, *torch.randint(a, b, (2,), generator=rng).tolist()}
        vertical.append(sorted(cols))
        slash.append([[0, int(torch.randint(1, n, (1,), generator=rng))] if n > 1 else [0, -1] for n in spans])
    width = max(map(len, vertical))
    vertical = torch.tensor([c + [-1] * (width - len(c)) for c in vertical], dtype=torch.int32)[None]
    return VerticalSlashIndex(vertical, torch.tensor(slash, dtype=torch.int32)[None], seq, block, docs)


@KERNELS
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("block, step", [(16, None), (32, 16)], ids=["block-16", "block-32-step-16"])
def test_bar_chunks_across_documents(block, step, rng, kdevice, block_bar_steps):
    """A bar dK/dV chunk walks each of its documents' rows apart (skipping the rows between,
    and a row step two documents share walked once): attention and gradients equal fp64
    dense attention under the block-diagonal mask."""
    if step is not None:
        block_bar_steps(step)
    seq = 192
    cu = random_boundaries(rng, seq, block=block)
    q, k, v = inputs(rng, seq, device=kdevice)
    index = columns_in_every_document(rng, cu, q.shape[2], block).to(kdevice)
    assert not (index.to_dense_mask(seq).cpu() & ~block_diagonal(cu, seq)).any()
    check_attention(q, k, v, index, "triton", rng)


@KERNELS
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("layout_kind, rank", [("striped", 1), ("balanced", 3), ("zigzag", 0)])
def test_ring_pieces_of_a_rank_within_documents(layout_kind, rank, rng, kdevice, block_bar_steps):
    """One context-parallel rank's pieces on the kernels, as the ring runs them, on one
    device: the vertical columns' piece (its rows by their global blocks, the gathered
    columns as keys), then every ring step's chunk adding into the fp32 running result in
    place. Out, lse, dq and the K/V gradients from the rank's rows (each chunk's and the
    columns' scattered back) equal fp64 dense attention under the whole index's
    block-diagonal mask: bar dK/dV's walk of a column's document over the rank's stripes
    misses no row, and in-place steps keep the rows they leave untouched. Striped, balanced
    (stripes placed by the documents, not in a fixed cycle) and zigzag ranks."""
    from megatron_mtraining.context_parallel import ContextParallelLayout
    from megatron_mtraining.context_parallel.ring import ring_work, vertical_columns
    from megatron_mtraining.context_parallel.step_index import StepIndex
    from megatron_mtraining.context_parallel.step_tables import StepTables
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    block_bar_steps(16)  # two row steps a query block, as the recipes' 64 of 128
    seq, world, block = 512, 4, 32
    cu = random_boundaries(rng, seq, block=block)
    q, k, v = (t.detach() for t in inputs(rng, seq, device=kdevice))
    index = columns_in_every_document(rng, cu, q.shape[2], block).to(kdevice)
    documents = cu if layout_kind == "balanced" else None  # placed by its documents
    layout = ContextParallelLayout(layout_kind, world, seq, stripe=block, documents=documents)
    queries = layout.token_positions(rank, kdevice)
    cols = vertical_columns(index)
    present = cols >= 0
    bars = StepIndex(VerticalSlashPart(index, "bars"), queries, cols)
    pieces = [(StepTables(bars.index, queries).of(bars.keys), cols.clamp(min=0), present)]
    steps = StepTables(ring_work(index), queries)
    for i in range(world):
        keys = layout.token_positions((rank - i) % world, kdevice)
        pieces.append((steps.of(keys), keys.values, torch.ones_like(keys.values, dtype=torch.bool)))
    q_r = layout.shard(q, rank).contiguous()
    kv = [[torch.where(ok.view(1, -1, 1, 1), x[:, at], 0).contiguous() for x in (k, v)] for _, at, ok in pieces]
    scale = q.shape[-1] ** -0.5

    running = None
    for (tables, _, _), (k_p, v_p) in zip(pieces, kv, strict=True):
        running = block_bar.kernel_forward(q_r, k_p, v_p, tables, scale, running, torch.float32)
    out, lse = running
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    full_out, full_lse = dense_attention(*leaves, index.to_dense_mask(seq), scale)
    rows = queries.values
    ref_out, ref_lse = full_out[:, rows], full_lse[:, :, rows]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close_rel(out, ref_out, 2e-5, "out")
    assert_close_rel(finite(lse), finite(ref_lse), 1e-5, "lse")

    g_out, g_lse = torch.randn(out.shape, generator=rng).to(kdevice), torch.randn(lse.shape, generator=rng).to(kdevice)
    want = torch.autograd.grad((ref_out * g_out.double()).sum() + (finite(ref_lse) * g_lse.double()).sum(), leaves)
    dlse = torch.where(torch.isinf(lse), 0.0, g_lse)
    dq, dk, dv = None, torch.zeros_like(k, dtype=torch.float64), torch.zeros_like(v, dtype=torch.float64)
    for (tables, at, ok), (k_p, v_p) in zip(pieces, kv, strict=True):
        dq, dk_p, dv_p = block_bar.kernel_backward(
            q_r, k_p, v_p, tables, scale, out, lse, g_out, dlse, dq, torch.float32
        )
        dk.index_add_(1, at[ok], dk_p[:, ok].double())
        dv.index_add_(1, at[ok], dv_p[:, ok].double())
    assert_close_rel(dq, want[0][:, rows], 4e-5, "dq")
    assert_close_rel(dk, want[1], 4e-5, "dk")
    assert_close_rel(dv, want[2], 4e-5, "dv")


@KERNELS
@pytest.mark.parametrize("config", [VS_CONFIG, dataclasses.replace(VS_CONFIG, dense_below=0)],
                         ids=["dense-below-32", "all-sparse"])  # fmt: skip
def test_vertical_slash_statistics_kernels_per_document(config, rng, kdevice, monkeypatch):
    """The per-document build on the statistics kernels (every document's statistics in one
    batched pass) equals the reference build; with ``dense_below=0`` documents of one token
    and shorter than the window too."""
    from megatron_mtraining.sparse.kernels.index_build import window_stats

    seq = 192
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq, device=kdevice)
    q, k = q.detach(), k.detach()
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    want = build_vertical_slash_index(q, k, config, cu_seqlens=cu)
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(
        window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, chunk_blocks=2, block_mass=16)
    )
    got = build_vertical_slash_index(q, k, config, cu_seqlens=cu.to(kdevice))
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)


class CountedLaunches:
    """A Triton kernel that counts its launches in ``counts[name]``."""

    def __init__(self, kernel, counts, name):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


def document_statistics_fp64(q, k, a: int, b: int, last_q: int, block: int, scale: float):
    """Document ``[a, b)``'s window statistics alone in fp64, from its dense causal softmax:
    the column mass, and the block-diagonal mass (token diagonal ``o = d * block + t`` gives
    ``(block - t) / block`` of its mass to ``d`` and the rest to ``d + 1``, or all of it to
    ``d`` when ``d`` is the document's last), each divided by the window's rows."""
    n, w = b - a, min(last_q, b - a)
    qw = q[0, b - w : b].double()
    keys = k[0, a:b].double().repeat_interleave(q.shape[2] // k.shape[2], 1)
    rows, cols = torch.arange(n - w, n).view(-1, 1), torch.arange(n).view(1, -1)
    logits = torch.einsum("whd,nhd->hwn", qw, keys) * scale
    probs = torch.softmax(logits.masked_fill(cols > rows, float("-inf")), -1)
    offset = (rows - cols).expand(w, n)
    seen = offset >= 0
    d, t = offset[seen] // block, offset[seen] % block
    n_diagonals = -(-n // block)
    slash = torch.zeros(q.shape[2], n_diagonals, dtype=torch.float64)
    slash.index_add_(1, d, probs[:, seen] * (block - t) / block)
    slash.index_add_(1, (d + 1).clamp(max=n_diagonals - 1), probs[:, seen] * t / block)
    return probs.sum(1) / w, slash / w


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=KERNELS)])
def test_document_statistics_are_each_documents_alone(backend, rng, kdevice, monkeypatch):
    """Every document's window statistics in one batched pass (all of them sparse: documents
    of one token, shorter than the window, of exactly one block, ending on a block edge, two
    long ones) against each document's fp64 statistics alone; the padding is zero. On the
    kernels each pass is one launch whatever the number of documents."""
    from megatron_mtraining.sparse.kernels.index_build import window_stats
    from megatron_mtraining.sparse.vertical_slash import ObservationWindows, document_statistics_from_parts

    seq, last_q, scale = 192, 16, 0.25
    cu = random_boundaries(rng, seq).tolist()
    bounds = list(zip(cu[:-1], cu[1:], strict=True))
    q = torch.randn(1, seq, 4, 16, generator=rng).half()
    k = torch.randn(1, seq, 2, 16, generator=rng).half()
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", backend)
    monkeypatch.setattr(
        window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, chunk_blocks=2, block_mass=16)
    )
    launches = collections.Counter()
    for name in ("_row_stats_kernel", "_mass_kernel", "_pool_kernel"):
        monkeypatch.setattr(window_stats, name, CountedLaunches(getattr(window_stats, name), launches, name))
    windows = ObservationWindows.of_documents(bounds, last_q, seq)
    rows = torch.tensor(windows.row_positions())
    config = VerticalSlashConfig(last_q=last_q, block_size=BLOCK)
    stats = document_statistics_from_parts(
        q.index_select(1, rows).to(kdevice), k.to(kdevice), None, windows, config, scale
    )
    assert launches == (
        {} if backend == "reference" else {"_row_stats_kernel": 2, "_mass_kernel": 1, "_pool_kernel": 1}
    )
    longest, most = max(windows.lengths), -(-max(windows.lengths) // BLOCK)
    assert stats.vertical.shape == (1, 4, len(bounds), longest) and stats.slash.shape == (1, 4, len(bounds), most)
    for m, (a, b) in enumerate(bounds):
        vertical, slash = document_statistics_fp64(q, k, a, b, last_q, BLOCK, scale)
        got_vertical, got_slash = stats.vertical[0, :, m].cpu(), stats.slash[0, :, m].cpu()
        torch.testing.assert_close(got_vertical[:, : b - a], vertical.float(), rtol=2e-5, atol=1e-8, msg=f"{m}")
        torch.testing.assert_close(got_slash[:, : slash.shape[1]], slash.float(), rtol=2e-5, atol=1e-8, msg=f"{m}")
        assert not got_vertical[:, b - a :].any() and not got_slash[:, slash.shape[1] :].any()


def test_observation_windows_need_ascending_key_positions():
    """A rank's keys must ascend by position (each document's keys one run of them): the
    error names the first entry out of order and its value."""
    from megatron_mtraining.sparse.vertical_slash import ObservationWindows

    windows = ObservationWindows.of_documents([(0, 5), (9, 12)], 4, 12, torch.tensor([1, 3, 4, 10, 11]))
    assert windows.key_ranges == ((0, 3), (3, 5)) and windows.rows == (4, 3)
    with pytest.raises(ValueError, match=r"key_positions\[2\]=3 .*key_positions\[1\] = 4"):
        ObservationWindows.of_documents([(0, 12)], 4, 12, torch.tensor([1, 4, 3]))


def test_mask_is_block_diagonal_for_every_index_type(rng):
    """Hand-made indexes that list keys before the documents: the rows never see them."""
    seq, block = 96, 16
    cu = random_boundaries(rng, seq)
    docs = packed_documents(cu, seq)
    allowed = block_diagonal(cu, seq)
    everything = torch.arange(-(-seq // block), dtype=torch.int32)
    indexes = [
        DenseIndex(1, 2, seq, documents=docs),
        VerticalSlashIndex(
            torch.arange(seq, dtype=torch.int32).expand(1, 2, seq),
            everything.expand(1, 2, docs.count, len(everything)).contiguous(),
            seq,
            block,
            docs,
        ),
        BlockTopKIndex(everything.expand(1, seq, 2, len(everything)).contiguous(), block, 2, documents=docs),
    ]
    for index in indexes:
        mask = index.to_dense_mask(seq)
        assert torch.equal(mask, allowed.expand_as(mask)), type(index).__name__
        assert torch.equal(key_list_mask(index), mask), type(index).__name__


def test_within_masks_the_same_lists_to_the_documents(rng):
    """An index without documents (random diagonals, 0 among them, and random columns),
    masked by ``within``: its mask is the unmasked one inside the block-diagonal mask."""
    seq, block, heads = 96, 16, 2
    n = seq // block
    cu = random_boundaries(rng, seq)
    docs = packed_documents(cu, seq)
    slash = torch.stack(
        [torch.cat([torch.zeros(1), 1 + torch.randperm(n - 1, generator=rng)[:2]]).sort().values for _ in range(heads)]
    )
    vertical = torch.stack([torch.randperm(seq, generator=rng)[:5].sort().values for _ in range(heads)])
    index = VerticalSlashIndex(vertical.int()[None], slash.int()[None], seq, block)
    masked = index.within(docs)
    expected = index.to_dense_mask(seq) & block_diagonal(cu, seq)
    assert torch.equal(masked.to_dense_mask(seq), expected)
    with pytest.raises(ValueError, match=r"VerticalSlashIndex.documents=.* documents' is not accepted: expected None"):
        masked.within(docs)


def key_list_mask(index, bounded: bool = False) -> torch.Tensor:
    """The mask that ``key_lists`` (``bounded``: ``bounded_key_lists``, the recall's) and
    ``visible`` give (the reference path's view)."""
    b, h, s = index.batch_size, index.num_heads, index.seq_len
    mask = torch.zeros(b, h, s, s + 1, dtype=torch.bool)
    for q0, q1 in index.query_ranges(s):
        keys = index.bounded_key_lists(q0, q1) if bounded else index.key_lists(q0, q1)
        seen = index.visible(keys, q0, q1)
        keys = torch.where(seen, keys.expand_as(seen), s).long()
        keys = keys.expand(b, -1, -1, -1).repeat_interleave(h // keys.shape[1], dim=1)
        mask[:, :, q0:q1].scatter_(-1, keys, True)
    return mask[..., :s]


@pytest.mark.parametrize("kind", KINDS)
def test_views_and_area_agree_with_the_mask(kind, rng):
    seq = 160
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    index = index_of(kind, q, k, cu)
    mask = index.to_dense_mask(seq)
    assert torch.equal(key_list_mask(index), mask)
    assert torch.equal(key_list_mask(index, bounded=True), mask)
    assert torch.equal(index.attended_area(), mask.sum((-1, -2)))
    rows = torch.randperm(seq, generator=rng)[: seq // 3].sort().values
    keys = torch.randperm(seq, generator=rng)[: seq // 2].sort().values
    want = mask[:, :, rows][..., keys].sum((-1, -2))
    assert torch.equal(index.area_between(rows, torch.cat([keys, torch.full((3,), -1)])), want)
    block = 16
    n = -(-seq // block)
    pooled = torch.nn.functional.pad(mask.double().sum((0, 1)), (0, n * block - seq, 0, n * block - seq))
    assert torch.equal(index.block_areas(block), pooled.view(n, block, n, block).sum((1, 3)))
    if kind == "mtraining":
        for part in ("tiles", "bars"):
            piece = VerticalSlashPart(index, part)
            piece_mask = key_list_mask(piece)
            assert torch.equal(piece.attended_area(), piece_mask.sum((-1, -2))), part
            pooled = torch.nn.functional.pad(piece_mask.double().sum((0, 1)), (0, n * block - seq, 0, n * block - seq))
            assert torch.equal(piece.block_areas(block), pooled.view(n, block, n, block).sum((1, 3))), part
        assert torch.equal(
            VerticalSlashPart(index, "tiles").attended_area() + VerticalSlashPart(index, "bars").attended_area(),
            index.attended_area(),
        )


@pytest.mark.parametrize("kind", KINDS)
def test_tile_tables_skip_tiles_before_the_documents(kind, rng):
    """No listed tile lies wholly before the document start of its query block's first row,
    and every attended pair is in a listed tile or a listed bar."""
    seq = 160
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    index = index_of(kind, q, k, cu)
    tables = tile_tables(index)
    bs = tables.block
    starts = packed_documents(cu, seq).starts
    n_q = tables.tiles.shape[2]
    mask = index.to_dense_mask(seq)
    covered = torch.zeros(mask.shape[1], seq, seq, dtype=torch.bool)
    heads = mask.shape[1]
    for h in range(heads):
        th = h * tables.tiles.shape[1] // heads
        for qb in range(n_q):
            rows = slice(qb * bs, min((qb + 1) * bs, seq))
            listed = tables.tiles[0, th, qb, : tables.tile_count[0, th, qb]].tolist()
            assert all((kb + 1) * bs > starts[qb * bs] for kb in listed), (h, qb, listed)
            for kb in listed:
                covered[h, rows, kb * bs : (kb + 1) * bs] = True
            if tables.has_bars:
                first = 0 if tables.bar_start is None else int(tables.bar_start[0, h, qb])
                for c in tables.vertical[0, h, first : tables.bar_count[0, h, qb]].tolist():
                    covered[h, rows, c] = True
    assert not (mask[0] & ~covered).any()


@KERNELS
@pytest.mark.parametrize("block", [16, 32])
def test_tables_kernel_with_documents_equals_the_torch_tables(block, rng, kdevice):
    """The one-launch tables of a vertical-slash index with documents (``tables_kernel``)
    against the torch composition (the CPU path), entry for entry: the whole sequence with
    bars, context-parallel rows over every chunk's keys (tiles only), over whole-sequence
    keys (bars) and over the gathered column keys; built indexes and every-diagonal ones."""
    from megatron_mtraining.context_parallel import ContextParallelLayout
    from megatron_mtraining.sparse.kernels.block_bar.block_map import BlockMap
    from megatron_mtraining.sparse.kernels.block_bar.tables import vertical_slash_tables
    from megatron_mtraining.sparse.kernels.block_bar.tables_kernel import launch_vertical_slash_tables

    seq = 256
    n = seq // block
    cu = random_boundaries(rng, seq, block=block)
    q, k, _ = inputs(rng, seq)
    config = dataclasses.replace(VS_CONFIG, block_size=block, dense_below=2 * block)
    built = build_vertical_slash_index(q.detach(), k.detach(), config, cu_seqlens=cu)
    docs = packed_documents(cu, seq)
    everything = torch.arange(n, dtype=torch.int32).expand(1, 4, docs.count, n).contiguous()
    columns = torch.arange(0, seq, 7, dtype=torch.int32).expand(1, 4, -1).contiguous()
    layout = ContextParallelLayout("zigzag", 2, seq, stripe=block)

    def blocks(rank, dev):
        return BlockMap.of(layout.positions(rank, dev)[::block] // block, n)

    for index in (built, VerticalSlashIndex(columns, everything, seq, block, docs)):
        gathered = index.vertical[index.vertical >= 0].unique().int()
        gathered = torch.cat([gathered, torch.full((3,), -1, dtype=torch.int32)])
        cases = [(None, None, True, None)]
        for rank in range(2):
            cases += [(rank, src, False, None) for src in range(2)]
            cases += [(rank, None, True, None), (rank, None, True, gathered)]
        for rank, src, bars, cols in cases:
            rows = None if rank is None else blocks(rank, "cpu")
            keys = None if src is None else blocks(src, "cpu")
            want = vertical_slash_tables(index, rows, keys, bars, cols)
            got = launch_vertical_slash_tables(
                index.to(kdevice),
                None if rank is None else blocks(rank, kdevice),
                None if src is None else blocks(src, kdevice),
                bars,
                None if cols is None else cols.to(kdevice),
            )
            for name, t in got.items():
                expected = getattr(want, name)
                assert t.dtype == expected.dtype and torch.equal(t.cpu(), expected), (rank, src, bars, name)
            assert set(got) >= {"tiles", "tiles_t"} | ({"active", "active_offset", "bar_start"} if bars else set())


def test_transpose_by_sorting_equals_the_membership_table(rng):
    n_q, n_kv, listed = 12, 9, 5
    tiles = torch.randint(0, n_kv, (2, 3, n_q, listed), generator=rng).sort(-1).values
    keep = torch.cat([torch.ones(2, 3, n_q, 1, dtype=torch.bool), tiles[..., 1:] != tiles[..., :-1]], -1)
    keep &= torch.rand(keep.shape, generator=rng) < 0.8
    tiles, count = compact(tiles.int(), keep, listed)
    want = transpose_tiles(tiles, count, n_kv, n_q)
    got = transpose_sorted(tiles, count, n_kv, n_q)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


DIFFUSE = dataclasses.replace(VS_CONFIG, vertical_topp=0.97, slash_topp=0.97, dense_below=0)


@pytest.mark.parametrize(
    "config",
    [VS_CONFIG, dataclasses.replace(VS_CONFIG, dense_below=0, local_window=40), DIFFUSE,
     dataclasses.replace(DIFFUSE, dense_if_cheaper=False)],
    ids=["dense-below-32", "all-sparse", "diffuse", "diffuse-kept"],
)  # fmt: skip
def test_vertical_slash_per_document_equals_each_document_alone(config, rng):
    """The batched selection (``document_index``: every document's budgets in one pass)
    against each document's build alone; with ``dense_below=0`` one-token documents too,
    shorter than the window and than the forced sinks. Budgets near 1 (a diffuse model's)
    keep nearly everything, so heads whose index costs the whole triangle go dense
    (``dense_if_cheaper``); with it off each keeps its own."""
    dense_heads = _per_document_against_alone(config, rng)
    if config is DIFFUSE:
        assert dense_heads > 0


def _per_document_against_alone(config, rng) -> int:
    VS_CONFIG = config
    seq = 192
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    q, k = q.detach(), k.detach()
    index = build_vertical_slash_index(q, k, VS_CONFIG, cu_seqlens=cu)
    assert index.slash.shape[:3] == (1, 4, len(cu) - 1)
    bounds = cu.tolist()
    sparse = dense_heads = 0
    for m, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        slash = [[d for d in index.slash[0, h, m].tolist() if d >= 0] for h in range(4)]
        columns = [[c - a for c in index.vertical[0, h].tolist() if a <= c < b] for h in range(4)]
        if b - a < VS_CONFIG.dense_below:  # dense: every diagonal of the blocks it touches, no column
            span = (b - 1) // BLOCK - a // BLOCK + 1
            assert slash == [list(range(span))] * 4 and columns == [[]] * 4
            continue
        sparse += 1
        alone = build_vertical_slash_index(q[:, a:b], k[:, a:b], VS_CONFIG)
        want_slash = [[d for d in alone.slash[0, h].tolist() if d >= 0] for h in range(4)]
        # Less the columns that every row seeing them reads through a tile: those past the
        # document's last block minus its first missing diagonal (on the sequence's grid).
        missing = [min(set(range(len(d) + 1)) - set(d)) for d in want_slash]
        first, last = a // BLOCK, (b - 1) // BLOCK
        want = [[c for c in alone.vertical[0, h].tolist() if c >= 0 and (c + a) // BLOCK <= last - missing[h]]
                for h in range(4)]  # fmt: skip
        for h in range(4):
            # A head whose index computes no fewer key rows a block than the whole triangle
            # (a tile is BLOCK of them, a column one in each block from its own on) is dense.
            span = last - first + 1
            cost = BLOCK * sum(span - d for d in want_slash[h]) + sum(last - (c + a) // BLOCK + 1 for c in want[h])
            if config.dense_if_cheaper and cost >= BLOCK * span * (span + 1) // 2:
                want_slash[h], want[h] = list(range(span)), []
                dense_heads += 1
        assert slash == want_slash, m
        assert columns == want, m
    assert sparse >= 2  # the two long documents
    return dense_heads


@pytest.mark.parametrize("topp", [0.5, 0.97], ids=["topp-0.5", "topp-0.97"])
def test_covered_columns_leave_the_mask_unchanged(topp, rng, monkeypatch):
    """The per-document index lists no column that every row seeing it reads through a
    tile (``uncovered_columns``): the attention mask equals that of the lists with those
    columns kept, and with budgets near 1 (a diffuse model's) most columns go."""
    from megatron_mtraining.sparse import vertical_slash

    config = dataclasses.replace(VS_CONFIG, vertical_topp=topp, slash_topp=topp, dense_below=0, dense_if_cheaper=False)
    seq = 192
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    q, k = q.detach(), k.detach()
    index = build_vertical_slash_index(q, k, config, cu_seqlens=cu)
    with monkeypatch.context() as patch:
        patch.setattr(vertical_slash, "uncovered_columns", lambda columns, *_: columns)
        listed = build_vertical_slash_index(q, k, config, cu_seqlens=cu)
    assert torch.equal(index.slash, listed.slash)
    assert torch.equal(index.to_dense_mask(seq), listed.to_dense_mask(seq))
    kept, every = int((index.vertical >= 0).sum()), int((listed.vertical >= 0).sum())
    assert kept < every  # some columns were covered
    if topp > 0.9:
        assert kept <= every // 2, (kept, every)


def test_dense_if_cheaper_only_grows_the_mask(rng):
    """Heads of documents that go dense attend a superset of their selected index's pairs,
    within the block-diagonal causal mask. Nearly every column and a few diagonals missing
    (long documents with flat columns): the dense triangle is cheaper than those columns'
    bars, and it adds the missing diagonals' pairs."""
    seq = 768
    config = dataclasses.replace(DIFFUSE, slash_topp=0.7)
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    q, k = q.detach(), k.detach()
    chosen = build_vertical_slash_index(q, k, config, cu_seqlens=cu).to_dense_mask(seq)
    selected = build_vertical_slash_index(
        q, k, dataclasses.replace(config, dense_if_cheaper=False), cu_seqlens=cu
    ).to_dense_mask(seq)
    assert torch.equal(chosen | selected, chosen)
    assert not torch.equal(chosen, selected)
    assert torch.equal(chosen & block_diagonal(cu, seq), chosen)


def brute_force_msa(q_idx, k_idx, cu, block, topk):
    """Per (query, group): the own block and the best ``topk - 1`` other blocks by the max
    over the keys of the query's document up to the query, as sets."""
    seq, groups = q_idx.shape[1], q_idx.shape[2]
    allowed = block_diagonal(cu, seq)
    scores = torch.einsum("bqgd,bkd->bgqk", q_idx.double(), k_idx[:, :, 0].double())
    chosen = []
    for i in range(seq):
        row = []
        for g in range(groups):
            best = {}
            for j in allowed[i].nonzero().flatten().tolist():
                best[j // block] = max(best.get(j // block, float("-inf")), scores[0, g, i, j].item())
            own = i // block
            others = sorted((b for b in best if b != own), key=lambda b: -best[b])[: topk - 1]
            row.append({own, *others})
        chosen.append(row)
    return chosen


def selections(blocks: torch.Tensor):
    return [
        [{b for b in blocks[0, i, s].tolist() if b >= 0} for s in range(blocks.shape[2])]
        for i in range(blocks.shape[1])
    ]


def test_msa_selection_is_brute_force_per_document(rng):
    from megatron_mtraining.sparse import msa_select_blocks

    seq = 112
    cu = random_boundaries(rng, seq)
    q_idx = torch.randn(1, seq, 2, 16, generator=rng)
    k_idx = torch.randn(1, seq, 1, 16, generator=rng)
    want = brute_force_msa(q_idx, k_idx, cu, BLOCK, MSA_CONFIG.topk)
    index = msa_select_blocks(q_idx, k_idx, MSA_CONFIG, 4, cu_seqlens=cu)
    assert index.documents is not None
    assert selections(index.blocks) == want


@KERNELS
def test_msa_selection_kernel_per_document(rng, kdevice, monkeypatch):
    from megatron_mtraining.sparse.kernels.index_build import msa_index

    monkeypatch.setattr(msa_index, "LAUNCH", msa_index.SelectLaunch(block_m=32, block_m_wide=16, block_n=16))
    seq = 112
    cu = random_boundaries(rng, seq)
    q_idx = torch.randn(1, seq, 2, 16, generator=rng)
    k_idx = torch.randn(1, seq, 1, 16, generator=rng)
    starts = packed_documents(cu, seq).starts
    blocks = msa_index.select_blocks(q_idx.to(kdevice), k_idx.to(kdevice), BLOCK, 3, doc_starts=starts.to(kdevice))
    assert selections(blocks.cpu()) == brute_force_msa(q_idx, k_idx, cu, BLOCK, 3)
    scores = msa_index.block_max_scores_triton(q_idx.to(kdevice), k_idx.to(kdevice), BLOCK, starts.to(kdevice))
    from megatron_mtraining.sparse import block_max_scores

    positions = torch.arange(seq)
    want = block_max_scores(q_idx, positions, k_idx, positions, -(-seq // BLOCK), BLOCK, starts)
    torch.testing.assert_close(scores.cpu(), want, atol=1e-5, rtol=1e-5)


def test_moba_selection_is_brute_force_per_document(rng):
    seq = 160
    cu = random_boundaries(rng, seq)
    q, k, _ = inputs(rng, seq)
    q, k = q.detach().double(), k.detach().double()
    index = patterns.get("moba")(MOBA_CONFIG).local_index(q, k, 1.0, cu)
    cs, topk, group = MOBA_CONFIG.chunk_size, MOBA_CONFIG.topk, 2
    allowed = block_diagonal(cu, seq)
    want = []
    for i in range(seq):
        own = i // cs
        row = []
        for h in range(4):
            gate = {}
            for c in range(own):  # an earlier chunk, pooled over the query's document's keys in it
                keys = [j for j in range(c * cs, (c + 1) * cs) if allowed[i, j]]
                if keys:
                    gate[c] = (q[0, i, h] @ k[0, keys, h // group].mean(0)).item()
            row.append({own, *sorted(gate, key=lambda c: -gate[c])[: topk - 1]})
        want.append(row)
    assert selections(index.blocks) == want


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup-dense"])
def test_msa_kl_loss_within_documents(warmup, rng):
    """The KL spans the selected tokens of each row's document only (brute force from the
    index's mask, as tests/test_msa.py checks it without documents)."""
    from test_msa import brute_force_kl

    from megatron_mtraining.sparse import msa_kl_loss, msa_select_blocks

    seq, hq, groups, d, di = 112, 4, 2, 16, 8
    cu = random_boundaries(rng, seq)
    q, k = (torch.randn(1, seq, h, d, generator=rng, dtype=torch.float64) for h in (hq, groups))
    q_idx = torch.randn(1, seq, groups, di, generator=rng, dtype=torch.float64).requires_grad_()
    k_idx = torch.randn(1, seq, 1, di, generator=rng, dtype=torch.float64).requires_grad_()
    config = MSAConfig(block_size=BLOCK, topk=2, index_head_dim=di)
    docs = packed_documents(cu, seq)
    index = DenseIndex(1, hq, seq, documents=docs) if warmup else msa_select_blocks(q_idx, k_idx, config, hq, cu)
    loss = msa_kl_loss(q, k, q_idx, k_idx, index)
    want = brute_force_kl(q, k, q_idx, k_idx, index.to_dense_mask(seq))
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-10)
    for a, e in zip(torch.autograd.grad(loss, (q_idx, k_idx)), torch.autograd.grad(want, (q_idx, k_idx)), strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize(
    "cu, message",
    [
        ([0, 5, 10], "cu_seqlens='list' is not accepted"),
        (torch.tensor([0.0, 10.0]), "cu_seqlens.dtype=torch.float32"),
        (torch.tensor([[0, 10]], dtype=torch.int32), r"cu_seqlens.shape=\(1, 2\)"),
        (torch.tensor([0], dtype=torch.int32), "at least two entries"),
        (torch.tensor([1, 10], dtype=torch.int32), r"cu_seqlens\[0\]=1 .*first document starts"),
        (torch.tensor([0, 4, 4, 10], dtype=torch.int32), r"cu_seqlens\[2\]=4 .*no empty document"),
        (torch.tensor([0, 6, 3, 10], dtype=torch.int32), r"cu_seqlens\[2\]=3 .*strictly increase"),
        (torch.tensor([0, 4, 9], dtype=torch.int32), r"cu_seqlens\[2\]=9 .*sequence length 10"),
        (torch.tensor([0, 4, 12], dtype=torch.int32), r"cu_seqlens\[2\]=12 .*sequence length 10"),
    ],
)
def test_bad_boundaries_are_named(cu, message):
    with pytest.raises(ValueError, match=message):
        packed_documents(cu, 10)
    q = torch.randn(1, 10, 2, 16)
    with pytest.raises(ValueError, match=message):
        patterns.get("dense")().local_index(q, q, 1.0, cu)


def test_int64_boundaries_and_none():
    assert packed_documents(None, 10) is None
    docs = packed_documents(torch.tensor([0, 3, 10]), 10)
    assert docs.cu_seqlens.dtype == torch.int32 and docs.starts.tolist() == [0] * 3 + [3] * 7
    assert docs.ids.tolist() == [0] * 3 + [1] * 7 and docs.ends().tolist() == [3] * 3 + [10] * 7


def count_host_reads(monkeypatch, *tensors) -> list:
    """The ``tolist`` calls on ``tensors`` (only theirs: other threads of the process may read
    their own), listed as they happen. A call that a torch-function mode re-dispatches (the
    CPU runs' ``CudaToCpu``, installed for the rest of the process by a Megatron test) reaches
    the patched method twice: the inner call is the same read and is not counted again."""
    reads, original, inside = [], torch.Tensor.tolist, []

    def tolist(t):
        if inside:
            return original(t)
        inside.append(t)
        try:
            reads.extend([t] if any(t is x for x in tensors) else [])
            return original(t)
        finally:
            inside.pop()

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return reads


def test_boundaries_are_read_once_per_tensor(monkeypatch):
    """Every layer of a micro-batch gets the same cu_seqlens: one host read, one Documents;
    a modified or another tensor is read again."""
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    copy = cu.clone()
    reads = count_host_reads(monkeypatch, cu, copy)
    first = packed_documents(cu, 16)
    again = packed_documents(cu, 16)
    assert again is first, "the same tensor gave a new Documents"
    assert len(reads) == 1, f"{len(reads)} host reads"
    other = packed_documents(copy, 16)
    assert other is not first and other.bounds == first.bounds and len(reads) == 2
    cu[1] = 9  # in place: the version moves, so the new boundaries are read
    assert packed_documents(cu, 16).bounds == (0, 9, 16) and len(reads) == 3
    with pytest.raises(ValueError, match="the sequence length 20"):
        packed_documents(cu, 20)  # another length is checked, not served from the first read


def test_a_freed_tensors_entry_does_not_evict_the_new_one(monkeypatch):
    """Tensor ids are reused: an entry left by a freed tensor under the same key must not
    keep its place first in line, or the full memo evicts the new tensor's bounds at once."""
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    reads = count_host_reads(monkeypatch, cu)
    dead = weakref.ref(torch.zeros(1))
    assert dead() is None
    monkeypatch.setattr(documents_module, "_RECENT", OrderedDict())
    documents_module._RECENT[(id(cu), cu._version, "bounds", 16)] = (dead, (0, 16))
    for i in range(documents_module.RECENT_SIZE - 1):  # full: the stale entry first, others after
        documents_module._RECENT[("other", i)] = (dead, None)
    first = packed_documents(cu, 16)
    assert first.bounds == (0, 7, 16) and packed_documents(cu, 16) is first
    assert len(reads) == 1, f"{len(reads)} host reads"


def test_api_errors_name_the_argument(rng):
    seq = 64
    q, k, _ = inputs(rng, seq)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 20, 64\] .*documents the index was built with \(None\)"):
        build_index(DenseIndex(1, 4, seq), q, k, 1.0, cu_seqlens=cu)
    index = build_index(patterns.get("dense")(), q, k, 1.0, cu_seqlens=cu)
    assert build_index(index, q, k, 1.0, cu_seqlens=cu) is index
    with pytest.raises(ValueError, match="VerticalSlashIndex.slash.shape"):
        VerticalSlashIndex(torch.zeros(1, 4, 1, dtype=torch.int32), torch.zeros(1, 4, 1, dtype=torch.int32), seq, 16,
                           packed_documents(cu, seq))  # fmt: skip
    with pytest.raises(ValueError, match="DenseIndex.documents"):
        DenseIndex(1, 4, 32, documents=packed_documents(cu, seq))


def test_dispatch_keeps_documents_off_libraries_without_bounds():
    import types

    from megatron_mtraining.sparse.kernels import triton_available

    if not triton_available():
        pytest.skip("the kernel rules need Triton installed")
    seq = 131072
    shape = torch.Size((1, seq, 4, 64))
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=shape, device=torch.device("cuda"),
                              numel=shape.numel)  # fmt: skip
    docs = packed_documents(torch.tensor([0, 1000, seq], dtype=torch.int32), seq)
    blocks = torch.full((1, seq, 2, 4), -1, dtype=torch.int32)
    blocks[..., 0] = (torch.arange(seq) // 128).view(1, seq, 1).int()
    plain = BlockTopKIndex(blocks, 128, 4)
    assert dispatch.attention_kernel(q, plain, "auto").kernel == "kv_outer"
    decision = dispatch.attention_kernel(q, BlockTopKIndex(blocks, 128, 4, documents=docs), "auto")
    assert decision.kernel == "block_bar" and "packed documents" in decision.reason
    dense = DenseIndex(1, 4, seq, documents=docs)
    assert dispatch.attention_kernel(q, dense, "auto").kernel == "block_bar"
    with pytest.raises(ValueError, match="packed documents"):
        dispatch.attention_kernel(q, dense, "sdpa")


def test_recall_is_dense_mass_within_documents(rng):
    seq, rows = 128, 24
    cu = random_boundaries(rng, seq)
    cu = torch.cat([cu[cu < seq - 10], torch.tensor([seq - 10, seq], dtype=torch.int32)])  # the last rows split
    q, k, _ = inputs(rng, seq)
    q, k = q.detach(), k.detach()
    index = index_of("mtraining", q, k, cu)
    got = attention_recall(q, k, index, num_rows=rows)
    allowed = block_diagonal(cu, seq)[-rows:]
    logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2))[:, :, -rows:]
    probs = torch.softmax(logits * q.shape[-1] ** -0.5 + torch.where(allowed, 0.0, float("-inf")), -1)
    want = (probs * index.to_dense_mask(seq)[:, :, -rows:]).sum(-1).mean(-1)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_context_parallel_document_statistics_reduced_once(rng):
    """CP 2 on gloo: the per-document vertical-slash index, every document sparse, equals the
    single-device one in every layout with five collectives in all."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    run(2, check_document_statistics_reduced_once, seed, 192)


# (ranks, K/V exchange, inner ring size of a hierarchical ring): CP 2 and a 2x2 hierarchy by
# default, CP 4 and 8 (flat and hierarchical, both exchanges) behind -m slow.
CP_SHAPES = [
    (2, "ring", None),
    (2, "allgather", None),
    (4, "ring", 2),
    (4, "allgather", 2),  # gathered inside nodes of 2, the ring across them
    *(
        pytest.param(*shape, marks=pytest.mark.slow)
        for shape in (
            (4, "ring", None),
            (4, "allgather", None),
            (8, "ring", None),
            (8, "ring", 4),
            (8, "allgather", None),
        )
    ),
]


def _tokens(world: int) -> int:
    """Whole 16-token stripes on every rank: 192 up to CP 4, 256 at CP 8."""
    return 192 if world <= 4 else 256


@pytest.mark.parametrize("world,kv_exchange,inner", CP_SHAPES)
def test_context_parallel_reference_path(world, kv_exchange, inner, rng):
    """fp64 reference path on gloo: contiguous, zigzag and striped layouts, flat rings,
    hierarchical ones (inner rings of ``inner`` ranks), the all-gather, and the all-gather
    inside nodes (with the balanced layout too, numbered node-major)."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    layouts = ("contiguous", "zigzag", "striped") + (("balanced",) if inner and kv_exchange == "allgather" else ())
    run(world, check_ring_with_documents, seed, _tokens(world), False, kv_exchange, layouts, inner)


@KERNELS
@pytest.mark.parametrize(
    "world,kv_exchange,inner",
    [
        (2, "ring", None),
        pytest.param(2, "allgather", None, marks=pytest.mark.slow),
        pytest.param(4, "ring", 2, marks=pytest.mark.slow),
        pytest.param(4, "allgather", 2, marks=pytest.mark.slow),
        pytest.param(8, "ring", None, marks=pytest.mark.slow),
    ],
)
def test_context_parallel_kernels(world, kv_exchange, inner, rng):
    """The ring steps (and the column piece) or the all-gathered piece on the kernels: CP 2
    flat by default; the all-gather, a 2x2 hierarchy, 2x2 gathered inside nodes and CP 8
    behind -m slow. Zigzag chunks
    must be whole 16-token tiles here: 256 tokens from CP 4 on."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    layouts = ("contiguous", "zigzag", "striped")
    tokens = _tokens(world) if world <= 2 else 256
    run_on_device(world, check_ring_with_documents, seed, tokens, True, kv_exchange, layouts, inner)


@KERNELS
def test_context_parallel_msa_kl_kernels(rng):
    """MSA's KL under CP 2 with fresh random documents on the fused KL kernels per ring step
    (the step tables carry the document starts; fp32, interpreted without CUDA): the ranks'
    values and q_idx / k_idx gradients equal ``msa_kl_loss`` on the whole sequence, for a
    top-k index selected within the documents on the balanced layout and the warmup's dense
    index on zigzag."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    run_on_device(2, check_msa_kl_ring, seed, "triton", torch.float32, MSA_KL_RANDOM_DOCUMENT_CASES)
