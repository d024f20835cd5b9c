"""The fused linear + cross entropy (``training/linear_cross_entropy.py``) against an fp64
reference: per-token losses, and the gradients of hidden states and weight for a loss
``c * sum(losses * mask)``, chunk sizes that do not divide the rows; and its Triton kernels
(in Triton's interpreter on a CPU) against the PyTorch path."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_mtraining.training import linear_cross_entropy as lce

HIDDEN, VOCAB = 32, 300
CHUNK = 10  # tokens per chunk: divides neither 37 nor 74 rows

needs_kernels = pytest.mark.skipif(
    lce.triton is None or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton on CUDA or TRITON_INTERPRET=1",
)


def make_inputs(rng, seq, batch, dtype, device, vocab=VOCAB):
    hidden = torch.randn(seq, batch, HIDDEN, generator=rng).to(dtype)
    # Logits of a few units, so the softmax is far from uniform and from one-hot.
    weight = (torch.randn(vocab, HIDDEN, generator=rng) * 0.4).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=rng)
    mask = (torch.rand(batch, seq, generator=rng) > 0.3).float()
    mask[0, :3] = 0.0  # zeros for certain, whatever the draw
    sign = 1 if torch.rand((), generator=rng) > 0.5 else -1
    scale = sign * float(torch.empty(()).uniform_(0.5, 3.0, generator=rng))
    return [t.to(device) for t in (hidden, weight, labels, mask)] + [scale]


def reference(hidden, weight, labels, mask, scale):
    """fp64 losses [b, s] and the gradients of ``scale * sum(losses * mask)``."""
    x = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    s, b, _ = x.shape
    logits = x @ w.t()
    losses = F.cross_entropy(logits.reshape(s * b, -1), labels.t().reshape(-1), reduction="none").view(s, b).t()
    ((losses * mask.double()).sum() * scale).backward()
    return losses.detach(), x.grad, w.grad


def fused(hidden, weight, labels, mask, scale, **kwargs):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    losses = lce.linear_cross_entropy(x, w, labels, mask, **kwargs)
    ((losses * mask).sum() * scale).backward()
    return losses.detach(), x.grad, w.grad


def assert_near(got, want, rel, name):
    """Max error within ``rel`` of the reference's largest magnitude: a row, label or mask
    out of place is off by about the values themselves."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.double() - want.double().to(got.device)).abs().max().item()
    size = want.abs().max().item()
    assert err <= rel * size, f"{name}: max error {err:.3g} > {rel} x {size:.3g}"


TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
def test_matches_fp64_reference(dtype, batch, rng, device):
    inputs = make_inputs(rng, 37, batch, dtype, device)
    losses, grad_x, grad_w = fused(*inputs, chunk_rows=CHUNK)
    ref_losses, ref_x, ref_w = reference(*inputs)
    assert losses.dtype == torch.float32 and grad_x.dtype == dtype and grad_w.dtype == dtype
    tol = TOLERANCES[dtype]
    assert_near(losses, ref_losses, tol, "losses")
    assert_near(grad_x, ref_x, tol, "grad hidden")
    assert_near(grad_w, ref_w, tol, "grad weight")
    # Masked tokens get no hidden-state gradient.
    masked = (inputs[3] == 0).t()
    assert grad_x[masked].abs().max() == 0


def test_one_chunk_equals_many(rng, device):
    inputs = make_inputs(rng, 37, 2, torch.float32, device)
    whole = fused(*inputs)
    chunked = fused(*inputs, chunk_rows=CHUNK)
    # Chunks sum the weight gradient in another order, so entries that cancel to near zero
    # differ by more than an elementwise rtol allows: the bound is relative to the largest.
    for got, want, name in zip(chunked, whole, ("losses", "grad hidden", "grad weight"), strict=True):
        assert_near(got, want, 1e-5, name)


def test_no_grad_computes_losses_only(rng, device):
    hidden, weight, labels, mask, scale = make_inputs(rng, 37, 2, torch.float32, device)
    with torch.no_grad():
        losses = lce.linear_cross_entropy(hidden.requires_grad_(), weight, labels, mask, chunk_rows=CHUNK)
    assert losses.grad_fn is None
    assert_near(losses, reference(hidden, weight, labels, mask, scale)[0], 1e-5, "losses")


def test_only_the_weight_needs_a_gradient(rng, device):
    hidden, weight, labels, mask, scale = make_inputs(rng, 37, 2, torch.float32, device)
    w = weight.clone().requires_grad_()
    losses = lce.linear_cross_entropy(hidden, w, labels, mask, chunk_rows=CHUNK)
    ((losses * mask).sum() * scale).backward()
    assert_near(w.grad, reference(hidden, weight, labels, mask, scale)[2], 1e-5, "grad weight")


def test_a_second_backward_fails(rng):
    hidden, weight, labels, mask, _ = make_inputs(rng, 8, 2, torch.float32, "cpu")
    losses = lce.linear_cross_entropy(hidden.requires_grad_(), weight, labels, mask)
    total = losses.sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        total.backward()


def test_labels_outside_the_vocabulary_count_as_logit_zero(rng):
    # Megatron's vocab-parallel cross entropy takes a label outside the rank's range as logit 0.
    hidden, weight, labels, mask, _ = make_inputs(rng, 6, 1, torch.float32, "cpu")
    labels[0, 1], labels[0, 4] = -1, VOCAB
    losses = lce.linear_cross_entropy(hidden, weight, labels, mask)
    lse = torch.logsumexp(hidden[:, 0].double() @ weight.double().t(), dim=1)
    torch.testing.assert_close(losses[0, [1, 4]].double(), lse[[1, 4]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(hidden=a["hidden"][0]), r"hidden\.shape"),
        (lambda a: a.update(hidden=a["hidden"].double()), r"hidden\.dtype"),
        (lambda a: a.update(weight=a["weight"][:, :5]), r"weight\.shape"),
        (lambda a: a.update(weight=a["weight"].half()), r"weight\.dtype"),
        (lambda a: a.update(labels=a["labels"].t()), r"labels\.shape"),
        (lambda a: a.update(labels=a["labels"].float()), r"labels\.dtype"),
        (lambda a: a.update(loss_mask=a["loss_mask"][:, :2]), r"loss_mask\.shape"),
        (lambda a: a.update(chunk_rows=0), r"chunk_rows"),
    ],
)
def test_bad_inputs_name_the_argument(change, message, rng):
    hidden, weight, labels, mask, _ = make_inputs(rng, 6, 2, torch.float32, "cpu")
    args = {"hidden": hidden, "weight": weight, "labels": labels, "loss_mask": mask, "chunk_rows": None}
    change(args)
    with pytest.raises(ValueError, match=message):
        lce.linear_cross_entropy(
            args.pop("hidden"), args.pop("weight"), args.pop("labels"), args.pop("loss_mask"), **args
        )


# The Triton kernels. The interpreter's bf16 is broken, so fp16 and fp32 there.
KERNEL_DTYPES = [torch.float16, torch.float32]
KERNEL_VOCAB = 1000
KERNEL_BLOCK = 256  # four blocks a row, the last one partial


def kernel_inputs(rng, dtype, device, rows=7):
    logits = (torch.randn(rows, KERNEL_VOCAB, generator=rng) * 3).to(dtype).to(device)
    labels = torch.randint(0, KERNEL_VOCAB, (rows,), generator=rng)
    labels[0], labels[1], labels[2] = -1, KERNEL_VOCAB, KERNEL_VOCAB - 1  # outside, outside, last column
    mask = (torch.rand(rows, generator=rng) > 0.3).float()
    mask[:3], mask[3] = 1.0, 0.0
    return logits, labels.to(device), mask.to(device)


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernels_match_the_pytorch_path(dtype, rng, kdevice):
    logits, labels, mask = kernel_inputs(rng, dtype, kdevice)
    rows = logits.shape[0]
    losses = torch.full((rows,), float("nan"), device=kdevice)
    ref_losses = torch.empty(rows, device=kdevice)
    lse = lce.row_stats_triton(logits, labels, losses, block=KERNEL_BLOCK)
    ref_lse = lce.row_stats_torch(logits, labels, ref_losses)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-5)
    grad, ref_grad = logits.clone(), logits.clone()
    lce.softmax_grad_triton_(grad, labels, lse, mask, block=KERNEL_BLOCK)
    lce.softmax_grad_torch_(ref_grad, labels, ref_lse, mask)
    atol = 1e-3 if dtype == torch.float16 else 1e-6  # one fp16 rounding of values up to 1
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=atol)
    assert grad[3].abs().max() == 0  # the masked row
    assert (grad[2, -1].float() < 0) and (grad[0].float() >= 0).all()  # a label's -1; none outside


@needs_kernels
def test_fused_function_with_kernels_matches_fp64(rng, kdevice, monkeypatch):
    monkeypatch.setattr(lce, "use_kernels", lambda logits: True)
    inputs = make_inputs(rng, 13, 2, torch.float32, kdevice)
    losses, grad_x, grad_w = fused(*inputs, chunk_rows=CHUNK)
    ref_losses, ref_x, ref_w = reference(*inputs)
    assert_near(losses, ref_losses, 1e-5, "losses")
    assert_near(grad_x, ref_x, 1e-5, "grad hidden")
    assert_near(grad_w, ref_w, 1e-5, "grad weight")
