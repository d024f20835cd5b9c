"""What an attention pattern is: the contract every module of this package fulfils.

A pattern is one class, registered under its ``attention.type`` name
(:func:`megatron_mtraining.patterns.register`). The class holds what is true of the pattern
whatever its settings (its settings dataclass, whether it has a trainable index branch, the
metrics it logs); its classmethods answer questions about one settings object (the checks
against a sequence, the memory model); an instance binds one settings object and builds
the index, on one device or over a context-parallel group. Instances are what the sparse
ring and the Megatron core attention take as ``pattern``.

Kernels are not part of a pattern: the index a pattern builds is plain data, and
``sparse/`` decides how it runs.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..context_parallel.layout import ContextParallelLayout
from ..context_parallel.step_tables import kernel_tiles
from ..sparse.documents import Documents
from ..sparse.index import BlockTopKIndex, SparseIndex
from ..sparse.validation import fail

# The per-layer index metrics every pattern logs (``training/attention_metrics.py`` records
# them): share of the attendable area attended (the causal area, within documents where
# they are packed), with packed documents that area's share of the whole causal area, dense
# attention mass kept (recall over the last rows, and over sampled rows that did not build
# the index: :meth:`Pattern.building_rows`), and the ring's imbalance between workers and
# between steps.
FRACTION_METRIC = "attended_fraction"
DOCUMENT_AREA_METRIC = "document_area"
RECALL_METRIC = "index_recall"
HELDOUT_RECALL_METRIC = "index_recall_heldout"
WORKER_METRIC = "worker_imbalance"
STEP_METRIC = "step_imbalance"
INDEX_METRICS = (
    FRACTION_METRIC, DOCUMENT_AREA_METRIC, RECALL_METRIC, HELDOUT_RECALL_METRIC, WORKER_METRIC, STEP_METRIC
)  # fmt: skip


class Pattern:
    """An attention pattern bound to its settings (``self.config``).

    Subclasses set ``name`` and, where the pattern has settings, ``settings`` (a
    ``ValidatedConfig`` dataclass: the ``attention.<name>`` section of the plugin config) and
    ``size_field`` (the settings field giving the key block size that the sequence must
    exceed); they implement :meth:`local_index` and :meth:`distributed_index`.
    """

    name: ClassVar[str]
    settings: ClassVar[type | None] = None
    size_field: ClassVar[str | None] = None
    # A trainable index branch (MSA): the layer owns its parameters, trains them with an
    # auxiliary KL loss, needs the layer input, and checkpoints gain its keys.
    has_index_branch: ClassVar[bool] = False
    metrics: ClassVar[tuple[str, ...]] = INDEX_METRICS

    def __init__(self, config=None):
        if self.settings is None:
            if config is not None:
                fail(f"{type(self).__name__} config", type(config).__name__, "None (the pattern has no settings)")
        else:
            config = self.settings() if config is None else config
            if not isinstance(config, self.settings):
                fail(f"{type(self).__name__} config", type(config).__name__, f"a {self.settings.__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'' if self.config is None else repr(self.config)})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.config == self.config

    __hash__ = None

    # Index builders.
    def local_index(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None
    ) -> SparseIndex:
        """The index of the whole sequence held on this device (q ``[B, S, Hq, D]``, k ``[B, S, Hkv, D]``).
        ``cu_seqlens``: packed documents (flash-attn's varlen boundaries, int32 ``[0, ..., S]``;
        ``sparse.documents``), which no row's attention crosses; None: one document."""
        raise NotImplementedError

    def distributed_index(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        layout: ContextParallelLayout,
        group,
        scale: float,
        cu_seqlens: torch.Tensor | None = None,
    ) -> SparseIndex:
        """The index :meth:`local_index` would build on the whole sequence, from this rank's
        tokens of a context-parallel group (in ``layout``'s order), with no rank gathering
        the sequence. Top-k indices need rows only for this rank's queries. ``cu_seqlens``:
        the whole sequence's packed documents, by global position, on every rank."""
        raise NotImplementedError

    def building_rows(self, seq: int, documents: Documents | None = None) -> list[tuple[int, int]]:
        """The query rows (``[start, end)`` ranges of global positions) whose dense attention
        the index is built from, which the held-out recall samples none of: none unless the
        pattern says so (MSA and MoBA select each row from its own index scores)."""
        return []

    # Facts of one settings object.
    @classmethod
    def ring_tiles(cls, config) -> tuple[int, ...]:
        """The tile sizes the ring's kernels take this pattern's index in (``StepTables``):
        a rank's tokens must come in whole, aligned runs of one of them, or every ring step
        runs the PyTorch reference path. This base is the top-k patterns'."""
        return kernel_tiles(BlockTopKIndex, getattr(config, cls.size_field))

    @classmethod
    def check_sequence(cls, config, seq_length: int, where: str) -> None:
        """Fails where ``config`` cannot be sparse on ``seq_length`` tokens: a block covering
        the whole sequence, or a top-k taking every block, is dense attention."""
        if cls.size_field is None:
            return
        size = getattr(config, cls.size_field)
        if size >= seq_length:
            fail(
                f"{where}.{cls.size_field}",
                size,
                f"a power of two below seq_length ({seq_length}): one block covering the whole sequence is dense "
                "attention (type 'dense')",
            )
        topk = getattr(config, "topk", None)
        blocks = -(-seq_length // size)
        if topk is not None and topk >= blocks:
            fail(
                f"{where}.topk",
                topk,
                f"at most {blocks - 1}: seq_length / {cls.name}.{cls.size_field} = {seq_length} / {size} gives "
                f"{blocks} blocks, and selecting all of them is dense attention (type 'dense')",
            )

    @classmethod
    def index_parameters(cls, config, hidden_size: int, query_groups: int) -> int:
        """Parameters the pattern adds to a layer (replicated over tensor parallelism)."""
        return 0

    @classmethod
    def index_state_bytes(cls, config, batch: int, heads: int, query_groups: int, seq: int, local_seq: int) -> float:
        """Bytes a layer keeps for its backward beyond q/k/v/output/LSE: the index, and the
        index branch's projections where there is one (``seq`` the whole sequence,
        ``local_seq`` a context-parallel rank's share)."""
        return 0.0
