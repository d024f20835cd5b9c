"""Public attention entry points: ``sparse_attention`` and ``merge_attention_outputs``."""

from __future__ import annotations

import os

import torch

from .index import BlockTopKIndex, SparseIndex
from .kernels import triton_available
from .kernels.block_bar.tables import TileTables, tile_tables
from .kernels.dense_backends import flash_attn, sdpa
from .reference import ReferenceSparseAttention, combine
from .validation import check_qkv, check_softmax_scale, check_tensor, fail

BACKENDS = ("auto", "reference", "triton", "flash_attn", "sdpa")
BACKEND_ENV = "MTRAINING_ATTENTION_BACKEND"


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal softmax attention restricted to ``index``.

    q ``[B, S, Hq, D]``, k and v ``[B, S, Hkv, D]`` (Hq a multiple of Hkv). Returns
    ``out [B, S, Hq, D]`` in q's dtype and ``lse [B, Hq, S]`` float32. A row with no
    visible key gives zeros and ``lse = -inf``. Differentiable in q, k, v (and
    through ``lse``).

    ``backend``: ``"auto"`` (default; for a ``DenseIndex`` on CUDA fp16/bf16 inputs
    flash-attn where it is installed, else PyTorch's fused attention, see
    ``dense_backend``; else Triton kernels for CUDA tensors in fp16, bf16 or fp32 with head
    dim <= 256, else the PyTorch reference), ``"reference"``, ``"triton"``,
    ``"flash_attn"`` or ``"sdpa"`` (PyTorch's fused attention: cuDNN on Hopper,
    FlashAttention-2 on Ampere; also on a CPU). The environment variable
    ``MTRAINING_ATTENTION_BACKEND`` sets the default, e.g. ``reference`` to rule the
    kernels out while debugging.
    """
    check_qkv(q, k, v)
    if not isinstance(index, SparseIndex):
        fail("index", type(index).__name__, "a sparse index (DenseIndex, VerticalSlashIndex, BlockTopKIndex)")
    b, s, hq, d = q.shape
    index.check_compatible(b, hq, s, k.shape[2], q.device)
    scale = check_softmax_scale(softmax_scale, d)
    dense = dense_backend(q, index, backend)
    if dense == "flash_attn":
        return flash_attn.FlashAttention.apply(q, k, v, scale)
    if dense == "sdpa":
        return sdpa.SDPAAttention.apply(q, k, v, scale)
    if kv_outer_preferred(index) and backend_choice(q, backend) == "triton":
        from .kernels.kv_outer.attention import KVOuterAttention  # imports Triton

        return KVOuterAttention.apply(q, k, v, index, scale)
    tables = _tile_tables(q, index, backend)
    if tables is None:
        return ReferenceSparseAttention.apply(q, k, v, index, scale)
    from .kernels.block_bar.attention import TritonBlockBarAttention  # imports Triton

    return TritonBlockBarAttention.apply(q, k, v, tables, scale)


# The loop order of a top-k index on the kernels, by measurement (H100, Qwen2.5-3B attention,
# docs/benchmarks.md): KV-outer programs compute only the rows that chose their key block,
# but stream the queries in chunks whose fixed cost is paid per chunk; the query-major
# union-of-tiles kernels compute every row of a query block against the union of its rows'
# blocks. KV-outer wins where the selections are a small share of the keys; the union where
# they are not, and for MoBA's wide chunks, whose rows of a query block mostly agree. The
# thresholds sit between the measured crossovers (docs/benchmarks.md, "KV-outer kernels for
# top-k indexes" and "Kernels at 256K on one H100"): MSA's 128-token blocks at k=16 ran
# faster on KV-outer at 128K and 64K, not at 32K; MoBA's 4096-token chunks at k=12 at 256K,
# not at 128K.
KV_OUTER_MAX_BLOCK = 128
KV_OUTER_MAX_SHARE = 1 / 16  # blocks of at most KV_OUTER_MAX_BLOCK tokens
KV_OUTER_MAX_SHARE_WIDE = 1 / 4  # wider blocks


def kv_outer_preferred(index: SparseIndex) -> bool:
    """Whether a top-k ``index`` runs on the KV-outer kernels rather than the union of tiles:
    each query selecting under ``KV_OUTER_MAX_SHARE`` of the sequence in blocks of at most
    ``KV_OUTER_MAX_BLOCK`` tokens, or under ``KV_OUTER_MAX_SHARE_WIDE`` in wider blocks
    (the union's waste grows as the selections spread)."""
    if not isinstance(index, BlockTopKIndex):
        return False
    share = index.blocks.shape[-1] * index.block_size / index.seq_len
    return share < (KV_OUTER_MAX_SHARE if index.block_size <= KV_OUTER_MAX_BLOCK else KV_OUTER_MAX_SHARE_WIDE)


def backend_choice(q: torch.Tensor, backend: str | None = None) -> str:
    """``"triton"`` when the kernels run this call, else ``"reference"`` (``backend``, else
    ``MTRAINING_ATTENTION_BACKEND``, else ``auto``: kernels for CUDA inputs they serve).
    ``flash_attn`` and ``sdpa`` count as ``auto`` here: they compute whole dense attention
    only (``dense_backend``), so what else a run needs (index statistics, merges, the steps
    of a context-parallel ring) goes where ``auto`` sends it."""
    choice = _backend_setting(backend)
    # The kernels address elements with int32 offsets (2^31 elements: 1M tokens x 16 heads x 128).
    kernel_ok = (
        triton_available()
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.shape[-1] <= 256
        and q.numel() < 2**31
    )
    if choice == "triton" and not kernel_ok:
        fail(
            "backend",
            "triton",
            f"inputs the kernels serve (fp16/bf16/fp32, head dim <= 256, fewer than 2^31 elements, Triton "
            f"installed), got {q.dtype}, head dim {q.shape[-1]}, {q.numel()} elements; split longer sequences "
            "with context parallelism",
        )
    if choice in ("auto", "flash_attn", "sdpa"):
        choice = "triton" if q.is_cuda and kernel_ok else "reference"
    return choice


def dense_backend(q: torch.Tensor, index: SparseIndex, backend: str | None = None) -> str | None:
    """The library that computes ``sparse_attention(q, k, v, index)`` as whole causal
    attention: ``"flash_attn"``, ``"sdpa"``, or None when the index goes to the plugin's
    kernels or the reference. Under ``auto``, for CUDA inputs: flash-attn where it serves
    the call (``flash_attn.unsupported``), else PyTorch's fused attention where it
    does (``sdpa.unsupported``); never under ``reference`` or ``triton``. Asking for
    ``flash_attn`` or ``sdpa`` where it cannot run is a ``ValueError`` that names the reason."""
    choice = _backend_setting(backend)
    name = "backend" if backend else BACKEND_ENV
    if choice == "flash_attn":
        why_not = flash_attn.unsupported(q, index)
        if why_not is not None:
            fail(name, choice, f"{flash_attn.REQUIREMENTS}; {why_not}")
        return choice
    if choice == "sdpa":
        why_not = sdpa.unsupported(q, index)
        if why_not is not None:
            fail(name, choice, f"{sdpa.REQUIREMENTS}; {why_not}")
        return choice
    if choice != "auto":
        return None
    if flash_attn.unsupported(q, index) is None:
        return "flash_attn"
    return "sdpa" if q.is_cuda and sdpa.unsupported(q, index) is None else None


def _backend_setting(backend: str | None) -> str:
    choice = backend or os.environ.get(BACKEND_ENV) or "auto"
    if choice not in BACKENDS:
        fail("backend" if backend else BACKEND_ENV, choice, f"one of {', '.join(BACKENDS)}")
    return choice


def index_kernels(t: torch.Tensor) -> bool:
    """Whether the index builders' Triton kernels (top-p selection) serve ``t``: CUDA, Triton
    installed, and ``MTRAINING_ATTENTION_BACKEND`` not ``reference``."""
    return _backend_setting(None) != "reference" and t.is_cuda and triton_available()


def _tile_tables(q: torch.Tensor, index: SparseIndex, backend: str | None) -> TileTables | None:
    """The tile tables when the Triton backend runs this call, else None."""
    if backend_choice(q, backend) == "reference":
        return None
    tables = tile_tables(index)
    if tables is None and (backend or os.environ.get(BACKEND_ENV)) == "triton":
        fail("backend", "triton", f"an index type the kernels serve, got {type(index).__name__}")
    return tables


def merge_attention_outputs(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines attention over two disjoint key sets into attention over their union.

    ``out_*`` ``[B, S, H, D]``, ``lse_*`` ``[B, H, S]``; ``lse = log(e^lse_a + e^lse_b)``,
    ``out = w_a out_a + w_b out_b`` with ``w_i = e^(lse_i - lse)``. Rows empty on both
    sides stay zero with ``lse = -inf``; no NaN appears in values or gradients.
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(name, t, ndim=4)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, t, ndim=3)
    if out_b.shape != out_a.shape:
        fail("out_b.shape", tuple(out_b.shape), f"the shape of out_a {tuple(out_a.shape)}")
    bsz, seq, heads, _ = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != (bsz, heads, seq):
            fail(f"{name}.shape", tuple(t.shape), f"[B, H, S] = {[bsz, heads, seq]} to match out_a")
    if backend_choice(out_a) == "triton":
        # One fused pass instead of ``combine``'s ~8 elementwise passes and their autograd graph.
        from .kernels.shared.combine import FusedCombine  # imports Triton

        out, lse = FusedCombine.apply(out_a, lse_a.float(), out_b, lse_b.float())
    else:
        out, lse = combine(out_a, lse_a.float(), out_b, lse_b.float())
    return out.to(out_a.dtype), lse.float()
