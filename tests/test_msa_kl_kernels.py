"""MSA's fused sparse KL kernels (``sparse/kernels/msa_kl``) against an fp64 reference.

The index LSE, the KL value handed to the logger, dq_idx and dk_idx, for top-k selections
(rows of a query block choosing different blocks, a ragged last block, one and several
heads per group) and the warmup's dense index; and the pieces a context-parallel ring
would call per step. The union-of-tiles backward runs in one pass (dq_idx by atomics) by
default and in two under torch's deterministic mode (``kl_passes``). Without CUDA the
kernels run in Triton's interpreter (fp32, fp16); on a GPU in bf16 too. Kernel outputs are
poisoned with NaN before each run.
"""

import collections
import contextlib
import dataclasses
import math
import os

import pytest
import torch
from dense_reference import assert_close_rel, dense_attention
from documents_reference import block_diagonal, random_boundaries
from msa_reference import kl_parts
from test_kv_outer import small_work

from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.context_parallel.step_tables import StepTables
from megatron_mtraining.sparse import (
    BlockTopKIndex,
    DenseIndex,
    MSAConfig,
    VerticalSlashIndex,
    dispatch,
    msa_attention,
    msa_kl_loss,
    msa_kl_objective,
    msa_select_blocks,
    sparse_attention,
)
from megatron_mtraining.sparse.dispatch import kl_kernel
from megatron_mtraining.sparse.documents import packed_documents
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs CUDA or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("poisoned_outputs"),
]

# (relative tolerance of the gradients, absolute tolerance of LSE and KL value) per input dtype.
TOLERANCE = {torch.float32: (2e-4, 2e-5), torch.float16: (2e-2, 5e-3), torch.bfloat16: (6e-2, 3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _loss_module():
    from megatron_mtraining.sparse.kernels.msa_kl import loss  # imports Triton

    return loss


def _kv_loss():
    from megatron_mtraining.sparse.kernels.msa_kl import kv_loss  # imports Triton

    return kv_loss


def _inputs(rng, b, s, hq, hkv, d, di, dtype, device):
    """q, k, q_idx, k_idx rounded to ``dtype`` (the fp64 reference reads the same values)."""

    def t(*shape):
        return torch.randn(*shape, generator=rng).to(dtype).to(device)

    return t(b, s, hq, d), t(b, s, hkv, d), t(b, s, hkv, di), t(b, s, 1, di)


def _index(kind, q_idx, k_idx, hq, block, topk, shared=False, cu_seqlens=None):
    """The warmup's DenseIndex or MSA's selection (``cu_seqlens``: within packed documents)."""
    b, s, hkv, di = q_idx.shape
    if kind == "dense":
        return DenseIndex(b, hq, s, device=q_idx.device, documents=packed_documents(cu_seqlens, s, q_idx.device))
    if shared:  # one selection for every group
        q_idx = q_idx.float().mean(2, keepdim=True)
    config = MSAConfig(block_size=block, topk=topk, index_head_dim=di)
    return msa_select_blocks(q_idx.float(), k_idx.float(), config, hq, cu_seqlens=cu_seqlens)


@pytest.fixture
def kl_launches(monkeypatch):
    """Counts the union-of-tiles backward's launches (``kl_fused``, ``kl_dq``, ``kl_dk``)."""
    loss = _loss_module()
    calls = collections.Counter()
    for name in ("kl_fused", "kl_dq", "kl_dk"):
        real = getattr(loss, name)
        monkeypatch.setattr(
            loss, name, lambda *a, _real=real, _name=name, **kw: calls.update([_name]) or _real(*a, **kw)
        )
    return calls


@contextlib.contextmanager
def _deterministic(on: bool):
    """Torch's deterministic mode on or off inside, restored after. Warn-only: the dispatch
    reads only whether it is on, and the tests' own CUDA ops need not all have a
    deterministic kernel."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@pytest.fixture(params=["one_pass", "two_pass"])
def kl_passes(request, kl_launches):
    """The union-of-tiles backward in one pass (the default) or, under torch's deterministic
    mode, in two; yields (the mode's name, the launches counted)."""
    with _deterministic(request.param == "two_pass"):
        assert dispatch.kl_backward_passes().kernel == request.param
        yield request.param, kl_launches


def _ran(passes, launches, backwards):
    """Each of ``backwards`` backward calls ran the launches of ``passes``, and only those."""
    want = {"kl_fused": backwards} if passes == "one_pass" else {"kl_dq": backwards, "kl_dk": backwards}
    assert dict(launches) == want, launches


def _reference(q, k, q_idx, k_idx, index, scale):
    """fp64 (per-row KL, index LSE, main LSE, KL value, dq_idx and dk_idx of 3 * KL) on the CPU."""
    s = q.shape[1]
    qi, ki = (t.detach().cpu().double().requires_grad_() for t in (q_idx, k_idx))
    rows, lse_idx, lse_main = kl_parts(q.cpu(), k.cpu(), qi, ki, index.to("cpu").to_dense_mask(s), scale)
    value = rows.sum() / rows.numel()
    dq, dk = torch.autograd.grad(3.0 * value, (qi, ki))
    return rows.detach(), lse_idx.detach(), lse_main.detach(), value.detach(), dq, dk


def _close(got, want, rtol, atol_share=1.0, what=""):
    """``got`` within ``rtol`` of ``want``'s largest magnitude, elementwise."""
    scale = want.abs().max().item() * atol_share
    torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


CASES = [
    # kind, batch, length, query heads, KV heads, head dim, index head dim, block, topk, shared selection
    ("topk", 2, 100, 4, 4, 16, 16, 16, 3, False),  # G = 1, ragged last block
    ("topk", 1, 150, 6, 2, 32, 16, 32, 3, False),  # G = 3 (padded to 4), ragged
    ("topk", 1, 200, 8, 2, 16, 32, 16, 4, False),  # G = 4
    ("topk", 1, 112, 4, 2, 16, 16, 16, 3, True),  # one selection shared by the groups
    ("topk", 1, 96, 16, 1, 16, 16, 32, 2, False),  # G = 16: a 16-head teacher loop
    ("dense", 1, 64, 16, 2, 16, 16, 32, 0, False),  # warmup, G = 8 (Qwen2.5-3B's group)
    ("dense", 2, 100, 4, 2, 16, 16, 32, 0, False),  # warmup, G = 2
    ("dense", 1, 130, 2, 2, 32, 16, 16, 0, False),  # warmup, G = 1
]


def _case(case, dtype, rng, kdevice):
    """A case's fresh inputs, index and tile tables: (kind, topk, q, k, q_idx, k_idx, index,
    tables, scale); bf16 only on a GPU (the interpreter's bf16 is broken)."""
    kind, b, s, hq, hkv, d, di, block, topk, shared = case
    if dtype == torch.bfloat16 and kdevice.type == "cpu":
        pytest.skip("bf16 on a GPU only (the interpreter's bf16 is broken)")
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, dtype, kdevice)
    index = _index(kind, q_idx, k_idx, hq, block, topk, shared)
    return kind, topk, q, k, q_idx, k_idx, index, tile_tables(index, dense_block=block), 0.8 / math.sqrt(d)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])) + ("-shared" if c[9] else ""))
def test_kernels_match_fp64(case, dtype, rng, kdevice, kl_launches):
    """The default backward, in one pass."""
    kind, topk, q, k, q_idx, k_idx, index, tables, scale = _case(case, dtype, rng, kdevice)
    loss = _loss_module()
    if kind == "topk":  # rows of a query block chose different blocks: the union is wider than k
        assert tables.tile_count.max() > topk
    rows, lse_idx, lse_main, value, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    rtol, atol = TOLERANCE[dtype]

    got_lse = loss.index_lse(q_idx, k_idx, tables)
    torch.testing.assert_close(got_lse.cpu().double(), lse_idx, rtol=0, atol=atol)

    qi, ki = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
    recorded = []
    out = loss.fused_kl(q, k, lse_main.float().to(kdevice), qi, ki, tables, scale, recorded.append)
    assert out.item() == 0.0 and not recorded  # the forward is skipped
    (3.0 * out).backward()
    assert len(recorded) == 1
    torch.testing.assert_close(recorded[0].cpu().double(), value, rtol=10 * atol, atol=atol)
    assert qi.grad.dtype == dtype and ki.grad.dtype == dtype
    _close(qi.grad, dq_want, rtol, what="dq_idx")
    _close(ki.grad, dk_want, rtol, what="dk_idx")

    # The per-row KL terms themselves (what the value sums).
    _, _, kl_rows = loss.kl_backward(
        q, k, lse_main.float().to(kdevice), q_idx, k_idx, got_lse, tables, scale, torch.ones(1, device=kdevice), 1
    )
    torch.testing.assert_close(kl_rows.cpu().double(), rows, rtol=10 * atol, atol=10 * atol)
    _ran("one_pass", kl_launches, 2)


TWO_PASS_CASES = [CASES[4], CASES[5]]  # the smallest: top-k with G = 16, warmup with G = 8


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", TWO_PASS_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_two_passes_in_deterministic_mode_match_fp64(case, dtype, rng, kdevice, kl_launches):
    """Under torch's deterministic mode the backward runs the dQ and dK kernels (no atomics):
    dq_idx, dk_idx and the per-row KL against fp64, and the same bits on a second run."""
    _, _, q, k, q_idx, k_idx, index, tables, scale = _case(case, dtype, rng, kdevice)
    loss = _loss_module()
    rows, _, lse_main, _, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    rtol, atol = TOLERANCE[dtype]
    lse_idx = loss.index_lse(q_idx, k_idx, tables)
    grad = torch.full((1,), 3.0, device=kdevice)
    with _deterministic(True):
        decision = dispatch.kl_backward_passes()
        runs = [
            loss.kl_backward(
                q, k, lse_main.float().to(kdevice), q_idx, k_idx, lse_idx, tables, scale, grad, rows.numel()
            )
            for _ in range(2)
        ]
    assert decision.kernel == "two_pass" and "deterministic mode" in decision.reason, decision
    _ran("two_pass", kl_launches, 2)
    dq, dk, kl = runs[0]
    assert dq.dtype == dtype and dk.dtype == dtype
    _close(dq, dq_want, rtol, what="dq_idx")
    _close(dk, dk_want, rtol, what="dk_idx")
    torch.testing.assert_close(kl.cpu().double(), rows, rtol=10 * atol, atol=10 * atol)
    for first, second in zip(runs[0], runs[1], strict=True):
        assert torch.equal(first, second)


DOCUMENT_CASES = [
    # kind, length, query heads, KV heads, block, MTRAINING_KL_CONFIG
    ("dense", 100, 4, 2, 16, ""),  # warmup, G = 2, ragged last block
    ("topk", 160, 4, 2, 32, "lse:16,16,4,1;dq:16,16,4,1;dk:16,16,4,1;fused:16,16,4,1"),  # 16-row / key steps
]


@pytest.mark.parametrize("case", DOCUMENT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-block{c[4]}")
def test_kernels_with_documents_match_fp64(case, rng, kdevice, monkeypatch, kl_passes):
    """Packed documents on fresh random boundaries (one token, ending on a block edge,
    exactly one block, short runs, long documents spanning blocks): the kernels with the
    document starts (tables built with documents) give the index LSE, the KL value, the
    per-row KL, dq_idx and dk_idx of fp64 under the index's mask, which keeps every row in
    its document; the teacher's LSE is the main pass's within the document. In one pass and
    in two; ``topk`` is selected within the documents and walks 32-token tiles in 16-row /
    16-key steps, so document starts fall inside a step."""
    kind, s, hq, hkv, block, config = case
    loss = _loss_module()
    monkeypatch.setenv(loss.CONFIG_ENV, config)
    d = di = 16
    q, k, q_idx, k_idx = _inputs(rng, 1, s, hq, hkv, d, di, torch.float32, kdevice)
    cu = random_boundaries(rng, s, block=block)
    index = _index(kind, q_idx, k_idx, hq, block, 3, cu_seqlens=cu.to(kdevice))
    assert index.documents is not None
    assert not (index.to_dense_mask(s).cpu() & ~block_diagonal(cu, s)).any(), "a row selects outside its document"
    tables = tile_tables(index, dense_block=block)
    assert tables.doc_start is not None
    scale = 0.8 / math.sqrt(d)
    rows, lse_idx, lse_main, value, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    rtol, atol = TOLERANCE[torch.float32]

    got_lse = loss.index_lse(q_idx, k_idx, tables)
    torch.testing.assert_close(got_lse.cpu().double(), lse_idx, rtol=0, atol=atol)
    qi, ki = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
    recorded = []
    (3.0 * loss.fused_kl(q, k, lse_main.float().to(kdevice), qi, ki, tables, scale, recorded.append)).backward()
    torch.testing.assert_close(recorded[0].cpu().double(), value, rtol=10 * atol, atol=atol)
    _close(qi.grad, dq_want, rtol, what="dq_idx")
    _close(ki.grad, dk_want, rtol, what="dk_idx")
    _, _, kl_rows = loss.kl_backward(
        q, k, lse_main.float().to(kdevice), q_idx, k_idx, got_lse, tables, scale, torch.ones(1, device=kdevice), 1
    )
    torch.testing.assert_close(kl_rows.cpu().double(), rows, rtol=10 * atol, atol=10 * atol)
    _ran(*kl_passes, 2)


def test_kl_backward_passes_follow_deterministic_mode():
    """One pass by default; two, each element written once, under torch's deterministic mode."""
    with _deterministic(False):
        fast = dispatch.kl_backward_passes()
    with _deterministic(True):
        exact = dispatch.kl_backward_passes()
    assert fast.kernel == "one_pass" and "atomics" in fast.reason, fast
    assert exact.kernel == "two_pass" and "deterministic mode" in exact.reason, exact
    assert {fast.kernel, exact.kernel} == set(dispatch.KL_BACKWARDS)


def test_main_queries_and_keys_get_no_gradient(rng, kdevice, kl_passes):
    b, s, hq, hkv, d, di = 1, 64, 4, 2, 16, 16
    q, k, q_idx, k_idx = (t.requires_grad_() for t in _inputs(rng, b, s, hq, hkv, d, di, torch.float32, kdevice))
    index = _index("topk", q_idx.detach(), k_idx.detach(), hq, 16, 2)
    _, _, lse_main, *_ = _reference(q.detach(), k.detach(), q_idx, k_idx, index, 1 / math.sqrt(d))
    lse = lse_main.float().to(kdevice).requires_grad_()
    kl = msa_kl_objective(q, k, q_idx, k_idx, index, lse, backend="triton")
    kl.backward()
    _ran(*kl_passes, 1)
    assert q.grad is None and k.grad is None and lse.grad is None
    for g in (q_idx.grad, k_idx.grad):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


@pytest.mark.parametrize("stages", [0, 2], ids=["heads-unrolled", "heads-pipelined"])
@pytest.mark.parametrize("kind", ["topk", "dense", "topk-kv-outer", "topk-kv-outer-documents"])
def test_recorded_value_is_the_kl(kind, stages, rng, kdevice, monkeypatch):
    """As the layer runs it: the main pass's own LSE (``sparse_attention``'s) normalises the
    teacher; the value reaches ``on_value`` once, in the backward, and equals the fp64 KL and
    ``msa_kl_loss``; the gradients equal ``msa_kl_loss``'s. ``topk-kv-outer``: the density
    rule moved so that the top-k index takes the KV-outer order (attention and KL); with
    ``documents`` (fresh random packed documents, the selection within them) both take the
    union of tiles instead. ``stages``: the teacher's loop over the group's heads unrolled
    or pipelined (``TEACHER_STAGES`` of both orders)."""
    for module in (_loss_module(), _kv_loss()):
        monkeypatch.setattr(module, "TEACHER_STAGES", stages)
    b, s, hq, hkv, d, di = 1, 80, 4, 2, 16, 16
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, torch.float32, kdevice)
    v = torch.randn(k.shape, generator=rng).to(kdevice)
    cu = random_boundaries(rng, s).to(kdevice) if kind.endswith("documents") else None
    index = _index(kind.split("-")[0], q_idx, k_idx, hq, 16, 2, cu_seqlens=cu)
    want = {"topk": "msa_kl", "dense": "msa_kl", "topk-kv-outer": "msa_kl_kv_outer"}.get(kind, "msa_kl")
    if kind.startswith("topk-kv-outer"):
        monkeypatch.setattr(dispatch, "KV_OUTER_MAX_SHARE", float("inf"))
        attention = dispatch.attention_kernel(q, index, backend="triton").kernel
        assert attention == ("kv_outer" if cu is None else "block_bar"), attention
    assert kl_kernel(q, q_idx, index, backend="triton").kernel == want
    _, lse = sparse_attention(q, k, v, index, backend="triton")
    qi, ki = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
    recorded = []
    kl = msa_kl_objective(q, k, qi, ki, index, lse, on_value=recorded.append, backend="triton")
    assert not recorded
    kl.backward()
    *_, value, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, 1 / math.sqrt(d))
    assert len(recorded) == 1 and recorded[0].shape == () and recorded[0].dtype == torch.float32
    torch.testing.assert_close(recorded[0].cpu().double(), value, rtol=1e-5, atol=1e-6)
    qr, kr = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
    reference = msa_kl_loss(q, k, qr, kr, index)
    reference.backward()
    torch.testing.assert_close(recorded[0], reference.detach().float(), rtol=1e-5, atol=1e-6)
    _close(qi.grad, qr.grad.double().cpu(), 2e-4, what="dq_idx")
    _close(ki.grad, kr.grad.double().cpu(), 2e-4, what="dk_idx")
    _close(qi.grad, dq_want / 3, 2e-4, what="dq_idx vs fp64")


@pytest.mark.parametrize("teacher", ["shared", "recompute"])
def test_msa_attention_is_attention_and_objective(teacher, rng, kdevice, monkeypatch):
    """``msa_attention``, as the layer trains with it: out and lse equal
    ``sparse_attention``'s, the KL's value reaches ``on_value`` once, in the backward, and
    every gradient (q, k, v of a random loss on out; q_idx, k_idx of the KL) equals that of
    ``sparse_attention`` and ``msa_kl_loss`` run apart, whether the KL's teacher comes from
    the attention's backward or is recomputed."""
    monkeypatch.setattr(dispatch, "KV_OUTER_MAX_SHARE", float("inf"))
    monkeypatch.setenv(dispatch.KL_TEACHER_ENV, teacher)
    b, s, hq, hkv, d, di = 1, 80, 4, 2, 16, 16
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, torch.float32, kdevice)
    v = torch.randn(k.shape, generator=rng).to(kdevice)
    index = _index("topk", q_idx, k_idx, hq, 16, 2)
    want = "msa_kl_with_attention" if teacher == "shared" else "msa_kl_kv_outer"
    assert kl_kernel(q, q_idx, index, backend="triton", with_attention=True).kernel == want
    g_out = torch.randn(q.shape, generator=rng).to(kdevice)

    def run(joint: bool):
        main = [t.clone().requires_grad_() for t in (q, k, v)]
        qi, ki = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
        recorded = []
        if joint:
            out, lse, kl = msa_attention(*main, qi, ki, index, on_value=recorded.append, backend="triton")
            assert not recorded
        else:
            out, lse = sparse_attention(*main, index, backend="triton")
            kl = msa_kl_loss(*main[:2], qi, ki, index)
        ((out * g_out).sum() + 3.0 * kl).backward()
        value = recorded[0] if joint else kl.detach()
        return out.detach(), lse.detach(), value, [t.grad for t in (*main, qi, ki)], recorded

    out, lse, value, grads, recorded = run(joint=True)
    ref_out, ref_lse, ref_value, ref_grads, _ = run(joint=False)
    assert len(recorded) == 1 and recorded[0].shape == () and recorded[0].dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)  # the same forward kernels
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    torch.testing.assert_close(value.float(), ref_value.float(), rtol=1e-5, atol=1e-6)
    for name, got, expected in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), grads, ref_grads, strict=True):
        _close(got, expected.double().cpu(), 2e-4, what=name)


def test_reference_path_records_in_the_forward(rng):
    """Where the dispatch keeps the KL on PyTorch (here: forced), the result is the KL and
    ``on_value`` gets it at once."""
    b, s, hq, hkv, d, di = 1, 48, 4, 2, 8, 8
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, torch.float64, "cpu")
    index = _index("topk", q_idx, k_idx, hq, 16, 2)
    *_, lse_main, value, _, _ = _reference(q, k, q_idx, k_idx, index, 1 / math.sqrt(d))
    recorded = []
    kl = msa_kl_objective(q, k, q_idx, k_idx, index, lse_main, on_value=recorded.append, backend="reference")
    assert len(recorded) == 1
    torch.testing.assert_close(kl, value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(recorded[0], value.float())


def test_dispatch_decision(rng):
    q = torch.randn(1, 32, 4, 16, generator=rng)
    q_idx = torch.randn(1, 32, 2, 16, generator=rng)
    dense = DenseIndex(1, 4, 32)
    assert kl_kernel(q, q_idx, dense).kernel == "reference"  # CPU tensors
    assert kl_kernel(q, q_idx, dense, backend="triton").kernel == "msa_kl"
    vs = VerticalSlashIndex(
        vertical=torch.zeros(1, 4, 1, dtype=torch.int32),
        slash=torch.zeros(1, 4, 1, dtype=torch.int32),
        block_size=16,
        seq_len=32,
    )
    assert kl_kernel(q, q_idx, vs).kernel == "reference"
    with pytest.raises(ValueError, match="KL kernels"):
        kl_kernel(q, q_idx, vs, backend="triton")
    assert kl_kernel(q, q_idx.double(), dense, backend="auto").kernel == "reference"
    packed = DenseIndex(1, 4, 32, documents=packed_documents(torch.tensor([0, 9, 32], dtype=torch.int32), 32))
    decision = kl_kernel(q, q_idx, packed, backend="triton")
    assert decision.kernel == "msa_kl" and "document start" in decision.reason, decision
    if torch.cuda.is_available():
        topk = BlockTopKIndex(blocks=torch.zeros(1, 32, 2, 1, dtype=torch.int32), block_size=16, num_heads=4)
        decision = kl_kernel(q.cuda().half(), q_idx.cuda().half(), topk.to("cuda"))
        assert decision.kernel == "msa_kl", decision


def _topk_of(s, block, topk, documents=None):
    blocks = torch.zeros(1, s, 2, topk, dtype=torch.int32)
    return BlockTopKIndex(blocks=blocks, block_size=block, num_heads=4, documents=documents)


def test_kl_dispatch_follows_the_attention_order(rng):
    """The KL of a top-k index takes the loop order the attention takes
    (``kv_outer_preferred``): KV-outer where it selects a small share of the keys, the union
    of tiles where not, and with packed documents (the KV-outer kernels take no document
    bounds), saying so."""
    s = 1024
    q = torch.randn(1, s, 4, 16, generator=rng)
    q_idx = torch.randn(1, s, 2, 16, generator=rng)
    sparse, wide, dense = _topk_of(s, 16, 2), _topk_of(s, 256, 2), _topk_of(s, 16, 8)  # shares 1/32, 1/2, 1/8
    for index, kernel, why in (
        (sparse, "msa_kl_kv_outer", "KV-outer"),
        (wide, "msa_kl", "union of tiles"),
        (dense, "msa_kl", "union of tiles"),
        (DenseIndex(1, 4, s), "msa_kl", "union of tiles"),
    ):
        decision = kl_kernel(q, q_idx, index, backend="triton")
        assert decision.kernel == kernel and why in decision.reason, decision
        if isinstance(index, BlockTopKIndex):
            attention = dispatch.attention_kernel(q, index, backend="triton")
            assert (attention.kernel == "kv_outer") == (kernel == "msa_kl_kv_outer"), attention
            assert f"{dispatch._share(index):.4f}" in decision.reason
    assert kl_kernel(q, q_idx, sparse).kernel == "reference"  # CPU tensors under auto
    packed = _topk_of(s, 16, 2, packed_documents(torch.tensor([0, 300, s], dtype=torch.int32), s))
    assert dispatch.kv_outer_preferred(packed)  # as sparse as the index that runs KV-outer
    decision = kl_kernel(q, q_idx, packed, backend="triton")
    assert decision.kernel == "msa_kl" and "packed documents" in decision.reason, decision
    assert "KV-outer kernels take no document bounds" in decision.reason, decision
    assert dispatch.attention_kernel(q, packed, backend="triton").kernel == "block_bar"
    if torch.cuda.is_available():
        on_gpu = (q.cuda().half(), q_idx.cuda().half())
        assert kl_kernel(*on_gpu, sparse.to("cuda")).kernel == "msa_kl_kv_outer"
        assert kl_kernel(*on_gpu, packed.to("cuda")).kernel == "msa_kl"
        assert kl_kernel(*on_gpu, sparse.to("cuda"), with_attention=True).kernel == "msa_kl_kv_outer"


def test_kl_with_attention_dispatch(rng, monkeypatch):
    """With the attention in the same call, the KV-outer KL recomputes its teacher by
    default and takes it from the attention's backward under ``MTRAINING_KL_TEACHER=shared``
    where the attention runs KV-outer; each says why. A bad setting names the variable."""
    s = 1024
    q = torch.randn(1, s, 4, 16, generator=rng)
    q_idx = torch.randn(1, s, 2, 16, generator=rng)
    sparse, wide = _topk_of(s, 16, 2), _topk_of(s, 256, 2)
    decision = kl_kernel(q, q_idx, sparse, backend="triton", with_attention=True)
    assert decision.kernel == "msa_kl_kv_outer" and "MTRAINING_KL_TEACHER=recompute (the default" in decision.reason
    monkeypatch.setenv(dispatch.KL_TEACHER_ENV, "shared")
    decision = kl_kernel(q, q_idx, sparse, backend="triton", with_attention=True)
    assert decision.kernel == "msa_kl_with_attention" and "teacher from its probabilities" in decision.reason
    assert kl_kernel(q, q_idx, wide, backend="triton", with_attention=True).kernel == "msa_kl"
    assert kl_kernel(q, q_idx, DenseIndex(1, 4, s), backend="triton", with_attention=True).kernel == "msa_kl"
    with monkeypatch.context() as m:  # as for main queries of a head dim the kernels do not take
        m.setattr(dispatch, "attention_kernel", lambda *a, **kw: dispatch.Decision("reference", "head dim 512"))
        decision = kl_kernel(q, q_idx, sparse, backend="triton", with_attention=True)
        assert decision.kernel == "msa_kl_kv_outer" and "the attention runs on reference" in decision.reason
    monkeypatch.setenv(dispatch.KL_TEACHER_ENV, "recompute")
    decision = kl_kernel(q, q_idx, sparse, backend="triton", with_attention=True)
    assert decision.kernel == "msa_kl_kv_outer" and "MTRAINING_KL_TEACHER=recompute" in decision.reason
    monkeypatch.setenv(dispatch.KL_TEACHER_ENV, "attention")
    with pytest.raises(ValueError, match="MTRAINING_KL_TEACHER.*recompute, shared"):
        kl_kernel(q, q_idx, sparse, backend="triton", with_attention=True)


def _fresh_topk(rng, b, s, hs, topk, block):
    """Per-row selections drawn afresh (rows of a query block choose different blocks): the
    row's own block and ``topk - 1`` others at random, some after the row (invisible), about
    one slot in five left empty (-1); ascending, -1 padded."""
    n_blocks = -(-s // block)
    own = (torch.arange(s) // block).view(1, s, 1, 1).expand(b, s, hs, 1)
    draw = torch.rand(b, s, hs, n_blocks, generator=rng).scatter(-1, own, -1.0)  # the own block first
    chosen = draw.argsort(-1)[..., :topk]
    empty = torch.rand(chosen.shape, generator=rng) < 0.2
    empty[..., 0] = False
    chosen = torch.where(empty, n_blocks, chosen).sort(-1).values
    return torch.where(chosen < n_blocks, chosen, -1).int()


@pytest.fixture
def small_kv_work(monkeypatch):
    """The KV-outer KL on tiny inputs in many pieces: query chunks of ``chunk`` tokens,
    16-row tiles, ``block_n`` keys a step, one tile an item (so blocks chosen by many rows
    split into several items, whose dK partials ``_reduce_kernel`` adds), and a dK partial
    pool that holds every split at one tile an item: at a pool the size of the dq slots, a
    chunk's splits could outgrow it and take whole-group items (``work_list``), which left
    some draws with no split at all. Returns the work lists the backward builds."""
    from megatron_mtraining.sparse.kernels.kv_outer import attention as kv

    kv_loss = _kv_loss()
    lists = []

    def setup(chunk, block_n):
        for name in kv_loss.CHUNKS:
            monkeypatch.setitem(kv_loss.CHUNKS, name, kv.Streaming(buffer_share=0.0, min_chunk=chunk))
        monkeypatch.setattr(kv, "PARTIAL_SHARE", 16.0)
        for name, cfg in kv_loss.DEFAULTS.items():
            small = dataclasses.replace(cfg, block_m=16, block_n=block_n, num_stages=1, tiles_per_item=1)
            monkeypatch.setitem(kv_loss.OVERRIDES, name, small)
        real = kv_loss.work_list
        monkeypatch.setattr(kv_loss, "work_list", lambda *a, **kw: lists.append(real(*a, **kw)) or lists[-1])
        return lists

    return setup


KV_CASES = [
    # batch, length, query heads, KV heads, head dim, index head dim, block, topk, key step, shared selection
    (2, 100, 4, 4, 16, 16, 16, 3, 16, False),  # G = 1, ragged last block
    (1, 150, 6, 2, 32, 16, 32, 3, 16, False),  # G = 3 (padded to 4), ragged, a block in two key steps
    (1, 200, 8, 2, 16, 32, 16, 4, 16, False),  # G = 4
    (1, 112, 4, 2, 16, 16, 16, 3, 16, True),  # one selection shared by the groups
    (1, 96, 16, 1, 16, 16, 32, 2, 32, False),  # G = 16: a 16-head teacher loop (fp32: two key steps)
]


def _kv_case_params():
    """Every KV case with the teacher's head loop unrolled; the cases whose blocks take two
    key steps (so ``_kl_dq_kernel`` runs) with it pipelined too."""
    for case in KV_CASES:
        ids = "-".join(map(str, case[:9])) + ("-shared" if case[9] else "")
        yield pytest.param(case, 0, id=ids)
        if case[6] > case[8]:
            yield pytest.param(case, 2, id=f"{ids}-heads-pipelined")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case,stages", _kv_case_params())
def test_kv_outer_kl_matches_fp64(case, stages, dtype, rng, kdevice, small_kv_work, monkeypatch):
    """The KV-outer order (``msa_kl.kv_loss``) on fresh random selections, streamed over
    several query chunks with split items: index LSE, per-row KL, the KL value, dq_idx and
    dk_idx against fp64; ``stages``: the teacher's head loop (``TEACHER_STAGES``)."""
    b, s, hq, hkv, d, di, block, topk, block_n, shared = case
    if dtype == torch.bfloat16 and kdevice.type == "cpu":
        pytest.skip("bf16 on a GPU only (the interpreter's bf16 is broken)")
    kv_loss = _kv_loss()
    monkeypatch.setattr(kv_loss, "TEACHER_STAGES", stages)
    lists = small_kv_work(chunk=48, block_n=block_n)
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, dtype, kdevice)
    blocks = _fresh_topk(rng, b, s, 1 if shared else hkv, topk, block)
    index = BlockTopKIndex(blocks=blocks, block_size=block, num_heads=hq).to(kdevice)
    # Rows of a query block chose different blocks: the union is wider than k.
    assert tile_tables(index, dense_block=block).tile_count.max() > topk
    scale = 0.8 / math.sqrt(d)
    rows, lse_idx, lse_main, value, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    rtol, atol = TOLERANCE[dtype]

    got_lse = kv_loss.kv_index_lse(q_idx, k_idx, index)
    torch.testing.assert_close(got_lse.cpu().double(), lse_idx, rtol=0, atol=atol)

    grad = torch.full((1,), 3.0, device=kdevice)
    dq, dk, kl = kv_loss.kv_kl_backward(
        q, k, lse_main.float().to(kdevice), q_idx, k_idx, got_lse, index, scale, grad, rows.numel()
    )
    assert dq.dtype == dtype and dk.dtype == dtype and dk.shape == k_idx.shape
    torch.testing.assert_close(kl.cpu().double(), rows, rtol=10 * atol, atol=10 * atol)
    torch.testing.assert_close(kl.sum().cpu().double() / rows.numel(), value, rtol=10 * atol, atol=atol)
    _close(dq, dq_want, rtol, what="dq_idx")
    _close(dk, dk_want, rtol, what="dk_idx")
    # The streaming ran: several query chunks, and blocks whose rows split into several items.
    assert lists and all(len(w.chunk_items) - 1 == -(-s // 48) > 1 for w in lists)
    assert any(w.partial is not None and bool((w.partial >= 0).any()) for w in lists)


# Relative tolerance of the main attention against fp64 (``test_kernels``'s).
ATTENTION_TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


# G = 3 with a block in two key steps, short enough for the default run.
SMALL_G3 = (1, 64, 6, 2, 16, 16, 32, 2, 16, False)


def _kl_with_attention_params():
    """Every KV case in every dtype; in the default run fp32 of two (``SMALL_G3`` and the
    shared selection), the rest behind ``-m slow`` (the interpreter takes up to ~40 s a
    case)."""
    for case in [SMALL_G3, *KV_CASES]:
        for dtype, name in zip(DTYPES, ["fp32", "fp16", "bf16"], strict=True):
            default = dtype == torch.float32 and case in (SMALL_G3, KV_CASES[3])
            ids = "-".join(map(str, case[:9])) + ("-shared" if case[9] else "") + f"-{name}"
            yield pytest.param(case, dtype, id=ids, marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("case,dtype", _kl_with_attention_params())
def test_kl_with_attention_matches_fp64(case, dtype, rng, kdevice, small_kv_work, monkeypatch):
    """The attention and the KL in one function (``msa_kl.kv_attention``), the KL's teacher
    stored by the attention's backward: out, lse and dq / dk / dv against fp64 attention
    under the index's mask, the KL value, dq_idx and dk_idx against fp64, on fresh random
    selections streamed over the attention's query chunks (which the KL shares) with split
    items on both sides."""
    from megatron_mtraining.sparse.kernels.kv_outer import attention as kv
    from megatron_mtraining.sparse.kernels.msa_kl import kv_attention

    b, s, hq, hkv, d, di, block, topk, block_n, shared = case
    if dtype == torch.bfloat16 and kdevice.type == "cpu":
        pytest.skip("bf16 on a GPU only (the interpreter's bf16 is broken)")
    lists = small_kv_work(chunk=48, block_n=block_n)  # the KL's passes; their own chunks go unused
    small_work(monkeypatch, kv, chunk=40, tiles_per_item=2, block_n=block_n)  # the attention's
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, dtype, kdevice)
    v = torch.randn(k.shape, generator=rng).to(dtype).to(kdevice)
    blocks = _fresh_topk(rng, b, s, 1 if shared else hkv, topk, block)
    index = BlockTopKIndex(blocks=blocks, block_size=block, num_heads=hq).to(kdevice)
    scale = 0.8 / math.sqrt(d)
    rows, _, _, value, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    main = [t.clone().requires_grad_() for t in (q, k, v)]
    qi, ki = q_idx.clone().requires_grad_(), k_idx.clone().requires_grad_()
    recorded = []
    out, lse, kl = kv_attention.kv_outer_msa(*main, qi, ki, index, scale, recorded.append)
    forward_lists = len(lists)

    reference = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_attention(*reference, index.to("cpu").to_dense_mask(s), softmax_scale=scale)
    tol = ATTENTION_TOLERANCE[dtype]
    assert_close_rel(out.cpu(), ref_out, tol, "out")
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=0, atol=max(tol, 1e-5))
    assert float(kl.detach()) == 0.0 and not recorded  # the value comes in the backward
    g_out = torch.randn(out.shape, generator=rng)
    ((out.float() * g_out.to(kdevice)).sum() + 3.0 * kl).backward()
    wants = torch.autograd.grad((ref_out * g_out.double()).sum(), reference)
    for name, got, want in zip(("dq", "dk", "dv"), (t.grad for t in main), wants, strict=True):
        assert got.dtype == dtype, name
        assert_close_rel(got.cpu(), want, 2 * tol, name)
    rtol, atol = TOLERANCE[dtype]
    assert len(recorded) == 1 and recorded[0].shape == ()
    torch.testing.assert_close(recorded[0].cpu().double(), value, rtol=10 * atol, atol=atol)
    _close(qi.grad, dq_want, rtol, what="dq_idx")
    _close(ki.grad, dk_want, rtol, what="dk_idx")
    # The KL's backward ran on the attention's chunks (40 tokens), not its own (48).
    assert lists[forward_lists:] and all(len(w.chunk_items) - 1 == -(-s // 40) for w in lists[forward_lists:])


@pytest.mark.parametrize("kind", ["topk", "dense"])
def test_ring_steps(kind, rng, kdevice, kl_passes):
    """A context-parallel rank's rows against each rank's chunk of keys (a ring's steps,
    global positions through the step tables): the steps' LSEs merged per row, then the
    backward per step in fp32 (one pass, or the dQ and dK kernels), add up to the rows'
    share of the whole sequence's KL, and to one device's backward of the whole sequence."""
    b, s, hq, hkv, d, di, block, cp, rank = 1, 128, 4, 2, 16, 16, 16, 2, 1
    loss = _loss_module()
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, torch.float32, kdevice)
    index = _index(kind, q_idx, k_idx, hq, block, 3)
    scale = 1 / math.sqrt(d)
    layout = ContextParallelLayout("zigzag", cp, s)
    mine = layout.positions(rank).to(kdevice)
    # fp64 reference restricted to this rank's rows: per-row KL, LSEs, gradients of their sum / (B S Hkv).
    qi, ki = (t.detach().cpu().double().requires_grad_() for t in (q_idx, k_idx))
    rows, lse_idx, lse_main = kl_parts(q.cpu(), k.cpu(), qi, ki, index.to("cpu").to_dense_mask(s), scale)
    local = rows[:, :, mine.cpu()]
    dq_want, dk_want = torch.autograd.grad(local.sum() / rows.numel(), (qi, ki))

    queries = layout.token_positions(rank, kdevice)
    steps = StepTables(index, queries)
    chunks = [(layout.positions(src).to(kdevice), steps.of(layout.token_positions(src, kdevice))) for src in range(cp)]
    assert all(t is not None and t.query_blocks is not None for _, t in chunks)
    q_r, qi_r, lse_r = q[:, mine], q_idx[:, mine], lse_main[:, :, mine.cpu()].float().to(kdevice)
    lse_steps = [loss.index_lse(qi_r, k_idx[:, keys], tables) for keys, tables in chunks]
    merged = torch.stack(lse_steps).logsumexp(0)
    torch.testing.assert_close(merged.cpu().double(), lse_idx[:, :, mine.cpu()], rtol=0, atol=2e-5)
    dq = torch.zeros(qi_r.shape, device=kdevice)
    dk = torch.zeros(k_idx.shape, device=kdevice)
    kl = torch.zeros(local.shape, device=kdevice)
    grad = torch.ones(1, device=kdevice)
    for keys, tables in chunks:
        dq_s, dk_s, kl_s = loss.kl_backward(
            q_r, k[:, keys], lse_r, qi_r, k_idx[:, keys], merged, tables, scale, grad, rows.numel(), torch.float32
        )
        assert dq_s.dtype == dk_s.dtype == torch.float32
        dq += dq_s
        dk[:, keys] += dk_s
        kl += kl_s
    torch.testing.assert_close(kl.cpu().double(), local, rtol=1e-4, atol=1e-5)
    _close(dq, dq_want[:, mine.cpu()], 2e-4, what="dq_idx")
    _close(dk, dk_want, 2e-4, what="dk_idx")
    # One device, the whole sequence (this rank's rows' dq_idx; dk_idx of every row's share).
    whole = tile_tables(index, dense_block=block)
    lse_whole = loss.index_lse(q_idx, k_idx, whole)
    dq_one, _, kl_one = loss.kl_backward(
        q, k, lse_main.float().to(kdevice), q_idx, k_idx, lse_whole, whole, scale, grad, rows.numel()
    )
    _ran(kl_passes[0], kl_passes[1], cp + 1)
    torch.testing.assert_close(dq, dq_one[:, mine], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(kl, kl_one[:, :, mine], rtol=1e-4, atol=1e-6)


def test_launch_config_table_and_override(monkeypatch):
    loss = _loss_module()
    monkeypatch.delenv(loss.CONFIG_ENV, raising=False)
    assert loss.launch_config("dq", 128) == loss.DEFAULT_CONFIGS["dq"]
    assert loss.launch_config("dk", 16) == loss.LaunchConfig(16, 16, 4, loss.DEFAULT_CONFIGS["dk"].num_stages)
    monkeypatch.setenv(loss.CONFIG_ENV, "dq:64,128,4,3; dk:128,64,8,1")
    assert loss.launch_config("dq", 128) == loss.LaunchConfig(64, 128, 4, 3)
    assert loss.launch_config("dk", 128) == loss.LaunchConfig(128, 64, 8, 1)
    assert loss.launch_config("lse", 128) == loss.DEFAULT_CONFIGS["lse"]
    assert loss.launch_config("fused", 128) == loss.DEFAULT_CONFIGS["fused"]
    monkeypatch.setenv(loss.CONFIG_ENV, "fused:32,64,4,2")
    assert loss.launch_config("fused", 128) == loss.LaunchConfig(32, 64, 4, 2)
    assert loss.launch_config("dk", 128) == loss.DEFAULT_CONFIGS["dk"]
    for bad in ("dq:64,64,8", "dx:64,64,8,2", "dk:48,64,8,2", "fused:64,128,8"):
        with pytest.raises(ValueError, match=loss.CONFIG_ENV):
            loss.parse_configs(bad)


@pytest.mark.parametrize(
    "config", ["dq:16,16,4,1;dk:16,32,4,1;lse:16,16,4,1;fused:16,32,4,1", "dq:32,16,4,2;dk:32,16,4,2;fused:32,16,4,2"]
)
def test_overridden_configs_match(config, rng, kdevice, monkeypatch, kl_passes):
    """Other rows / keys per step (``MTRAINING_KL_CONFIG``) give the same results, in one
    pass and in two."""
    loss = _loss_module()
    b, s, hq, hkv, d, di, block = 1, 96, 8, 2, 16, 16, 32
    q, k, q_idx, k_idx = _inputs(rng, b, s, hq, hkv, d, di, torch.float32, kdevice)
    index = _index("topk", q_idx, k_idx, hq, block, 2)
    tables = tile_tables(index, dense_block=block)
    scale = 1 / math.sqrt(d)
    rows, lse_idx, lse_main, _, dq_want, dk_want = _reference(q, k, q_idx, k_idx, index, scale)
    monkeypatch.setenv(loss.CONFIG_ENV, config)
    got_lse = loss.index_lse(q_idx, k_idx, tables)
    torch.testing.assert_close(got_lse.cpu().double(), lse_idx, rtol=0, atol=2e-5)
    grad = torch.full((1,), 3.0, device=kdevice)
    dq, dk, kl = loss.kl_backward(
        q, k, lse_main.float().to(kdevice), q_idx, k_idx, got_lse, tables, scale, grad, rows.numel()
    )
    _ran(*kl_passes, 1)
    _close(dq, dq_want, 2e-4, what="dq_idx")
    _close(dk, dk_want, 2e-4, what="dk_idx")
    torch.testing.assert_close(kl.cpu().double(), rows, rtol=1e-4, atol=1e-5)
