"""``BlockMap``, in a module of its own so that both builders of a vertical-slash index's
tile tables take it, the torch one (``tables``) and the one-launch Triton one
(``tables_kernel``, which ``tables`` calls), with no import between them both ways."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMap:
    """Which of a sequence's blocks a context-parallel side holds (a rank's query rows, a
    ring step's chunk): ``ids`` [n] int32, the global block id of each local block,
    ascending; ``local`` [n_blocks] int32, the local index of each global block, -1 where
    not held (the inverse, so that a lookup costs one load)."""

    ids: torch.Tensor
    local: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, n_blocks: int) -> BlockMap:
        local = torch.full((n_blocks,), -1, dtype=torch.int32, device=ids.device)
        local[ids.long()] = torch.arange(len(ids), dtype=torch.int32, device=ids.device)
        return cls(ids.int().contiguous(), local)
