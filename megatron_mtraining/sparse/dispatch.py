"""Which implementation runs a call, and why: the one place that decides.

An attention call goes to one of :data:`KERNELS`:

* ``flash_attn`` / ``sdpa``: another library's whole causal attention (flash-attn 2 where it
  is installed, else PyTorch's fused attention: cuDNN on sm90+, FlashAttention-2 on sm80). Only
  a ``DenseIndex`` over the whole sequence on one device, in fp16/bf16, without packed
  documents: these libraries take no index, no key positions, no document bounds and no
  running result. Not ``sdpa`` under torch's deterministic
  mode (Megatron's ``deterministic_mode``): its backward is not bitwise reproducible.
* ``varlen_blocks``: a top-k index of wide blocks (MoBA's chunks) a key block at a time on a
  varlen attention library (``kernels/varlen_blocks``): each block's own rows causally, then per
  selection slot the rows that chose each earlier block against its keys, merged by LSE
  (:func:`varlen_blocks_preferred`). Not under torch's deterministic mode, and not with packed
  documents. The library is ``varlen_blocks.choose.choice``'s, named in the reason: cuDNN's
  ragged attention (cudnn-frontend, sm90) where it serves the call, else PyTorch's
  FlashAttention-2 (sm80, or no cudnn-frontend); ``MTRAINING_VARLEN_LIBRARY`` forces either.
* ``kv_outer``: the Triton KV-outer kernels (``kernels/kv_outer``), for a top-k index whose
  queries select a small share of the keys (:func:`kv_outer_preferred`), without packed
  documents (they take no document bounds; ``block_bar`` masks rows by their document start).
* ``block_bar``: the Triton query-major tile + bar kernels (``kernels/block_bar``), for every
  index type. The only kernels that take keys at arbitrary global positions and add into an
  fp32 running result, which a piece of a context-parallel rank's attention (a ring step, the
  vertical-column pass, the all-gathered K/V) needs; so every piece on the kernels runs here,
  top-k indices included (the KV-outer kernels would need both).
* ``reference``: the PyTorch path (``reference.py``), for what no kernel serves: CPU tensors,
  dtypes and head dims outside the kernels', Triton missing, or
  ``MTRAINING_ATTENTION_BACKEND=reference``.

The user's setting (``backend`` argument, else ``MTRAINING_ATTENTION_BACKEND``, else
``auto``) is one of :data:`BACKENDS`; forcing a backend that cannot run the call is a
``ValueError`` that says why. :func:`attention_kernel` returns the choice with its reason;
with ``logging.getLogger("megatron_mtraining.dispatch")`` at DEBUG every single-device call
and every ring call logs it. The other kernel families follow the same setting:
:func:`backend_choice` (merges, index statistics, MSA selection, MoBA's gate top-k) and
:func:`index_kernels` (the vertical-slash selection). MSA's KL loss in training goes where :func:`kl_kernel` says:
the fused kernels (``kernels/msa_kl``) or the PyTorch reference, and on one device with
the KV-outer attention inside its backward where ``MTRAINING_KL_TEACHER=shared``
(``msa_kl_with_attention``); the union-of-tiles KL backward takes one pass or two as
:func:`kl_backward_passes` says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .index import BlockTopKIndex, DenseIndex, SparseIndex
from .kernels import triton_available
from .kernels.block_bar.tables import SERVED_INDEXES
from .kernels.dense_backends import flash_attn, sdpa
from .kernels.varlen_blocks import attention as varlen_blocks
from .kernels.varlen_blocks import choose as varlen_choose
from .validation import check_choice, env_choice, fail

BACKENDS = ("auto", "reference", "triton", "flash_attn", "sdpa", "varlen_blocks")
BACKEND_ENV = "MTRAINING_ATTENTION_BACKEND"
KERNELS = ("flash_attn", "sdpa", "varlen_blocks", "kv_outer", "block_bar", "reference")
# MSA's KL loss in training (:func:`kl_kernel`): the KV-outer KL run by the KV-outer
# attention's backward, which hands it the teacher; the fused kernels in the KV-outer order
# or over the union of tiles, which recompute the teacher; or msa_kl_loss's PyTorch.
KL_KERNELS = ("msa_kl_with_attention", "msa_kl_kv_outer", "msa_kl", "reference")
# Where the KV-outer KL's teacher comes from when the attention runs KV-outer in the same
# call: recomputed by the KL's own kernels (``recompute``), or the attention's backward
# (``shared``: one fewer product per tile, but in the first measured training step the
# attention's backward with the group sums cost more than the KL's own recomputation saved
# (docs/benchmarks.md, "The MSA step with the KL's teacher shared or recomputed"), so it is
# opt-in until its launches are tuned).
KL_TEACHER_ENV = "MTRAINING_KL_TEACHER"
KL_TEACHERS = ("recompute", "shared")
# The union-of-tiles KL backward (:func:`kl_backward_passes`): the dK kernel adding dq_idx
# and the KL rows by atomics, or the dQ and dK kernels.
KL_BACKWARDS = ("one_pass", "two_pass")

# The loop order of a top-k index on the kernels, by measurement (docs/benchmarks.md,
# "KV-outer kernels for top-k indexes" and "Kernels at 256K on one H100"): KV-outer programs
# compute only the rows that chose their key block, but stream the queries in chunks whose
# fixed cost is paid per chunk; the query-major union-of-tiles kernels compute every row of
# a query block against the union of its rows' blocks. KV-outer wins where the selections
# are a small share of the keys; the union where they are not, and for wide blocks, whose
# rows of a query block mostly agree. The thresholds sit between the measured crossovers.
KV_OUTER_MAX_BLOCK = 128
KV_OUTER_MAX_SHARE = 1 / 16  # blocks of at most KV_OUTER_MAX_BLOCK tokens
KV_OUTER_MAX_SHARE_WIDE = 1 / 4  # wider blocks
# A top-k index whose blocks hold at least this many tokens runs on ``varlen_blocks``: every row
# of its library calls attends a whole block it chose, so nothing is computed for a block a row
# did not choose (the union of tiles' waste) and the tiles run at the library's dense rate. Its
# own cost is per (row, chosen block): the row gathered, its partial merged, its dQ summed, about
# ten row-wide passes over memory, against the block's keys' work, so it pays only where blocks
# are wide. Measured at MoBA's 4096-token blocks only (faster than the Triton kernels in the
# training step: docs/benchmarks.md); 1024 sits between that and MSA's 128-token blocks, the
# KV-outer kernels' range, and is not measured (scripts/bench_kernels.py --patterns moba).
VARLEN_MIN_BLOCK = 1024

logger = logging.getLogger("megatron_mtraining.dispatch")


@dataclass(frozen=True)
class Decision:
    """The implementation that runs a call (one of :data:`KERNELS`, :data:`KL_KERNELS` or
    :data:`KL_BACKWARDS`) and why."""

    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.reason}"


def attention_kernel(
    q: torch.Tensor,
    index: SparseIndex,
    backend: str | None = None,
    piece: bool = False,
    whole_blocks: bool | None = None,
) -> Decision:
    """Where attention of ``q`` under ``index`` runs: a whole single-device call
    (``sparse_attention``), or with ``piece`` a piece of a context-parallel rank's attention,
    whose caller passes ``whole_blocks`` (``StepTables.whole_blocks``: whether the rank's
    tokens are whole kernel tiles; the ring steps have no tile tables otherwise)."""
    setting = _backend_setting(backend)
    if not piece:
        dense = dense_backend(q, index, backend)
        if dense is not None:
            why = "forced" if setting == dense else "auto: whole causal attention of a DenseIndex on CUDA"
            if dense == "sdpa" and setting != "sdpa":
                why += f" (not flash-attn: {flash_attn.unsupported(q, index)})"
            return Decision(dense, why)
        if setting == "varlen_blocks":
            why_not = varlen_blocks.unsupported(q, index)
            if why_not is not None:
                fail("backend" if backend else BACKEND_ENV, setting, f"{varlen_blocks.REQUIREMENTS}; {why_not}")
            return Decision("varlen_blocks", "forced")
    if backend_choice(q, backend) == "reference":
        return Decision("reference", _reference_reason(q, setting))
    if not isinstance(index, SERVED_INDEXES):
        if setting == "triton":
            fail("backend", "triton", f"an index type the kernels serve, got {type(index).__name__}")
        return Decision("reference", f"no kernel serves a {type(index).__name__}")
    if piece and whole_blocks is False:
        why = "context-parallel tokens that are not whole kernel tiles (no ring-step tile tables)"
        if setting == "triton":
            fail("backend", "triton", f"a layout the kernels serve, got {why}")
        return Decision("reference", why)
    if piece:
        return Decision("block_bar", "a context-parallel piece: keys at global positions, an fp32 running result")
    if isinstance(index, BlockTopKIndex):
        on_library, library_why = varlen_blocks_preferred(q, index, backend)
        if on_library:
            return Decision("varlen_blocks", library_why)
        kv_outer, why = _top_k_order(index)
        if setting == "auto" and index.block_size >= VARLEN_MIN_BLOCK:
            why += f" (not varlen_blocks: {library_why})"
        return Decision("kv_outer" if kv_outer else "block_bar", why)
    if isinstance(index, DenseIndex) and torch.are_deterministic_algorithms_enabled():
        return Decision("block_bar", "a DenseIndex on CUDA in deterministic mode (cuDNN's backward is not)")
    return Decision("block_bar", f"a {type(index).__name__} on CUDA")


def kl_kernel(
    q: torch.Tensor,
    q_idx: torch.Tensor,
    index: SparseIndex,
    backend: str | None = None,
    whole_blocks: bool | None = None,
    with_attention: bool = False,
) -> Decision:
    """Where MSA's KL loss runs when training with the main pass's LSE at hand, on one device
    (``msa.msa_kl_objective``) or per ring step under context parallelism
    (``context_parallel.msa_kl``, which passes ``whole_blocks``: whether its tokens are
    whole kernel blocks, ``StepTables.whole_blocks``): one of :data:`KL_KERNELS`. With
    ``with_attention`` the caller would run the main attention in the same call
    (``msa.msa_attention``): where both run KV-outer, ``msa_kl_with_attention`` (one autograd
    function, ``msa_kl.kv_attention``: the attention's backward hands the KL its teacher)
    where ``MTRAINING_KL_TEACHER=shared``. The fused
    Triton kernels (``kernels/msa_kl``: no KL forward, the teacher from that LSE, the value
    computed in the backward), where the kernels serve both the main and the index queries.
    On one device in the loop order the main attention takes (:func:`kv_outer_preferred`,
    the same density rule, and packed documents, as :func:`attention_kernel`):
    ``msa_kl_kv_outer`` (``msa_kl.kv_loss``: per key block, the rows that chose it) for a
    top-k index selecting a small share of the keys without documents, ``msa_kl`` (the union
    of tiles, which masks each row by its document start) for the others and the warmup's
    ``DenseIndex``; per ring step ``msa_kl`` on the step's tile tables. Else ``reference``,
    the chunked PyTorch of ``msa_kl_loss`` (per ring step under context parallelism)."""
    setting = _backend_setting(backend)
    if backend_choice(q, backend) == "reference":
        return Decision("reference", _reference_reason(q, setting))
    if not _kernels_serve(q_idx):
        if setting == "triton":
            fail("backend", "triton", f"index queries the kernels serve, got {q_idx.dtype}, head dim {q_idx.shape[-1]}")
        return Decision("reference", f"no kernel serves index queries of {q_idx.dtype}, head dim {q_idx.shape[-1]}")
    if not isinstance(index, (BlockTopKIndex, DenseIndex)):
        if setting == "triton":
            fail("backend", "triton", f"a BlockTopKIndex or DenseIndex for the KL kernels, got {type(index).__name__}")
        return Decision("reference", f"no KL kernel serves a {type(index).__name__}")
    if whole_blocks is False:
        why = "context-parallel tokens that are not whole kernel blocks (no ring-step tile tables)"
        if setting == "triton":
            fail("backend", "triton", f"a layout the KL kernels serve, got {why}")
        return Decision("reference", why)
    documents = "" if index.documents is None else ", each row masked by its document start"
    if whole_blocks:
        return Decision(
            "msa_kl",
            f"a {type(index).__name__} under context parallelism: fused KL kernels per ring step{documents}",
        )
    fused = "fused KL kernels, the teacher from the main LSE"
    if isinstance(index, BlockTopKIndex):
        kv_outer, why = _top_k_order(index)
        if kv_outer:
            kv_fused = f"{why}; {fused}, KV-outer (per key block, the rows that chose it)"
            if not with_attention:
                return Decision("msa_kl_kv_outer", kv_fused)
            not_shared = _teacher_not_shared(q, index, backend)
            if not_shared is None:
                return Decision(
                    "msa_kl_with_attention",
                    f"{why}; KV-outer KL kernels in the KV-outer attention's backward, the teacher from its "
                    "probabilities",
                )
            return Decision("msa_kl_kv_outer", f"{kv_fused}; the teacher recomputed: {not_shared}")
        return Decision("msa_kl", f"{why}; {fused}, over the union of tiles, as the attention")
    return Decision("msa_kl", f"a {type(index).__name__} on CUDA: {fused}, over the union of tiles{documents}")


def _teacher_not_shared(q: torch.Tensor, index: BlockTopKIndex, backend: str | None) -> str | None:
    """Why the KV-outer KL cannot take its teacher from the attention's backward, or None."""
    if env_choice(KL_TEACHER_ENV, KL_TEACHERS) == "recompute":
        return f"{KL_TEACHER_ENV}=recompute (the default; shared measured slower)"
    attention = attention_kernel(q, index, backend)
    if attention.kernel != "kv_outer":
        return f"the attention runs on {attention.kernel}"
    return None


def kl_backward_passes() -> Decision:
    """How the union-of-tiles KL backward (``kernels/msa_kl/loss.kl_backward``, on one device
    and per ring step) runs: one of :data:`KL_BACKWARDS`. Each pass recomputes the teacher,
    the group's G main products per (row, key), which bound it; ``one_pass`` computes it once
    but adds dq_idx and the KL rows in fp32 atomics whose order varies, so torch's
    deterministic mode (Megatron's ``deterministic_mode``) takes ``two_pass``, whose kernels
    write each element once."""
    if torch.are_deterministic_algorithms_enabled():
        return Decision(
            "two_pass",
            "deterministic mode: the dQ and dK passes write each element once (bitwise reproducible); "
            "the one pass adds dq_idx and the KL rows by fp32 atomics in a varying order",
        )
    return Decision(
        "one_pass",
        "the teacher once per (rows, keys) step: dk_idx in registers, dq_idx and the KL rows added by "
        "fp32 atomics (not bitwise reproducible; deterministic mode takes two passes)",
    )


def log_decision(decision: Decision, where: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s -> %s", where, decision)


def _share(index: BlockTopKIndex) -> float:
    return index.blocks.shape[-1] * index.block_size / index.seq_len


def _top_k_order(index: BlockTopKIndex) -> tuple[bool, str]:
    """(whether a top-k index's attention and KL run KV-outer on one device, why): where
    :func:`kv_outer_preferred`, unless the index has packed documents, which the KV-outer
    kernels do not take; the union of tiles masks each row by its document start."""
    share = f"a top-k index selecting {_share(index):.4f} of the keys in blocks of {index.block_size}"
    if index.documents is not None:
        share += " with packed documents"
    if not kv_outer_preferred(index):
        return False, f"{share} (too dense or wide for KV-outer)"
    if index.documents is not None:
        why = "the KV-outer kernels take no document bounds, the union of tiles masks each row by its document start"
        return False, f"{share}: {why}"
    return True, share


def varlen_blocks_preferred(q: torch.Tensor, index: BlockTopKIndex, backend: str | None = None) -> tuple[bool, str]:
    """(whether a whole single-device call of a top-k index runs on ``varlen_blocks`` under
    ``auto``, why or why not): blocks of at least ``VARLEN_MIN_BLOCK`` tokens, where
    ``varlen_blocks.unsupported`` has nothing against the call, outside torch's deterministic
    mode. PyTorch runs FlashAttention-2's deterministic backward in that mode (its
    ``_flash_attention_backward`` reads the flag), and the cuDNN library asks for cuDNN's
    deterministic backward, but neither is yet checked on a GPU here, so deterministic runs keep
    the plugin's bitwise-reproducible kernels, as for ``sdpa``. The reason names the library
    (``varlen_blocks.choose.choice``)."""
    if _backend_setting(backend) != "auto":
        return False, "the setting is not auto"
    if index.block_size < VARLEN_MIN_BLOCK:
        return False, f"blocks of {index.block_size} tokens, under {VARLEN_MIN_BLOCK}"
    if not q.is_cuda:  # the stand-in calls serve tests and a forced setting only
        return False, f"{q.device.type} tensors"
    why_not = varlen_blocks.unsupported(q, index)
    if why_not is not None:
        return False, why_not
    if torch.are_deterministic_algorithms_enabled():
        return False, "deterministic mode (FlashAttention-2's fast backward adds dQ by fp32 atomics)"
    return True, (
        f"a top-k index of {index.block_size}-token blocks on CUDA: a key block at a time on "
        f"{varlen_choose.choice(q)[1]}, no row computed against a block it did not choose"
    )


def kv_outer_preferred(index: SparseIndex) -> bool:
    """Whether a top-k ``index`` runs on the KV-outer kernels rather than the union of tiles:
    each query selecting under ``KV_OUTER_MAX_SHARE`` of the sequence in blocks of at most
    ``KV_OUTER_MAX_BLOCK`` tokens, or under ``KV_OUTER_MAX_SHARE_WIDE`` in wider blocks
    (the union's waste grows as the selections spread)."""
    if not isinstance(index, BlockTopKIndex):
        return False
    limit = KV_OUTER_MAX_SHARE if index.block_size <= KV_OUTER_MAX_BLOCK else KV_OUTER_MAX_SHARE_WIDE
    return _share(index) < limit


def _kernels_serve(q: torch.Tensor) -> bool:
    # The kernels address elements with int32 offsets (2^31 elements: 1M tokens x 16 heads x 128).
    return (
        triton_available()
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.shape[-1] <= 256
        and q.numel() < 2**31
    )


def _reference_reason(q: torch.Tensor, setting: str) -> str:
    if setting == "reference":
        return "forced"
    if not q.is_cuda:
        return f"{q.device.type} tensors"
    if not triton_available():
        return "Triton is not installed"
    return f"no kernel serves {q.dtype}, head dim {q.shape[-1]}, {q.numel()} elements"


def backend_choice(q: torch.Tensor, backend: str | None = None) -> str:
    """``"triton"`` when the kernels run this call, else ``"reference"`` (``backend``, else
    ``MTRAINING_ATTENTION_BACKEND``, else ``auto``: kernels for CUDA inputs they serve).
    ``flash_attn`` and ``sdpa`` count as ``auto`` here: they compute whole dense attention
    only (``dense_backend``), so what else a run needs (index statistics, merges, the steps
    of a context-parallel ring) goes where ``auto`` sends it."""
    choice = _backend_setting(backend)
    kernel_ok = _kernels_serve(q)
    if choice == "triton" and not kernel_ok:
        fail(
            "backend",
            "triton",
            f"inputs the kernels serve (fp16/bf16/fp32, head dim <= 256, fewer than 2^31 elements, Triton "
            f"installed), got {q.dtype}, head dim {q.shape[-1]}, {q.numel()} elements; split longer sequences "
            "with context parallelism",
        )
    if choice in ("auto", "flash_attn", "sdpa", "varlen_blocks"):
        choice = "triton" if q.is_cuda and kernel_ok else "reference"
    return choice


def dense_backend(q: torch.Tensor, index: SparseIndex, backend: str | None = None) -> str | None:
    """The library that computes ``sparse_attention(q, k, v, index)`` as whole causal
    attention: ``"flash_attn"``, ``"sdpa"``, or None when the index goes to the plugin's
    kernels or the reference. Under ``auto``, for CUDA inputs: flash-attn where it serves
    the call (``flash_attn.unsupported``), else PyTorch's fused attention where it does
    (``sdpa.unsupported``); never under ``reference`` or ``triton``. Asking for
    ``flash_attn`` or ``sdpa`` where it cannot run is a ``ValueError`` that names the reason."""
    choice = _backend_setting(backend)
    name = "backend" if backend else BACKEND_ENV
    if choice in ("flash_attn", "sdpa"):
        library = flash_attn if choice == "flash_attn" else sdpa
        why_not = library.unsupported(q, index)
        if why_not is not None:
            fail(name, choice, f"{library.REQUIREMENTS}; {why_not}")
        return choice
    if choice != "auto":
        return None
    if flash_attn.unsupported(q, index) is None:
        return "flash_attn"
    # cuDNN's fused backward is not bitwise reproducible (torch's deterministic mode does not
    # rule it out); the plugin's dense kernels are, so deterministic runs take them.
    deterministic = torch.are_deterministic_algorithms_enabled()
    return "sdpa" if q.is_cuda and not deterministic and sdpa.unsupported(q, index) is None else None


def _backend_setting(backend: str | None) -> str:
    if not backend:
        return env_choice(BACKEND_ENV, BACKENDS)
    check_choice("backend", backend, BACKENDS)
    return backend


def index_kernels(t: torch.Tensor) -> bool:
    """Whether the index builders' Triton kernels (top-p selection) serve ``t``: CUDA, Triton
    installed, and ``MTRAINING_ATTENTION_BACKEND`` not ``reference``."""
    return _backend_setting(None) != "reference" and t.is_cuda and triton_available()
