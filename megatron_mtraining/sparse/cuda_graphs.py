"""Replaying a function of CUDA tensors from a captured CUDA graph, cached by key.

The vertical-slash index build (``vertical_slash.build_vertical_slash_index``) launches
dozens of kernels, most of them small torch operations whose host launch time (~5-10 us
each) exceeds their device time; replayed from a graph they cost one launch.

A graph reads fixed input buffers and writes fixed output buffers. A call has its inputs
written straight into the graph's buffers by whatever produces them (the build's mass
kernel), rather than made elsewhere and copied in: an input may be large (the build's
runs, 64 MiB at 128K tokens), and a copy costs a read and a write of it. The call then
replays the graph and returns a copy of the outputs (one clone of a packed byte buffer):
the next replay overwrites the graph's own outputs, and one call's results (a layer's
index) must live until its backward. Calls on different streams are ordered by an event,
so one call never writes the buffers that another's replay is still reading.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from .host_tables import sources_of_capture
from .validation import fail

GRAPHS_ENV = "MTRAINING_INDEX_GRAPHS"


def graphs_enabled(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` may replay a graph: ``MTRAINING_INDEX_GRAPHS`` is not 0,
    the tensors are on CUDA, and no graph is being captured on the current stream (Megatron's
    own CUDA graphs then take in the eager operations) nor traced by torch.compile."""
    value = os.environ.get(GRAPHS_ENV, "1")
    if value not in ("0", "1"):
        fail(GRAPHS_ENV, value, "0 (build eagerly) or 1 (replay CUDA graphs where they apply, the default)")
    return (
        value == "1"
        and all(t.is_cuda for t in tensors)
        and not torch.cuda.is_current_stream_capturing()
        and not torch.compiler.is_compiling()
    )


class GraphedCalls:
    """Graphs by key, at most ``size`` of them (the least recently used is dropped).

    ``call(key, fn, inputs)`` returns ``fn(*inputs(...))``: a tuple of dataclasses whose
    tensor fields are the results. ``inputs(None)`` returns new input tensors, which the
    key's first call keeps as its graph's input buffers; on later calls ``inputs(buffers)``
    writes the call's inputs into those buffers (to copy a tensor ``x`` in:
    ``lambda out: (x.clone(),) if out is None else out[0].copy_(x)``). ``fn`` is captured on
    the key's first call; the key must fix everything ``fn`` does other than read its
    inputs' values, and the inputs' shapes and dtypes."""

    def __init__(self, size: int):
        self.size = size
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()

    def call(self, key: Hashable, fn: Callable, inputs: Callable) -> tuple:
        graph = self.graphs.pop(key, None)
        if graph is None:
            graph = _Graph(fn, inputs(None))
        else:
            graph.write(inputs)
        self.graphs[key] = graph
        if len(self.graphs) > self.size:
            _, dropped = self.graphs.popitem(last=False)
            dropped.done.synchronize()  # its memory goes back to the allocator: no replay may still use it
        return graph.replay()


class _Graph:
    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        self.inputs = inputs
        # Warm-up on a side stream, as capture requires: Triton compiles its kernels (which
        # cannot happen during capture) and the allocator sees the sizes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)
        self.graph = torch.cuda.CUDAGraph()
        # Captured on the side stream, ordered after the current one by the wait above, with
        # capture_begin / capture_end rather than ``torch.cuda.graph``: that one synchronizes
        # the device and empties the device and pinned-host caches at every capture, and a
        # packed-documents step captures once (its bounds are new), so every step would then
        # pay the device drain and allocate its activations and pinned tables afresh. Host
        # tables the captured code copies (``host_tables.to_device``) are copied again from
        # their pinned sources at every replay: kept while the graph lives.
        with sources_of_capture() as self.sources, torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.outputs = fn(*self.inputs)
                self.leaves = _tensor_leaves(self.outputs)
                self.packed = _pack(self.leaves)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.done = torch.cuda.Event()

    def write(self, inputs: Callable):
        """Has ``inputs`` write into the buffers once the last replay, on any stream, is done with them."""
        torch.cuda.current_stream().wait_event(self.done)
        inputs(self.inputs)

    def replay(self) -> tuple:
        self.graph.replay()
        packed = self.packed.clone()
        self.done.record(torch.cuda.current_stream())
        return _rebuild(self.outputs, self.leaves, packed)


def _tensor_fields(obj) -> dict[str, torch.Tensor]:
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return {name: v for name, v in values.items() if isinstance(v, torch.Tensor)}


def _tensor_leaves(outputs: tuple) -> list[torch.Tensor]:
    """The distinct tensors of ``outputs``."""
    return list({id(t): t for obj in outputs for t in _tensor_fields(obj).values()}.values())


# Each tensor's copy starts 16-byte aligned, as a fresh allocation does: Triton compiles a
# kernel for each alignment class of its pointers, and the sizes before a tensor (list
# widths) change from one key to the next.
ALIGN = 16


def _offsets(leaves: list[torch.Tensor]) -> list[int]:
    """Where each of ``leaves`` starts in the packed buffer, and its end last."""
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in leaves]
    return [0, *itertools.accumulate(sizes)]


def _pack(leaves: list[torch.Tensor]) -> torch.Tensor:
    offsets = _offsets(leaves)
    packed = torch.empty(offsets[-1], dtype=torch.uint8, device=leaves[0].device)
    for t, at in zip(leaves, offsets, strict=False):
        packed[at : at + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    return packed


def _rebuild(outputs: tuple, leaves: list[torch.Tensor], packed: torch.Tensor) -> tuple:
    """``outputs`` with each tensor field replaced by its copy in ``packed`` (views; a tensor
    that several fields share stays shared)."""
    copies = {}
    for t, at in zip(leaves, _offsets(leaves), strict=False):
        copies[id(t)] = packed[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return tuple(
        dataclasses.replace(obj, **{name: copies[id(t)] for name, t in _tensor_fields(obj).items()}) for obj in outputs
    )
