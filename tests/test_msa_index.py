"""The Triton MSA selection (``sparse.kernels.index_build.msa_index``) against the torch path of
``sparse.msa``: block-max scores, the top-k selection, and its tie rule."""

import pytest
import torch

from megatron_mtraining.sparse import MSAConfig, msa_select_blocks
from megatron_mtraining.sparse.msa import block_max_scores


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles small enough that a few hundred tokens span several row tiles per key block,
    several key blocks per tile and several matrix products per key block."""
    from megatron_mtraining.sparse.kernels.index_build import msa_index

    monkeypatch.setattr(msa_index, "LAUNCH", msa_index.SelectLaunch(block_m=32, block_m_wide=16, block_n=16))
    return msa_index


def make_inputs(rng, b, s, groups, d, dtype, device, integer=False):
    if integer:  # small integers: exact scores, so equal block scores tie exactly
        q = torch.randint(-2, 3, (b, s, groups, d), generator=rng).float()
        k = torch.randint(-2, 3, (b, s, 1, d), generator=rng).float()
    else:
        q = torch.randn(b, s, groups, d, generator=rng)
        k = torch.randn(b, s, 1, d, generator=rng)
    return q.to(device, dtype), k.to(device, dtype)


def torch_block_max(q, k, block_size):
    pos = torch.arange(q.shape[1])
    return block_max_scores(q.cpu(), pos, k.cpu(), pos, -(-q.shape[1] // block_size), block_size)


def lower_id_reference(q, k, block_size, topk):
    """The selection with ties broken toward the lower block id, from the torch block maxima."""
    scores = torch_block_max(q, k, block_size)
    n = scores.shape[-1]
    own = (torch.arange(q.shape[1]) // block_size).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    values, order = scores.scatter(-1, own, float("inf")).sort(dim=-1, descending=True, stable=True)
    ids = torch.where(values[..., :topk] > float("-inf"), order[..., :topk], n).sort(-1).values
    ids = torch.nn.functional.pad(torch.where(ids == n, -1, ids), (0, topk - ids.shape[-1]), value=-1)
    return ids.permute(0, 2, 1, 3).int()


def assert_same_selection(got, want, scores, block_size, rtol):
    """Same per-row layout (ascending, -1 padded, own block in, as many blocks) and the
    same multiset of block scores: blocks may differ only where their scores tie."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == torch.int32
    valid = got >= 0
    assert torch.equal(valid, want >= 0)
    assert ((got[..., 1:] > got[..., :-1]) | ~valid[..., 1:]).all()
    own = (torch.arange(got.shape[1]) // block_size).view(1, -1, 1, 1)
    assert (got == own).any(-1).all()
    per_row = scores.permute(0, 2, 1, 3).scatter(-1, own.expand(*got.shape[:3], 1), float("inf"))

    def chosen(ids):
        s = per_row.gather(-1, ids.clamp(min=0).long()).masked_fill(ids < 0, float("-inf"))
        return s.sort(-1, descending=True).values

    assert chosen(got).isfinite().sum() + (got == own).sum() == valid.sum()  # no invisible block taken
    torch.testing.assert_close(chosen(got), chosen(want), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("block_size,seq", [(16, 211), (32, 250), (64, 233)])
def test_block_max_equals_torch(block_size, seq, rng, kdevice, small_tiles):
    q, k = make_inputs(rng, 2, seq, 2, 16, torch.float32, kdevice)
    got = small_tiles.block_max_scores_triton(q, k, block_size).cpu()
    want = torch_block_max(q, k, block_size)
    assert got.shape == want.shape == (2, 2, seq, -(-seq // block_size)) and got.dtype == torch.float32
    assert torch.equal(got.isneginf(), want.isneginf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "block_size,seq,topk,dtype",
    [
        (16, 211, 1, torch.float32),
        (16, 250, 4, torch.float32),
        (16, 233, 9, torch.float32),  # not a power of two: padded set
        (32, 250, 12, torch.float32),  # more than the 8 blocks: every visible block, then -1
        (16, 250, 40, torch.float32),  # past the block count by more than the set's width
        (16, 227, 6, torch.float16),
        (32, 227, 5, torch.bfloat16),
    ],
)
def test_selection_matches_torch(block_size, seq, topk, dtype, rng, kdevice, small_tiles):
    if dtype == torch.bfloat16 and kdevice.type == "cpu":
        pytest.skip("the interpreter's bf16 is broken")
    q, k = make_inputs(rng, 2, seq, 2, 16, dtype, kdevice)
    cfg = MSAConfig(block_size=block_size, topk=topk, index_head_dim=16)
    got = small_tiles.select_blocks(q, k, block_size, topk)
    want = msa_select_blocks(q.cpu(), k.cpu(), cfg, num_heads=4)
    assert got.device == q.device
    assert_same_selection(got, want.blocks, torch_block_max(q, k, block_size), block_size, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ties_go_to_the_lower_block(dtype, rng, kdevice, small_tiles):
    """Integer inputs tie often and exactly: the selection is then fully determined."""
    q, k = make_inputs(rng, 1, 243, 2, 16, dtype, kdevice, integer=True)
    for topk in (2, 5):
        got = small_tiles.select_blocks(q, k, 16, topk).cpu()
        assert torch.equal(got, lower_id_reference(q, k, 16, topk))
    # Every key alike: all blocks tie, so each row takes the lowest ids besides its own.
    k = k[:, :1].expand_as(k).contiguous()
    got = small_tiles.select_blocks(q, k, 16, 3).cpu()
    assert torch.equal(got[0, 100, 1], torch.tensor([0, 1, 6], dtype=torch.int32))
    assert torch.equal(got[0, 20, 0], torch.tensor([0, 1, -1], dtype=torch.int32))


def test_wide_selection(rng, kdevice, small_tiles):
    """More than 32 slots: the wide set, on its smaller row tiles."""
    q, k = make_inputs(rng, 1, 560, 1, 16, torch.float32, kdevice)
    cfg = MSAConfig(block_size=16, topk=34, index_head_dim=16)
    got = small_tiles.select_blocks(q, k, 16, 34)
    want = msa_select_blocks(q.cpu(), k.cpu(), cfg, num_heads=1)
    assert_same_selection(got, want.blocks, torch_block_max(q, k, 16), 16, rtol=1e-5)


def test_strided_inputs(rng, kdevice, small_tiles):
    """Index heads sliced out of wider projections (rows not contiguous)."""
    q, k = make_inputs(rng, 1, 150, 4, 16, torch.float32, kdevice)
    q, k = q[:, :, 1:3], k.expand(-1, -1, 2, -1)[:, :, 1:]
    cfg = MSAConfig(block_size=16, topk=3, index_head_dim=16)
    got = small_tiles.select_blocks(q, k, 16, 3)
    want = msa_select_blocks(q.cpu(), k.cpu(), cfg, num_heads=2)
    assert_same_selection(got, want.blocks, torch_block_max(q, k, 16), 16, rtol=1e-5)


def test_msa_select_blocks_runs_the_kernel_where_the_kernels_run(rng, kdevice, small_tiles, monkeypatch):
    """The dispatch: with the kernels chosen, ``msa_select_blocks`` returns the kernel's
    selection (the same blocks as the reference path); with ``reference``, the torch path."""
    from megatron_mtraining.sparse import msa

    q, k = make_inputs(rng, 1, 200, 2, 16, torch.float32, kdevice)
    cfg = MSAConfig(block_size=16, topk=5, index_head_dim=16)
    want = msa_select_blocks(q.cpu(), k.cpu(), cfg, num_heads=4)
    launches = []
    real = small_tiles.select_blocks
    monkeypatch.setattr(small_tiles, "select_blocks", lambda *a: launches.append(a[2:]) or real(*a))
    monkeypatch.setattr(msa, "backend_choice", lambda q: "triton")
    got = msa_select_blocks(q, k, cfg, num_heads=4)
    assert launches == [(16, 5)] and (got.block_size, got.num_heads) == (16, 4)
    assert_same_selection(got.blocks, want.blocks, torch_block_max(q, k, 16), 16, rtol=1e-5)
    monkeypatch.setattr(msa, "backend_choice", lambda q: "reference")
    msa_select_blocks(q, k, cfg, num_heads=4)
    assert len(launches) == 1


def test_bad_inputs_are_named(small_tiles):
    q, k = torch.zeros(1, 40, 2, 16), torch.zeros(1, 40, 1, 16)
    with pytest.raises(ValueError, match=r"k_idx\.shape\[2\]=2 is not accepted"):
        small_tiles.select_blocks(q, torch.zeros(1, 40, 2, 16), 16, 4)
    with pytest.raises(ValueError, match=r"q_idx\.dtype=torch\.float64 is not accepted"):
        small_tiles.select_blocks(q.double(), k.double(), 16, 4)
    with pytest.raises(ValueError, match=r"topk=129 is not accepted"):
        small_tiles.select_blocks(q, k, 16, 129)
    with pytest.raises(ValueError, match=r"block_size=24 is not accepted"):
        small_tiles.block_max_scores_triton(q, k, 24)


def test_launch_defaults_are_the_sweeps_winners():
    """What runs unless ``LAUNCH`` is replaced (the tests' tiles, a sweep's candidates): the
    launch sweep's winner on an H200 (docs/benchmarks.md, "MSA's tuned launches")."""
    from megatron_mtraining.sparse.kernels.index_build import msa_index

    assert msa_index.SelectLaunch() == msa_index.SelectLaunch(
        block_m=128, block_m_wide=64, block_n=128, num_warps=8, num_stages=2, num_stages_fp32=1
    )


def test_launch_override_changes_the_tiles_not_the_selection(rng, kdevice, small_tiles, monkeypatch):
    """Another ``LAUNCH`` (as ``bench_kernels.py --tune msa_select`` sets it) changes the grid
    and the tiles the kernel receives; on small-integer inputs, whose scores are exact in any
    tiling, the selection is the same."""
    q, k = make_inputs(rng, 1, 200, 2, 16, torch.float16, kdevice, integer=True)  # fp32 takes num_stages_fp32
    launches = []
    kernel = small_tiles._block_select_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]))
                kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(small_tiles, "_block_select_kernel", Spy())
    want = small_tiles.select_blocks(q, k, 32, 4)
    monkeypatch.setattr(
        small_tiles, "LAUNCH", small_tiles.SelectLaunch(block_m=16, block_n=32, num_warps=4, num_stages=3)
    )
    got = small_tiles.select_blocks(q, k, 32, 4)
    assert launches == [((2, 7), 32, 16, 8, 2), ((2, 13), 16, 32, 4, 3)]
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "launch,message",
    [
        ({"block_m": 96}, r"msa_index\.LAUNCH\.block_m=96 is not accepted: expected a power of two >= 16"),
        ({"block_n": 8}, r"msa_index\.LAUNCH\.block_n=8 is not accepted: expected a power of two >= 16"),
        ({"num_warps": 6}, r"msa_index\.LAUNCH\.num_warps=6 is not accepted: expected a power of two from 1 to 32"),
        ({"num_stages": 0}, r"msa_index\.LAUNCH\.num_stages=0 is not accepted: expected an integer >= 1"),
    ],
)
def test_bad_launch_is_refused(launch, message, small_tiles, monkeypatch):
    monkeypatch.setattr(small_tiles, "LAUNCH", small_tiles.SelectLaunch(**launch))
    q, k = torch.zeros(1, 40, 2, 16), torch.zeros(1, 40, 1, 16)
    with pytest.raises(ValueError, match=message):
        small_tiles.select_blocks(q, k, 16, 4)


def test_a_launch_of_another_kernel_is_refused(small_tiles, monkeypatch):
    from megatron_mtraining.sparse.kernels.kv_outer.attention import RowConfig

    monkeypatch.setattr(small_tiles, "LAUNCH", RowConfig(rows=16, num_warps=4, num_stages=3))
    with pytest.raises(ValueError, match=r"msa_index\.LAUNCH=RowConfig\(.*\) is not accepted: expected a SelectLaunch"):
        small_tiles.block_max_scores_triton(torch.zeros(1, 40, 2, 16), torch.zeros(1, 40, 1, 16), 16)
