"""cuDNN's ragged attention as ``varlen_blocks``' library (``kernels/varlen_blocks/cudnn_library``).

On a CPU: the packed tensors as cuDNN reads them (dims, strides and ragged offsets per segment,
the stats against our LSE), the bucketing and graph keys, the graphs as cudnn-frontend declares
and validates them (where it is installed), the library choice and its reasons, and
``CudnnVarlen``'s calls end to end with an emulated cuDNN that reads and writes its buffers
exactly as the declared layouts say (alone and under the whole MoBA path, in fp64 against
dense attention). On an sm90 GPU: cuDNN itself against fp64 per segment and the whole path.
"""

from __future__ import annotations

import pytest
import torch
from dense_reference import TOLERANCE, assert_close_rel, check_index_attention, make_inputs

from megatron_mtraining.sparse import MoBAConfig, build_moba_index
from megatron_mtraining.sparse.kernels.varlen_blocks import choose, library
from megatron_mtraining.sparse.kernels.varlen_blocks import cudnn_library as cl

# The emulated calls compute in fp64, but their softmax stats are fp32 as cuDNN's are: a
# misplaced element is off by O(1), fp32 stats by about 1e-7.
STATS_TOL = 1e-5


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).int()


def _segment_view(buffer, dims, strides, offset, length):
    """Segment ``[H, length, D]`` (or ``[H, length]`` for stats) of a packed buffer, addressed as
    cuDNN addresses it: the ragged offset, then the head / row / column strides."""
    flat = buffer.view(-1)
    if dims[3] == 1:  # stats
        return flat.as_strided((dims[1], length), (strides[1], strides[2]), offset)
    return flat.as_strided((dims[1], length, dims[3]), (strides[1], strides[2], strides[3]), offset)


def test_packed_tensors_are_what_cudnn_reads_per_segment(rng):
    """Each segment's rows and LSE, through the declared layouts and the ragged offsets built
    from cu_seqlens, are the packed tensors' own rows; empty segments included."""
    lengths = [5, 0, 17, 1, 0, 9]
    cu, h, d = _cu(lengths), 3, 8
    x = torch.randn(int(cu[-1]), h, d, generator=rng)
    lse = torch.randn(h, int(cu[-1]), generator=rng)
    s = cl.bucket(max(lengths))
    dims, strides = cl.thd_layout(len(lengths), h, s, d)
    stat_dims, stat_strides = cl.stats_layout(len(lengths), h, s)
    offsets, stat_offsets = cl.ragged_offsets(cu, h * d), cl.ragged_offsets(cu, h)
    assert offsets.dtype == torch.int64 and offsets.shape == (len(lengths) + 1, 1, 1, 1)
    lens = cl.seq_lens(cu)
    assert lens.dtype == torch.int32 and lens.flatten().tolist() == lengths
    stats = cl.stats_from_lse(lse)
    assert stats.shape == (int(cu[-1]), h) and stats.is_contiguous()
    for i, n in enumerate(lengths):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        got = _segment_view(x, dims, strides, int(offsets[i]), n)
        assert torch.equal(got, x[rows].transpose(0, 1))
        got_lse = _segment_view(stats, stat_dims, stat_strides, int(stat_offsets[i]), n)
        assert torch.equal(got_lse, lse[:, rows])
    back = cl.lse_from_stats(stats)
    assert back.is_contiguous() and torch.equal(back, lse)


def test_buckets_bound_the_dimension_and_the_number_of_graphs():
    assert [cl.bucket(n) for n in (1, 64, 65, 96, 97, 128, 129, 3000, 4096, 4097)] == [
        64, 64, 96, 96, 128, 128, 192, 3072, 4096, 6144,
    ]  # fmt: skip
    values = [cl.bucket(n) for n in range(1, 1 << 20)]
    assert all(b >= n and (n <= cl.MIN_BUCKET or b <= 1.5 * n) for n, b in zip(range(1, 1 << 20), values, strict=True))
    assert len(set(values)) == 2 * (20 - 6) + 1  # two per doubling above MIN_BUCKET


def test_graph_keys_change_with_what_fixes_a_graph_only():
    q = torch.empty(1000, 8, 64, dtype=torch.bfloat16)
    k = torch.empty(600, 2, 64, dtype=torch.bfloat16)
    cu = torch.zeros(5, dtype=torch.int32)

    def key(backward=False, q=q, k=k, max_q=300, max_k=257, causal=False, scale=0.125):
        return cl.graph_key(backward, q, k, cu, max_q, max_k, causal, scale, device_index=0)

    assert key(max_q=300) == key(max_q=380)  # one bucket (384)
    assert key(max_q=300) != key(max_q=390)
    assert key(q=q[:900]) == key()  # the forward is not keyed by the row count
    assert key(True, q=q[:900]) == key(True)  # the backward by its bucket (1024)
    assert key(True, q=q[:700]) != key(True)
    assert key(causal=True) != key() and key(scale=0.1) != key()
    assert key(q=q.half(), k=k.half()) != key() and key(True) != key()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert key(True).deterministic and not key().deterministic
    finally:
        torch.use_deterministic_algorithms(previous)
    assert not key(True).deterministic


def _frontend():
    cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    if cl.frontend()[0] is None:
        pytest.skip(cl.frontend()[1])
    return cudnn


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_graphs_declare_and_validate_without_a_gpu(backward):
    """cudnn-frontend's own validation of every graph shape the path builds (the C++ checks and
    planning need the GPU); a graph it cannot take fails here."""
    cudnn = _frontend()
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv, d in ((16, 2, 128), (4, 4, 64), (1, 1, 128)):
            for causal in (False, True):
                key = cl.GraphKey(backward, dtype, hq, hkv, d, 6, 384, 256, causal, 0.09, backward, 4096, 2048)
                graph, tensors = cl.declare(cudnn, key)
                graph.validate()
                graph.build_operation_graph()
                wanted = (
                    (cl.BACKWARD_INPUTS + cl.BACKWARD_OUTPUTS) if backward else (cl.FORWARD_INPUTS + cl.FORWARD_OUTPUTS)
                )
                assert sorted(tensors) == sorted(wanted)
                (node,) = graph.nodes
                params = node.params
                assert params["use_padding_mask"] and params["attn_scale"] == 0.09
                if causal:
                    assert params["diagonal_alignment"] == cudnn.diagonal_alignment.BOTTOM_RIGHT
                    assert params["diagonal_band_right_bound"] == 0
                else:
                    assert "diagonal_band_right_bound" not in params
                if backward:
                    assert params["use_deterministic_algorithm"] and params["max_total_seq_len_q"] == 4096
    with pytest.raises(cudnn.cudnnGraphNotSupportedError):
        graph, _ = cl.declare(cudnn, cl.GraphKey(backward, torch.bfloat16, 6, 4, 64, 2, 64, 64, False, 0.1))
        graph.validate()


def _cuda_like(dtype=torch.bfloat16, dim=128):
    """A stand-in for a CUDA q (the choice reads device, dtype and shape only)."""
    import types

    shape = torch.Size((100, 4, dim))
    return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=shape, device=torch.device("cuda"))


def test_the_library_choice_says_why(monkeypatch):
    monkeypatch.delenv(choose.LIBRARY_ENV, raising=False)
    assert choose.choice(torch.zeros(4, 2, 8)) == (library.ReferenceVarlen, "cpu tensors: the PyTorch stand-in")
    q = _cuda_like()
    monkeypatch.setattr(cl, "unsupported", lambda q: None)
    # auto takes cuDNN's calls wherever they can run.
    assert choose.choice(q) == (
        cl.CudnnVarlen,
        "cuDNN's ragged attention (cudnn-frontend, MTRAINING_VARLEN_LIBRARY=auto)",
    )
    monkeypatch.setenv(choose.LIBRARY_ENV, "cudnn")
    calls, why = choose.choice(q)
    assert (
        calls is cl.CudnnVarlen and why == "cuDNN's ragged attention (cudnn-frontend, MTRAINING_VARLEN_LIBRARY=cudnn)"
    )
    assert choose.library(q) is cl.CudnnVarlen
    monkeypatch.setenv(choose.LIBRARY_ENV, "flash")
    assert choose.choice(q) == (
        library.FlashVarlen,
        "PyTorch's FlashAttention-2 varlen kernels (MTRAINING_VARLEN_LIBRARY=flash)",
    )
    monkeypatch.setenv(choose.LIBRARY_ENV, "cudnn")
    monkeypatch.setattr(cl, "unsupported", lambda q: "got a GPU of compute capability (8, 0), used on sm90 only")
    with pytest.raises(ValueError, match=r"MTRAINING_VARLEN_LIBRARY='cudnn'.*sm90 only"):
        choose.choice(q)
    monkeypatch.setenv(choose.LIBRARY_ENV, "auto")
    assert choose.choice(q) == (
        library.FlashVarlen,
        "PyTorch's FlashAttention-2 varlen kernels (not cuDNN's ragged attention: "
        "got a GPU of compute capability (8, 0), used on sm90 only)",
    )
    monkeypatch.setenv(choose.LIBRARY_ENV, "cudnn9")
    with pytest.raises(ValueError, match=r"MTRAINING_VARLEN_LIBRARY='cudnn9'.*one of auto, flash, cudnn"):
        choose.choice(q)


def test_cudnn_says_what_it_does_not_serve(monkeypatch):
    assert cl.unsupported(torch.zeros(4, 2, 64, dtype=torch.bfloat16)) == "got inputs on cpu"
    assert cl.unsupported(_cuda_like(torch.float32)) == "got torch.float32"
    assert cl.unsupported(_cuda_like(dim=12)) == "got head dim 12"
    assert cl.unsupported(_cuda_like(dim=264)) == "got head dim 264"
    monkeypatch.setattr(cl, "frontend", lambda: (None, "cudnn-frontend is not installed"))
    assert cl.unsupported(_cuda_like()) == "cudnn-frontend is not installed"
    monkeypatch.setattr(cl, "frontend", lambda: (object(), None))
    for capability, want in (((8, 0), "got a GPU of compute capability (8, 0), used on sm90 only"), ((9, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert cl.unsupported(_cuda_like()) == want


def test_the_frontend_reports_a_missing_package_or_an_old_cudnn(monkeypatch):
    import sys
    import types

    cl.frontend.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
        assert cl.frontend()[0] is None and "cudnn-frontend is not installed" in cl.frontend()[1]
        cl.frontend.cache_clear()
        old = types.SimpleNamespace(__version__="1.0", backend_version=lambda: 90100)
        monkeypatch.setitem(sys.modules, "cudnn", old)
        assert cl.frontend() == (None, "cuDNN 90100 is older than 90600 (ragged softmax stats)")
        cl.frontend.cache_clear()
        new = types.SimpleNamespace(__version__="1.32", backend_version=lambda: 92000)
        monkeypatch.setitem(sys.modules, "cudnn", new)
        assert cl.frontend() == (new, None)
    finally:
        cl.frontend.cache_clear()


class EmulatedCudnn:
    """Stands in for cuDNN behind ``CudnnVarlen``: reads the buffers of a call exactly as the
    graph declares them (``thd_layout``, ``stats_layout``, the ragged offsets and segment
    lengths it is given), computes fp64 attention per segment and writes the outputs the same
    way; checks the graph's bounds (``s_q``, ``s_k``, the backward's row counts) hold."""

    def __init__(self, monkeypatch, declines=False):
        self.keys, self.declines = [], declines
        monkeypatch.setattr(cl, "_graph", self.graph)
        monkeypatch.setattr(cl, "_run", self.run)

    def graph(self, key, device):
        self.keys.append(key)
        return (None if self.declines else cl._Graph(key, None, {}, 0)), None

    def run(self, entry, handle, buffers, device):
        key, b = entry.key, entry.key.segments
        seq_q, seq_k = buffers["seq_q"].flatten().tolist(), buffers["seq_k"].flatten().tolist()
        assert len(seq_q) == len(seq_k) == b and max(seq_q) <= key.s_q and max(seq_k) <= key.s_k
        if key.backward:
            assert buffers["q"].shape[0] <= key.rows_q and buffers["k"].shape[0] <= key.rows_k
        q_layout = cl.thd_layout(b, key.hq, key.s_q, key.d)
        k_layout = cl.thd_layout(b, key.hkv, key.s_k, key.d)
        stats_layout = cl.stats_layout(b, key.hq, key.s_q)
        off_q, off_k, off_s = (buffers[n].flatten().tolist() for n in ("off_q", "off_k", "off_stats"))
        group = key.hq // key.hkv
        for i in range(b):
            nq, nk = seq_q[i], seq_k[i]
            if nq == 0:
                continue

            def rows(name, layout=q_layout, offset=off_q[i], n=nq):
                return _segment_view(buffers[name], *layout, offset, n)

            q, k, v = rows("q"), rows("k", k_layout, off_k[i], nk), rows("v", k_layout, off_k[i], nk)
            k64, v64 = (x.double().repeat_interleave(group, 0) for x in (k, v))
            logits = q.double() @ k64.transpose(1, 2) * key.scale  # [H, nq, nk]
            if key.causal:
                seen = torch.arange(nk).view(1, -1) <= torch.arange(nq).view(-1, 1) + nk - nq
                logits = logits.masked_fill(~seen, float("-inf"))
            stats = rows("stats", stats_layout, off_s[i])
            if not key.backward:
                lse = torch.logsumexp(logits, -1)
                rows("o").copy_(torch.exp(logits - lse.unsqueeze(-1)) @ v64)
                stats.copy_(lse)
                continue
            p = torch.exp(logits - stats.double().unsqueeze(-1))
            do, o = rows("do").double(), rows("o").double()
            ds = p * (do @ v64.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
            rows("dq").copy_(ds @ k64 * key.scale)
            dk = (ds.transpose(1, 2) @ q.double() * key.scale).unflatten(0, (key.hkv, group)).sum(1)
            dv = (p.transpose(1, 2) @ do).unflatten(0, (key.hkv, group)).sum(1)
            rows("dk", k_layout, off_k[i], nk).copy_(dk)
            rows("dv", k_layout, off_k[i], nk).copy_(dv)


SEGMENTS = {
    # (rows, keys) per segment
    "causal": [(130, 130), (0, 64), (257, 257), (5, 5)],
    "full": [(130, 64), (0, 64), (300, 200), (7, 3), (0, 0)],
}


def _segment_inputs(rng, lengths, hq, hkv, d, dtype, device):
    cu_q = _cu([r for r, _ in lengths]).to(device)
    cu_k = _cu([k for _, k in lengths]).to(device)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=rng).to(device, dtype)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, generator=rng).to(device, dtype) for _ in "kv")
    return q, k, v, cu_q, cu_k, max(r for r, _ in lengths), max(k for _, k in lengths)


def _arbitrary_out_and_lse(rng, out, lse):
    """An output and LSE unlike the call's own, as a caller's merged ones are: the LSE of more
    keys (never smaller) and another output."""
    other = torch.randn(out.shape, generator=rng).to(out.device, out.dtype)
    more = torch.rand(lse.shape, generator=rng).to(lse.device, lse.dtype)
    return other, lse + more


@pytest.mark.parametrize("hq, hkv", [(8, 1), (4, 4)], ids=["gqa8", "mha"])
@pytest.mark.parametrize("mask", SEGMENTS)
def test_cudnn_calls_move_the_right_elements(mask, hq, hkv, rng, monkeypatch):
    """``CudnnVarlen`` on the emulated cuDNN against the stand-in in fp64: forward, and the
    backward of an arbitrary (out, lse) pair; keys of segments without rows get zero gradients."""
    emulated = EmulatedCudnn(monkeypatch)
    q, k, v, cu_q, cu_k, max_q, max_k = _segment_inputs(rng, SEGMENTS[mask], hq, hkv, 16, torch.float64, "cpu")
    args = (cu_q, cu_k, max_q, max_k, mask == "causal", 0.3)
    out, lse = cl.CudnnVarlen.forward(q, k, v, *args)
    want_out, want_lse = library.ReferenceVarlen.forward(q, k, v, *args)
    assert lse.shape == (hq, q.shape[0]) and lse.is_contiguous()
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=0, atol=STATS_TOL)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=STATS_TOL)
    merged_out, merged_lse = _arbitrary_out_and_lse(rng, out, lse)
    dout = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    grads = cl.CudnnVarlen.backward(dout, q, k, v, merged_out, merged_lse, *args)
    want = library.ReferenceVarlen.backward(dout, q, k, v, merged_out, merged_lse, *args)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close_rel(got, ref, STATS_TOL, name)
    assert [key.backward for key in emulated.keys] == [False, True]


def test_declined_graphs_run_on_flash_attention(rng, monkeypatch):
    EmulatedCudnn(monkeypatch, declines=True)
    ran = []
    for name in ("forward", "backward"):
        real = getattr(library.ReferenceVarlen, name)
        monkeypatch.setattr(library.FlashVarlen, name, staticmethod(lambda *a, n=name, r=real: ran.append(n) or r(*a)))
    q, k, v, cu_q, cu_k, max_q, max_k = _segment_inputs(rng, SEGMENTS["full"], 2, 1, 8, torch.float64, "cpu")
    args = (cu_q, cu_k, max_q, max_k, False, 0.3)
    out, lse = cl.CudnnVarlen.forward(q, k, v, *args)
    cl.CudnnVarlen.backward(out, q, k, v, out, lse, *args)
    assert ran == ["forward", "backward"]


@pytest.mark.parametrize("shape", [(1, 300, 4, 2, 16, 32, 4), (2, 200, 8, 1, 16, 16, 6)], ids=["gqa2", "mqa-b2"])
def test_moba_on_emulated_cudnn_matches_fp64_dense(shape, rng, monkeypatch):
    """The whole MoBA path with its calls on ``CudnnVarlen`` (emulated cuDNN), fp64 against
    dense attention under the index's mask."""
    emulated = EmulatedCudnn(monkeypatch)
    monkeypatch.setattr(choose, "library", lambda q: cl.CudnnVarlen)
    b, s, hq, hkv, d, chunk, topk = shape
    q, k, v = make_inputs(rng, (b, s, hq, hkv, d), torch.float64, "cpu")
    index = build_moba_index(q.detach(), k.detach(), MoBAConfig(chunk_size=chunk, topk=topk))
    check_index_attention(q, k, v, index, rng, STATS_TOL, backend="varlen_blocks", grads=("out",))
    assert any(key.causal for key in emulated.keys) and any(key.backward for key in emulated.keys)


# GPU: cuDNN itself.


def _cudnn_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    why_not = cl.unsupported(torch.empty(1, 1, 128, dtype=torch.bfloat16, device="cuda"))
    if why_not is not None:
        pytest.skip(why_not)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("hq, hkv", [(16, 2), (4, 4)], ids=["gqa8", "mha"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", SEGMENTS)
def test_cudnn_calls_match_fp64(mask, dtype, hq, hkv, d, rng):
    """cuDNN's ragged attention against the stand-in in fp64 per segment (empty segments, a
    causal square one, uneven lengths): the forward, and the backward given an arbitrary
    (out, lse) pair as the caller passes its merged ones. No graph declined."""
    _cudnn_on_gpu()
    q, k, v, cu_q, cu_k, max_q, max_k = _segment_inputs(rng, SEGMENTS[mask], hq, hkv, d, dtype, "cuda")
    args = (cu_q, cu_k, max_q, max_k, mask == "causal", d**-0.5)
    tol = TOLERANCE[dtype]
    out, lse = cl.CudnnVarlen.forward(q, k, v, *args)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (hq, q.shape[0]) and lse.is_contiguous()
    fp64 = [x.double() for x in (q, k, v)]
    want_out, want_lse = library.ReferenceVarlen.forward(*fp64, *args)
    assert_close_rel(out, want_out, tol, "out")
    assert_close_rel(lse, want_lse, 1e-4, "lse")
    merged_out, merged_lse = _arbitrary_out_and_lse(rng, out, lse)
    dout = torch.randn(out.shape, generator=rng).to("cuda", dtype)
    grads = cl.CudnnVarlen.backward(dout, q, k, v, merged_out, merged_lse, *args)
    want = library.ReferenceVarlen.backward(dout.double(), *fp64, merged_out.double(), merged_lse.double(), *args)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.dtype == dtype
        assert_close_rel(got, ref, 2 * tol, name)
    assert not cl.DECLINED, cl.DECLINED


@pytest.mark.gpu
def test_cudnn_graphs_are_reused_and_the_deterministic_backward_repeats(rng):
    _cudnn_on_gpu()
    q, k, v, cu_q, cu_k, max_q, max_k = _segment_inputs(rng, SEGMENTS["full"], 8, 2, 128, torch.bfloat16, "cuda")
    args = (cu_q, cu_k, max_q, max_k, False, 0.1)
    out, lse = cl.CudnnVarlen.forward(q, k, v, *args)
    graphs = len(cl._GRAPHS)
    cl.CudnnVarlen.forward(q, k, v, cu_q, cu_k, max_q + 10, max_k, False, 0.1)  # the same bucket
    assert len(cl._GRAPHS) == graphs
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = cl.CudnnVarlen.backward(out, q, k, v, out, lse, *args)
        second = cl.CudnnVarlen.backward(out, q, k, v, out, lse, *args)
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert not cl.DECLINED, cl.DECLINED


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_moba_on_cudnn_matches_fp64_dense(dtype, rng, monkeypatch):
    """The whole path as the dispatch runs it on sm90 with cuDNN's calls asked for, at
    Qwen2.5-3B's head shape on a sequence that is no multiple of the chunk; then with an LSE
    gradient."""
    _cudnn_on_gpu()
    from megatron_mtraining.sparse import dispatch

    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    monkeypatch.setenv(choose.LIBRARY_ENV, "cudnn")
    q, k, v = make_inputs(rng, (1, 3000, 16, 2, 128), dtype, "cuda")
    index = build_moba_index(q.detach(), k.detach(), MoBAConfig(chunk_size=1024, topk=3))
    decision = dispatch.attention_kernel(q, index)
    assert decision.kernel == "varlen_blocks" and "cuDNN's ragged attention" in decision.reason, decision
    assert choose.library(q) is cl.CudnnVarlen
    check_index_attention(q, k, v, index, rng, TOLERANCE[dtype], grads=("out",))
    check_index_attention(q, k, v, index, rng, TOLERANCE[dtype], grads=("out", "lse"))
    assert not cl.DECLINED, cl.DECLINED
