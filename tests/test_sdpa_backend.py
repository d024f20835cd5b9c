"""PyTorch's fused attention behind ``sparse_attention`` (``sparse/kernels/dense_backends/sdpa.py``).

On a CPU the backend runs PyTorch's CPU flash kernel, on a GPU cuDNN's (Hopper) or
FlashAttention-2's (Ampere); both are checked against fp64 dense attention under an explicit
mask (``dense_reference``), gradients included. A gradient through the LSE runs on the dense
Triton kernels (the interpreter on a CPU, so fp16 there: its bf16 is broken).
"""

from __future__ import annotations

import types

import pytest
import torch
from dense_reference import TOLERANCE, check_against_dense, make_inputs

from megatron_mtraining.sparse import BlockTopKIndex, DenseIndex, sparse_attention
from megatron_mtraining.sparse import dispatch as api
from megatron_mtraining.sparse.kernels.dense_backends import sdpa as sdpa_backend


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused op's forward calls."""
    calls = {"forward": 0}
    real = sdpa_backend._fused

    def counted(*args):
        calls["forward"] += 1
        return real(*args)

    monkeypatch.setattr(sdpa_backend, "_fused", counted)
    monkeypatch.delenv(api.BACKEND_ENV, raising=False)
    return calls


@pytest.mark.parametrize("grads", [("out",), ("out", "lse"), ("lse",)], ids=["out", "out+lse", "lse"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "shape, scale",
    [((2, 83, 4, 2, 16), None), ((1, 130, 3, 3, 32), 0.3), ((1, 300, 8, 1, 128), None)],
    ids=["gqa2-b2-ragged", "mha-scale0.3", "mqa-d128"],
)
def test_matches_fp64_dense(shape, scale, dtype, grads, rng, kdevice, fused_calls, kernel_backward_calls):
    if dtype == torch.bfloat16 and "lse" in grads and kdevice.type == "cpu":
        pytest.skip("the LSE gradient runs on the Triton kernels, whose interpreter's bf16 is broken")
    q, k, v = make_inputs(rng, shape, dtype, kdevice)
    check_against_dense(q, k, v, scale, grads, rng, "sdpa", lse_tol=TOLERANCE[dtype])
    assert fused_calls["forward"] == 1
    # An LSE gradient takes the dense kernels' backward; without one, the fused op's own.
    assert kernel_backward_calls["kernel_backward"] == (1 if "lse" in grads else 0)


def test_no_graph_without_gradients(rng, fused_calls):
    q, k, v = make_inputs(rng, (1, 64, 4, 2, 16), torch.bfloat16, "cpu")
    index = DenseIndex(1, 4, 64)
    with torch.no_grad():
        out, lse = sparse_attention(q, k, v, index, backend="sdpa")
    assert out.grad_fn is None and lse.grad_fn is None and not out.requires_grad
    want, want_lse = sparse_attention(q.detach(), k.detach(), v.detach(), index, backend="reference")
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=0)


def test_auto_uses_it_for_dense_attention_on_cuda_only(monkeypatch):
    monkeypatch.delenv(api.BACKEND_ENV, raising=False)
    q = torch.zeros(1, 40, 4, 16, dtype=torch.bfloat16)
    dense = DenseIndex(1, 4, 40)
    # On a CPU ``auto`` keeps the reference path; ``sdpa`` asked for runs there.
    assert api.dense_backend(q, dense) is None
    assert api.dense_backend(q, dense, "sdpa") == "sdpa"
    cuda_q = types.SimpleNamespace(is_cuda=True, dtype=q.dtype, shape=q.shape)
    assert api.dense_backend(cuda_q, dense) == "sdpa"
    for forced in ("reference", "triton"):
        assert api.dense_backend(cuda_q, dense, forced) is None
    assert api.dense_backend(types.SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=q.shape), dense) is None
    own = (torch.arange(40) // 16).int().view(1, 40, 1, 1).expand(1, 40, 4, 1).contiguous()
    assert api.dense_backend(cuda_q, BlockTopKIndex(blocks=own, block_size=16, num_heads=4)) is None


@pytest.mark.parametrize(
    "q, index, reason",
    [
        (torch.zeros(1, 40, 4, 16), DenseIndex(1, 4, 40), r"got torch\.float32"),
        (torch.zeros(1, 40, 4, 12, dtype=torch.float16), DenseIndex(1, 4, 40), "got head dim 12"),
        (torch.zeros(1, 40, 4, 264, dtype=torch.float16), DenseIndex(1, 4, 40), "got head dim 264"),
    ],
    ids=["fp32", "head-dim-12", "head-dim-264"],
)
def test_asking_where_it_cannot_run_names_the_reason(q, index, reason, monkeypatch):
    accepted = r"expected a DenseIndex on fp16/bf16 inputs whose head dim is a multiple of 8 up to 256; "
    with pytest.raises(ValueError, match=rf"^backend='sdpa' is not accepted: {accepted}{reason}$"):
        api.dense_backend(q, index, "sdpa")
    monkeypatch.setenv(api.BACKEND_ENV, "sdpa")
    with pytest.raises(ValueError, match=rf"^MTRAINING_ATTENTION_BACKEND='sdpa' is not accepted: {accepted}"):
        api.dense_backend(q, index)


def test_kernel_follows_the_compute_capability(monkeypatch):
    cuda_q = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    for capability, kind in (((8, 0), "flash"), ((8, 6), "flash"), ((9, 0), "cudnn"), ((10, 0), "cudnn")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert sdpa_backend.fused_kernel(cuda_q) == kind
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert sdpa_backend.fused_kernel(cuda_q) == "flash"
    assert sdpa_backend.fused_kernel(torch.zeros(1)) == "flash_cpu"
