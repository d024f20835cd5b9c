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
* ``balanced``: stripes of ``stripe`` tokens assigned from a packed sample's
  ``documents`` (``document_balance``), the same number on every rank, each rank's in
  ascending order. Without documents, or with one, it is ``striped``: striping is what
  balances one causal sequence, and nothing else is known about the sample. A micro-batch
  has its own layout, so everything derived from one (positions, orders) is kept for the
  latest documents only, per rank and device.

``node_size`` (``G``; default None, one node) numbers the ranks for a group spread over
``O = cp_size / G`` nodes, ``rank = node * G + local``: the kind places its tokens on *flat*
ranks ``local * O + node``, so consecutive flat ranks (consecutive stripes) go round the
nodes first. The hierarchical exchange that gathers K/V inside a node (``node_gather``) then
puts each block diagonal of the attention on one outer step for every rank, as striping puts
it on one ring step (``docs/benchmarks.md``, "All-gather inside a node, ring across nodes").

``token_positions(rank, device)`` holds a rank's positions on the host and the device
with what is derived from them (``TokenPositions``), once per layout, rank and device:
every layer and iteration of a run reuses it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sparse.documents import Documents, document_bounds
from ..sparse.index import position_lookup
from ..sparse.validation import check_choice, check_int, fail
from .document_balance import balanced_stripe_ranks

KINDS = ("contiguous", "zigzag", "striped", "balanced")
# The kinds whose stripe length moves tokens.
STRIPED_KINDS = ("striped", "balanced")


@dataclass(frozen=True)
class ContextParallelLayout:
    """``documents``: the packed sample's document boundaries (``cu_seqlens`` as a tensor, a
    ``Documents`` or a sequence of ints; kept as a tuple of ints, read once on the host),
    which only the ``balanced`` kind reads; the other kinds, and one document, keep None, so
    that layouts placing the same tokens compare equal."""

    kind: str
    cp_size: int
    seq_len: int
    stripe: int = 128
    documents: tuple[int, ...] | None = None
    node_size: int | None = None

    def __post_init__(self):
        check_choice("ContextParallelLayout.kind", self.kind, KINDS)
        check_int("ContextParallelLayout.cp_size", self.cp_size, minimum=1)
        check_int("ContextParallelLayout.seq_len", self.seq_len, minimum=1)
        check_int("ContextParallelLayout.stripe", self.stripe, minimum=1)
        if self.node_size is not None:
            check_int("ContextParallelLayout.node_size", self.node_size, minimum=1)
            if self.cp_size % self.node_size:
                fail("ContextParallelLayout.node_size", self.node_size, f"a divisor of cp_size ({self.cp_size})")
        striped = self.stripe * self.cp_size
        unit = {"contiguous": self.cp_size, "zigzag": 2 * self.cp_size, "striped": striped, "balanced": striped}[
            self.kind
        ]
        if self.seq_len % unit:
            how = {
                "contiguous": f"cp_size ({self.cp_size})",
                "zigzag": f"2 x cp_size ({unit})",
            }.get(self.kind, f"stripe x cp_size ({self.stripe} x {self.cp_size} = {unit})")
            fail("ContextParallelLayout.seq_len", self.seq_len, f"a multiple of {how} for the {self.kind} layout")
        documents = self.documents
        if documents is not None and not isinstance(documents, torch.Tensor | Documents):
            documents = torch.tensor(list(documents), dtype=torch.int64)
        bounds = document_bounds(documents, self.seq_len) if self.kind == "balanced" else None
        # One document places its tokens as none does (striped).
        object.__setattr__(self, "documents", bounds if bounds is not None and len(bounds) > 2 else None)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    def flat_rank(self, rank: int) -> int:
        """The rank whose tokens the kind places on ``rank`` (``node_size``: ``local * O + node``)."""
        if self.node_size is None:
            return rank
        node, local = divmod(rank, self.node_size)
        return local * (self.cp_size // self.node_size) + node

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions of the tokens rank ``rank`` holds, in its order (int64)."""
        check_int("rank", rank, minimum=0, maximum=self.cp_size - 1)
        w, rank = self.cp_size, self.flat_rank(rank)
        if self.kind == "contiguous":
            pos = torch.arange(rank * self.local_len, (rank + 1) * self.local_len)
        elif self.kind == "zigzag":
            c = self.seq_len // (2 * w)
            pos = torch.cat(
                [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * w - 1 - rank) * c, (2 * w - rank) * c)]
            )
        else:
            stripes = (
                torch.arange(self.seq_len // (self.stripe * w)) * w + rank
                if self.documents is None
                else torch.nonzero(_stripe_ranks(self) == rank).flatten()
            )
            pos = (stripes.view(-1, 1) * self.stripe + torch.arange(self.stripe)).flatten()
        return pos.to(device) if device is not None else pos

    def token_positions(self, rank: int, device) -> TokenPositions:
        """``positions(rank)`` as ``TokenPositions`` on ``device``: the same object for equal
        layouts, rank and device, so the tables derived from it are built once."""
        return _cached(_token_positions, self, rank, torch.device(device))

    def whole_sequence(self, device) -> TokenPositions:
        """Every position, in order: the keys of K/V gathered from all ranks."""
        return _token_positions(ContextParallelLayout("contiguous", 1, self.seq_len), 0, torch.device(device))

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full-sequence tensor ``x`` (sequence along ``dim``)."""
        if x.shape[dim] != self.seq_len:
            fail(f"x.shape[{dim}]", x.shape[dim], f"the layout's seq_len ({self.seq_len})")
        return x.index_select(dim, self.positions(rank, x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: the full sequence from every rank's part, in rank order."""
        if len(parts) != self.cp_size:
            fail("len(parts)", len(parts), f"cp_size ({self.cp_size}) parts, one per rank")
        return torch.cat(parts, dim).index_select(dim, self.gathered(self.ranks, parts[0].device).to_ascending)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.cp_size))

    def gathered(self, ranks: tuple[int, ...], device) -> GatheredTokens:
        """The tokens of ``ranks`` together (what an all-gather over them brings), ascending;
        of ``self.ranks``, the whole sequence."""
        return _cached(_gathered, self, tuple(ranks), torch.device(device))


@functools.lru_cache(maxsize=8)
def _stripe_ranks(layout: ContextParallelLayout) -> torch.Tensor:
    return balanced_stripe_ranks(layout.documents, layout.seq_len, layout.stripe, layout.cp_size)


# What is derived from a layout with documents, per (function, layout without its documents,
# arguments): the latest documents' only. Each micro-batch brings a layout, and an LRU cache
# of them would keep sequence-sized tables of past micro-batches alive on the device.
_LATEST: dict = {}


def _cached(make, layout: ContextParallelLayout, *args):
    """``make(layout, *args)``, from its LRU cache for a layout without documents, else kept
    until the same call comes with other documents."""
    if layout.documents is None:
        return make(layout, *args)
    key = (make, dataclasses.replace(layout, documents=None), *args)
    documents, value = _LATEST.get(key, (None, None))
    if documents != layout.documents:
        value = make.__wrapped__(layout, *args)
        _LATEST[key] = (layout.documents, value)
    return value


@dataclass(frozen=True)
class GatheredTokens:
    """The tokens of several ranks: ``keys`` ascending, ``to_ascending`` (where each of them lies
    among the ranks' parts concatenated in the ranks' order) and ``to_rank_major`` (its
    inverse: where each row of that concatenation lies among ``keys``)."""

    keys: TokenPositions
    to_ascending: torch.Tensor
    to_rank_major: torch.Tensor


@functools.lru_cache(maxsize=64)
def _gathered(layout: ContextParallelLayout, ranks: tuple[int, ...], device: torch.device) -> GatheredTokens:
    concatenated = torch.cat([layout.positions(r) for r in ranks])
    to_ascending = torch.argsort(concatenated)
    to_rank_major = torch.empty_like(to_ascending)
    to_rank_major[to_ascending] = torch.arange(len(to_ascending))
    return GatheredTokens(
        TokenPositions(concatenated[to_ascending], device), to_ascending.to(device), to_rank_major.to(device)
    )


class TokenPositions:
    """Global token positions held on the host and on one device, and facts derived from
    the positions alone (``derived``), each computed on first use and kept.

    The host copy serves bookkeeping that must not read the device; positions made on
    the device (the gathered vertical columns) are copied to the host only if such a
    fact is asked for. Entries of -1 are padding.
    """

    def __init__(self, positions: torch.Tensor, device):
        self._given = positions
        self.values = positions.to(device=device, dtype=torch.int64)
        self._derived: dict = {}

    @functools.cached_property
    def host(self) -> torch.Tensor:
        return self._given.cpu().long()

    @functools.cached_property
    def int32(self) -> torch.Tensor:
        """On the device, as the kernels read them."""
        return self.values.int()

    def derived(self, key, make: Callable[[TokenPositions], object]):
        """``make(self)``, computed once per ``key``."""
        if key not in self._derived:
            self._derived[key] = make(self)
        return self._derived[key]

    def index_of(self, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Index among these positions of each global position in ``positions`` (-1 where
        it is absent or padding), by a ``[seq_len + 1]`` table built once."""
        table = self.derived(("index table", seq_len), lambda p: position_lookup(p.values, seq_len))
        return table[torch.where(positions >= 0, positions, seq_len).long()]


# A run uses one layout (cp_size entries per rank: its own and every ring chunk's); the
# bound only limits what sweeps over many layouts (tests, benchmarks) keep alive.
@functools.lru_cache(maxsize=1024)
def _token_positions(layout: ContextParallelLayout, rank: int, device: torch.device) -> TokenPositions:
    return TokenPositions(layout.positions(rank), device)
