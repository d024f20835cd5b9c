"""MSA: block selection, KL alignment loss, gradient confinement, warmup."""

import math
from pathlib import Path

import pytest
import torch
from msa_reference import brute_force_kl

from megatron_mtraining.sparse import DenseIndex, IndexBranch, MSAConfig, msa_kl_loss, msa_select_blocks


def brute_force_selection(q_idx, k_idx, block_size, topk):
    """Per (b, i, r): {own block} + top-(topk-1) other visible blocks by max score."""
    b, s, groups, d = q_idx.shape
    scores = torch.einsum("bird,bjd->brij", q_idx.double(), k_idx[:, :, 0].double()) / math.sqrt(d)
    out = {}
    for bi in range(b):
        for r in range(groups):
            for i in range(s):
                own = i // block_size
                best = {}
                for j in range(i + 1):
                    blk = j // block_size
                    best[blk] = max(best.get(blk, -math.inf), scores[bi, r, i, j].item())
                others = sorted((blk for blk in best if blk != own), key=lambda x: -best[x])[: topk - 1]
                out[bi, i, r] = {own, *others}
    return out


@pytest.mark.parametrize("topk", [3, 10])
def test_selection_matches_brute_force(topk, rng, device):
    b, s, groups, d = 2, 90, 2, 8
    q_idx = torch.randn(b, s, groups, d, generator=rng)
    k_idx = torch.randn(b, s, 1, d, generator=rng)
    cfg = MSAConfig(block_size=16, topk=topk, index_head_dim=d)
    index = msa_select_blocks(q_idx.to(device), k_idx.to(device), cfg, num_heads=6).to("cpu")
    assert index.blocks.shape == (b, s, groups, topk) and index.num_heads == 6 and index.block_size == 16
    want = brute_force_selection(q_idx, k_idx, 16, topk)
    for (bi, i, r), expected in want.items():
        row = index.blocks[bi, i, r].tolist()
        n = sum(x >= 0 for x in row)
        assert row[:n] == sorted(expected) and all(x == -1 for x in row[n:]), (bi, i, r)
        assert i // 16 in row  # own block always present
        assert n == min(topk, i // 16 + 1)  # all visible blocks when fewer than topk


def test_selection_in_several_query_chunks(rng):
    """Long enough that the builder works in several query chunks; still exact."""
    b, s, groups, d, bs, topk = 1, 3000, 2, 8, 16, 4
    q_idx = torch.randn(b, s, groups, d, generator=rng)
    k_idx = torch.randn(b, s, 1, d, generator=rng)
    index = msa_select_blocks(q_idx, k_idx, MSAConfig(block_size=bs, topk=topk, index_head_dim=d), num_heads=4)
    scores = torch.einsum("bird,bjd->brij", q_idx.double(), k_idx[:, :, 0].double())
    causal = torch.arange(s).view(1, -1) <= torch.arange(s).view(-1, 1)
    scores = scores.masked_fill(~causal, -math.inf)
    n_blocks = -(-s // bs)
    block_max = (
        torch.nn.functional.pad(scores, (0, n_blocks * bs - s), value=-math.inf).unflatten(-1, (n_blocks, bs)).amax(-1)
    )
    own = torch.arange(s) // bs
    block_max[:, :, torch.arange(s), own] = math.inf
    top = block_max.topk(topk, dim=-1)
    want = torch.where(top.values > -math.inf, top.indices, n_blocks).sort(-1).values
    want = torch.where(want == n_blocks, -1, want).permute(0, 2, 1, 3)
    assert torch.equal(index.blocks.long(), want)


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup-dense"])
def test_kl_loss_value_and_gradients_match_brute_force(warmup, rng, device):
    b, s, hq, groups, d, di = 2, 70, 4, 2, 16, 8

    def randn(*shape):
        return torch.randn(*shape, generator=rng, dtype=torch.float64).to(device)

    q, k = randn(b, s, hq, d), randn(b, s, groups, d)
    q_idx, k_idx = randn(b, s, groups, di).requires_grad_(), randn(b, s, 1, di).requires_grad_()
    cfg = MSAConfig(block_size=16, topk=2, index_head_dim=di)
    index = DenseIndex(b, hq, s, device=device) if warmup else msa_select_blocks(q_idx, k_idx, cfg, hq)
    loss = msa_kl_loss(q, k, q_idx, k_idx, index)
    want = brute_force_kl(q, k, q_idx, k_idx, index.to_dense_mask(s))
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-10)
    assert loss.item() > 0
    got = torch.autograd.grad(3.0 * loss, (q_idx, k_idx))
    expected = torch.autograd.grad(3.0 * want, (q_idx, k_idx))
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-9)


def test_kl_loss_is_zero_when_index_matches_main_branch(rng):
    """One head per group and index projections equal to the main ones (d equal,
    same scale): student == teacher, so KL == 0."""
    b, s, groups, d = 1, 48, 2, 8
    q = torch.randn(b, s, groups, d, generator=rng, dtype=torch.float64)
    k = torch.randn(b, s, 1, d, generator=rng, dtype=torch.float64)
    k_main = k.expand(-1, -1, groups, -1).contiguous()
    index = msa_select_blocks(q, k, MSAConfig(block_size=16, topk=2, index_head_dim=d), groups)
    assert abs(msa_kl_loss(q, k_main, q, k, index).item()) < 1e-12


def test_gradient_reaches_only_the_index_projections(rng):
    b, s, hidden, hq, groups, d = 2, 64, 32, 4, 2, 8
    cfg = MSAConfig(block_size=16, topk=2, index_head_dim=8)
    branch = IndexBranch(hidden, groups, cfg)
    x = torch.randn(b, s, hidden, generator=rng, requires_grad=True)
    q = torch.randn(b, s, hq, d, generator=rng, requires_grad=True)
    k = torch.randn(b, s, groups, d, generator=rng, requires_grad=True)
    q_idx, k_idx = branch(x)
    assert q_idx.shape == (b, s, groups, 8) and k_idx.shape == (b, s, 1, 8)
    index = msa_select_blocks(q_idx, k_idx, cfg, hq)
    msa_kl_loss(q, k, q_idx, k_idx, index).backward()
    assert x.grad is None and q.grad is None and k.grad is None
    for p in branch.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_warmup_schedule():
    cfg = MSAConfig(warmup_steps=3)
    assert [cfg.in_warmup(step) for step in range(5)] == [True, True, True, False, False]
    assert not MSAConfig(warmup_steps=0).in_warmup(0)


_MEMORY_PROBE = """
import resource, sys, torch
from megatron_mtraining.sparse import MSAConfig, msa_kl_loss, msa_select_blocks
torch.manual_seed(0)
s, hq, hkv, d, d_idx = 32768, 2, 1, 16, 16
q, k = torch.randn(1, s, hq, d), torch.randn(1, s, hkv, d)
q_idx = torch.randn(1, s, hkv, d_idx, requires_grad=True)
k_idx = torch.randn(1, s, 1, d_idx, requires_grad=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
index = msa_select_blocks(q_idx, k_idx, MSAConfig(block_size=64, topk=4, index_head_dim=d_idx), hq)
msa_kl_loss(q, k, q_idx, k_idx, index).backward()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown * 1024, int(index.blocks.max()), float(q_idx.grad.abs().sum()))
"""


def test_index_branch_memory_is_linear_in_the_sequence():
    """Selection + KL loss + its backward at S = 32768 on a CPU, in a fresh process (peak RSS):
    far below one S x S fp32 matrix (4 GiB), which a token-level score matrix would need."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, last_block, grad_mass = out.stdout.split()
    s_by_s = 32768**2 * 4
    assert int(grown) < s_by_s / 8, f"peak grew by {int(grown) / 2**30:.2f} GiB"
    assert int(last_block) == 32768 // 64 - 1 and float(grad_mass) > 0  # the probe did the work


@pytest.fixture
def deterministic_mode(monkeypatch):
    """``megatron.deterministic_mode=true`` in the YAML, through Megatron's own validation:
    yields the resolved arguments; torch's global mode and the environment are restored."""
    from megatron_mtraining.training.megatron_args import megatron_defaults, resolve_megatron_args
    from megatron_mtraining.training.yaml_config import load_config

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    for name in ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    run_config = load_config(config, ["megatron.deterministic_mode=true", "attention.type=msa"])
    try:
        yield resolve_megatron_args(run_config, megatron_defaults(cpu=not torch.cuda.is_available()), world_size=1)
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_mode_switch_reaches_torch(deterministic_mode, rng, device):
    """The YAML switch turns on torch's deterministic algorithms (CUDA index_add_ then sums in
    a fixed order) and the cuBLAS workspace setting; the MSA KL backward, whose key gradient
    is an index_add_, runs under it and matches the fp64 brute force and the default mode."""
    import os

    assert deterministic_mode.deterministic_mode
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    b, s, hq, groups, d, di = 2, 70, 4, 2, 16, 8

    def randn(*shape):
        return torch.randn(*shape, generator=rng, dtype=torch.float64).to(device)

    q, k = randn(b, s, hq, d), randn(b, s, groups, d)
    q_idx, k_idx = randn(b, s, groups, di).requires_grad_(), randn(b, s, 1, di).requires_grad_()
    index = msa_select_blocks(q_idx, k_idx, MSAConfig(block_size=16, topk=2, index_head_dim=di), hq)
    got = torch.autograd.grad(msa_kl_loss(q, k, q_idx, k_idx, index), (q_idx, k_idx))
    want = torch.autograd.grad(brute_force_kl(q, k, q_idx, k_idx, index.to_dense_mask(s)), (q_idx, k_idx))
    torch.use_deterministic_algorithms(False)
    default = torch.autograd.grad(msa_kl_loss(q, k, q_idx, k_idx, index), (q_idx, k_idx))
    for a, e, f in zip(got, want, default, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-9)
        torch.testing.assert_close(a, f, atol=1e-12, rtol=1e-12)
