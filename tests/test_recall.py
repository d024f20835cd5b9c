"""Index recall (``attention_recall``, and ``heldout_recall`` of sampled rows that did not
build the index) against fp64 dense attention under the index's own mask, MSA's block and
score recall (``msa_recall``) against an fp64 brute force, and their context-parallel forms
against the same references (the MSA figures: the single-device ones) on gloo processes."""

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from gloo import run
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.context_parallel.recall import (
    distributed_attention_recall,
    distributed_heldout_recall,
    distributed_msa_recall,
    distributed_window_and_heldout_recall,
)
from megatron_mtraining.patterns.dense import DensePattern
from megatron_mtraining.patterns.moba import MoBAPattern
from megatron_mtraining.patterns.msa import MSAPattern
from megatron_mtraining.patterns.vertical_slash import VerticalSlashPattern
from megatron_mtraining.sparse import (
    BlockTopKIndex,
    DenseIndex,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    attention_recall,
    msa_recall,
    msa_select_blocks,
)
from megatron_mtraining.sparse.documents import packed_documents
from megatron_mtraining.sparse.metrics import heldout_recall, heldout_rows, window_and_heldout_recall

B, HQ, HKV, D = 2, 4, 2, 8
ROWS = 24


def _patterns(q, gen):
    s = q.shape[1]
    q_idx = torch.randn(B, s, HKV, 8, generator=gen, dtype=torch.float64)
    k_idx = torch.randn(B, s, 1, 8, generator=gen, dtype=torch.float64)
    return {
        "dense": DensePattern(),
        "vertical_slash": VerticalSlashPattern(
            VerticalSlashConfig(last_q=16, vertical_topp=0.6, slash_topp=0.6, block_size=16)
        ),
        "moba": MoBAPattern(MoBAConfig(chunk_size=32, topk=2)),
        "msa": MSAPattern(MSAConfig(block_size=16, topk=2, index_head_dim=8), q_idx, k_idx),
    }


def _inputs(gen, seq):
    return (torch.randn(B, seq, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV))


def _dense_recall(q, k, index, rows):
    """fp64: the share of each row's dense causal softmax (within its document) that falls
    under the index's dense mask, averaged over ``rows``, ``[B, Hq]``."""
    seq = q.shape[1]
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(HQ // HKV, dim=2)) * D**-0.5
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if index.documents is not None:
        starts = index.documents.starts.long()
        allowed &= torch.arange(seq).view(1, -1) >= starts.view(-1, 1)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)[:, :, rows]
    return (probs * index.to_dense_mask(seq)[:, :, rows]).sum(-1).mean(-1)


def _row_tiles(monkeypatch, rows: int | None) -> None:
    """Row tiles of ``rows`` rows in the window-statistics kernels (None: as launched). Small
    tiles split a window's (row, head) pairs over several, so the tiles of a shorter window's
    padding rows, which skip their keys, are exercised."""
    if rows is not None:
        from megatron_mtraining.sparse.kernels.index_build import window_stats

        monkeypatch.setattr(window_stats, "LAUNCH", dataclasses.replace(window_stats.LAUNCH, block_m=rows))


def _draw(pattern, index, seq, gen):
    """Held-out rows as the training loop draws them, with a fresh seed; none of them built
    the index."""
    building = pattern.building_rows(seq, index.documents)
    rows = heldout_rows(seq, building, 4, 8, int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    assert len(rows) == 32 and not any(a <= r < b for r in rows.tolist() for a, b in building), (rows, building)
    return rows


@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "moba", "msa"])
def test_recall_equals_dense_mass_under_the_mask(kind, rng):
    seq = 200  # not a multiple of the blocks
    q, k = _inputs(rng, seq)
    index = _patterns(q, rng)[kind].local_index(q, k, D**-0.5)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(HQ // HKV, dim=2)) * D**-0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)[:, :, -ROWS:]
    mask = index.to_dense_mask(seq)
    expected = (probs * mask[:, :, -ROWS:]).sum(-1).mean(-1)
    # An index that says it is complete (its recall is taken as 1) attends the causal mask.
    assert index.complete == bool((mask == causal).all()), (kind, index.complete)
    recall = attention_recall(q, k, index, num_rows=ROWS)
    torch.testing.assert_close(recall, expected.float(), rtol=1e-6, atol=1e-6)
    if kind == "dense":
        assert torch.allclose(recall, torch.ones_like(recall))
    else:
        assert (recall < 1).any()  # the patterns drop mass at this sparsity


# Documents of 32 tokens on are sparse; each keeps its selected index (dense_if_cheaper off),
# so that short ones drop mass and the recall falls below 1.
DOCUMENTS_CFG = VerticalSlashConfig(
    last_q=16, vertical_topp=0.6, slash_topp=0.6, block_size=16, dense_below=32, dense_if_cheaper=False
)


@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "moba", "msa", "vertical_slash_documents"])
def test_heldout_recall_equals_dense_mass_of_the_sampled_rows(kind, rng):
    seq = 200
    q, k = _inputs(rng, seq)
    cu, pattern = None, _patterns(q, rng).get(kind)
    if kind == "vertical_slash_documents":  # the middle document, under dense_below, attends densely
        cu = torch.tensor([0, 70, 90, seq], dtype=torch.int32)
        pattern = VerticalSlashPattern(DOCUMENTS_CFG)
    index = pattern.local_index(q, k, D**-0.5, cu_seqlens=cu)
    rows = _draw(pattern, index, seq, rng)
    if kind != "dense":
        # Rows near a document's start may see every key they can (about one draw in 60 has
        # only such rows): draw again until some row is sparse, so the recall must fall below 1.
        for _ in range(50):
            if (_dense_recall(q, k, index, rows) < 1 - 1e-6).any():
                break
            rows = _draw(pattern, index, seq, rng)
    recall = heldout_recall(q, k, index, rows)
    torch.testing.assert_close(recall, _dense_recall(q, k, index, rows).float(), rtol=1e-6, atol=1e-6)
    if kind != "dense":
        assert (recall < 1).any()


@pytest.mark.parametrize("kind", ["vertical_slash", "vertical_slash_documents", "moba", "msa"])
def test_recall_on_the_window_kernels(kind, rng, kdevice, monkeypatch):
    """The recall's softmax and kept mass on the window-statistics kernels (fp32 inputs,
    as on a GPU; runs of rows that cross documents, held-out rows) against the fp64 dense
    mass under the index's mask."""
    seq = 200
    q, k = _inputs(rng, seq)
    cu = torch.tensor([0, 61, 90, 150, seq], dtype=torch.int32) if kind.endswith("documents") else None
    pattern = _patterns(q, rng)[kind.removesuffix("_documents")]
    if cu is not None:  # documents from 32 tokens on are sparse
        pattern = VerticalSlashPattern(DOCUMENTS_CFG)
    index = pattern.local_index(q, k, D**-0.5, cu_seqlens=cu)
    window = torch.arange(seq - ROWS, seq)  # crosses the last boundary where there are documents
    rows = _draw(pattern, index, seq, rng)
    want = [_dense_recall(q, k, index, r).float() for r in (window, rows)]
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    from megatron_mtraining.sparse.kernels.index_build.window_stats import WindowKernels

    calls, kept_sums = [], WindowKernels.kept_sums
    monkeypatch.setattr(WindowKernels, "kept_sums", lambda *a: calls.append(1) or kept_sums(*a))
    qf, kf, on = q.float().to(kdevice), k.float().to(kdevice), index.to(kdevice)
    got = [attention_recall(qf, kf, on, num_rows=ROWS), heldout_recall(qf, kf, on, rows)]
    assert len(calls) == 2  # both on the kernels
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
    assert (want[0] < 1).any() or (want[1] < 1).any()


@pytest.mark.parametrize("kind", ["vertical_slash", "vertical_slash_documents", "moba", "msa", "dense"])
@pytest.mark.parametrize("path", ["reference", "kernels", "kernels-16-row-tiles"])
def test_window_and_heldout_recall_in_one_pass(kind, path, rng, kdevice, monkeypatch):
    """Both recalls from one pass over the union of their rows (what the training loop
    records) against the fp64 dense mass of each set: held-out rows as drawn, and rows that
    overlap the last window (the union holds them once). The held-out runs are shorter than
    the window, so with 16-row tiles whole tiles of their windows are padding."""
    if path == "reference" and kdevice.type != "cpu":
        pytest.skip("the reference path runs on the CPU")
    _row_tiles(monkeypatch, 16 if path.endswith("row-tiles") else None)
    seq = 200
    q, k = _inputs(rng, seq)
    cu = torch.tensor([0, 61, 90, 150, seq], dtype=torch.int32) if kind.endswith("documents") else None
    pattern = _patterns(q, rng)[kind.removesuffix("_documents")]
    if cu is not None:
        pattern = VerticalSlashPattern(DOCUMENTS_CFG)
    index = pattern.local_index(q, k, D**-0.5, cu_seqlens=cu)
    window = torch.arange(seq - ROWS, seq)
    from megatron_mtraining.sparse.kernels.index_build.window_stats import WindowKernels

    overlapping = torch.cat([torch.arange(40, 56), torch.arange(seq - 10, seq)])  # the last 10 in the window
    # The fp64 references, of the fp64 inputs, before the kernels' path takes them in fp32.
    cases = [
        (rows, _dense_recall(q, k, index, rows).float()) for rows in (_draw(pattern, index, seq, rng), overlapping)
    ]
    want_window = _dense_recall(q, k, index, window).float()
    calls, kept_sums = [], WindowKernels.kept_sums
    monkeypatch.setattr(WindowKernels, "kept_sums", lambda *a: calls.append(1) or kept_sums(*a))
    if path != "reference":
        monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
        q, k, index = q.float().to(kdevice), k.float().to(kdevice), index.to(kdevice)
    tol = 1e-6 if path == "reference" else 1e-5
    for rows, want_rows in cases:
        got = window_and_heldout_recall(q, k, index, ROWS, rows)
        for g, want in zip(got, (want_window, want_rows), strict=True):
            torch.testing.assert_close(g.cpu(), want, rtol=tol, atol=tol)
    # One kept-sums pass a call on the kernels (none for a complete index, whose recall is 1).
    assert len(calls) == (0 if path == "reference" or index.complete else 2)


def test_heldout_rows_are_seeded_runs_outside_the_excluded_rows():
    excluded = [(0, 5), (100, 130)]
    rows = heldout_rows(256, excluded, 3, 16, seed=7)
    torch.testing.assert_close(rows, heldout_rows(256, excluded, 3, 16, seed=7))
    starts = rows[::16]
    assert rows.dtype == torch.int64 and len(rows) == 48 and (starts % 16 == 0).all()
    assert torch.equal(rows, (starts.view(-1, 1) + torch.arange(16)).flatten()) and (starts[1:] > starts[:-1]).all()
    # Runs 0, 6, 7 and 8 hold excluded rows; the other 12 are drawn alike over the seeds.
    drawn = torch.cat([heldout_rows(256, excluded, 3, 16, seed)[::16] // 16 for seed in range(400)])
    assert set(drawn.tolist()) == set(range(16)) - {0, 6, 7, 8}
    counts = torch.bincount(drawn, minlength=16)[[1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14, 15]].double()
    assert counts.min() > 0.6 * counts.mean(), counts
    assert len(heldout_rows(52, [(0, 20)], 3, 16, 0)) == 16  # only run 2 qualifies (the rest is partial)
    assert len(heldout_rows(52, [(0, 40)], 3, 16, 0)) == 0


def test_heldout_recall_rejects_bad_rows(rng):
    q, k = _inputs(rng, 64)
    index = DensePattern().local_index(q, k, D**-0.5)
    for rows in (torch.tensor([3, 2]), torch.tensor([0, 64]), torch.tensor([1, 2], dtype=torch.int32), [1, 2]):
        with pytest.raises(ValueError, match="rows=.*ascending positions in \\[0, 64\\)"):
            heldout_recall(q, k, index, rows)


def _check_distributed_recall(rank, world, seed, seq):
    gen = torch.Generator().manual_seed(seed)
    q, k = _inputs(gen, seq)
    for name, pattern in _patterns(q, gen).items():
        index = pattern.local_index(q, k, D**-0.5)
        expected = attention_recall(q, k, index, num_rows=ROWS)
        rows = _draw(pattern, index, seq, gen)  # the same on every rank: one seed
        expected_heldout = _dense_recall(q, k, index, rows).float()
        for kind in ("contiguous", "zigzag", "striped"):
            layout = ContextParallelLayout(kind, world, seq, stripe=16)
            lq, lk = layout.shard(q, rank), layout.shard(k, rank)
            local_pattern = pattern
            if isinstance(pattern, MSAPattern):
                local_pattern = pattern.with_inputs(
                    layout.shard(pattern.q_idx, rank), layout.shard(pattern.k_idx, rank)
                )
            index = local_pattern.distributed_index(lq, lk, layout, dist.group.WORLD, D**-0.5)
            recall = distributed_attention_recall(lq, lk, index, layout, num_rows=ROWS)
            torch.testing.assert_close(recall, expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name} {kind}")
            heldout = distributed_heldout_recall(lq, lk, index, layout, rows)
            torch.testing.assert_close(heldout, expected_heldout, rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {kind}")
            both = distributed_window_and_heldout_recall(lq, lk, index, layout, ROWS, rows)
            for got, want in zip(both, (expected, expected_heldout), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{rank} {name} {kind} in one pass")


# ---------------------------------------------------------------- MSA block and score recall

MSA_CFG = MSAConfig(block_size=16, topk=4, index_head_dim=8)
# fp32 block scores (``block_max_scores``) rank like the fp64 brute force only away from ties.
MIN_MARGIN = 1e-5


def _msa_inputs(gen, seq):
    q, k = _inputs(gen, seq)
    q_idx = torch.randn(B, seq, HKV, MSA_CFG.index_head_dim, generator=gen, dtype=torch.float64)
    k_idx = torch.randn(B, seq, 1, MSA_CFG.index_head_dim, generator=gen, dtype=torch.float64)
    return q, k, q_idx, k_idx


def _ranked(scores, visible):
    """The visible block ids of one row, best first (ties to the lower id), and the gap
    between each consecutive pair."""
    order = sorted(visible, key=lambda b: (-scores[b], b))
    return order, [scores[a] - scores[b] for a, b in zip(order, order[1:], strict=False)]


def _brute_msa_recall(q, k, q_idx, k_idx, cfg, rows, selected=None, bounds=None):
    """fp64, one row at a time: dense causal softmax, block masses by summing, top-k by
    sorting. ``selected[b][g][r]``: the index's block set of window row ``r`` (None: the
    index branch's own-block-plus-top-(k-1) selection from q_idx/k_idx). ``bounds``: packed
    documents' boundaries (a row sees its own document only). Returns the [B, Hq] recalls
    and the smallest ranking gap met at the top-k boundary."""
    seq, bs, topk = q.shape[1], cfg.block_size, cfg.topk
    group = HQ // HKV
    bounds = bounds or [0, seq]
    start = [max(b for b in bounds[:-1] if b <= i) for i in range(seq)]
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2)) * D**-0.5
    causal = torch.tensor([[start[i] <= j <= i for j in range(seq)] for i in range(seq)])
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    index_scores = torch.einsum("bqgd,bkd->bgqk", q_idx, k_idx[:, :, 0]) / cfg.index_head_dim**0.5
    n_blocks = -(-seq // bs)
    block_recall = torch.zeros(B, HQ, dtype=torch.float64)
    score_recall = torch.zeros(B, HQ, dtype=torch.float64)
    margin = float("inf")
    for b in range(B):
        for h in range(HQ):
            g = h // group
            for r, i in enumerate(range(seq - rows, seq)):
                visible = list(range(start[i] // bs, i // bs + 1))
                mass = [probs[b, h, i, c * bs : min((c + 1) * bs, i + 1)].sum().item() for c in range(n_blocks)]
                order, gaps = _ranked(mass, visible)
                best = set(order[:topk])
                margin = min([margin, *gaps[topk - 1 : topk]])
                if selected is None:
                    block_max = {
                        c: index_scores[b, g, i, max(c * bs, start[i]) : min((c + 1) * bs, i + 1)].max().item()
                        for c in visible
                    }
                    others, gaps = _ranked(block_max, [c for c in visible if c != i // bs])
                    chosen = {i // bs, *others[: topk - 1]}
                    margin = min([margin, *gaps[topk - 2 : topk - 1]])
                else:
                    chosen = set(selected[b][g][r])
                hit = best & chosen
                block_recall[b, h] += len(hit) / len(best) / rows
                score_recall[b, h] += sum(mass[c] for c in hit) / sum(mass[c] for c in best) / rows
    return block_recall, score_recall, margin


def _window_blocks(index, rows):
    """index.blocks' window rows as nested lists [b][group][row] of block ids."""
    blocks = index.blocks[:, -rows:].permute(0, 2, 1, 3).tolist()
    return [[[[c for c in row if c >= 0] for row in g] for g in b] for b in blocks]


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_msa_recall_equals_brute_force(phase, rng):
    seq = 200  # not a multiple of the block
    # Redraw an input whose ranking sits within rounding of a tie: about 3 draws in 10 do,
    # so 20 draws all do with a chance of about 1e-10.
    for _ in range(20):
        q, k, q_idx, k_idx = _msa_inputs(rng, seq)
        index = msa_select_blocks(q_idx, k_idx, MSA_CFG, HQ) if phase == "sparse" else None
        # The sparse phase reads the index's rows; the brute force selects on its own either way.
        block, score, margin = _brute_msa_recall(q, k, q_idx, k_idx, MSA_CFG, ROWS)
        if margin > MIN_MARGIN:
            break
    else:
        pytest.fail(f"20 draws within {MIN_MARGIN} of a tie")
    if index is not None:
        want_selection = _brute_msa_recall(q, k, q_idx, k_idx, MSA_CFG, ROWS, _window_blocks(index, ROWS))
        torch.testing.assert_close(want_selection[:2], (block, score), rtol=0, atol=1e-12)
    got = msa_recall(q, k, q_idx, k_idx, MSA_CFG, index, num_rows=ROWS, softmax_scale=D**-0.5)
    torch.testing.assert_close(got, (block.float(), score.float()), rtol=1e-6, atol=1e-6)
    # The figures are informative at this sparsity: the index misses blocks and mass, and the
    # blocks it finds carry more than their share of the mass.
    assert (got[0] < 1).all() and (got[0] > 0).all(), got
    assert (got[1] > got[0]).any(), got


def _documents_around_the_window(gen, seq):
    """Boundaries with a long document ending inside the window (more visible blocks than
    top-k) and a short last one."""
    first = int(torch.randint(20, 60, (1,), generator=gen))
    second = int(torch.randint(seq - ROWS + 2, seq - 4, (1,), generator=gen))
    return [0, first, second, seq]


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_msa_recall_within_packed_documents(phase, rng):
    seq = 200
    for _ in range(5):
        q, k, q_idx, k_idx = _msa_inputs(rng, seq)
        bounds = _documents_around_the_window(rng, seq)
        cu = torch.tensor(bounds, dtype=torch.int32)
        if phase == "sparse":
            index = msa_select_blocks(q_idx, k_idx, MSA_CFG, HQ, cu_seqlens=cu)
        else:
            index = DenseIndex(B, HQ, seq, documents=packed_documents(cu, seq))
        block, score, margin = _brute_msa_recall(q, k, q_idx, k_idx, MSA_CFG, ROWS, bounds=bounds)
        if margin > MIN_MARGIN:
            break
    else:
        pytest.fail(f"20 draws within {MIN_MARGIN} of a tie")
    got = msa_recall(q, k, q_idx, k_idx, MSA_CFG, index, num_rows=ROWS, softmax_scale=D**-0.5)
    torch.testing.assert_close(got, (block.float(), score.float()), rtol=1e-6, atol=1e-6)
    # Without the documents the figures differ: the rows would rank blocks of other documents.
    unpacked = _brute_msa_recall(q, k, q_idx, k_idx, MSA_CFG, ROWS)
    assert not torch.allclose(unpacked[1], score), (unpacked[1], score)


@pytest.mark.parametrize("phase,packed", [("warmup", False), ("sparse", True)], ids=["warmup", "sparse-documents"])
@pytest.mark.parametrize("row_tile", [None, 16])
def test_msa_recall_on_the_window_kernels(phase, packed, row_tile, rng, kdevice, monkeypatch):
    """MSA's block masses on the window-statistics kernels (fp32 inputs, as on a GPU; the
    row maxima, then each row's sums per key block) against the fp64 brute force, with
    packed documents: one ending inside the window, whose rows see more blocks than top-k,
    and a short last one, whose rows see fewer (with 16-row tiles, tiles of padding)."""
    _row_tiles(monkeypatch, row_tile)
    seq = 200
    for _ in range(20):  # redraw an input within rounding of a tie
        q, k, q_idx, k_idx = _msa_inputs(rng, seq)
        bounds = _documents_around_the_window(rng, seq) if packed else None
        block, score, margin = _brute_msa_recall(q, k, q_idx, k_idx, MSA_CFG, ROWS, bounds=bounds)
        if margin > MIN_MARGIN:
            break
    else:
        pytest.fail(f"20 draws within {MIN_MARGIN} of a tie")
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    if phase == "sparse":
        index = msa_select_blocks(q_idx.float(), k_idx.float(), MSA_CFG, HQ, cu_seqlens=cu).to(kdevice)
    else:
        index = None
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    from megatron_mtraining.sparse.kernels.index_build.window_stats import WindowKernels

    calls, block_sums = [], WindowKernels.block_sums
    monkeypatch.setattr(WindowKernels, "block_sums", lambda *a: calls.append(1) or block_sums(*a))
    inputs = (t.float().to(kdevice) for t in (q, k, q_idx, k_idx))
    got = msa_recall(*inputs, MSA_CFG, index, num_rows=ROWS, softmax_scale=D**-0.5)
    assert calls == [1]
    torch.testing.assert_close(tuple(g.cpu() for g in got), (block.float(), score.float()), rtol=1e-5, atol=1e-5)
    assert (got[0] < 1).any()


def test_msa_recall_is_one_when_every_visible_block_fits(rng):
    seq = 64  # 4 blocks of 16, topk 4
    q, k, q_idx, k_idx = _msa_inputs(rng, seq)
    for index in (None, msa_select_blocks(q_idx, k_idx, MSA_CFG, HQ)):
        for got in msa_recall(q, k, q_idx, k_idx, MSA_CFG, index, num_rows=ROWS):
            torch.testing.assert_close(got, torch.ones(B, HQ))


def test_msa_recall_is_one_for_the_main_branch_top_k(rng):
    """An index of each head's top-k blocks by the main branch's block masses (one selection
    head per query head) recalls everything; taking one block away recalls less."""
    seq = 200
    bs, topk, n_blocks = MSA_CFG.block_size, MSA_CFG.topk, -(-seq // MSA_CFG.block_size)
    for _ in range(5):  # redraw the rare input whose top-k boundary sits within rounding of a tie
        q, k, q_idx, k_idx = _msa_inputs(rng, seq)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(HQ // HKV, dim=2)) * D**-0.5
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        blocks = torch.full((B, seq, HQ, topk), -1, dtype=torch.int32)
        margin = float("inf")
        for b in range(B):
            for h in range(HQ):
                for i in range(seq - ROWS, seq):
                    mass = [probs[b, h, i, c * bs : (c + 1) * bs].sum().item() for c in range(n_blocks)]
                    order, gaps = _ranked(mass, range(i // bs + 1))
                    margin = min([margin, *gaps[topk - 1 : topk]])
                    blocks[b, i, h, : min(topk, len(order))] = torch.tensor(sorted(order[:topk]))
        if margin > MIN_MARGIN:
            break
    else:
        pytest.fail(f"20 draws within {MIN_MARGIN} of a tie")
    index = BlockTopKIndex(blocks=blocks, block_size=bs, num_heads=HQ)
    for got in msa_recall(q, k, q_idx, k_idx, MSA_CFG, index, num_rows=ROWS):
        torch.testing.assert_close(got, torch.ones(B, HQ))
    blocks[:, -1, :, 0] = -1  # the last row loses its lowest block (sorted to the end again)
    blocks[:, -1] = blocks[:, -1].roll(-1, dims=-1)
    dropped = BlockTopKIndex(blocks=blocks, block_size=bs, num_heads=HQ)
    block, score = msa_recall(q, k, q_idx, k_idx, MSA_CFG, dropped, num_rows=ROWS)
    torch.testing.assert_close(block, torch.full((B, HQ), 1 - 1 / (topk * ROWS)))
    assert (score < 1).all() and (score > block).any(), score


def _check_distributed_msa_recall(rank, world, seed, seq, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, q_idx, k_idx = (t.to(dtype) for t in _msa_inputs(gen, seq))
    pattern = MSAPattern(MSA_CFG, q_idx, k_idx)
    packed = torch.tensor(_documents_around_the_window(gen, seq), dtype=torch.int32)
    for phase, cu in (("warmup", None), ("sparse", None), ("warmup", packed), ("sparse", packed)):
        docs = {} if cu is None else {"cu_seqlens": cu}
        if phase == "sparse":
            index = pattern.local_index(q, k, D**-0.5, **docs)
        else:
            index = None if cu is None else DenseIndex(B, HQ, seq, documents=packed_documents(cu, seq))
        expected = msa_recall(q, k, q_idx, k_idx, MSA_CFG, index, num_rows=ROWS)
        for kind in ("contiguous", "zigzag", "striped"):
            layout = ContextParallelLayout(kind, world, seq, stripe=16)
            lq, lk, lq_idx, lk_idx = (layout.shard(t, rank) for t in (q, k, q_idx, k_idx))
            local = index
            if phase == "sparse":
                local = pattern.with_inputs(lq_idx, lk_idx).distributed_index(
                    lq, lk, layout, dist.group.WORLD, D**-0.5, **docs
                )
            got = distributed_msa_recall(lq, lk, lq_idx, lk_idx, MSA_CFG, local, layout, num_rows=ROWS)
            msg = f"rank {rank} {phase} {kind} documents {cu}"
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=msg)


def _check_distributed_recalls(rank, world, seed, seq):
    # One spawn for both (spawning costs seconds).
    _check_distributed_recall(rank, world, seed, seq)
    _check_distributed_msa_recall(rank, world, seed + 1, seq)


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_recall_and_msa_recall_equal_single_device(world, rng):
    """Index recall (of the window and of held-out rows) and MSA's block / score recall
    (warmup and sparse selections) from CP shards in every layout equal the single-device
    figures (the held-out recall: fp64 dense attention's)."""
    run(world, _check_distributed_recalls, int(torch.randint(0, 2**31 - 1, (1,), generator=rng)), 256)


@pytest.mark.slow
def test_distributed_msa_recall_on_the_window_kernels(rng, monkeypatch):
    """MSA's block / score recall from CP shards on the window kernels (fp32 inputs; Triton's
    interpreter on a CPU): each rank's block sums use the reduced row maxima, so they add up
    to the single-device figures in every layout, with and without documents."""
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    run(2, _check_distributed_msa_recall, int(torch.randint(0, 2**31 - 1, (1,), generator=rng)), 256, torch.float32)


class Ops(TorchDispatchMode):
    """Counts the ATen operations run while active."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("positions", ["all", "some"])
def test_block_attended_equals_the_key_lists_in_a_fixed_number_of_operations(positions, rng):
    """A top-k index's attended keys for the recall are built for every row at once (issue 21:
    the key lists cost a round of operations per row for wide blocks), equal to the lists'."""
    from megatron_mtraining.sparse.index import position_lookup
    from megatron_mtraining.sparse.metrics import _block_attended

    b, s, hs, hq, bs, topk = 2, 200, 2, 4, 16, 3
    blocks = torch.randint(-1, -(-s // bs), (b, s, hs, topk), generator=rng).int()
    index = BlockTopKIndex(blocks=blocks, block_size=bs, num_heads=hq)
    rows = torch.tensor([3, 4, 5, 90, 150, 151, 199])
    keys = None if positions == "all" else torch.cat([torch.randperm(s, generator=rng)[:120], torch.full((5,), -1)])
    n_keys = s if keys is None else len(keys)
    column = torch.arange(s + 1) if keys is None else position_lookup(keys, s, missing=n_keys)
    want = torch.zeros(b, hq, len(rows), n_keys + 1, dtype=torch.bool)
    for slot, row in enumerate(rows.tolist()):
        lists = index.key_lists(row, row + 1)  # [B, Hs, 1, width] positions, -1: none
        for i, h in itertools.product(range(b), range(hq)):
            for key in lists[i, h // (hq // hs), 0].tolist():
                if key >= 0:
                    want[i, h, slot, column[key]] = True
    want = want[..., :n_keys]
    with Ops() as ops:
        got = _block_attended(index, rows, len(rows), keys, n_keys, hq)
    assert torch.equal(got, want)
    assert ops.count <= 20  # whatever the number of rows


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "documents"])
def test_chunk_key_lists_equal_each_chunks_in_a_fixed_number_of_operations(packed, rng):
    """The recall's key lists of a vertical-slash index for several query blocks at once equal
    each block's ``bounded_key_lists``, in as many operations for six blocks as for one (with
    documents, a call per block cost ~100 launches: the packed step's host time)."""
    seq = 200
    q, k = _inputs(rng, seq)
    cu = torch.tensor([0, 70, 90, seq], dtype=torch.int32) if packed else None
    pattern = VerticalSlashPattern(DOCUMENTS_CFG) if packed else _patterns(q, rng)["vertical_slash"]
    index = pattern.local_index(q, k, D**-0.5, cu_seqlens=cu)
    chunk = index.query_chunk
    starts = sorted(torch.randperm(-(-seq // chunk), generator=rng)[:6].mul(chunk).tolist())
    got = index.chunk_key_lists(starts)
    for i, q0 in enumerate(starts):
        assert torch.equal(got[:, :, i : i + 1], index.bounded_key_lists(q0, min(q0 + chunk, seq)))
    counts = []
    for some in (starts[:1], starts):
        with Ops() as ops:
            index.chunk_key_lists(some)
        counts.append(ops.count)
    assert counts[0] == counts[1], counts
