"""Top-k attention of wide blocks on a library's varlen attention (``kernels/varlen_blocks``).

On a CPU the library calls run on their PyTorch stand-in (``library.ReferenceVarlen``), so the
layout, the gathers, the LSE merges and the gradient logic are checked here against fp64 dense
attention under the index's own mask (``dense_reference``); in fp64 the stand-in is exact, so
those checks are tight. The GPU cases run PyTorch's FlashAttention-2 ops themselves, against the
same fp64 reference and against the stand-in, segment by segment.
"""

from __future__ import annotations

import os

import pytest
import torch
from dense_reference import TOLERANCE, assert_close_rel, check_index_attention, make_inputs
from host_reads import HostReads
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mtraining.sparse import BlockTopKIndex, MoBAConfig, build_moba_index, sparse_attention
from megatron_mtraining.sparse.kernels import triton_available
from megatron_mtraining.sparse.kernels.varlen_blocks import attention as varlen_attention
from megatron_mtraining.sparse.kernels.varlen_blocks import library

FP64_TOL = 1e-10


@pytest.fixture
def library_calls(monkeypatch):
    """Counts the varlen forward and backward calls of the three implementations (a graph cuDNN
    declined would count its FlashVarlen call too; the cuDNN tests require none)."""
    from megatron_mtraining.sparse.kernels.varlen_blocks.cudnn_library import CudnnVarlen

    calls = {"forward": 0, "backward": 0}
    for impl in (library.FlashVarlen, library.ReferenceVarlen, CudnnVarlen):
        for name in calls:
            real = getattr(impl, name)

            def counted(*args, real=real, name=name):
                calls[name] += 1
                return real(*args)

            monkeypatch.setattr(impl, name, staticmethod(counted))
    return calls


def moba_index(q, k, chunk, topk):
    return build_moba_index(q.detach(), k.detach(), MoBAConfig(chunk_size=chunk, topk=topk))


def odd_index(rng, b, s, hs, block, topk, hq):
    """A top-k index no builder makes: per row random blocks (some after the row's own, which
    it cannot see), -1 holes, its own block left out of about a third of the rows, and
    repeated entries never; one selection per ``hs`` heads."""
    n = -(-s // block)
    own = (torch.arange(s) // block).view(1, s, 1, 1)
    scores = torch.rand(b, s, hs, n + 1, generator=rng)
    chosen = scores.topk(min(topk, n + 1), -1).indices
    chosen = torch.where(chosen >= n, -1, chosen)  # block n is "none"
    drop_own = torch.rand(b, s, hs, 1, generator=rng) < 1 / 3
    chosen = torch.where(drop_own & (chosen == own), -1, chosen)
    return BlockTopKIndex(blocks=chosen.sort(-1).values.int(), block_size=block, num_heads=hq)


SHAPES = {
    # b, s, hq, hkv, d, chunk, topk
    "gqa2-ragged": (1, 300, 4, 2, 16, 32, 4),
    "mha-b2-whole-chunks": (2, 256, 3, 3, 8, 64, 3),
    "mqa-many-chunks": (1, 200, 8, 1, 16, 16, 12),
    "shorter-than-a-chunk": (1, 100, 2, 1, 16, 128, 3),
    "own-chunk-only": (1, 160, 4, 2, 16, 32, 1),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_moba_matches_fp64_dense(shape, dtype, rng, library_calls):
    b, s, hq, hkv, d, chunk, topk = shape
    q, k, v = make_inputs(rng, (b, s, hq, hkv, d), dtype, "cpu")
    index = moba_index(q, k, chunk, topk)
    tol = FP64_TOL if dtype == torch.float64 else TOLERANCE[dtype]
    check_index_attention(q, k, v, index, rng, tol, backend="varlen_blocks", grads=("out",))
    # The diagonal, then one call for every slot that sends some row to an earlier chunk (tiny
    # slots: together within CALL_ROWS); as many backward calls.
    n = -(-s // chunk)
    calls = 1 + (min(topk - 1, n - 1) > 0)
    assert library_calls == {"forward": calls, "backward": calls}


@pytest.mark.parametrize("call_rows", [1, 1000, 3000, 1 << 22], ids=["alone", "1000", "3000", "all"])
def test_slots_share_calls_exactly(call_rows, rng, library_calls, monkeypatch):
    """Slots sharing calls (each slot's segments over its own copy of the keys) give fp64
    dense attention whatever the bound on a call's rows; a call holds more than one slot only
    within the bound, the largest slot left opening it and the smallest joining."""
    monkeypatch.setattr(varlen_attention, "CALL_ROWS", call_rows)
    q, k, v = make_inputs(rng, (1, 200, 8, 1, 16), torch.float64, "cpu")
    index = moba_index(q, k, 16, 12)  # 13 chunks: 11 slots of up to 1600 rows
    check_index_attention(q, k, v, index, rng, FP64_TOL, backend="varlen_blocks", grads=("out",))
    plan = varlen_attention.layout(index, 8, 1)
    calls = varlen_attention._calls(plan, 200, call_rows)
    assert library_calls == {"forward": 1 + len(calls), "backward": 1 + len(calls)}
    counts = sorted(slot.order.shape[0] for slot in plan.slots)
    assert len(counts) == 11 and sum(call.copies for call in calls) == 11
    assert sum(call.order.shape[0] for call in calls) == sum(counts)
    if call_rows in (1, 1 << 22):  # every slot alone, or all in one call
        assert len(calls) == (11 if call_rows == 1 else 1)
    for call in calls:
        rows = call.order.shape[0]
        assert call.copies == 1 or rows <= call_rows
        # Its segments cut its rows and its copies of the 200 keys, a run of rows per slot.
        assert call.cu_q[-1] == rows and call.cu_k[-1] == call.copies * 200
        bounds = [a for a, _ in call.runs] + [call.runs[-1][1]]
        assert len(call.runs) == call.copies and bounds[0] == 0 and bounds[-1] == rows
        assert all(z == a for (_, z), (a, _) in zip(call.runs[:-1], call.runs[1:], strict=True))
    # Greedy: each call's first slot is the largest not in an earlier call.
    firsts = [call.runs[0][1] for call in calls]
    assert firsts == sorted(firsts, reverse=True) and firsts[0] == counts[-1]


@pytest.mark.parametrize("hs", [1, 2, 4], ids=["shared", "per-kv-head", "per-query-head"])
def test_any_top_k_index_matches_fp64_dense(hs, rng):
    """Rows that skip their own block, choose blocks they cannot see or choose nothing, and
    selection heads of every kind."""
    b, s, hq, hkv, d = 2, 150, 4, 2, 8
    q, k, v = make_inputs(rng, (b, s, hq, hkv, d), torch.float64, "cpu")
    index = odd_index(rng, b, s, hs, 16, 4, hq)
    check_index_attention(q, k, v, index, rng, FP64_TOL, backend="varlen_blocks", grads=("out",))


def test_an_lse_gradient_takes_the_reference_backward(rng, library_calls):
    """The library's backward has no input for an LSE gradient: such a backward runs on the
    reference (on CUDA, the block-bar kernels), which takes it."""
    q, k, v = make_inputs(rng, (1, 300, 4, 2, 16), torch.float64, "cpu")
    index = moba_index(q, k, 32, 4)
    for grads in (("out", "lse"), ("lse",)):
        check_index_attention(q, k, v, index, rng, FP64_TOL, backend="varlen_blocks", grads=grads)
    assert library_calls["backward"] == 0


def test_no_graph_without_gradients(rng):
    q, k, v = make_inputs(rng, (1, 96, 2, 1, 8), torch.float64, "cpu")
    index = moba_index(q, k, 32, 2)
    with torch.no_grad():
        out, lse = sparse_attention(q, k, v, index, backend="varlen_blocks")
    assert out.grad_fn is None and lse.grad_fn is None
    want, want_lse = sparse_attention(q.detach(), k.detach(), v.detach(), index, backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse)


def test_the_layout_reads_the_host_once_and_skips_empty_slots(rng):
    """One device read per forward (the slots' row counts and longest segments); slots with no
    row sending it to an earlier block make no call."""
    q, k, _ = make_inputs(rng, (1, 64, 2, 1, 8), torch.float64, "cpu")
    index = moba_index(q, k, 32, 4)  # two chunks: only one slot can reach an earlier one
    with HostReads() as reads:  # (a patched Tensor.tolist would count twice under a torch-function mode)
        plan = varlen_attention.layout(index, 2, 1)
    assert reads.count == 1
    assert len(plan.slots) == 1 and plan.own is None
    (slot,) = plan.slots
    # Every row of the second chunk, both heads, against the first chunk's keys.
    assert slot.order.numel() == 64 and slot.max_q == 64
    assert slot.cu_q.tolist() == [0, 64, 64]


def test_flash_calls_bind_to_this_torch():
    """The FlashAttention-2 ops as ``FlashVarlen`` calls them, on meta tensors: the schema of
    the installed torch takes the arguments and gives the shapes read."""
    assert library.missing_ops() is None
    rows, keys, hq, hkv, d = 100, 48, 4, 2, 64
    q = torch.empty(rows, hq, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(keys, hkv, d, dtype=torch.bfloat16, device="meta")
    cu_q = torch.empty(3, dtype=torch.int32, device="meta")
    cu_k = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = library.FlashVarlen.forward(q, k, k, cu_q, cu_k, 60, 24, True, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (hq, rows) and lse.dtype == torch.float32
    dq, dk, dv = library.FlashVarlen.backward(q, q, k, k, out, lse, cu_q, cu_k, 60, 24, False, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_unsupported_inputs_say_why():
    from megatron_mtraining.sparse import DenseIndex

    q = torch.zeros(1, 64, 2, 8)
    index = BlockTopKIndex(blocks=torch.zeros(1, 64, 2, 1, dtype=torch.int32), block_size=64, num_heads=2)
    assert varlen_attention.unsupported(q, index) is None  # the stand-in
    assert varlen_attention.unsupported(q, DenseIndex(1, 2, 64)) == "got a DenseIndex"
    with pytest.raises(ValueError, match=r"backend='varlen_blocks'.*got a DenseIndex"):
        sparse_attention(q, q[:, :, :1], q[:, :, :1], DenseIndex(1, 2, 64), backend="varlen_blocks")


def _fp64_segments(q, k, v, cu_q, cu_k, causal, scale):
    """Autograd fp64 attention per segment, bottom-right causal: (out, lse [H, rows])."""
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (x[a:z].double() for x, a, z in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]),
                                                      (v, cu_k[i], cu_k[i + 1])))  # fmt: skip
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        logits = torch.einsum("rhd,nhd->hrn", qs, ks) * scale
        r, n = logits.shape[1:]
        if causal:
            seen = torch.arange(n).view(1, -1) <= torch.arange(r).view(-1, 1) + n - r
            logits = logits.masked_fill(~seen.to(q.device), float("-inf"))
        lse = torch.logsumexp(logits, -1)
        outs.append(torch.einsum("hrn,nhd->rhd", torch.exp(logits - lse.unsqueeze(-1)), vs))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_calls_match_fp64_and_the_stand_in(causal, rng):
    """``FlashVarlen`` against fp64 autograd attention per segment (GQA, an empty segment, ragged
    lengths), given the output and LSE it returned; and the stand-in against it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    why_not = library.unsupported(torch.empty(1, 1, 64, dtype=torch.bfloat16, device="cuda"))
    if why_not is not None:
        pytest.skip(why_not)
    lengths = [(130, 130), (0, 64), (257, 257), (5, 5)] if causal else [(130, 64), (0, 64), (300, 200), (7, 3)]
    cu_q = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + [k for _, k in lengths]).cumsum(0).int().cuda()
    max_q, max_k = max(q for q, _ in lengths), max(k for _, k in lengths)
    hq, hkv, d, scale = 8, 2, 128, 0.09
    q, k, v = (torch.randn(int(cu[-1]), h, d, generator=rng).to("cuda", torch.bfloat16).requires_grad_()
               for cu, h in ((cu_q, hq), (cu_k, hkv), (cu_k, hkv)))  # fmt: skip
    args = (cu_q, cu_k, max_q, max_k, causal, scale)
    tol = TOLERANCE[torch.bfloat16]
    out, lse = library.FlashVarlen.forward(q, k, v, *args)
    ref_out, ref_lse = _fp64_segments(q, k, v, cu_q.tolist(), cu_k.tolist(), causal, scale)
    assert_close_rel(out, ref_out, tol, "out")
    assert_close_rel(lse, ref_lse, 1e-4, "lse")
    dout = torch.randn(out.shape, generator=rng).to("cuda", torch.bfloat16)
    grads = library.FlashVarlen.backward(dout, q, k, v, out, lse, *args)
    want = torch.autograd.grad((ref_out * dout.double()).sum(), (q, k, v))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close_rel(got, ref, 2 * tol, name)
    stand_in = library.ReferenceVarlen.forward(q, k, v, *args)
    assert_close_rel(stand_in[0], out, tol, "stand-in out")
    assert_close_rel(stand_in[1], lse, 1e-4, "stand-in lse")
    stand_in_grads = library.ReferenceVarlen.backward(dout, q, k, v, out, lse, *args)
    for name, got, ref in zip(("dq", "dk", "dv"), stand_in_grads, grads, strict=True):
        assert_close_rel(got, ref, 2 * tol, f"stand-in {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_moba_on_cuda_matches_fp64_dense(dtype, rng, library_calls, monkeypatch):
    """The whole path on the library, as ``auto`` dispatches it (blocks of 1024), at Qwen2.5-3B's
    head shape on a sequence that is no multiple of the chunk; then with an LSE gradient, whose
    backward runs on the block-bar kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megatron_mtraining.sparse import dispatch

    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    q, k, v = make_inputs(rng, (1, 3000, 16, 2, 128), dtype, "cuda")
    index = moba_index(q, k, 1024, 2)
    decision = dispatch.attention_kernel(q, index)
    assert decision.kernel == "varlen_blocks", decision
    check_index_attention(q, k, v, index, rng, TOLERANCE[dtype], grads=("out",))
    assert library_calls == {"forward": 2, "backward": 2}
    check_index_attention(q, k, v, index, rng, TOLERANCE[dtype], grads=("out", "lse"))
    assert library_calls == {"forward": 4, "backward": 2}


class _Launches(TorchDispatchMode):
    """Counts the ATen operations that would launch a kernel on CUDA (views and empty
    allocations do not), outside the library calls, the merges, the row gathers and dQ's adds,
    which count one each (a FlashAttention-2 call, one Triton launch)."""

    FREE = {"view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
            "alias", "detach", "permute", "empty", "empty_like", "empty_strided", "lift_fresh", "promote_types"}  # fmt: skip

    def __init__(self, monkeypatch):
        super().__init__()
        self.count, self.paused = 0, False
        for owner, name in (
            (library.ReferenceVarlen, "forward"), (library.ReferenceVarlen, "backward"),
            (varlen_attention, "_merge_into"), (varlen_attention, "_gather"), (varlen_attention, "_add_into"),
        ):  # fmt: skip
            real = getattr(owner, name)

            def one(*args, real=real):
                self.paused = True
                try:
                    return real(*args)
                finally:
                    self.paused = False
                    self.count += 1

            monkeypatch.setattr(owner, name, staticmethod(one) if owner is library.ReferenceVarlen else one)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


# Launches of a forward + backward: a fixed number (the layout's 38, the copies of the keys
# 4), then per slot with rows the forward's merge, the backward's dQ add (the part's cast in
# it) and dK's and dV's adds, and its share of its call's: the forward's gather and call, the
# backward's gather (dO, q, O and the LSE in one) and call, and the call's bounds. Measured
# with a slot a call: 52 + 8 a slot; all in one call (these tiny slots, within CALL_ROWS): 60,
# 75, 81, 99 and 153 for 1, 2, 3, 6 and 15 slots.
FIXED_LAUNCHES, SLOT_LAUNCHES = 56, 10


@pytest.mark.parametrize("topk", [2, 7, 16])
def test_launches_grow_by_a_constant_per_slot(topk, rng, monkeypatch):
    """The layout is a fixed number of operations whatever ``topk`` (one sort for every slot,
    not one per slot), and each slot adds a stated number to the forward and the backward:
    issue 21, where a 128K-token MoBA layer's GPU waited on the host between hundreds of small
    launches."""
    q, k, v = make_inputs(rng, (1, 512, 4, 2, 16), torch.float32, "cpu")
    index = moba_index(q, k, 16, topk)  # 32 chunks: every slot sends rows to earlier ones
    with _Launches(monkeypatch) as layout_ops:
        plan = varlen_attention.layout(index, 4, 2)
    assert len(plan.slots) == topk - 1
    assert layout_ops.count <= 38
    with _Launches(monkeypatch) as launches:
        out, _ = sparse_attention(q, k, v, index, backend="varlen_blocks")
        out.backward(torch.ones_like(out))
    assert launches.count <= FIXED_LAUNCHES + SLOT_LAUNCHES * (topk - 1)


needs_triton = pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on CUDA or TRITON_INTERPRET=1",
)


@needs_triton
@pytest.mark.parametrize("d", [16, 24])
def test_the_fused_row_merge_equals_the_reference(d, rng):
    """``merge_rows`` (the forward's merge on CUDA, one launch) against ``_merge_into``'s
    PyTorch, rows empty on one or both sides included."""
    from megatron_mtraining.sparse.kernels.shared.combine import merge_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, n = 50, 30
    out = torch.randn(rows, d, generator=rng)
    lse = torch.randn(rows, generator=rng) * 3
    part = torch.randn(n, d, generator=rng).bfloat16()
    part_lse = torch.randn(n, generator=rng) * 3
    order = torch.randperm(rows, generator=rng)[:n].int()
    lse[:5], part_lse[:3] = float("-inf"), float("-inf")
    lse[order[:2].long()] = float("-inf")  # both sides empty
    want_out, want_lse = out.clone(), lse.clone()
    varlen_attention._merge_into(want_out, want_lse, part, part_lse, order)
    got_out, got_lse = out.to(device), lse.to(device)
    merge_rows(got_out, got_lse, part.to(device), part_lse.to(device), order.to(device))
    torch.testing.assert_close(got_out.cpu(), want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_row_kernels_change_no_bit(dtype, rng, monkeypatch):
    """The path with its gathers and dQ's adds on ``shared.rows`` (as on CUDA; here under the
    interpreter, the calls and merges still PyTorch's) gives the same bits as with PyTorch's
    indexing and ``index_add_``: copies, and fp32 sums of the same values in the same order."""
    from megatron_mtraining.sparse.kernels.shared import rows

    b, s, hq, hkv, d, chunk, topk = 1, 300, 4, 2, 24, 32, 4
    q, k, v = make_inputs(rng, (b, s, hq, hkv, d), dtype, "cpu")
    index = moba_index(q, k, chunk, topk)
    dout = torch.randn(q.shape, generator=rng).to(dtype)

    def run():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = sparse_attention(*inputs, index, backend="varlen_blocks")
        return [out.detach(), *torch.autograd.grad(out, inputs, dout)]

    want = run()
    launches = {"gather_rows": 0, "add_rows": 0}
    for name in launches:
        real = getattr(rows, name)

        def counted(*args, real=real, name=name):
            launches[name] += 1
            return real(*args)

        monkeypatch.setattr(rows, name, counted)
    monkeypatch.setattr(varlen_attention, "_triton_rows", lambda t: True)
    got = run()
    slots = min(topk - 1, -(-s // chunk) - 1)
    calls = 1 if slots else 0  # tiny slots share one call: a gather each way, an add a slot
    assert launches == {"gather_rows": 2 * calls, "add_rows": slots}
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g.view(bits), w.view(bits)), name
