"""Context-parallel sparse attention over a process group, independent of Megatron."""

from .distributed_index import IndexSource, build_index
from .hierarchy import inner_size_from_nodes, new_hierarchy
from .imbalance import RingStats, imbalance_degrees, ring_sources, ring_time_degree, simulate_ring_areas
from .layout import ContextParallelLayout
from .ring import ring_attention, ring_work
from .step_index import StepIndex

__all__ = [
    "ContextParallelLayout",
    "IndexSource",
    "RingStats",
    "StepIndex",
    "build_index",
    "imbalance_degrees",
    "inner_size_from_nodes",
    "new_hierarchy",
    "ring_attention",
    "ring_sources",
    "ring_time_degree",
    "ring_work",
    "simulate_ring_areas",
]
