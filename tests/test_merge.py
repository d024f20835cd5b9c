"""merge_attention_outputs equals attention over the union of two disjoint key sets."""

import torch
from dense_reference import dense_attention, finite

from megatron_mtraining.sparse import VerticalSlashIndex, merge_attention_outputs, sparse_attention

B, S, HQ, HKV, D, BS = 2, 80, 4, 2, 16, 16


def make_qkv(rng, dtype=torch.float64):
    def t(h):
        return torch.randn(B, S, h, D, generator=rng, dtype=torch.float64).to(dtype).requires_grad_()

    return t(HQ), t(HKV), t(HKV)


def index_of(slash=(), vertical=()):
    """A VerticalSlashIndex with the same diagonals / columns for every (batch, head)."""

    def field(values):
        row = torch.tensor(sorted(values) or [-1], dtype=torch.int32)
        return row.view(1, 1, -1).expand(B, HQ, -1).contiguous()

    return VerticalSlashIndex(vertical=field(vertical), slash=field(slash), seq_len=S, block_size=BS)


def grads(out, lse, inputs, g_out, g_lse):
    """Gradients of the linear functional <out, g_out> + <finite(lse), g_lse>."""
    loss = (out.double() * g_out).sum() + (finite(lse).double() * g_lse).sum()
    return torch.autograd.grad(loss, inputs)


def test_merge_equals_union_values_and_gradients(rng):
    q, k, v = make_qkv(rng)
    index_a, index_b, union = index_of(slash={0}), index_of(slash={1, 3}), index_of(slash={0, 1, 3})
    mask_a, mask_b = index_a.to_dense_mask(S), index_b.to_dense_mask(S)
    assert not (mask_a & mask_b).any(), "the two key sets must be disjoint"
    assert torch.equal(mask_a | mask_b, union.to_dense_mask(S))

    out_a, lse_a = sparse_attention(q, k, v, index_a)
    out_b, lse_b = sparse_attention(q, k, v, index_b)
    # Rows of query block 0 see nothing on side b: the merge must handle one-sided rows.
    assert torch.isneginf(lse_b[..., :BS]).all()
    out, lse = merge_attention_outputs(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (B, HQ, S)

    out_u, lse_u = sparse_attention(q, k, v, union)
    ref_out, ref_lse = dense_attention(q, k, v, union.to_dense_mask(S))
    assert torch.isfinite(lse).all()
    # lse is fp32 by contract, so the merge weights carry fp32 rounding.
    for want_out, want_lse in ((out_u, lse_u), (ref_out, ref_lse)):
        torch.testing.assert_close(out.double(), want_out.double(), atol=2e-6, rtol=0)
        torch.testing.assert_close(lse.double(), want_lse.double(), atol=2e-6, rtol=1e-6)

    g_out = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=rng, dtype=torch.float64)
    got = grads(out, lse, (q, k, v), g_out, g_lse)
    via_union = grads(out_u, lse_u, (q, k, v), g_out, g_lse)
    via_dense = grads(ref_out, ref_lse, (q, k, v), g_out, g_lse)
    for name, a, u, e in zip(("dq", "dk", "dv"), got, via_union, via_dense, strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, u, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n} vs union: {m}")
        torch.testing.assert_close(a, e, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n} vs dense: {m}")


def test_rows_empty_on_both_sides(rng):
    q, k, v = make_qkv(rng)
    index_a, index_b = index_of(vertical={50}), index_of(vertical={60})
    out_a, lse_a = sparse_attention(q, k, v, index_a)
    out_b, lse_b = sparse_attention(q, k, v, index_b)
    out, lse = merge_attention_outputs(out_a, lse_a, out_b, lse_b)

    assert torch.equal(out[:, :50], torch.zeros_like(out[:, :50]))
    assert torch.isneginf(lse[..., :50]).all()
    assert torch.isfinite(lse[..., 50:]).all()

    union = index_of(vertical={50, 60})
    ref_out, ref_lse = dense_attention(q, k, v, union.to_dense_mask(S))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(finite(lse).double(), finite(ref_lse), atol=2e-6, rtol=1e-6)

    g_out = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=rng, dtype=torch.float64)
    got = grads(out, lse, (q, k, v), g_out, g_lse)
    want = grads(ref_out, ref_lse, (q, k, v), g_out, g_lse)
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(a).any() and torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # Queries with nothing visible get no gradient.
    assert torch.equal(got[0][:, :50], torch.zeros_like(got[0][:, :50]))


def test_merge_with_all_empty_side_returns_other_side(rng):
    q, k, v = make_qkv(rng)
    # A side with some empty rows of its own (rows < 40 see only nothing).
    out_a, lse_a = sparse_attention(q, k, v, index_of(slash={1}, vertical={40}))
    assert torch.isneginf(lse_a).any() and torch.isfinite(lse_a).any()
    empty_out = torch.zeros_like(out_a)
    empty_lse = torch.full_like(lse_a, float("-inf"))
    for out, lse in (
        merge_attention_outputs(out_a, lse_a, empty_out, empty_lse),
        merge_attention_outputs(empty_out, empty_lse, out_a, lse_a),
    ):
        assert torch.equal(out, out_a)
        assert torch.equal(lse, lse_a)

    # The same on random (not attention-produced) inputs.
    out_r = torch.randn(B, S, HQ, D, generator=rng, dtype=torch.float64)
    lse_r = torch.randn(B, HQ, S, generator=rng, dtype=torch.float64).float() * 10
    out, lse = merge_attention_outputs(out_r, lse_r, torch.zeros_like(out_r), torch.full_like(lse_r, float("-inf")))
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r)


def test_merge_is_symmetric(rng):
    out_a = torch.randn(B, S, HQ, D, generator=rng, dtype=torch.float64)
    out_b = torch.randn(B, S, HQ, D, generator=rng, dtype=torch.float64)
    lse_a = (torch.randn(B, HQ, S, generator=rng) * 5).float()
    lse_b = (torch.randn(B, HQ, S, generator=rng) * 5).float()
    # Some rows empty on one side, some on both.
    lse_a[..., :10] = float("-inf")
    out_a[:, :10] = 0
    lse_b[..., 5:15] = float("-inf")
    out_b[:, 5:15] = 0
    out_ab, lse_ab = merge_attention_outputs(out_a, lse_a, out_b, lse_b)
    out_ba, lse_ba = merge_attention_outputs(out_b, lse_b, out_a, lse_a)
    torch.testing.assert_close(out_ab, out_ba, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_ab, lse_ba, atol=0, rtol=0)
    assert torch.isneginf(lse_ab[..., 5:10]).all() and torch.equal(out_ab[:, 5:10], torch.zeros_like(out_ab[:, 5:10]))

    # Against the formula in fp64.
    la, lb = lse_a.double(), lse_b.double()
    want_lse = torch.logaddexp(la, lb)
    wa = torch.exp(la - finite(want_lse)).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lb - finite(want_lse)).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(lse_ab.double(), want_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out_ab, wa * out_a + wb * out_b, atol=1e-5, rtol=0)


def test_mixed_dtype_bf16_out_fp32_lse(rng):
    out_a = torch.randn(B, S, HQ, D, generator=rng).bfloat16()
    out_b = torch.randn(B, S, HQ, D, generator=rng).bfloat16()
    lse_a = torch.randn(B, HQ, S, generator=rng) * 3
    lse_b = torch.randn(B, HQ, S, generator=rng) * 3
    out, lse = merge_attention_outputs(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == out_a.shape and lse.shape == lse_a.shape

    la, lb = lse_a.double(), lse_b.double()
    want_lse = torch.logaddexp(la, lb)
    wa = torch.exp(la - want_lse).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lb - want_lse).transpose(1, 2).unsqueeze(-1)
    want_out = wa * out_a.double() + wb * out_b.double()
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=1e-2)


def test_merge_gradient_through_bf16_outputs(rng):
    """Autograd reaches bf16 outs and fp32 lses without NaN on empty rows."""
    out_a = torch.randn(B, S, HQ, D, generator=rng).bfloat16()
    out_b = torch.randn(B, S, HQ, D, generator=rng).bfloat16()
    lse_a = torch.randn(B, HQ, S, generator=rng)
    lse_b = torch.randn(B, HQ, S, generator=rng)
    lse_a[..., :8] = float("-inf")
    lse_b[..., :8] = float("-inf")
    out_a[:, :8] = 0
    out_b[:, :8] = 0
    leaves = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_attention_outputs(*leaves)
    (out.float().sum() + finite(lse).sum()).backward()
    for t in leaves:
        assert t.grad is not None and t.grad.dtype == t.dtype
        assert torch.isfinite(t.grad).all()
