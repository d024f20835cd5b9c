"""Single-device sparse attention: index types, pattern builders, exact attention.

Shapes: q ``[B, S, Hq, D]``, k and v ``[B, S, Hkv, D]`` (Hq a multiple of Hkv),
lse ``[B, Hq, S]`` float32; causal.
"""

from .attention import merge_attention_outputs, sparse_attention
from .documents import Documents, packed_documents
from .index import BlockColumns, BlockTopKIndex, DenseIndex, SparseIndex, VerticalSlashIndex
from .metrics import attention_recall, msa_recall
from .moba import MoBAConfig, build_moba_index
from .msa import (
    IndexBranch,
    MSAConfig,
    block_max_scores,
    msa_attention,
    msa_kl_loss,
    msa_kl_objective,
    msa_select_blocks,
)
from .vertical_slash import (
    VerticalSlashConfig,
    WindowStatistics,
    build_vertical_slash_index,
    select_vertical_slash,
    window_statistics,
)

__all__ = [
    "BlockColumns",
    "BlockTopKIndex",
    "DenseIndex",
    "Documents",
    "IndexBranch",
    "MSAConfig",
    "MoBAConfig",
    "SparseIndex",
    "VerticalSlashConfig",
    "VerticalSlashIndex",
    "WindowStatistics",
    "attention_recall",
    "block_max_scores",
    "build_moba_index",
    "build_vertical_slash_index",
    "merge_attention_outputs",
    "msa_attention",
    "msa_kl_loss",
    "msa_kl_objective",
    "msa_recall",
    "msa_select_blocks",
    "packed_documents",
    "select_vertical_slash",
    "sparse_attention",
    "window_statistics",
]
