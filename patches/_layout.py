"""The context-parallel token layout the patches make Megatron follow.

The ``balanced`` layout is a function of the micro-batch's documents. The batch split
(``cp_batch_split``) reads them from ``batch["cu_seqlens"]`` and records them here
(:func:`record_split_documents`); the RoPE slice of sbhd samples, which Megatron calls with
no batch at hand, and the core attention's check read the record (:func:`split_documents`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from megatron_mtraining.context_parallel.layout import KINDS, ContextParallelLayout
from megatron_mtraining.sparse.validation import check_choice, check_int

_ROPE_MODULES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YarnRotaryEmbedding",
}


@dataclass(frozen=True)
class LayoutChoice:
    """Layout kind, stripe and ``node_size`` (``ContextParallelLayout``'s: the ranks of a node
    when they are numbered node-major, for the exchange that gathers K/V inside nodes; None:
    flat); the CP size, sequence length and documents come from each call."""

    kind: str
    stripe: int = 128
    node_size: int | None = None

    def __post_init__(self):
        check_choice("layout_kind", self.kind, KINDS)
        check_int("stripe", self.stripe, minimum=1)
        if self.node_size is not None:
            check_int("node_size", self.node_size, minimum=1)

    def layout(self, cp_size: int, seq_len: int, documents=None) -> ContextParallelLayout:
        return ContextParallelLayout(
            self.kind, cp_size, seq_len, stripe=self.stripe, documents=documents, node_size=self.node_size
        )

    def positions(self, cp_size: int, seq_len: int, rank: int, device, what: str, documents=None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens on ``device`` (made once per layout, rank and
        device: every micro-batch splits the same few shapes); ``what`` names the split
        dimension in the error when ``seq_len`` does not divide into the layout."""
        try:
            layout = self.layout(cp_size, seq_len, documents)
        except ValueError as err:
            raise ValueError(f"{what}={seq_len} cannot be split over {cp_size} context-parallel ranks: {err}") from err
        return layout.token_positions(rank, device).values


_split_documents: tuple[int, ...] | None = None


def record_split_documents(documents: tuple[int, ...] | None) -> None:
    """Records the documents the batch split placed tokens by (None: none); a change clears
    the rotary modules' cached tables, which hold a micro-batch's positions under
    ``balanced``."""
    global _split_documents
    if documents != _split_documents:
        clear_rope_caches()
    _split_documents = documents


def split_documents() -> tuple[int, ...] | None:
    """The documents of the last batch split (None: none, or no split yet)."""
    return _split_documents


def clear_rope_caches() -> None:
    """Empties ``forward``'s cache of every imported Megatron rotary embedding class."""
    for module_name, class_name in _ROPE_MODULES.items():
        module = sys.modules.get(module_name)
        if module is not None:
            getattr(module, class_name).forward.cache_clear()
