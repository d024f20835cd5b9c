"""One-pass RoPE (``megatron/fused_rope.py``) against Megatron's own unfused RoPE in fp64,
forward and backward, on fresh random inputs (the Triton interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_mtraining.megatron.fused_rope import FusedRoPE, serves

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _freqs(seq: int, rot: int, gen: torch.Generator) -> torch.Tensor:
    """Megatron's layout: the angles of one half repeated for the other, [s, 1, 1, rot];
    random positions so that every angle range is exercised."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    pos = torch.randint(0, 1 << 17, (seq,), generator=gen).double()
    half = torch.outer(pos, inv)
    return torch.cat([half, half], dim=-1).float().view(seq, 1, 1, rot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "shape, rot, mscale, strided",
    [((37, 2, 5, 64), 64, 1.0, False), ((20, 1, 16, 128), 96, 1.2, True), ((9, 3, 2, 32), 32, 0.7, True)],
    ids=["plain", "partial-yarn-view", "small-view"],
)
def test_matches_megatron_rope_in_fp64(shape, rot, mscale, strided, dtype, rng, kdevice):
    s, b, h, d = shape
    freqs = _freqs(s, rot, rng).to(kdevice)
    if strided:  # a view of q out of a fused QKV projection
        big = torch.randn(s, b, h + 3, d, generator=rng).to(kdevice, dtype)
        t = big[:, :, 1 : h + 1]
        assert not t.is_contiguous()
    else:
        t = torch.randn(shape, generator=rng).to(kdevice, dtype)
    t.requires_grad_()
    assert serves(t, freqs)
    out = FusedRoPE.apply(t, freqs, mscale)
    ref_in = t.detach().double().requires_grad_()
    ref = rope_utils._apply_rotary_pos_emb_bshd(ref_in, freqs.double(), mscale=mscale)
    assert out.dtype == dtype and out.shape == t.shape
    tol = TOLERANCE[dtype] * max(1.0, mscale)
    torch.testing.assert_close(out.double(), ref, atol=tol * 4, rtol=tol)
    grad = torch.randn(shape, generator=rng).to(kdevice, dtype)
    (got,) = torch.autograd.grad(out, t, grad)
    (want,) = torch.autograd.grad(ref, ref_in, grad.double())
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)


def test_patched_function_keeps_megatron_on_cpu(rng):
    """Installed, the patch leaves CPU tensors to Megatron's function: identical results."""
    from megatron_mtraining.patches import fused_rope

    original = rope_utils._apply_rotary_pos_emb_bshd
    replacement = fused_rope.PATCH.build(None)
    fused_rope.PATCH.original = original
    try:
        t, freqs = torch.randn(8, 1, 4, 32, generator=rng), _freqs(8, 32, rng)
        assert torch.equal(replacement(t, freqs, mscale=1.1), original(t, freqs, mscale=1.1))
    finally:
        fused_rope.PATCH.original = None


def test_serves_only_what_it_computes():
    t = torch.zeros(8, 1, 4, 32)
    assert serves(t, torch.zeros(8, 1, 1, 32))
    assert not serves(t, torch.zeros(8, 2, 1, 32))  # per-sample angles (mRoPE)
    assert not serves(t, torch.zeros(8, 1, 1, 33))  # odd rotary width
    assert not serves(t, torch.zeros(8, 1, 1, 64))  # wider than the head
    assert not serves(t, torch.zeros(8, 1, 1, 32, dtype=torch.float64))
    assert not serves(t[:, :, :, 0], torch.zeros(8, 1, 1, 32))
