"""Independent ground truth: dense attention in float64 under an explicit boolean mask."""

import torch

from megatron_mtraining.sparse import DenseIndex, sparse_attention

# Relative tolerance of 16-bit attention against the fp64 reference.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def dense_attention(q, k, v, mask, softmax_scale=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D], mask [B, Hq, Sq, Sk] (True = attended).

    Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq]) in float64, differentiable; rows
    with no attended key give zeros and lse = -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(logits - safe.unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def finite(lse):
    """lse with -inf rows zeroed, for use inside a loss."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def make_inputs(rng, shape, dtype, device):
    b, s, hq, hkv, d = shape

    def t(h):
        return torch.randn(b, s, h, d, generator=rng).to(device, dtype).requires_grad_()

    return t(hq), t(hkv), t(hkv)


def assert_close_rel(got, want, tol, what):
    """max |got - want| <= tol * max(1, max |want|)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.1e} x {scale:.2f}"


def check_against_dense(q, k, v, scale, grads, rng, backend, lse_tol=1e-5):
    """``sparse_attention`` on a DenseIndex against fp64 dense attention: out, lse, and dq /
    dk / dv of a random loss on ``grads`` ("out", "lse" or both). The stand-in's LSE is fp64
    rounded to fp32, hence the default ``lse_tol``; ``backend`` as ``sparse_attention``'s."""
    index = DenseIndex(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    out, lse = sparse_attention(q, k, v, index, softmax_scale=scale, backend=backend)
    ref_out, ref_lse = dense_attention(q, k, v, index.to_dense_mask(q.shape[1]), softmax_scale=scale)
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert_close_rel(out, ref_out, tol, "out")
    assert_close_rel(lse, ref_lse, lse_tol, "lse")
    g_out = torch.randn(out.shape, generator=rng).to(q.device)
    g_lse = torch.randn(lse.shape, generator=rng).to(q.device)
    loss = (out.float() * g_out).sum() if "out" in grads else 0
    ref_loss = (ref_out * g_out.double()).sum() if "out" in grads else 0
    if "lse" in grads:
        loss = loss + (lse * g_lse).sum()
        ref_loss = ref_loss + (finite(ref_lse) * g_lse.double()).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    # An LSE alone does not depend on v: its reference gradient is then None.
    want = torch.autograd.grad(ref_loss, (q, k, v), allow_unused=True)
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == q.dtype and not a.isnan().any(), name
        assert_close_rel(a, torch.zeros_like(a) if e is None else e, 2 * tol, name)


def check_index_attention(q, k, v, index, rng, tol, backend=None, grads=("out", "lse")):
    """``sparse_attention`` under ``index`` against fp64 dense attention under the index's
    own mask: out, lse (empty rows -inf on both sides), and dq / dk / dv of a random loss on
    ``grads`` (the outputs it reads: "out", "lse" or both), within ``tol`` relative
    (gradients ``2 tol``); no NaN anywhere (kernel outputs may start poisoned). Returns
    (out, lse, (dq, dk, dv))."""
    out, lse = sparse_attention(q, k, v, index, backend=backend)
    ref_out, ref_lse = dense_attention(q, k, v, index.to_dense_mask(q.shape[1]).to(q.device))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close_rel(out, ref_out, tol, "out")
    assert_close_rel(finite(lse), finite(ref_lse), max(tol, 1e-5), "lse")
    g_out = torch.randn(out.shape, generator=rng).to(q.device)
    g_lse = torch.randn(lse.shape, generator=rng).to(q.device)
    # A term left out is not in the graph: a backward sees no gradient for that output at all.
    terms = {"out": ((out.float() * g_out).sum(), (ref_out * g_out.double()).sum())}
    terms["lse"] = ((finite(lse) * g_lse).sum(), (finite(ref_lse) * g_lse.double()).sum())
    got = torch.autograd.grad(sum(terms[name][0] for name in grads), (q, k, v))
    want = torch.autograd.grad(sum(terms[name][1] for name in grads), (q, k, v), allow_unused=True)
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not a.isnan().any(), f"{name} has NaN (unwritten?)"
        assert_close_rel(a, torch.zeros_like(a) if e is None else e, 2 * tol, name)
    return out, lse, got
