"""Context-parallel sparse attention over a process group, independent of Megatron."""

from .distributed_index import build_distributed_index
from .imbalance import RingStats, block_area_matrix, imbalance_degrees, simulate_ring_areas
from .layout import ContextParallelLayout
from .ring import ring_attention
from .step_index import StepIndex

__all__ = [
    "ContextParallelLayout",
    "RingStats",
    "StepIndex",
    "block_area_matrix",
    "build_distributed_index",
    "imbalance_degrees",
    "ring_attention",
    "simulate_ring_areas",
]
