"""Token layouts of one sequence over a context-parallel group.

A layout is a permutation: rank ``r`` holds the tokens ``positions(r)``, in that
order. Token-wise work (MLP, norms, loss) is unaffected; attention and RoPE use
the global positions.

* ``contiguous``: rank r holds ``[r*L, (r+1)*L)``.
* ``zigzag``: the sequence in ``2W`` chunks; rank r holds chunks ``r`` and
  ``2W-1-r`` (Megatron-Core's ``get_batch_on_this_cp_rank`` split). Balanced for
  dense causal attention, not for vertical-slash (its work sits on the diagonal).
* ``striped``: stripes of ``stripe`` tokens; rank r holds stripes ``r, r+W, ...``.
  Slash lines spread evenly over ranks and ring steps (MTraining).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sparse.validation import check_choice, check_int, fail

KINDS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class ContextParallelLayout:
    kind: str
    cp_size: int
    seq_len: int
    stripe: int = 128

    def __post_init__(self):
        check_choice("ContextParallelLayout.kind", self.kind, KINDS)
        check_int("ContextParallelLayout.cp_size", self.cp_size, minimum=1)
        check_int("ContextParallelLayout.seq_len", self.seq_len, minimum=1)
        check_int("ContextParallelLayout.stripe", self.stripe, minimum=1)
        unit = {"contiguous": self.cp_size, "zigzag": 2 * self.cp_size, "striped": self.stripe * self.cp_size}[
            self.kind
        ]
        if self.seq_len % unit:
            how = {
                "contiguous": f"cp_size ({self.cp_size})",
                "zigzag": f"2 x cp_size ({unit})",
                "striped": f"stripe x cp_size ({self.stripe} x {self.cp_size} = {unit})",
            }[self.kind]
            fail("ContextParallelLayout.seq_len", self.seq_len, f"a multiple of {how} for the {self.kind} layout")

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions of the tokens rank ``rank`` holds, in its order (int64)."""
        check_int("rank", rank, minimum=0, maximum=self.cp_size - 1)
        w = self.cp_size
        if self.kind == "contiguous":
            pos = torch.arange(rank * self.local_len, (rank + 1) * self.local_len)
        elif self.kind == "zigzag":
            c = self.seq_len // (2 * w)
            pos = torch.cat(
                [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * w - 1 - rank) * c, (2 * w - rank) * c)]
            )
        else:
            stripes = torch.arange(self.seq_len // (self.stripe * w)) * w + rank
            pos = (stripes.view(-1, 1) * self.stripe + torch.arange(self.stripe)).flatten()
        return pos.to(device) if device is not None else pos

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full-sequence tensor ``x`` (sequence along ``dim``)."""
        if x.shape[dim] != self.seq_len:
            fail(f"x.shape[{dim}]", x.shape[dim], f"the layout's seq_len ({self.seq_len})")
        return x.index_select(dim, self.positions(rank, x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: the full sequence from every rank's part, in rank order."""
        if len(parts) != self.cp_size:
            fail("len(parts)", len(parts), f"cp_size ({self.cp_size}) parts, one per rank")
        order = torch.cat([self.positions(r) for r in range(self.cp_size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(self.seq_len)
        return torch.cat(parts, dim).index_select(dim, inverse.to(parts[0].device))
