"""The varlen attention calls ``varlen_blocks`` is built of: ``forward`` gives each row's output
and LSE over its segment's keys; ``backward`` the gradients given an output and an LSE chosen by
the caller (the merged ones, see ``attention``).

Rows ``[Tq, Hq, D]`` and keys ``[Tk, Hkv, D]`` are cut into segments by ``cu_q`` / ``cu_k``
(int32, ``[n + 1]``, flash-attn's varlen convention); segment ``i``'s rows attend its keys, all
of them or causally (bottom-right aligned, FlashAttention's varlen convention; the caller's
causal segments have as many rows as keys). Query head ``h`` reads KV head ``h // (Hq / Hkv)``.
The LSE is ``[Hq, Tq]``.

* ``FlashVarlen``: PyTorch's FlashAttention-2, ``aten::_flash_attention_forward`` /
  ``_flash_attention_backward``, CUDA sm80 and sm90. ``torch.nn.attention.varlen.varlen_attn``
  calls the same ops, but its backward differentiates its own output with its own LSE, where a
  key block's piece must be differentiated with its rows' merged output and LSE, and its keywords
  changed between releases (``is_causal`` / ``window_size``, ``enable_gqa``).
* ``CudnnVarlen`` (``cudnn_library``): cuDNN's ragged attention through NVIDIA's cudnn-frontend
  (the optional ``cudnn`` extra), on sm90, where it runs near cuDNN's dense rate and
  FlashAttention-2 at about half of it. PyTorch's own ragged cuDNN ops
  (``aten::_cudnn_attention_forward`` with ``cum_seq_q``) are not used: before torch 2.14 their
  backward sizes dQ's accumulator wrongly and their graphs are rebuilt on every call.
* ``ReferenceVarlen``: the same calls in PyTorch, any device and dtype, a segment at a time: the
  stand-in that lets the gathering, merging and gradient logic run (and be tested) on a CPU.

Which one runs is ``choose``'s decision.
"""

from __future__ import annotations

import functools

import torch

from ...reference import compute_dtype, finite_or_zero

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)
# The ops as PyTorch has had them since 2.7 (rng_state / unused replaced philox_seed /
# philox_offset), to the keyword this module passes; later releases add optional keywords.
FORWARD_SCHEMA = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
    "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None) "
    "-> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)"
)
BACKWARD_SCHEMA = (
    "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
    "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None) -> (Tensor, Tensor, Tensor)"
)


@functools.cache
def missing_ops() -> str | None:
    """Why this PyTorch lacks the FlashAttention-2 ops as ``FlashVarlen`` calls them, or None."""
    for name, wanted in (("_flash_attention_forward", FORWARD_SCHEMA), ("_flash_attention_backward", BACKWARD_SCHEMA)):
        op = getattr(torch.ops.aten, name, None)
        if op is None:
            return f"torch {torch.__version__} has no aten::{name}"
        if not op.default._schema.is_backward_compatible_with(torch._C.parse_schema(wanted)):
            return f"torch {torch.__version__}'s aten::{name} is `{op.default._schema}`, not `{wanted}`"
    return None


def unsupported_inputs(q: torch.Tensor) -> str | None:
    """Why no GPU library of the varlen calls (FlashAttention-2's, cuDNN's: both fp16/bf16,
    head dims a multiple of 8 up to 256) takes inputs like ``q``, or None."""
    if not q.is_cuda:
        return f"got inputs on {q.device}"
    if q.dtype not in DTYPES:
        return f"got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
        return f"got head dim {q.shape[-1]}"
    return None


def unsupported(q: torch.Tensor) -> str | None:
    """Why ``FlashVarlen`` cannot run on inputs like ``q``, or None."""
    why_not = unsupported_inputs(q)
    if why_not is not None:
        return why_not
    if torch.cuda.get_device_capability(q.device) < MIN_CAPABILITY:
        return f"got a GPU of compute capability {torch.cuda.get_device_capability(q.device)}, below sm80"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this PyTorch was built without FlashAttention"
    return missing_ops()


class FlashVarlen:
    """PyTorch's FlashAttention-2 varlen kernels. Inputs fp16/bf16 with unit last stride, the
    output in their dtype, the LSE fp32; the backward's dQ is accumulated in fp32 inside the op.
    Under torch's deterministic mode PyTorch runs its deterministic backward."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )[:2]
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"aten::_flash_attention_forward of torch {torch.__version__} returned an LSE of shape "
                f"{tuple(lse.shape)}; varlen_blocks reads it as [heads, rows] = {[q.shape[1], q.shape[0]]}"
            )
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        # With no dropout the random state is not read; these are what varlen_attn passes too.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
        )


class ReferenceVarlen:
    """``FlashVarlen``'s calls in PyTorch, a segment at a time (the bounds read on the host):
    softmax attention in the compute dtype (fp32, fp64 for fp64 inputs), the output in q's
    dtype as the library gives it, the LSE in the compute dtype. A row whose LSE is +inf
    gets no gradient, as in the library (its probabilities are 0)."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        dt = compute_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=dt, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dt, device=q.device)
        for rows, keys in _segments(cu_q, cu_k):
            logits = _logits(q[rows], k[keys], scale, causal)  # [H, r, n]
            seg_lse = torch.logsumexp(logits, -1)
            p = torch.exp(logits - finite_or_zero(seg_lse).unsqueeze(-1))
            out[rows] = torch.einsum("hrn,nhd->rhd", p, _heads(v[keys], q.shape[1]).to(dt))
            lse[:, rows] = seg_lse
        return out.to(q.dtype), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        dt = compute_dtype(q.dtype)
        hq, hkv = q.shape[1], k.shape[1]
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)
        for rows, keys in _segments(cu_q, cu_k):
            qs, ks, vs = q[rows].to(dt), _heads(k[keys], hq).to(dt), _heads(v[keys], hq).to(dt)
            do = dout[rows].to(dt)
            p = torch.exp(_logits(qs, ks, scale, causal) - lse[:, rows].to(dt).unsqueeze(-1))
            delta = (do * out[rows].to(dt)).sum(-1).T  # [H, r]
            ds = p * (torch.einsum("rhd,nhd->hrn", do, vs) - delta.unsqueeze(-1))
            dq[rows] = torch.einsum("hrn,nhd->rhd", ds, ks) * scale
            # A KV head's gradient is the sum over its group's query heads.
            dk[keys] = torch.einsum("hrn,rhd->nhd", ds, qs).unflatten(1, (hkv, -1)).sum(2) * scale
            dv[keys] = torch.einsum("hrn,rhd->nhd", p, do).unflatten(1, (hkv, -1)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(rows, keys) slices of each segment with rows."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i]:
            yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])


def _heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """KV rows ``[n, Hkv, D]`` repeated for the query heads that read them, ``[n, Hq, D]``."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``[H, r, n]`` scaled scores of a segment's rows against its keys, in the compute dtype;
    with ``causal``, row ``t`` sees keys up to ``t + n - r``."""
    dt = compute_dtype(q.dtype)
    logits = torch.einsum("rhd,nhd->hrn", q.to(dt), _heads(k, q.shape[1]).to(dt)) * scale
    if causal:
        r, n = logits.shape[1:]
        seen = torch.arange(n, device=q.device).view(1, -1) <= torch.arange(r, device=q.device).view(-1, 1) + n - r
        logits = logits.masked_fill(~seen, float("-inf"))
    return logits
