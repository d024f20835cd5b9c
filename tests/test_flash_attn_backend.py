"""The optional flash-attn backend (``sparse/kernels/dense_backends/flash_attn.py``).

flash-attn is not installed on the CI or GPU machines, so the adapter runs against a
stand-in: a ``flash_attn`` package put in ``sys.modules`` whose private forward and backward
(the two functions the adapter calls, with flash-attn 2.7's signatures, checks and result
structures) compute exact causal GQA attention in fp64 from the tensors they are given, on
CPU tensors taken as CUDA ones. Results are checked against fp64 dense attention under an
explicit mask (``dense_reference``), a separate derivation. The gradient with an LSE term
runs on the dense Triton kernels (the interpreter on a CPU, so fp16 there: its bf16 is
broken). Where the real flash-attn and a GPU are present, the last test runs it.
"""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch
from dense_reference import TOLERANCE, check_against_dense, make_inputs

from megatron_mtraining.sparse import BlockTopKIndex, DenseIndex, VerticalSlashIndex, sparse_attention
from megatron_mtraining.sparse import dispatch as api
from megatron_mtraining.sparse.kernels.dense_backends import flash_attn as backend


def _causal_scores(q, k, v, scale):
    """fp64 causal scores ``[B, Hq, S, S]`` (-inf above the diagonal), and k and v repeated
    over each GQA group."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")), kk, vv


def _group_sum(x, num_kv_heads):
    """``[B, S, Hq, D]`` summed over each GQA group -> ``[B, S, Hkv, D]``."""
    return x.unflatten(2, (num_kv_heads, -1)).sum(3)


def _check_call(q, k, v, flags):
    """flash-attn's own refusals, and ``flags`` (dropout_p, causal, window_size_left,
    window_size_right, softcap, alibi_slopes): those of exact causal attention."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if q.shape[-1] % 8 or q.shape[-1] > 256 or q.shape[2] % k.shape[2] or k.shape != v.shape:
        raise RuntimeError(f"unsupported shapes {tuple(q.shape)}, {tuple(k.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    assert flags == (0.0, True, -1, -1, 0.0, None)


def _fake_flash_attn(version: str) -> tuple[types.ModuleType, collections.Counter]:
    calls = collections.Counter()

    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    ):  # fmt: skip
        _check_call(q, k, v, (dropout_p, causal, window_size_left, window_size_right, softcap, alibi_slopes))
        calls["forward"] += 1
        scores, _, vv = _causal_scores(q, k, v, softmax_scale)
        lse = scores.logsumexp(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse.unsqueeze(-1)), vv)
        s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
        return out.to(q.dtype), lse.float(), s_dmask, torch.zeros(2, dtype=torch.int64, device=q.device)

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
    ):  # fmt: skip
        _check_call(q, k, v, (dropout_p, causal, window_size_left, window_size_right, softcap, alibi_slopes))
        assert deterministic, "the adapter asks for flash-attn's deterministic backward"
        calls["backward"] += 1
        scores, kk, vv = _causal_scores(q, k, v, softmax_scale)
        p = torch.exp(scores - softmax_lse.double().unsqueeze(-1))  # from the LSE given, as flash-attn does
        do = dout.double()
        delta = (do * out.double()).sum(-1).transpose(1, 2)  # rowsum(dO * O), [B, Hq, S]
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - delta.unsqueeze(-1))
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kk) * softmax_scale)
        dk.copy_(_group_sum(torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * softmax_scale, k.shape[2]))
        dv.copy_(_group_sum(torch.einsum("bhqk,bqhd->bkhd", p, do), k.shape[2]))
        rows = -(-q.shape[1] // 128) * 128
        return torch.zeros(q.shape[0], q.shape[2], rows, dtype=torch.float32, device=q.device)

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = _flash_attn_forward
    interface._flash_attn_backward = _flash_attn_backward
    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.flash_attn_interface = interface
    return package, calls


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """Installs the stand-in flash-attn 2.7 and counts its calls; CPU tensors count as CUDA."""

    def install(version: str = "2.7.4.post1") -> collections.Counter:
        package, calls = _fake_flash_attn(version)
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", package.flash_attn_interface)
        backend.interface.cache_clear()
        return calls

    monkeypatch.delenv(api.BACKEND_ENV, raising=False)
    monkeypatch.setattr(backend, "on_cuda", lambda t: True)
    yield install
    backend.interface.cache_clear()


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("grads", [("out",), ("out", "lse"), ("lse",)], ids=["out", "out+lse", "lse"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "shape, scale", [((2, 83, 4, 2, 16), None), ((1, 130, 3, 3, 32), 0.3)], ids=["gqa2-b2-ragged", "mha-scale0.3"]
)
def test_matches_fp64_dense(shape, scale, dtype, grads, rng, kdevice, fake_flash_attn, kernel_backward_calls):
    if dtype == torch.bfloat16 and "lse" in grads and kdevice.type == "cpu":
        pytest.skip("the LSE gradient runs on the Triton kernels, whose interpreter's bf16 is broken")
    calls = fake_flash_attn()
    q, k, v = make_inputs(rng, shape, dtype, kdevice)
    check_against_dense(q, k, v, scale, grads, rng, "flash_attn")
    # An LSE gradient takes the dense kernels' backward; without one, flash-attn's.
    assert calls["forward"] == 1
    assert calls["backward"] == (0 if "lse" in grads else 1)
    assert kernel_backward_calls["kernel_backward"] == (1 if "lse" in grads else 0)


def _vertical_slash(b, h, s):
    one = torch.zeros(b, h, 1, dtype=torch.int32)
    return VerticalSlashIndex(vertical=one, slash=one, seq_len=s, block_size=16)


def _block_topk(b, h, s):
    own = (torch.arange(s) // 16).int().view(1, s, 1, 1).expand(b, s, h, 1).contiguous()
    return BlockTopKIndex(blocks=own, block_size=16, num_heads=h)


def _uninstall(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # importing it then fails, installed or not
    backend.interface.cache_clear()


# Each case changes one thing from a call flash-attn serves (``case``: q, index, monkeypatch,
# install): (name, change, the reason an explicit request is refused with).
_UNSERVED = [
    ("vertical-slash index", lambda c: c.update(index=_vertical_slash(1, 4, 40)), "got a VerticalSlashIndex"),
    ("top-k index", lambda c: c.update(index=_block_topk(1, 4, 40)), "got a BlockTopKIndex"),
    ("fp32", lambda c: c.update(q=c["q"].float()), r"got torch\.float32"),
    ("head dim 12", lambda c: c.update(q=torch.zeros(1, 40, 4, 12, dtype=torch.bfloat16)), "got head dim 12"),
    ("head dim 264", lambda c: c.update(q=torch.zeros(1, 40, 4, 264, dtype=torch.bfloat16)), "got head dim 264"),
    ("not installed", lambda c: _uninstall(c["mp"]), r"flash-attn is not installed here \(.*flash_attn"),
    ("flash-attn 2.6", lambda c: c["install"]("2.6.3"), r"flash-attn 2\.6\.3 is installed"),
    ("cpu", lambda c: c["mp"].setattr(backend, "on_cuda", lambda t: t.is_cuda), "got inputs on cpu"),
    ("no triton", lambda c: c["mp"].setattr(backend, "triton_available", lambda: False), "Triton is not installed"),
]


@pytest.mark.parametrize("change, reason", [case[1:] for case in _UNSERVED], ids=[case[0] for case in _UNSERVED])
def test_auto_uses_flash_attn_only_where_it_serves(change, reason, fake_flash_attn, monkeypatch):
    fake_flash_attn()
    case = {"q": torch.zeros(1, 40, 4, 16, dtype=torch.bfloat16), "index": DenseIndex(1, 4, 40)}
    case.update(mp=monkeypatch, install=fake_flash_attn)
    assert api.dense_backend(case["q"], case["index"]) == "flash_attn"
    assert api.dense_backend(case["q"], case["index"], "flash_attn") == "flash_attn"
    for forced in ("reference", "triton"):
        assert api.dense_backend(case["q"], case["index"], forced) != "flash_attn"
        with monkeypatch.context() as env:
            env.setenv(api.BACKEND_ENV, forced)
            assert api.dense_backend(case["q"], case["index"]) != "flash_attn"

    change(case)
    assert api.dense_backend(case["q"], case["index"]) != "flash_attn"
    accepted = r"expected a DenseIndex on CUDA fp16/bf16 inputs .* flash-attn >= 2\.7 and Triton installed; "
    with pytest.raises(ValueError, match=rf"^backend='flash_attn' is not accepted: {accepted}{reason}"):
        api.dense_backend(case["q"], case["index"], "flash_attn")
    monkeypatch.setenv(api.BACKEND_ENV, "flash_attn")
    with pytest.raises(ValueError, match=rf"^MTRAINING_ATTENTION_BACKEND='flash_attn' is not accepted: {accepted}"):
        api.dense_backend(case["q"], case["index"])


def test_sparse_attention_follows_the_backend_setting(rng, fake_flash_attn, monkeypatch):
    calls = fake_flash_attn()
    q, k, v = make_inputs(rng, (1, 40, 4, 2, 16), torch.float16, "cpu")
    index = DenseIndex(1, 4, 40)
    sparse_attention(q, k, v, index, backend="reference")
    monkeypatch.setenv(api.BACKEND_ENV, "reference")
    sparse_attention(q, k, v, index)
    assert calls["forward"] == 0
    sparse_attention(q, k, v, index, backend="flash_attn")
    monkeypatch.setenv(api.BACKEND_ENV, "flash_attn")
    sparse_attention(q, k, v, index)
    assert calls["forward"] == 2
    with pytest.raises(ValueError, match=r"^MTRAINING_ATTENTION_BACKEND='flash_attn'.*; got a BlockTopKIndex$"):
        sparse_attention(q, k, v, _block_topk(1, 4, 40))


def test_other_work_runs_as_auto_under_flash_attn(monkeypatch):
    """Index statistics, merges and ring steps ask ``backend_choice``, which flash-attn
    does not serve: ``flash_attn`` sends them where ``auto`` does."""
    q = torch.zeros(1, 40, 4, 16, dtype=torch.float16)
    monkeypatch.setenv(api.BACKEND_ENV, "flash_attn")
    assert api.backend_choice(q) == api.backend_choice(q, "flash_attn") == api.backend_choice(q, "auto")


def test_bad_backend_values_name_the_setting_and_the_choices(monkeypatch):
    q = torch.zeros(1, 40, 4, 16, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"^backend='flash' .*one of auto, reference, triton, flash_attn, sdpa, varlen_blocks$"
    ):
        sparse_attention(q, q, q, DenseIndex(1, 4, 40), backend="flash")
    monkeypatch.setenv(api.BACKEND_ENV, "flash-attn")
    with pytest.raises(
        ValueError, match=r"^MTRAINING_ATTENTION_BACKEND='flash-attn' .*triton, flash_attn, sdpa, varlen_blocks$"
    ):
        sparse_attention(q, q, q, DenseIndex(1, 4, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("grads", [("out",), ("out", "lse")], ids=["out", "out+lse"])
def test_real_flash_attn_matches_fp64_dense(grads, rng):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flash_attn")
    backend.interface.cache_clear()
    q, k, v = make_inputs(rng, (2, 1000, 8, 2, 128), torch.bfloat16, "cuda")
    assert api.dense_backend(q, DenseIndex(2, 8, 1000, device=q.device), "flash_attn") == "flash_attn"
    # Its scores are fp32 sums of bf16 products, like the Triton kernels'.
    check_against_dense(q, k, v, None, grads, rng, "flash_attn", lse_tol=TOLERANCE[q.dtype])
