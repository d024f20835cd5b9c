"""The fused merge of two partial attention results (Triton; the interpreter on CPU) equals
the reference ``combine`` in values and gradients, rows empty on one or both sides included."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_mtraining.sparse.kernels import triton_available
from megatron_mtraining.sparse.reference import combine

pytestmark = pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("b_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [16, 24])
def test_fused_combine_equals_reference(b_dtype, d):
    from megatron_mtraining.sparse.kernels.shared.combine import FusedCombine

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    b, s, h = 2, 37, 3
    out_a = torch.randn(b, s, h, d, generator=gen)
    out_b = torch.randn(b, s, h, d, generator=gen).to(b_dtype).float()
    lse_a, lse_b = (torch.randn(b, h, s, generator=gen) * 3 for _ in range(2))
    # Rows with no key on one side (their output is zero there) or on both.
    empty_a, empty_b = (torch.rand(b, h, s, generator=gen) < 0.2 for _ in range(2))
    empty_a[:, :, :3] = empty_b[:, :, :3] = True
    lse_a[empty_a], lse_b[empty_b] = float("-inf"), float("-inf")
    out_a = out_a.masked_fill(empty_a.transpose(1, 2).unsqueeze(-1), 0.0)
    out_b = out_b.masked_fill(empty_b.transpose(1, 2).unsqueeze(-1), 0.0)
    dout = torch.randn(b, s, h, d, generator=gen)
    dlse = torch.randn(b, h, s, generator=gen).masked_fill(empty_a & empty_b, 0.0)

    def run(fn, dtype, device, b_dtype=torch.float32):
        inputs = [t.to(device=device, dtype=dtype).requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
        inputs[2] = inputs[2].detach().to(b_dtype).requires_grad_()
        out, lse = fn(*inputs)
        grads = torch.autograd.grad(
            (out * dout.to(device, out.dtype)).sum() + (torch.where(lse.isinf(), 0, lse) * dlse.to(device)).sum(),
            inputs,
        )
        return [t.detach().double().cpu() for t in (out, lse, *grads)]

    want = run(combine, torch.float64, "cpu")
    got = run(FusedCombine.apply, torch.float32, DEVICE, b_dtype)
    for name, g, w in zip(("out", "lse", "d out_a", "d lse_a", "d out_b", "d lse_b"), got, want, strict=True):
        assert not g.isnan().any(), name
        # d out_b comes back in out_b's dtype.
        tol = 2e-3 if name == "d out_b" and b_dtype == torch.float16 else 1e-5
        torch.testing.assert_close(g, w, rtol=max(tol, 1e-4), atol=tol, msg=name)
