"""build_moba_index against a brute-force fp64 re-derivation of MoBA's gate."""

import pytest
import torch

from megatron_mtraining.sparse import BlockTopKIndex, MoBAConfig, build_moba_index
from megatron_mtraining.sparse.index import select_topk_blocks

# The index ranks fp64 gate scores rounded to fp32 (ties to the earlier chunk); two earlier
# chunks whose fp64 scores are closer than this may be ranked either way.
TIE_TOL = 1e-4


def make_qk(rng, b, s, hq, hkv, d, dtype=torch.float64):
    q = torch.randn(b, s, hq, d, generator=rng, dtype=torch.float64).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=rng, dtype=torch.float64).to(dtype)
    return q, k


def gate_scores(q, k, chunk_size):
    """fp64 ``[B, Hq, S, n_chunks]`` scores ``q_i . mean(k over chunk c)``, by explicit loops."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    n_chunks = -(-s // chunk_size)
    scores = torch.empty(b, hq, s, n_chunks, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            keys = k[bi, :, h // group].double()
            means = torch.stack([keys[c * chunk_size : min((c + 1) * chunk_size, s)].mean(0) for c in range(n_chunks)])
            scores[bi, h] = q[bi, :, h].double() @ means.T
    return scores


def check_row(got, scores, own, topk, where):
    """``got``: chosen chunks of one (b, i, h); ``scores``: its fp64 gate scores."""
    assert own in got, f"{where}: own chunk {own} missing from {sorted(got)}"
    earlier = sorted(range(own), key=lambda c: -scores[c])
    need = topk - 1
    if len(earlier) <= need:
        assert got == {own, *earlier}, f"{where}: got {sorted(got)}, want all of 0..{own}"
        return
    expected = {own, *earlier[:need]}
    gap = scores[earlier[need - 1]] - scores[earlier[need]] if need else float("inf")
    if gap > TIE_TOL:
        assert got == expected, f"{where}: got {sorted(got)}, want {sorted(expected)}"
    else:  # near tie at the cut: any top set consistent with the scores up to TIE_TOL
        assert len(got) == topk, f"{where}: got {sorted(got)}"
        cut = scores[earlier[need]]
        others = got - {own}
        assert all(scores[c] >= cut - TIE_TOL for c in others), f"{where}: got {sorted(got)}"
        assert all(c in got for c in earlier if scores[c] > cut + TIE_TOL), f"{where}: got {sorted(got)}"


def check_index(index, q, k, cfg):
    b, s, hq, _ = q.shape
    cs, topk = cfg.chunk_size, cfg.topk
    n_chunks = -(-s // cs)
    assert isinstance(index, BlockTopKIndex)
    assert index.block_size == cs and index.num_heads == hq
    assert index.batch_size == b and index.seq_len == s and index.selection_heads == hq
    assert index.blocks.shape == (b, s, hq, topk) and index.blocks.dtype == torch.int32

    blocks = index.blocks
    valid = blocks >= 0
    # -1 only at the end of a row; valid entries strictly ascending and in range.
    assert torch.equal(valid, valid.cummin(-1).values), "-1 padding must come last"
    step = blocks[..., 1:] > blocks[..., :-1]
    assert (step | ~valid[..., 1:]).all(), "chosen blocks must be strictly ascending"
    assert (blocks < n_chunks).all()

    scores = gate_scores(q, k, cs).tolist()
    rows = blocks.tolist()
    for bi in range(b):
        for i in range(s):
            for h in range(hq):
                got = {c for c in rows[bi][i][h] if c >= 0}
                check_row(got, scores[bi][h][i], i // cs, topk, f"b={bi} i={i} h={h}")

    mask = index.to_dense_mask(s)
    assert mask.shape == (b, hq, s, s)
    pos = torch.arange(s)
    assert not (mask & (pos.view(1, -1) > pos.view(-1, 1))).any(), "mask attends a future key"
    # Every query sees its own chunk up to itself (so the diagonal, at least).
    assert mask.diagonal(dim1=-2, dim2=-1).all()


@pytest.mark.parametrize("seq", [150, 128], ids=["ragged", "aligned"])
@pytest.mark.parametrize("topk", [1, 3, 20], ids=["own_only", "top3", "more_than_chunks"])
def test_matches_brute_force(seq, topk, rng):
    q, k = make_qk(rng, 2, seq, 4, 2, 16)
    cfg = MoBAConfig(chunk_size=16, topk=topk)
    check_index(build_moba_index(q, k, cfg), q, k, cfg)


@pytest.mark.parametrize("heads", [(4, 1), (3, 3)], ids=["mqa", "mha"])
def test_other_head_layouts(heads, rng):
    q, k = make_qk(rng, 1, 100, heads[0], heads[1], 8)
    cfg = MoBAConfig(chunk_size=32, topk=2)
    check_index(build_moba_index(q, k, cfg), q, k, cfg)


def test_fp32_inputs(rng):
    q, k = make_qk(rng, 2, 90, 4, 2, 16, dtype=torch.float32)
    cfg = MoBAConfig(chunk_size=16, topk=4)
    check_index(build_moba_index(q, k, cfg), q, k, cfg)


def test_more_chunks_than_topk_attends_all_when_topk_large(rng):
    """With topk >= number of chunks every query sees its whole causal prefix."""
    q, k = make_qk(rng, 1, 70, 2, 1, 8)
    index = build_moba_index(q, k, MoBAConfig(chunk_size=16, topk=5))
    pos = torch.arange(70)
    causal = pos.view(-1, 1) >= pos.view(1, -1)
    assert torch.equal(index.to_dense_mask(70), causal.expand(1, 2, 70, 70))


def test_hand_built_gate(rng):
    """Chunk means along one direction fixed by hand: each query takes the earlier
    chunks with the largest means, and a negative query reverses the order."""
    d, cs = 4, 16
    s = 5 * cs + 7  # chunks 0..4 full, chunk 5 holds 7 tokens
    levels = [3.0, -1.0, 5.0, 0.5, 4.0, 9.0]  # chunk 5 is never an earlier chunk
    k = torch.randn(1, s, 1, d, generator=rng, dtype=torch.float64) * 1e-3
    for c, level in enumerate(levels):
        k[0, c * cs : (c + 1) * cs, 0, 0] += level
    q = torch.zeros(1, s, 2, d, dtype=torch.float64)
    q[:, :, 0, 0], q[:, :, 1, 0] = 1.0, -1.0
    cfg = MoBAConfig(chunk_size=cs, topk=3)
    index = build_moba_index(q, k, cfg)
    blocks = index.blocks[0]
    assert blocks[0, 0].tolist() == [0, -1, -1]  # first chunk: only its own
    assert blocks[cs, 0].tolist() == [0, 1, -1]  # chunk 1: one earlier chunk available
    assert blocks[s - 1, 0].tolist() == [2, 4, 5]  # means 5.0 and 4.0
    assert blocks[s - 1, 1].tolist() == [1, 3, 5]  # negated: means -1.0 and 0.5
    assert blocks[4 * cs, 0].tolist() == [0, 2, 4]  # chunk 4 sees 0..3: 5.0 and 3.0
    check_index(index, q, k, cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_top_k_selection_ties_to_the_lower_block(dtype, rng):
    """``select_topk_blocks`` against a sort by (score descending, block id ascending) in Python,
    on scores drawn from a few values (many ties, at the cut too), with invisible blocks, NaNs,
    +inf scores (ranked as scores, after the own block), rows seeing fewer blocks than ``topk``
    and a ``topk`` above the block count."""
    rows, n = 300, 9
    scores = torch.randint(0, 4, (2, rows, n), generator=rng).to(dtype)
    drop = torch.rand(2, rows, n, generator=rng)
    scores = scores.masked_fill(drop < 0.2, float("-inf")).masked_fill(drop > 0.95, float("nan"))
    scores = scores.masked_fill((drop > 0.75) & (drop < 0.85), float("inf"))
    own = torch.randint(0, n, (rows,), generator=rng)
    for topk in (1, 3, 5, n + 2):
        got = select_topk_blocks(scores, own, topk)
        assert got.dtype == torch.int32 and got.shape == (2, rows, topk)
        for h in range(2):
            for r in range(rows):
                row = scores[h, r].tolist()
                visible = [c for c in range(n) if c != own[r] and row[c] > float("-inf")]  # NaN > -inf is False
                best = sorted(visible, key=lambda c: (-row[c], c))[: topk - 1]
                want = sorted([int(own[r]), *best])
                assert got[h, r].tolist() == want + [-1] * (topk - len(want)), (topk, h, r, row)


def test_equal_gates_take_the_earlier_chunks(rng):
    """Chunks of equal means (an exact tie in fp64) and means that differ below fp32's
    resolution: the earlier chunks are taken, as ``select_topk_blocks`` breaks ties."""
    d, cs = 4, 16
    s = 6 * cs
    k = torch.zeros(1, s, 1, d, dtype=torch.float64)
    levels = [1.0, 2.0, 2.0, 2.0 * (1 + 2**-30), 1.0, 0.0]
    for c, level in enumerate(levels):
        k[0, c * cs : (c + 1) * cs, 0, 0] = level
    q = torch.zeros(1, s, 1, d, dtype=torch.float64)
    # Few mantissa bits: 2**-30 relative above such a score is below half an fp32 ulp of it.
    q[..., 0] = 1.0 + torch.randint(0, 8, (1, s, 1), generator=rng, dtype=torch.float64) / 8
    blocks = build_moba_index(q, k, MoBAConfig(chunk_size=cs, topk=3)).blocks[0, :, 0]
    assert blocks[5 * cs].tolist() == [1, 2, 5]  # 2.0 three times (one just above): chunks 1, 2
    assert blocks[4 * cs].tolist() == [1, 2, 4]
    assert blocks[3 * cs].tolist() == [1, 2, 3]
