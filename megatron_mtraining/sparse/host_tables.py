"""Small tables built on the host (window rows, document starts and lengths, gather
positions) copied to a GPU without a wait.

A copy from pageable host memory first waits for the stream to drain (CUDA's rule for
pageable host-to-device transfers), so a build that copied a table between its launches
ran in step with the GPU, each side idle while the other worked (the per-document index
build did, a copy per table). A copy from pinned memory is queued like a launch; PyTorch's
host allocator keeps the pinned block until the copy has run, and caches it for the next.

During a CUDA graph capture (Megatron's CUDA graphs take in an eager build) the graph
copies from its source again at every replay, so the source must be pinned (a capture
copies from no other host memory) and must outlive the graph: it is kept for the process,
a few hundred integers a capture, and a model captures a graph a layer once; a graph of
this package's own (``cuda_graphs``) keeps its sources itself (``sources_of_capture``) and
releases them with the graph.
"""

from __future__ import annotations

import contextlib

import torch

_CAPTURED_SOURCES: list[torch.Tensor] = []


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: on a GPU, copied from pinned memory without a
    wait, during a capture too."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED_SOURCES.append(pinned)
    return pinned.to(device, non_blocking=True)


@contextlib.contextmanager
def sources_of_capture():
    """Collects, into the list it yields, the sources copied during a capture inside the
    block, for the graph that replays them to keep (and to release with it) rather than the
    process."""
    start = len(_CAPTURED_SOURCES)
    kept: list[torch.Tensor] = []
    try:
        yield kept
    finally:
        kept.extend(_CAPTURED_SOURCES[start:])
        del _CAPTURED_SOURCES[start:]
