"""The Triton top-k of block scores (``sparse.kernels.index_build.topk_blocks``) against
``index.select_topk_blocks``, and MoBA's gate on it against the torch path: the same blocks,
exactly."""

import pytest
import torch

from megatron_mtraining.sparse import MoBAConfig, build_moba_index, moba
from megatron_mtraining.sparse.index import select_topk_blocks

INF = float("inf")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of a few rows, so that small inputs span several programs."""
    from megatron_mtraining.sparse.kernels.index_build import topk_blocks

    monkeypatch.setattr(topk_blocks, "LAUNCH", topk_blocks.TopkLaunch(elements=256, max_rows=16))
    return topk_blocks


def tied_scores(rng, shape, dtype=torch.float32):
    """Scores from a few values (ties everywhere, at the cut too), with -inf, NaN and +inf."""
    scores = torch.randint(0, 4, shape, generator=rng).to(dtype)
    drop = torch.rand(shape, generator=rng)
    scores = scores.masked_fill(drop < 0.2, -INF).masked_fill(drop > 0.95, float("nan"))
    return scores.masked_fill((drop > 0.75) & (drop < 0.8), INF)


@pytest.mark.parametrize(
    "lead,n,topk",
    [
        ((), 1, 3),
        ((3,), 5, 1),
        ((2, 3), 5, 7),
        ((2, 2, 2), 32, 12),
        ((2, 3), 33, 4),
        ((2,), 33, 35),
        ((1,), 100, 12),
    ],
)
def test_equals_select_topk_blocks(lead, n, topk, rng, kdevice, small_tiles):
    nq = 37
    scores = tied_scores(rng, (*lead, nq, n))
    # Some rows see fewer blocks than topk.
    scores[..., ::5, 2:] = -INF
    own = torch.randint(0, n, (nq,), generator=rng)
    got = small_tiles.select_topk_blocks(scores.to(kdevice), own.to(kdevice), topk).cpu()
    assert got.dtype == torch.int32 and got.shape == (*lead, nq, topk)
    assert torch.equal(got, select_topk_blocks(scores, own, topk))


@pytest.mark.parametrize("documents", [False, True])
def test_limits_on_fp64_scores(documents, rng, kdevice, small_tiles):
    """fp64 scores ranked rounded to fp32 (values apart by less than fp32's resolution tie),
    blocks after the own one and before the first hidden by the limits, not by -inf."""
    nq, n, topk = 53, 20, 6
    scores = tied_scores(rng, (2, 3, nq, n), torch.float64)
    scores += torch.randint(0, 2, scores.shape, generator=rng) * 2**-30  # below half an fp32 ulp
    own = torch.randint(0, n, (nq,), generator=rng)
    first = (own - torch.randint(0, 8, (nq,), generator=rng)).clamp(min=0) if documents else None
    chunks = torch.arange(n)
    earlier = chunks < own.view(-1, 1)
    if documents:
        earlier &= chunks >= first.view(-1, 1)
    want = select_topk_blocks(scores.masked_fill(~earlier, -INF).float(), own, topk)
    got = small_tiles.select_topk_blocks(
        scores.to(kdevice), own.to(kdevice), topk, True, None if first is None else first.to(kdevice)
    )
    assert torch.equal(got.cpu(), want)


def test_writes_into_a_permuted_view(rng, kdevice, small_tiles):
    """``out``: the ``[B, H, nq, topk]`` view of a ``[B, nq, H, topk]`` result, as MoBA's."""
    scores = tied_scores(rng, (2, 4, 30, 9)).transpose(-1, -2).contiguous().transpose(-1, -2)  # strided blocks
    own = torch.randint(0, 9, (30,), generator=rng)
    out = torch.full((2, 30, 4, 5), 7, dtype=torch.int32, device=kdevice)
    small_tiles.select_topk_blocks(scores.to(kdevice), own.to(kdevice), 5, out=out.permute(0, 2, 1, 3))
    assert torch.equal(out.cpu(), select_topk_blocks(scores, own, 5).permute(0, 2, 1, 3))


def test_bad_inputs_are_named(small_tiles):
    own = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="n_blocks <= 128"):
        small_tiles.select_topk_blocks(torch.zeros(4, 129), own, 2)
    with pytest.raises(ValueError, match="scores.dtype"):
        small_tiles.select_topk_blocks(torch.zeros(4, 8, dtype=torch.bfloat16), own, 2)
    with pytest.raises(ValueError, match="own_block"):
        small_tiles.select_topk_blocks(torch.zeros(4, 8), own[:3], 2)
    with pytest.raises(ValueError, match="out"):
        small_tiles.select_topk_blocks(torch.zeros(4, 8), own, 2, out=torch.zeros(4, 3, dtype=torch.int32))


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("topk", [3, 12])
def test_moba_gate_on_the_kernel_equals_the_torch_path(documents, topk, rng, kdevice, small_tiles, monkeypatch):
    """``build_moba_index`` with the kernel (as on CUDA) and on the torch path: the same
    blocks, on small-integer inputs whose chunk means tie exactly; 10 chunks (``topk`` 12
    above them), packed documents starting inside chunks."""
    b, s, hq, hkv, d, cs = 2, 150, 4, 2, 8, 16
    q = torch.randint(-2, 3, (b, s, hq, d), generator=rng).float().to(kdevice)
    k = torch.randint(-2, 3, (b, s, hkv, d), generator=rng).float().to(kdevice)
    cu = torch.tensor([0, 37, 41, 120, s], dtype=torch.int32, device=kdevice) if documents else None
    cfg = MoBAConfig(chunk_size=cs, topk=topk)
    launches = []
    real = small_tiles.select_topk_blocks
    monkeypatch.setattr(small_tiles, "select_topk_blocks", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setattr(moba, "backend_choice", lambda q: "triton")
    got = build_moba_index(q, k, cfg, cu).blocks
    assert launches
    monkeypatch.setattr(moba, "backend_choice", lambda q: "reference")
    want = build_moba_index(q, k, cfg, cu).blocks
    assert len(launches) == 1
    assert got.is_contiguous() and torch.equal(got, want)
