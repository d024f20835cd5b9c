"""Kernel layouts of ring steps: a ``StepIndex`` in the kernels' tile + bar form.

Local query block ``i`` and chunk key block ``j`` are global blocks ``gq[i]`` and
``gk[j]`` when the layout's stripes (or zigzag chunks) are whole blocks, which
``step_kernel_layout`` checks; tiles are then decided per global block pair and
causality inside a tile is left to the kernels, which compare global positions.
The local vertical-column pass gets the bars of each local query block over the
gathered columns.
"""

from __future__ import annotations

import torch

from ..sparse.index import BlockTopKIndex, DenseIndex, VerticalSlashPart, compact
from ..sparse.kernels.layout import KernelLayout, layout_from_membership, selection_union, slash_tiles, vertical_counts
from .step_index import StepIndex


def _block_aligned(positions: torch.Tensor, block: int) -> bool:
    """Runs of ``block`` consecutive positions, each starting at a multiple of ``block``."""
    if len(positions) % block:
        return False
    runs = positions.view(-1, block)
    return bool(
        (runs[:, 0] % block == 0).all() and (runs == runs[:, :1] + torch.arange(block, device=runs.device)).all()
    )


def _global_blocks(positions: torch.Tensor, block: int) -> torch.Tensor:
    return positions[::block] // block


def step_kernel_layout(step: StepIndex) -> KernelLayout | None:
    """The kernel layout of one ring step, or None when the kernels cannot serve it (the
    tokens are not whole blocks, or the index type has no kernel form)."""
    work, qpos, kpos = step.index, step.query_positions, step.key_positions
    host_q, host_k = step.host_query_positions, step.host_key_positions
    if isinstance(work, VerticalSlashPart):
        block = work.index.block_size
        if work.part == "bars":
            return _bars_layout(step, work, block) if _block_aligned(host_q, block) else None
    elif isinstance(work, BlockTopKIndex):
        block = min(work.block_size, 128)
    elif isinstance(work, DenseIndex):
        block = next((b for b in (128, 64, 32, 16) if _block_aligned(host_q, b) and _block_aligned(host_k, b)), None)
    else:
        return None
    if block is None or not (_block_aligned(host_q, block) and _block_aligned(host_k, block)):
        return None
    gq, gk = _global_blocks(qpos, block), _global_blocks(kpos, block)
    fields = {"query_positions": qpos.int(), "key_positions": kpos.int()}
    if isinstance(work, VerticalSlashPart):
        return KernelLayout(block, *slash_tiles(work.index.slash, gq, gk, work.index.num_blocks), **fields)
    diag = gq.view(-1, 1) - gk.view(1, -1)
    if isinstance(work, DenseIndex):
        member = (diag >= 0).view(1, 1, *diag.shape)
    else:
        ratio = work.block_size // block
        rowsel = work.blocks[:, qpos].permute(0, 2, 1, 3).contiguous()  # this rank's rows, global block ids
        chosen = selection_union(rowsel, block, -(-work.seq_len // work.block_size))
        member = chosen[..., gk // ratio] & (diag >= 0)
        fields.update(rowsel=rowsel, rowsel_ratio=ratio)
    return layout_from_membership(member, block, **fields)


def _bars_layout(step: StepIndex, work: VerticalSlashPart, block: int) -> KernelLayout:
    """No tiles; each local query block reads a prefix of its head's vertical columns, as
    indices into the gathered keys (see ``KernelLayout.bar_count``)."""
    index, dev = work.index, step.device
    n_qb = len(step.query_positions) // block
    n_kb = -(-len(step.key_positions) // block)
    # The gathered keys are the vertical columns in position order, so each head's list
    # maps to ascending local indices and a prefix by position is a prefix of the list.
    local_vertical = torch.where(index.vertical >= 0, step.local_key(index.vertical), -1)
    vertical, _ = compact(local_vertical.int(), local_vertical >= 0)
    last_rows = step.query_positions.view(n_qb, block).amax(-1)
    bounds = torch.arange(n_kb + 1, device=dev, dtype=torch.int32) * block
    none = torch.full((1, 1, n_qb, 1), -1, dtype=torch.int32, device=dev)
    none_t = torch.full((1, 1, n_kb, 1), -1, dtype=torch.int32, device=dev)
    return KernelLayout(
        block=block,
        tiles=none,
        tile_count=torch.zeros(1, 1, n_qb, dtype=torch.int32, device=dev),
        tiles_t=none_t,
        tile_t_count=torch.zeros(1, 1, n_kb, dtype=torch.int32, device=dev),
        vertical=vertical,
        bar_count=vertical_counts(index.vertical, last_rows, right=True),
        vertical_ptr=vertical_counts(vertical, bounds),
        active=index.active_diagonals().to(torch.int8),
        query_positions=step.query_positions.int(),
        key_positions=step.key_positions.int(),
    )
