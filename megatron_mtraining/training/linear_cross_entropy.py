"""The output layer and cross entropy as one autograd function that computes the gradients in
its forward, chunk by chunk of rows, so the logits never exist whole and are never recomputed.

Per chunk of rows ``x`` (flattened ``[s, b]`` tokens): ``logits = x @ W^T`` in the input dtype,
each row's log-sum-exp (fp32) and target logit give the loss ``lse - logits[label]``; then
``dlogits = (softmax(logits) - onehot(label)) * mask`` overwrites the logits buffer, and the
two gradient GEMMs run at once: ``grad_x = dlogits @ W`` (kept in the input dtype) and
``grad_W += dlogits^T @ x`` (accumulated in fp32). The backward only scales what the forward
saved. Against Megatron's output layer and cross entropy under checkpointing (chunked_loss.py's
fallback) this drops the recomputed forward GEMM and the elementwise passes over fp32 logits.

The price is a contract on the incoming gradient. ``grad_W`` sums over tokens before the
backward knows each token's weight, so the function is exact only when the gradient reaching
the per-token losses is a scalar multiple of ``loss_mask`` (with ``loss_mask`` in {0, 1}):
``d L / d losses = c * loss_mask``. Megatron's loss function, ``sum(losses * loss_mask)``
scaled by scalars (token count, micro-batches, loss scale), and the plugin's ``loss_func``
satisfy it. The hidden-state gradient is exact per token for any incoming gradient where the
mask is 1 (each saved row already carries its mask); the weight gradient takes
``c = sum(g) / max(sum(loss_mask), 1)`` on the device, without a host synchronisation.

Row statistics and the in-place softmax gradient run as two Triton kernels on CUDA (one
program per row; plain Triton, so sm80 runs them) and as fp32 PyTorch on the CPU.
"""

from __future__ import annotations

import torch

from ..sparse.kernels import triton_available
from ..sparse.validation import fail

# Logits elements per chunk: with the logits in bf16, 2 GiB alive at a time. Each chunk's
# weight-gradient GEMM reads and writes the whole fp32 ``[V, h]`` sum, which at a
# 152K vocabulary costs as much as the GEMM's own work for chunks of ~1.8K rows.
CHUNK_ELEMENTS = 1 << 30
# Vocabulary columns per step of the kernels' loop over a row.
BLOCK_V = 4096
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ``addmm`` into an fp32 output from 16-bit operands (CUDA, recent PyTorch).
_ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _loss_row_stats_kernel(LOGITS, LABELS, LSE, LOSS, V, stride, BLOCK: tl.constexpr):
        """Per row: the log-sum-exp by an online max / sum-exp over blocks of the vocabulary
        (one read of the logits), and the loss ``lse - logits[label]`` (a label outside
        ``[0, V)`` counts as logit 0, as in Megatron's vocab-parallel cross entropy)."""
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride
        cols = tl.arange(0, BLOCK)
        peak = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        for start in range(0, V, BLOCK):
            ok = start + cols < V
            x = tl.load(base + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
            new_peak = tl.maximum(peak, tl.max(x, 0))
            total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), 0)
            peak = new_peak
        lse = peak + tl.log(total)
        label = tl.load(LABELS + row)
        valid = (label >= 0) & (label < V)
        target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
        tl.store(LSE + row, lse)
        tl.store(LOSS + row, lse - tl.where(valid, target, 0.0))

    @triton.jit
    def _loss_softmax_grad_kernel(LOGITS, LABELS, LSE, MASK, V, stride, BLOCK: tl.constexpr):
        """Overwrites a row of logits with ``(exp(l - lse) - onehot(label)) * mask``."""
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * stride
        cols = tl.arange(0, BLOCK)
        lse = tl.load(LSE + row)
        label = tl.load(LABELS + row)
        weight = tl.load(MASK + row)
        for start in range(0, V, BLOCK):
            c = start + cols
            ok = c < V
            x = tl.load(base + c, mask=ok, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(c == label, p - 1.0, p) * weight
            tl.store(base + c, p.to(LOGITS.dtype.element_ty), mask=ok)


def use_kernels(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels compute a chunk's row statistics and softmax gradient (the
    tests force them on the CPU under Triton's interpreter)."""
    return logits.is_cuda and triton_available()


def row_stats_triton(logits, labels, losses, block: int = BLOCK_V) -> torch.Tensor:
    """Writes each row's loss into ``losses`` (fp32 ``[n]``); returns the rows' fp32 LSE."""
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _loss_row_stats_kernel[(rows,)](logits, labels, lse, losses, vocab, logits.stride(0), BLOCK=block, num_warps=8)
    return lse


def softmax_grad_triton_(logits, labels, lse, mask, block: int = BLOCK_V) -> None:
    rows, vocab = logits.shape
    _loss_softmax_grad_kernel[(rows,)](logits, labels, lse, mask, vocab, logits.stride(0), BLOCK=block, num_warps=8)


def row_stats_torch(logits, labels, losses) -> torch.Tensor:
    """:func:`row_stats_triton` in fp32 PyTorch."""
    vocab = logits.shape[1]
    values = logits.float()
    lse = torch.logsumexp(values, dim=1)
    valid = (labels >= 0) & (labels < vocab)
    target = values.gather(1, labels.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
    torch.sub(lse, torch.where(valid, target, 0.0), out=losses)
    return lse


def softmax_grad_torch_(logits, labels, lse, mask) -> None:
    """:func:`softmax_grad_triton_` in fp32 PyTorch."""
    vocab = logits.shape[1]
    grad = torch.exp(logits.float() - lse.unsqueeze(1))
    valid = (labels >= 0) & (labels < vocab)
    grad.scatter_add_(1, labels.clamp(0, vocab - 1).unsqueeze(1), -valid.to(grad.dtype).unsqueeze(1))
    grad.mul_(mask.unsqueeze(1))
    logits.copy_(grad)


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in the input dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda and _ADDMM_OUT_DTYPE:
        # cuBLAS accumulates the 16-bit product into the fp32 sum: no 16-bit partial rounds it.
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif acc.is_cuda:
        # Older PyTorch: each chunk's partial sum is rounded to 16 bits once, as Megatron's own
        # 16-bit weight gradient is, and the partials add up in fp32.
        acc.add_(torch.mm(a, b))
    else:
        acc.addmm_(a.float(), b.float())


def _chunks(hidden, weight, labels, mask, chunk_rows, want_x: bool, want_w: bool):
    """Per-token losses (fp32 ``[n]``) of flattened rows, and, as asked, ``grad_x`` (input
    dtype ``[n, h]``) and ``grad_W`` (fp32 ``[V, h]``) of ``sum(losses * mask)``."""
    n, h = hidden.shape
    vocab = weight.shape[0]
    rows = max(1, min(n, chunk_rows))
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_x = torch.empty_like(hidden) if want_x else None
    grad_w = torch.zeros(vocab, h, dtype=torch.float32, device=hidden.device) if want_w else None
    # One buffer for every chunk: the last, shorter chunk takes its leading rows.
    buffer = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    kernels = use_kernels(buffer)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        x, chunk_labels = hidden[r0:r1], labels[r0:r1]
        logits = torch.mm(x, weight.t(), out=buffer[: r1 - r0])
        if kernels:
            lse = row_stats_triton(logits, chunk_labels, losses[r0:r1])
        else:
            lse = row_stats_torch(logits, chunk_labels, losses[r0:r1])
        if not (want_x or want_w):
            continue
        if kernels:
            softmax_grad_triton_(logits, chunk_labels, lse, mask[r0:r1])
        else:
            softmax_grad_torch_(logits, chunk_labels, lse, mask[r0:r1])
        if want_x:
            torch.mm(logits, weight, out=grad_x[r0:r1])
        if want_w:
            _accumulate_fp32(grad_w, logits.t(), x)
    return losses, grad_x, grad_w


def chunk_rows_for(vocab: int) -> int:
    """Rows per chunk that keep a chunk's logits within ``CHUNK_ELEMENTS``."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _losses(hidden, weight, labels, loss_mask, chunk_rows, want_x: bool, want_w: bool):
    """:func:`_chunks` on ``[s, b]`` inputs: losses ``[b, s]``, ``grad_x`` ``[s b, h]`` and
    ``grad_W`` as asked, and the mask's sum (the weight gradient's token count)."""
    s, b, h = hidden.shape
    mask = loss_mask.t().reshape(s * b).to(torch.float32)
    losses, grad_x, grad_w = _chunks(
        hidden.reshape(s * b, h),
        weight,
        labels.t().reshape(s * b).to(torch.int64),
        mask,
        chunk_rows or chunk_rows_for(weight.shape[0]),
        want_x,
        want_w,
    )
    return losses.view(s, b).t().contiguous(), grad_x, grad_w, mask.sum()


class LinearCrossEntropy(torch.autograd.Function):
    """``losses [b, s]`` (fp32) of ``hidden [s, b, h]`` through ``weight [V, h]`` against
    ``labels [b, s]``; see the module docstring for the gradient contract with ``loss_mask``.
    The backward runs once: it scales the saved gradients in place."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, chunk_rows=None):
        want_x, want_w = ctx.needs_input_grad[:2]
        losses, ctx.grad_x, ctx.grad_w, ctx.mask_sum = _losses(
            hidden, weight, labels, loss_mask, chunk_rows, want_x, want_w
        )
        ctx.shape, ctx.weight_dtype = hidden.shape[:2], weight.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        if ctx.shape is None:
            raise RuntimeError(
                "LinearCrossEntropy's backward ran a second time: it scales the gradients its "
                "forward saved in place, so it supports one backward (retain_graph=False)"
            )
        s, b = ctx.shape
        per_row = grad_losses.t().reshape(s * b, 1).float()
        grad_hidden = grad_weight = None
        if ctx.grad_x is not None:
            grad_hidden = ctx.grad_x.mul_(per_row).view(s, b, -1)
        if ctx.grad_w is not None:
            scale = per_row.sum() / ctx.mask_sum.clamp(min=1)
            grad_weight = ctx.grad_w.mul_(scale).to(ctx.weight_dtype)
        ctx.grad_x = ctx.grad_w = ctx.shape = None
        return grad_hidden, grad_weight, None, None, None


def _check(hidden, weight, labels, loss_mask, chunk_rows) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            fail(name, type(t).__name__, "a torch.Tensor")
    if hidden.dim() != 3:
        fail("hidden.shape", tuple(hidden.shape), "[s, b, h]")
    s, b, h = hidden.shape
    if hidden.dtype not in INPUT_DTYPES:
        fail("hidden.dtype", hidden.dtype, f"one of {', '.join(map(str, INPUT_DTYPES))}")
    if weight.dim() != 2 or weight.shape[1] != h:
        fail("weight.shape", tuple(weight.shape), f"[V, {h}] (hidden's last dimension)")
    if weight.dtype != hidden.dtype:
        fail("weight.dtype", weight.dtype, f"hidden's dtype {hidden.dtype}")
    if tuple(labels.shape) != (b, s):
        fail("labels.shape", tuple(labels.shape), f"[b, s] = {[b, s]} (hidden is [s, b, h])")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        fail("labels.dtype", labels.dtype, "an integer dtype")
    if tuple(loss_mask.shape) != (b, s):
        fail("loss_mask.shape", tuple(loss_mask.shape), f"[b, s] = {[b, s]} (hidden is [s, b, h])")
    for name, t in (("weight", weight), ("labels", labels), ("loss_mask", loss_mask)):
        if t.device != hidden.device:
            fail(f"{name}.device", t.device, f"hidden's device {hidden.device}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1):
        fail("chunk_rows", chunk_rows, "None or an integer >= 1")


def linear_cross_entropy(hidden, weight, labels, loss_mask, *, chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token cross entropy ``[b, s]`` (fp32) of the logits ``hidden @ weight^T``
    (``hidden [s, b, h]``, ``weight [V, h]``, ``labels [b, s]``, ``loss_mask [b, s]`` in
    {0, 1}), as :class:`LinearCrossEntropy`; ``chunk_rows`` tokens per chunk (default: as
    many as keep a chunk's logits within ``CHUNK_ELEMENTS``). Without autograd (no grad mode,
    or neither input requires a gradient) only the losses are computed."""
    _check(hidden, weight, labels, loss_mask, chunk_rows)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, labels, loss_mask, chunk_rows)
    return _losses(hidden, weight, labels, loss_mask, chunk_rows, False, False)[0]
