"""Autograd function running a ``BlockTopKIndex`` through the KV-outer kernels (``kernels``).

Both passes stream over query chunks: each chunk's slot buffers hold k partial results per
(token, head), so the chunk length bounds them (``CHUNKS``) and the buffers are reused from
chunk to chunk. The forward writes bf16/fp16 partials for 16-bit inputs (fp32 for fp32).
The backward's dK/dV sums are fp32, cast once at the end; its dQ partials are bf16 for bf16
inputs (``dq_slot_dtype``), which halves their traffic and the number of chunks: each partial
is rounded once before an fp32 sum of at most k of them, and dQ is stored in bf16 anyway (the
MSA paper, like our forward, keeps its forward's partials in bf16). Emulated in torch (4K
tokens, k=8, random inputs), dQ's relative L2 error against fp64 went from 1.7e-3 to 2.3e-3.
fp16's narrow range would lose small partials, so fp16 and fp32 inputs keep fp32 partials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton

from ...index import BlockTopKIndex
from ...validation import check_launch, check_power_of_two, fail
from ..shared import buffers
from ..shared.combine import ROWS
from ..shared.kernels import LOG2E
from . import kernels
from .reverse_index import ReverseIndex, reverse_index, work_list


@dataclass(frozen=True)
class PassConfig:
    """Launch parameters of one pass: ``fwd``, ``bwd`` (dK/dV, and dQ where the block is
    one step) or ``dq`` (dQ of blocks wider than the ``bwd`` step)."""

    block_m: int  # (token, head) rows of a tile (raised to the heads of a selection head where more)
    block_n: int  # keys per step, capped at the index block
    num_warps: int
    num_stages: int
    # The most tiles of one key block a program takes, for blocks of one step. A forward or
    # dQ program walks every step of its tiles, so it takes ``tiles_per_item // steps`` tiles
    # (at least one) of a wider block; a dK/dV program takes one step of each tile, and
    # ``tiles_per_item * steps``, which keeps the dK/dV partials of split items (each the
    # size of the block) at the memory they take for one-step blocks.
    tiles_per_item: int


@dataclass(frozen=True)
class RowConfig:
    """Launch parameters of a per-row kernel: ``merge`` and ``sum_slots`` take one program per
    ``rows`` (token, head) rows of a chunk's slots; ``reduce``'s grid strides over units of
    ``rows`` keys of a split group's block (capped at the block)."""

    rows: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Streaming:
    """How long a pass's query chunks are."""

    buffer_share: float  # a pass's slot buffers, as a share of q's bytes
    min_chunk: int  # query tokens per chunk at least: short sequences run in few chunks


DEFAULTS: dict[str, PassConfig | RowConfig] = {
    "fwd": PassConfig(block_m=64, block_n=128, num_warps=4, num_stages=1, tiles_per_item=8),
    "bwd": PassConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, tiles_per_item=8),
    "dq": PassConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, tiles_per_item=32),
    "merge": RowConfig(rows=64, num_warps=2, num_stages=3),
    "sum_slots": RowConfig(rows=8, num_warps=8, num_stages=3),
    "reduce": RowConfig(rows=8, num_warps=8, num_stages=3),
}
"""First choices, with ``OVERRIDES`` replacing them per kernel as in ``block_bar.attention``
(``scripts/bench_kernels.py --tune`` sweeps them on MSA's index; the choices here are that
sweep's winners on an H200, docs/benchmarks.md, "MSA's tuned launches"). Forward: 64 rows (8
tokens x 8 heads for Qwen2.5-3B's MSA) against a whole 128-key block, 4 warps, so that two
programs share a multiprocessor, unpipelined: each program's loads are one block's K/V, and a
second stage's shared memory costs more residency than it hides. dK/dV: 64 rows against a
128-key block, the shape of ``block_bar``'s dK/dV kernel. The per-row kernels (``merge``,
``sum_slots``, ``reduce``) are memory-bound: the merge reads each slot's rows once, so long
programs of few warps stream best; the sums and the reduction gather rows from many slots, so
short programs of many warps keep more loads in flight. Plain launch parameters, no sm90-only
feature: ``scripts/compile_kernels.py`` checks that they fit an A100. The KL's launches of
these kernels (``msa_kl.kv_loss``) keep their own settings."""
OVERRIDES: dict[str, PassConfig | RowConfig] = {}
# Query chunks (the dQ pass runs on the backward's). Each backward launch is as long as its
# longest program, so short chunks pay a tail per launch: at 128K, slots of q's size (16 chunks)
# ran the backward a quarter faster than 0.16x q (101 chunks), for a few hundred MiB more at the
# kernel's peak and none at the training step's, whose peak lies elsewhere (docs/benchmarks.md,
# "The KV-outer backward's chunks"). The kernel alone then exceeds the 1.2x of q, k, v, o and
# their gradients that 0.16 kept: training is what the kernels serve. The forward runs before
# the gradients exist: its output slots may take twice q's memory, so that its launches are
# few and full (measured faster than smaller slots, "KV-outer kernels for top-k indexes").
CHUNKS = {"fwd": Streaming(buffer_share=2.0, min_chunk=256), "bwd": Streaming(buffer_share=1.0, min_chunk=256)}
# The forward's merge. 0: each query chunk's slots are merged by ``_merge_kernel`` after its
# attention launch, by then long out of every cache (the partials of a chunk take twice q's
# bytes). A positive count orders the attention's items by query chunks of that many tokens,
# one ``_fwd_merging_kernel`` launch per forward chunk, and the tile that writes a token's last
# slot merges the token while its partials are recent: scripts/msa_loop_orders.py counts what
# this can reach (docs/benchmarks.md, "MSA's main branch: what each loop order can reach"). No
# GPU has timed it yet, so 0 stays the default.
FWD_MERGE_CHUNK = 0
# Programs per multiprocessor of ``_fwd_merging_kernel``, which take the items by tickets
# (``programs_on``).
FWD_MERGE_PROGRAMS_PER_SM = 2
# The backward's dK/dV partials of split groups (a whole key block each), as a share of its
# dQ slots' memory; a chunk whose splits would need more takes longer items.
PARTIAL_SHARE = 0.5
# Programs per multiprocessor of the dK/dV reduction (``reduce_programs``); untuned.
REDUCE_PROGRAMS_PER_SM = 4


def launch_config(name: str) -> PassConfig | RowConfig:
    """Kernel ``name``'s launch parameters: its ``OVERRIDES`` entry, checked (an error names
    the kernel, the value and what it accepts), else its default. A key of no kernel is an
    error too: a misspelt override would otherwise leave the default silently."""
    for key in OVERRIDES:
        if key not in DEFAULTS:
            fail("kv_outer.OVERRIDES key", key, f"one of {', '.join(DEFAULTS)}")
    if name not in OVERRIDES:
        return DEFAULTS[name]
    cfg = OVERRIDES[name]
    tiles = {"block_m": 16, "block_n": 16} if isinstance(DEFAULTS[name], PassConfig) else {"rows": 1}
    check_launch(f"kv_outer.OVERRIDES[{name!r}]", cfg, type(DEFAULTS[name]), tiles)
    return cfg


def _config(name: str, p: _Problem) -> tuple[PassConfig, int, int]:
    """(the pass's config, its tile rows, its key step). The configured tiles are for rows
    of up to 256 bytes (head dim 128 in 16 bits); wider rows halve them (to 16 at least) per
    doubling, and fp32 once more, whose products take more shared memory, so that every
    shape fits an A100's 163 KiB."""
    cfg = launch_config(name)
    block_m, block_n = tile_shape(cfg, p.dims()["D_PAD"], p.q.dtype, p.block, triton.next_power_of_2(p.group))
    return cfg, block_m, block_n


def tile_shape(cfg: PassConfig, d_pad: int, dtype: torch.dtype, block: int, min_rows: int = 16) -> tuple[int, int]:
    """(tile rows, key step) of ``cfg`` for rows of ``d_pad`` elements of ``dtype`` and key
    blocks of ``block``, shrunk as ``_config`` says; at least ``min_rows`` rows."""
    shrink = max(1, d_pad * dtype.itemsize // 256) * (2 if dtype == torch.float32 else 1)
    return max(16, cfg.block_m // shrink, min_rows), min(max(16, cfg.block_n // shrink), block)


def dq_slot_dtype(dtype: torch.dtype) -> torch.dtype:
    """The backward's dQ partials for inputs of ``dtype``: bf16 for bf16 (see the module
    docstring), else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def query_chunk(name: str, q: torch.Tensor, topk: int) -> int:
    """Query tokens per chunk of pass ``name``: slot buffers of ``buffer_share`` times q's
    bytes (forward: partials in q's dtype; backward: dQ partials in ``dq_slot_dtype``)."""
    b, s, hq, d = q.shape
    slot_bytes = q.element_size() if name == "fwd" else dq_slot_dtype(q.dtype).itemsize
    return chunk_tokens(CHUNKS[name], q.numel() * q.element_size(), q.shape[:3], topk, d, d * slot_bytes)


def chunk_tokens(
    stream: Streaming, budget: int, rows: tuple[int, int, int], topk: int, width: int, row_bytes: int
) -> int:
    """Query tokens per chunk of slot buffers of ``stream.buffer_share`` times ``budget``
    bytes (at least ``stream.min_chunk`` tokens, at most the sequence), for ``rows`` =
    (B, S, heads) rows of ``topk`` slots of ``row_bytes`` each, addressed with int32
    offsets in rows of ``width`` elements."""
    b, s, heads = rows
    tokens = max(stream.min_chunk, int(stream.buffer_share * budget / (b * heads * topk * row_bytes)))
    # The kernels address the buffers with int32 offsets.
    return min(s, tokens, (2**31 - 1) // (b * heads * topk * triton.next_power_of_2(width)))


@dataclass
class _Problem:
    """Shapes and per-call tensors shared by the launches of one call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    blocks: torch.Tensor  # [B, S, Hs, k], at least one selection head per KV head
    block: int
    scale: float

    @classmethod
    def of(cls, q, k, v, index: BlockTopKIndex, scale: float) -> _Problem:
        check_power_of_two("index.block_size", index.block_size, minimum=16)
        blocks = index.blocks
        if blocks.shape[2] < k.shape[2]:  # one selection shared by every head: each KV head reads it
            blocks = blocks.expand(-1, -1, k.shape[2], -1)
        if blocks.numel() >= 2**31:
            fail("index.blocks", tuple(blocks.shape), "fewer than 2^31 selections (the kernels number them in int32)")
        return cls(q.contiguous(), k.contiguous(), v.contiguous(), blocks.contiguous(), index.block_size, scale)

    @property
    def group(self) -> int:
        """Query heads per selection head."""
        return self.q.shape[2] // self.blocks.shape[2]

    @property
    def topk(self) -> int:
        return self.blocks.shape[3]

    def token_columns(self, block_m: int) -> int:
        """Tokens of a tile of ``block_m`` rows, as a power of two of at least 16: the width
        of the kernels' per-token columns (the teacher's group sums, the merge's counts)."""
        return max(16, triton.next_power_of_2(-(-block_m // self.group)))

    @property
    def n_blocks(self) -> int:
        return -(-self.q.shape[1] // self.block)

    def chunk_args(self, chunk: int) -> tuple:
        """The size arguments the kernels take after the chunk index, from ``CHUNK`` to ``N_KB``."""
        b, s, hq, _ = self.q.shape
        return chunk, s, hq, self.k.shape[2], self.blocks.shape[2], self.topk, self.n_blocks

    def dims(self) -> dict:
        d = self.q.shape[3]
        return {
            "HEAD_DIM": d,
            "D_PAD": max(16, triton.next_power_of_2(d)),
            "BLOCK": self.block,
            "G": self.group,
            # fp32 inputs get exact fp32 products; 16-bit inputs use the tensor cores as they are.
            "PRECISION": "ieee" if self.q.dtype == torch.float32 else "tf32",
        }

    def slot_rows(self, chunk: int) -> int:
        """(token, head) rows of a chunk's slot buffers."""
        return self.q.shape[0] * chunk * self.q.shape[2]

    def slot_args(self, chunk: int) -> tuple:
        """The size arguments of the per-row slot kernels after the chunk index."""
        b, s, hq, _ = self.q.shape
        return chunk, self.slot_rows(chunk), s, hq, self.blocks.shape[2], self.topk


def reduce_programs(device: torch.device) -> int:
    """Programs of a dK/dV reduction launch, which stride over the chunk's split groups
    (``programs_on``)."""
    return programs_on(device, REDUCE_PROGRAMS_PER_SM)


def programs_on(device: torch.device, per_sm: int) -> int:
    """Programs of a launch sized to the GPU rather than to its work, which its programs
    stride over or take by tickets: ``per_sm`` per multiprocessor on CUDA; in the
    interpreter a few, fewer than the tests' work, so that they walk it."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _opts(cfg: PassConfig, block_m: int, block_n: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _row_opts(name: str, max_rows: int | None = None) -> dict:
    """Launch arguments of per-row kernel ``name``, its rows capped at ``max_rows``."""
    cfg = launch_config(name)
    rows = cfg.rows if max_rows is None else min(cfg.rows, max_rows)
    return {"ROWS": rows, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def kv_outer_forward(p: _Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse fp32 ``[B, Hq, S]``); merged as ``FWD_MERGE_CHUNK`` says."""
    q = p.q
    b, s, hq, d = q.shape
    cfg, block_m, block_n = _config("fwd", p)
    chunk = query_chunk("fwd", q, p.topk)
    if FWD_MERGE_CHUNK > 0:
        return _merging_forward(p, cfg, block_m, block_n, chunk)
    rev, work = _forward_work(p, cfg, block_m, block_n, chunk)
    out = buffers.new_buffer(q.shape, q.dtype, q.device)
    lse = buffers.new_buffer((b, hq, s), torch.float32, q.device)
    o_buf, lse_buf = _slot_buffers(p, chunk)
    merge = _row_opts("merge")
    for c in range(rev.n_chunks):
        kernels._fwd_kernel[(work.items_per_chunk,)](
            q, p.k, p.v, rev.entries, work.tiles, work.items, work.chunk_items, o_buf, lse_buf, c,
            *p.chunk_args(chunk), p.scale * LOG2E, **p.dims(), **_opts(cfg, block_m, block_n),
        )  # fmt: skip
        kernels._merge_kernel[(triton.cdiv(p.slot_rows(chunk), merge["ROWS"]),)](
            o_buf, lse_buf, p.blocks, out, lse, c, *p.slot_args(chunk), HEAD_DIM=d, D_PAD=p.dims()["D_PAD"], **merge
        )
    return out, lse


def _merging_forward(p: _Problem, cfg: PassConfig, block_m: int, block_n: int, chunk: int):
    """:func:`kv_outer_forward` with the merge in the attention kernel: the reverse index on
    query chunks of ``FWD_MERGE_CHUNK`` tokens, a launch per window of them as long as the
    forward's ``chunk`` at most (its slot buffers as before), rows that choose nothing left
    at zeros and -inf."""
    q = p.q
    b, s, hq, _ = q.shape
    hs = p.blocks.shape[2]
    small = min(FWD_MERGE_CHUNK, s)
    window_chunks = max(1, chunk // small)
    window = small * window_chunks
    rev, work = _forward_work(p, cfg, block_m, block_n, small)
    n_windows = -(-rev.n_chunks // window_chunks)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
    o_buf, lse_buf = _slot_buffers(p, window)
    count = torch.zeros((b * window * hs,), dtype=torch.int32, device=q.device)  # zeroed again by the merges
    tickets = torch.zeros((n_windows,), dtype=torch.int32, device=q.device)
    grid = (programs_on(q.device, FWD_MERGE_PROGRAMS_PER_SM),)
    for w in range(n_windows):
        kernels._fwd_merging_kernel[grid](
            q, p.k, p.v, rev.entries, work.tiles, work.items, work.chunk_items, o_buf, lse_buf, p.blocks, count,
            tickets, out, lse, w, window_chunks, rev.n_chunks, window, s, hq, p.k.shape[2], hs, p.topk, p.n_blocks,
            p.scale * LOG2E, **p.dims(), TOKENS=p.token_columns(block_m), **_opts(cfg, block_m, block_n),
        )  # fmt: skip
    return out, lse


def _forward_work(p: _Problem, cfg: PassConfig, block_m: int, block_n: int, chunk: int):
    """The forward's reverse index on query chunks of ``chunk`` tokens, and its work list."""
    rev = reverse_index(p.blocks, p.k.shape[2], p.n_blocks, chunk)
    return rev, work_list(rev, block_m // p.group, max(1, cfg.tiles_per_item // (p.block // block_n)))


def _slot_buffers(p: _Problem, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's partials (q's dtype) and their fp32 LSEs for ``tokens`` query tokens."""
    rows, q = p.slot_rows(tokens) * p.topk, p.q
    o_buf = buffers.new_buffer((rows, q.shape[3]), q.dtype, q.device)
    return o_buf, buffers.new_buffer((rows,), torch.float32, q.device)


def backward_chunks(p: _Problem) -> tuple[int, ReverseIndex]:
    """The backward's query tokens per chunk and its reverse index on those chunks."""
    chunk = query_chunk("bwd", p.q, p.topk)
    return chunk, reverse_index(p.blocks, p.k.shape[2], p.n_blocks, chunk)


class ChunkFollower(Protocol):
    """Work run after each query chunk of :func:`kv_outer_backward`, on its chunks
    (:func:`backward_chunks`), reading what its dK/dV kernel stored for the chunk in
    ``teacher``: per (token, selection head, slot) row and key of the block, the sum over the
    selection head's query heads of P (``kernels._store_group_sums``), fp32. MSA's KL, whose
    teacher that is (``msa_kl.kv_loss.KLBackward``)."""

    chunk: int
    rev: ReverseIndex
    teacher: torch.Tensor

    def run(self, c: int) -> None: ...


def kv_outer_backward(
    p: _Problem, out, lse, dout, dlse, follower: ChunkFollower | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes, given the forward's out and lse; ``dlse`` may be
    None. ``follower`` runs after each query chunk (:class:`ChunkFollower`)."""
    q, k = p.q, p.k
    b, s, hq, d = q.shape
    dims = p.dims()
    dout = dout.to(q.dtype).contiguous()
    delta = buffers.new_buffer((b, hq, s), torch.float32, q.device)
    dlse = delta if dlse is None else dlse.float().contiguous()  # the placeholder is not read
    kernels._delta_kernel[(triton.cdiv(b * s * hq, ROWS),)](
        out.contiguous(), dout, dlse, delta, b * s * hq, hq, s, d,
        ROWS=ROWS, D_PAD=dims["D_PAD"], HAS_DLSE=dlse is not delta,
    )  # fmt: skip

    cfg, block_m, block_n = _config("bwd", p)
    steps = p.block // block_n
    chunk, rev = backward_chunks(p) if follower is None else (follower.chunk, follower.rev)
    teacher = {}
    if follower is not None:
        teacher = {"TEACHER": follower.teacher, "HAS_TEACHER": True, "TOKENS": p.token_columns(block_m)}
    slot_dtype = dq_slot_dtype(q.dtype)
    slot_shape = (p.slot_rows(chunk) * p.topk, d)
    # Partials (fp32 dK and dV of a block) of ``PARTIAL_SHARE`` times the dQ slots' bytes: bf16
    # slots keep the bytes of fp32 ones in chunks twice as long, so the pool keeps its bytes
    # too, and with them the peak memory; a bf16 chunk's split groups, about twice as many
    # items, then outgrow it sooner and take longer items (``work_list``).
    pool = max(2, int(PARTIAL_SHARE * slot_shape[0] * d * slot_dtype.itemsize) // (p.block * d * 8))
    work = work_list(rev, block_m // p.group, cfg.tiles_per_item * steps, pool)
    if steps > 1:
        dq_cfg, dq_block_m, dq_block_n = _config("dq", p)
        dq_work = work_list(rev, dq_block_m // p.group, max(1, dq_cfg.tiles_per_item // (p.block // dq_block_n)))

    dk_sum = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_sum = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dq = buffers.new_buffer(q.shape, q.dtype, q.device)
    dq_buf = buffers.new_buffer(slot_shape, slot_dtype, q.device)
    dk_part, dv_part = (buffers.new_buffer((pool * p.block, d), torch.float32, q.device) for _ in range(2))
    reduce, sum_slots = _row_opts("reduce", p.block), _row_opts("sum_slots")
    reduce_grid = (min(work.splits_per_chunk * (p.block // reduce["ROWS"]), reduce_programs(q.device)),)
    for c in range(rev.n_chunks):
        kernels._bwd_kernel[(work.items_per_chunk, steps)](
            q, k, p.v, dout, lse, delta, rev.entries, work.tiles, work.items, work.chunk_items, work.partial,
            dk_sum, dv_sum, dk_part, dv_part, dq_buf, c, *p.chunk_args(chunk), p.scale * LOG2E, p.scale,
            **dims, HAS_DQ=steps == 1, **teacher, **_opts(cfg, block_m, block_n),
        )  # fmt: skip
        if steps > 1:
            kernels._dq_kernel[(dq_work.items_per_chunk,)](
                q, k, p.v, dout, lse, delta, rev.entries, dq_work.tiles, dq_work.items, dq_work.chunk_items, dq_buf,
                c, *p.chunk_args(chunk), p.scale * LOG2E, p.scale, **dims, **_opts(dq_cfg, dq_block_m, dq_block_n),
            )  # fmt: skip
        kernels._reduce_kernel[reduce_grid](
            work.splits, work.chunk_splits, dk_part, dv_part, dk_sum, dv_sum, c, s, k.shape[2], p.n_blocks,
            HEAD_DIM=d, D_PAD=dims["D_PAD"], BLOCK=p.block, **reduce,
        )  # fmt: skip
        kernels._sum_slots_kernel[(triton.cdiv(p.slot_rows(chunk), sum_slots["ROWS"]),)](
            dq_buf, p.blocks, dq, c, *p.slot_args(chunk), HEAD_DIM=d, D_PAD=dims["D_PAD"], **sum_slots
        )
        if follower is not None:
            follower.run(c)
    return dq, dk_sum.to(k.dtype), dv_sum.to(k.dtype)


class KVOuterAttention(torch.autograd.Function):
    """``sparse_attention`` of a ``BlockTopKIndex`` on the Triton backend."""

    @staticmethod
    def forward(ctx, q, k, v, index: BlockTopKIndex, scale: float):
        p = _Problem.of(q, k, v, index, scale)
        out, lse = kv_outer_forward(p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.scale = index, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p = _Problem.of(q, k, v, ctx.index, ctx.scale)
        return (*kv_outer_backward(p, out, lse, dout, dlse), None, None)
