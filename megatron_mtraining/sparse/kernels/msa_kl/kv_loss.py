"""Launches of MSA's KL kernels in the KV-outer order (``kv_kernels``), for a ``BlockTopKIndex``.

The machinery is ``kv_outer``'s: the selection's reverse index and work lists
(``kv_outer.reverse_index``, a row being one (token, group) of the index), query chunks
that bound the slot buffers (``kv_outer.attention.chunk_tokens``), split groups' dK
partials added by ``_reduce_kernel`` and the per-row slot sums of ``_merge_kernel`` (the
index LSE) and ``_sum_slots_kernel`` (dq_idx, and the KL terms with it). Memory beyond the
inputs and gradients: the chunk's slot buffers (``CHUNKS``: a share of q's bytes, so
O(chunk x k x d_idx)), the split groups' dK partials (``kv_outer.attention.PARTIAL_SHARE``
of the dq slots) and fp32 dK sums per group ``[B, S, Hkv, d_idx]``, added over the groups
at the end (the index keys are the groups' shared head). Nothing is ``S x S``.

:class:`KVOuterKL` is the order ``loss.FusedMSAKL`` takes (``loss.fused_kl``);
:func:`kv_index_lse` and :func:`kv_kl_backward` are ``loss.index_lse`` and
``loss.kl_backward`` in this order. :class:`KLBackward` runs the backward a query chunk at
a time, on chunks of its own or, reading the teacher the attention's backward stored, on
the attention's (``kv_attention``: then a chunk's teacher buffer, ``B x chunk x Hkv x k x
block`` fp32, is added to the memory above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ...index import BlockTopKIndex
from ...validation import check_power_of_two
from ..kv_outer import attention as kv
from ..kv_outer import kernels as kv_kernels
from ..kv_outer.attention import PassConfig, Streaming
from ..kv_outer.reverse_index import reverse_index, work_list
from ..shared import arch, buffers
from ..shared.combine import ROWS
from ..shared.kernels import LOG2E
from .kv_kernels import _kl_bwd_kernel, _kl_dq_kernel, _kl_lse_kernel
from .loss import parse_table

DEFAULTS = {
    "lse": PassConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, tiles_per_item=8),
    "bwd": PassConfig(block_m=64, block_n=128, num_warps=8, num_stages=1, tiles_per_item=8),
    "dq": PassConfig(block_m=32, block_n=64, num_warps=4, num_stages=1, tiles_per_item=32),
}
"""Untimed first choices (``OVERRIDES`` replaces them per pass), ``block_m`` counting index
rows (tokens of one group), checked by compiling ahead of time (``scripts/compile_kernels.py
--family kl-kv-outer``: bf16, head dims 128, G = 8): ``lse``: 64 rows against a 128-key
block, 8 warps, no spill (4 warps spilled on sm80). ``bwd``: 64 rows against a 128-key
block, 8 warps, the shape of ``kv_outer``'s dK/dV kernel and of the union-of-tiles
``_dk_kl_kernel``; one stage, as that kernel. ``dq`` (blocks wider than the ``bwd`` step
only): 32 rows, one stage: 64 rows take more shared memory than an A100 has (the G heads'
queries held)."""
SM80_DEFAULTS = {"bwd": PassConfig(block_m=64, block_n=64, num_warps=8, num_stages=1, tiles_per_item=8)}
"""On Ampere, ``bwd`` takes 64-key steps, and ``dq`` runs apart: with 128-key steps ptxas
(CUDA 12.8, as Triton bundles it) gives the backward 32 registers and a stack of about 14 KB
a thread on sm80, where sm90 gets 255 registers and a few hundred bytes; 64-key steps
compile to 255 registers and a few hundred bytes on both. Chosen by those compile-time
counts: no A100 has timed either."""
OVERRIDES: dict[str, PassConfig] = {}
# Pipeline stages of the backward's loop over a group's heads where it recomputes the
# teacher (``kernels._teacher``'s ``STAGES``; 0 unrolls it).
TEACHER_STAGES = 0


def pass_defaults(major: int | None) -> dict[str, PassConfig]:
    """The passes' defaults on a GPU of compute capability ``major`` (None: no GPU, the
    interpreter): ``DEFAULTS``, with ``SM80_DEFAULTS`` on Ampere."""
    return DEFAULTS | SM80_DEFAULTS if major == 8 else DEFAULTS


def parse_overrides(text: str) -> dict[str, PassConfig]:
    """``"bwd:64,128,8,1,8;lse:64,128,4,2,8"`` (``pass:block_m,block_n,num_warps,num_stages,
    tiles_per_item`` for passes of ``DEFAULTS``, ``;``-separated) as ``OVERRIDES`` entries."""
    fields = ("block_m", "block_n", "num_warps", "num_stages", "tiles_per_item")
    return {name: PassConfig(*v) for name, v in parse_table(text, DEFAULTS, fields, "KV-outer KL passes").items()}


# Query chunks: slot buffers as a share of q's bytes (the main queries, which the teacher
# reads). The backward's slots are dq_idx partials (in ``kv_outer.attention.dq_slot_dtype``)
# and fp32 KL terms: with Qwen2.5-3B's shapes (16 query heads, 2 groups, head dims 128, k = 16,
# bf16) 0.16 is ~8% of the sequence a chunk. The forward's are one fp32 LSE each.
CHUNKS = {"lse": Streaming(buffer_share=0.16, min_chunk=256), "bwd": Streaming(buffer_share=0.16, min_chunk=256)}


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@dataclass
class _Problem:
    """Shapes and per-call tensors of one KV-outer KL call."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    q_bytes: int  # the main queries' bytes, the slot buffers' yardstick
    d_main: int  # the main head dim (0 for the index LSE alone)
    blocks: torch.Tensor  # [B, S, Hkv, k] int32, one selection per group
    block: int

    @classmethod
    def of(cls, q_idx, k_idx, index: BlockTopKIndex, q_bytes: int, d_main: int = 0) -> _Problem:
        check_power_of_two("index.block_size", index.block_size, minimum=16)
        blocks = index.blocks
        hkv = q_idx.shape[2]
        if blocks.shape[2] < hkv:  # one selection shared by the groups: each group reads it
            blocks = blocks.expand(-1, -1, hkv, -1)
        return cls(q_idx.contiguous(), k_idx.contiguous(), q_bytes, d_main, blocks.int().contiguous(), index.block_size)

    @property
    def topk(self) -> int:
        return self.blocks.shape[3]

    @property
    def n_blocks(self) -> int:
        return -(-self.q_idx.shape[1] // self.block)

    def config(self, name: str) -> tuple[PassConfig, int, int]:
        """(the pass's config, its tile rows, its key step), shrunk for wide rows and fp32
        as ``kv_outer``'s (``tile_shape``), by the wider of the main and index rows."""
        cfg = OVERRIDES.get(name, pass_defaults(arch.major(self.q_idx.device))[name])
        d_pad = max(_pad(self.q_idx.shape[3]), _pad(self.d_main) if self.d_main else 0)
        return (cfg, *kv.tile_shape(cfg, d_pad, self.q_idx.dtype, self.block))

    def chunk(self, name: str, row_bytes: int) -> int:
        b, s, hkv, di = self.q_idx.shape
        return kv.chunk_tokens(CHUNKS[name], self.q_bytes, (b, s, hkv), self.topk, di, row_bytes)

    def reverse_index(self, chunk: int):
        return reverse_index(self.blocks, self.q_idx.shape[2], self.n_blocks, chunk)

    def slot_rows(self, chunk: int) -> int:
        """(token, group) rows of a chunk's slot buffers."""
        return self.q_idx.shape[0] * chunk * self.q_idx.shape[2]

    def slot_args(self, chunk: int) -> tuple:
        """``kv_outer``'s per-row slot kernels' size arguments after the chunk index."""
        b, s, hkv, _ = self.q_idx.shape
        return chunk, self.slot_rows(chunk), s, hkv, hkv, self.topk

    def index_dims(self) -> dict:
        di = self.q_idx.shape[3]
        return {
            "DI": di,
            "DI_PAD": _pad(di),
            "BLOCK": self.block,
            "PRECISION": "ieee" if self.q_idx.dtype == torch.float32 else "tf32",
        }


def _opts(cfg: PassConfig, block_m: int, block_n: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def kv_index_lse(q_idx: torch.Tensor, k_idx: torch.Tensor, index: BlockTopKIndex, q_bytes: int | None = None):
    """``[B, Hkv, S]`` fp32 logsumexp of ``q_idx . k_idx / sqrt(d_idx)`` over each row's
    visible selected keys (``index``); -inf where none. ``q_bytes`` (the main queries'
    bytes; default: 8 times q_idx's) sizes the query chunks."""
    p = _Problem.of(q_idx, k_idx, index, q_bytes or 8 * q_idx.numel() * q_idx.element_size())
    b, s, hkv, di = p.q_idx.shape
    cfg, block_m, block_n = p.config("lse")
    chunk = p.chunk("lse", 4)
    rev = p.reverse_index(chunk)
    work = work_list(rev, block_m, max(1, cfg.tiles_per_item // (p.block // block_n)))
    lse = buffers.new_buffer((b, hkv, s), torch.float32, q_idx.device)
    lse_buf = buffers.new_buffer((p.slot_rows(chunk) * p.topk,), torch.float32, q_idx.device)
    dims = p.index_dims()
    for c in range(rev.n_chunks):
        _kl_lse_kernel[(work.items_per_chunk,)](
            p.q_idx, p.k_idx, rev.entries, work.tiles, work.items, work.chunk_items, lse_buf, c, chunk, s, hkv,
            p.topk, p.n_blocks, LOG2E / math.sqrt(di), **dims, **_opts(cfg, block_m, block_n),
        )  # fmt: skip
        # The LSE alone: the output arguments are placeholders, not read.
        kv_kernels._merge_kernel[(triton.cdiv(p.slot_rows(chunk), ROWS),)](
            lse_buf, lse_buf, p.blocks, lse, lse, c, *p.slot_args(chunk), HEAD_DIM=1, ROWS=ROWS, D_PAD=16, HAS_OUT=False
        )
    return lse


def kv_kl_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    lse_idx: torch.Tensor,
    index: BlockTopKIndex,
    scale: float,
    grad: torch.Tensor,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_idx, dk_idx, per-row KL ``[B, Hkv, S]`` fp32) of ``grad * sum_rows KL / rows``,
    as ``loss.kl_backward`` with the index's selection in place of tile tables."""
    backward = KLBackward(q, k, lse, q_idx, k_idx, lse_idx, index, scale, grad, rows)
    for c in range(backward.rev.n_chunks):
        backward.run(c)
    return backward.result()


class KLBackward:
    """:func:`kv_kl_backward` a query chunk at a time: :meth:`run` each chunk, then
    :meth:`result`. Given ``chunks`` (the main attention backward's chunk length and reverse
    index, ``kv_outer.attention.backward_chunks``), it is that backward's
    ``ChunkFollower``: the teacher is not recomputed from the main queries and keys but read
    from :attr:`teacher`, where the main backward's dK/dV kernel stored each chunk's sums
    of P over the group's heads just before :meth:`run` (``q``, ``k`` and ``lse`` are then
    not read). Else the teacher is recomputed (``kernels._teacher``) on chunks of its own."""

    def __init__(self, q, k, lse, q_idx, k_idx, lse_idx, index: BlockTopKIndex, scale: float, grad, rows: int,
                 chunks=None):  # fmt: skip
        q, k = q.contiguous(), k.contiguous()
        lse, lse_idx = lse.float().contiguous(), lse_idx.float().contiguous()
        grad = grad.detach().float().reshape(1).contiguous()
        b, s, hq, d = q.shape
        p = _Problem.of(q_idx, k_idx, index, q.numel() * q.element_size(), d)
        hkv, di = p.q_idx.shape[2], p.q_idx.shape[3]
        dev = q.device
        self.cfg, self.block_m, self.block_n = p.config("bwd")
        self.steps = p.block // self.block_n
        slot_dtype = kv.dq_slot_dtype(p.q_idx.dtype)
        if chunks is None:
            self.chunk = p.chunk("bwd", di * slot_dtype.itemsize + 4)
            self.rev = p.reverse_index(self.chunk)
        else:
            self.chunk, self.rev = chunks
        n_slots = p.slot_rows(self.chunk) * p.topk
        self.teacher = None if chunks is None else buffers.new_buffer((n_slots, p.block), torch.float32, dev)
        # Split groups' dK partials (fp32, a whole block each): PARTIAL_SHARE of the dq slots' bytes.
        pool = max(2, int(kv.PARTIAL_SHARE * n_slots * di * slot_dtype.itemsize) // (p.block * di * 4))
        self.work = work_list(self.rev, self.block_m, self.cfg.tiles_per_item * self.steps, pool)
        if self.steps > 1:
            self.dq_cfg, self.dq_block_m, self.dq_block_n = p.config("dq")
            tiles = max(1, self.dq_cfg.tiles_per_item // (p.block // self.dq_block_n))
            self.dq_work = work_list(self.rev, self.dq_block_m, tiles)

        self.dk_sum = torch.zeros((b, s, hkv, di), dtype=torch.float32, device=dev)
        self.dq_idx = buffers.new_buffer(p.q_idx.shape, p.q_idx.dtype, dev)
        self.kl = buffers.new_buffer((b, hkv, s), torch.float32, dev)
        self.dq_buf = buffers.new_buffer((n_slots, di), slot_dtype, dev)
        self.kl_buf = buffers.new_buffer((n_slots,), torch.float32, dev)
        self.dk_part = buffers.new_buffer((pool * p.block, di), torch.float32, dev)
        self.reduce_grid = (min(self.work.splits_per_chunk * (p.block // ROWS), kv.reduce_programs(dev)),)
        group = hq // hkv
        self.dims = {**p.index_dims(), "HEAD_DIM": d, "D_PAD": _pad(d), "G": group}
        if self.teacher is not None:
            self.dims |= {"TEACHER": self.teacher, "HAS_TEACHER": True}
        self.scalars = (scale * LOG2E, LOG2E / math.sqrt(di), 1.0 / group, 1.0 / (rows * math.sqrt(di)))
        self.tensors = (q, k, lse, p.q_idx, p.k_idx, lse_idx, grad, self.rev.entries)
        self.sizes = (self.chunk, s, hq, hkv, p.topk, p.n_blocks)
        self.p = p

    def run(self, c: int) -> None:
        """The kernels of query chunk ``c``."""
        p, work, s, hkv = self.p, self.work, self.sizes[1], self.sizes[3]
        _kl_bwd_kernel[(work.items_per_chunk, self.steps)](
            *self.tensors, work.tiles, work.items, work.chunk_items, work.partial, self.dk_sum, self.dk_part,
            self.dq_buf, self.kl_buf, c, *self.sizes, *self.scalars, **self.dims, HAS_DQ=self.steps == 1,
            TEACHER_STAGES=TEACHER_STAGES, **_opts(self.cfg, self.block_m, self.block_n),
        )  # fmt: skip
        if self.steps > 1:
            dq_work = self.dq_work
            _kl_dq_kernel[(dq_work.items_per_chunk,)](
                *self.tensors, dq_work.tiles, dq_work.items, dq_work.chunk_items, self.dq_buf, self.kl_buf, c,
                *self.sizes, *self.scalars, **self.dims, TEACHER_STAGES=TEACHER_STAGES,
                **_opts(self.dq_cfg, self.dq_block_m, self.dq_block_n),
            )  # fmt: skip
        # dK alone: the dV arguments are placeholders, not read.
        kv_kernels._reduce_kernel[self.reduce_grid](
            work.splits, work.chunk_splits, self.dk_part, self.dk_part, self.dk_sum, self.dk_sum, c, s, hkv,
            p.n_blocks, HEAD_DIM=self.dims["DI"], D_PAD=self.dims["DI_PAD"], BLOCK=p.block, ROWS=ROWS, HAS_DV=False,
        )  # fmt: skip
        kv_kernels._sum_slots_kernel[(triton.cdiv(p.slot_rows(self.chunk), ROWS),)](
            self.dq_buf, p.blocks, self.dq_idx, c, *p.slot_args(self.chunk), HEAD_DIM=self.dims["DI"], ROWS=ROWS,
            D_PAD=self.dims["DI_PAD"], STAT_BUF=self.kl_buf, STAT=self.kl, HAS_STAT=True,
        )  # fmt: skip

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq_idx, dk_idx, per-row KL), once every chunk has run."""
        return self.dq_idx, self.dk_sum.sum(2, keepdim=True).to(self.p.k_idx.dtype), self.kl


@dataclass(frozen=True)
class KVOuterKL:
    """The KV-outer order of the KL kernels for ``index`` (a ``loss.KLOrder``)."""

    index: BlockTopKIndex
    q_bytes: int | None = None  # the main queries' bytes, which size the forward's chunks

    def index_lse(self, q_idx, k_idx):
        return kv_index_lse(q_idx, k_idx, self.index, self.q_bytes)

    def kl_backward(self, q, k, lse, q_idx, k_idx, lse_idx, scale, grad, rows):
        return kv_kl_backward(q, k, lse, q_idx, k_idx, lse_idx, self.index, scale, grad, rows)
