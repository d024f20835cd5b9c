"""``CudnnVarlen``: the varlen calls of ``library`` on cuDNN's ragged (THD) attention, through
NVIDIA's cudnn-frontend Python API (``pip install nvidia-cudnn-frontend``, imported as ``cudnn``;
the ``cudnn`` extra). On Hopper cuDNN's attention runs near its dense rate, where PyTorch's
FlashAttention-2 (``FlashVarlen``) reaches about half of it; PyTorch's own ragged cuDNN ops are
not used (their backward and graph cache are broken before torch 2.14, pytorch#186142, #191576).

The calls are ``FlashVarlen``'s (``library``'s docstring): rows ``[Tq, Hq, D]`` and keys
``[Tk, Hkv, D]`` cut into segments by int32 ``cu_q`` / ``cu_k``; causal segments bottom-right
aligned; the LSE fp32 ``[Hq, Tq]``; the backward differentiates the caller's output with the
caller's LSE (cuDNN's backward takes O and the softmax stats as inputs), no gradient through the
LSE. A segment with rows must have keys (the caller's always do: a whole block).

How the packed tensors are described to cuDNN (``thd_layout``, ``stats_layout``):

* q, k, v, O and their gradients: dims ``[b, H, s, D]`` (``b`` segments, ``s`` a bound on the
  segment length), strides ``[s*H*D, D, H*D, 1]``, and a ragged offset per segment,
  ``cu * H * D`` elements (int64, ``ragged_offsets``): segment ``i``'s row ``r``, head ``h`` is
  element ``(cu[i] + r) * H * D + h * D``, i.e. the packed ``[T, H, D]`` tensor itself.
* the softmax stats: dims ``[b, H, s, 1]``, strides ``[H*s, 1, H, 1]``, ragged offset
  ``cu * H``: the packed ``[T, H]`` tensor, our LSE transposed (``stats_from_lse``,
  ``lse_from_stats``: exact, a copy). Ragged stats need cuDNN 9.6.
* the segment lengths ``cu[1:] - cu[:-1]`` (int32, ``[b, 1, 1, 1]``) with cuDNN's padding mask.

All of these are built on the device from ``cu_q`` / ``cu_k`` by torch ops: nothing is read on
the host beyond what the caller passes (``max_q``, ``max_k``, the tensors' shapes).

Graphs are built once per ``GraphKey`` (building one plans and compiles kernels, far too slow
per call) and kept in ``_GRAPHS``; the handle is one per device, set to torch's current stream
on every call; the workspace comes from torch's allocator. A graph cuDNN declines is recorded in
``DECLINED`` with cuDNN's reason (warned once; any error while building counts) and its calls
run on ``FlashVarlen``: the same results, at FlashAttention-2's rate; the GPU tests require
``DECLINED`` empty. Errors while executing a built graph are raised.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .library import FlashVarlen, unsupported_inputs

logger = logging.getLogger(__name__)

CAPABILITY_MAJOR = 9  # sm90; on sm80 FlashAttention-2 runs at cuDNN's rate, sm100 is not tested here
# Ragged softmax stats ([T, H] packed, as the LSE is) and int64 ragged offsets came with 9.6.
MIN_BACKEND = 90600
# The smallest graph dimension: short segments share one graph, and s = 1 is no case cuDNN takes
# in the backward (s_q = s_kv = 1).
MIN_BUCKET = 64
REQUIREMENTS = (
    "fp16/bf16 CUDA inputs whose head dim is a multiple of 8 up to 256 on sm90, with nvidia-cudnn-frontend installed "
    f"and cuDNN >= {MIN_BACKEND}"
)


@functools.cache
def frontend():
    """``(cudnn module, None)``, or ``(None, why it cannot be used)``: not installed, no cuDNN
    library it can load, or a cuDNN older than ``MIN_BACKEND``."""
    try:
        import cudnn
    except Exception as e:  # ImportError, or an OSError of a library it loads
        return None, f"cudnn-frontend is not installed ({type(e).__name__}: {e}); pip install nvidia-cudnn-frontend"
    try:
        version = int(cudnn.backend_version())
    except Exception as e:
        return None, f"cudnn-frontend {cudnn.__version__} found no cuDNN library ({type(e).__name__}: {e})"
    if version < MIN_BACKEND:
        return None, f"cuDNN {version} is older than {MIN_BACKEND} (ragged softmax stats)"
    return cudnn, None


def unsupported(q: torch.Tensor) -> str | None:
    """Why ``CudnnVarlen`` cannot run on inputs like ``q``, or None. cuDNN's Hopper forward and
    backward take the inputs FlashAttention-2's do (its support matrix, 9.x)."""
    why_not = unsupported_inputs(q) or frontend()[1]
    if why_not is not None:
        return why_not
    capability = torch.cuda.get_device_capability(q.device)
    if capability[0] != CAPABILITY_MAJOR:
        return f"got a GPU of compute capability {capability}, used on sm90 only"
    return None


def bucket(n: int) -> int:
    """The graph dimension that serves ``n`` rows: the smallest of ``2^k`` and ``3 * 2^(k-1)``
    (at least ``MIN_BUCKET``) not below ``n``. ``max_q`` and the row counts change from call to
    call (how many rows chose a block is data), and every value would be a graph of its own: two
    buckets per doubling keep a training run to a few graphs per call shape (each slot's
    counts stay within a bucket or two, and slots share graphs) while a dimension is at most
    1.5x what it serves (cuDNN launches programs by ``s_q``: those past a segment's rows exit at
    once, as FlashAttention-2's do past ``max_q``; the backward's dQ accumulator is sized by the
    row bound)."""
    if n <= MIN_BUCKET:
        return MIN_BUCKET
    power = 1 << (n - 1).bit_length()  # the next power of two, >= n
    return power * 3 // 4 if power * 3 // 4 >= n else power


@dataclass(frozen=True)
class GraphKey:
    """Everything that fixes a cuDNN graph: the direction, dtype, heads, head dim, the number of
    segments, the dimension bounds (``s_q`` / ``s_k`` bucketed from ``max_q`` / ``max_k``, and in
    the backward the packed row counts that size its workspace), the mask, the scale (a graph
    constant), the backward's determinism and the device."""

    backward: bool
    dtype: torch.dtype
    hq: int
    hkv: int
    d: int
    segments: int
    s_q: int
    s_k: int
    causal: bool
    scale: float
    deterministic: bool = False
    rows_q: int = 0  # backward only: a bound on the packed rows (max_total_seq_len_q)
    rows_k: int = 0
    device: int = 0


def graph_key(backward, q, k, cu_q, max_q, max_k, causal, scale, device_index=None) -> GraphKey:
    """The key of a call (``device_index`` defaults to q's device)."""
    return GraphKey(
        backward=backward,
        dtype=q.dtype,
        hq=q.shape[1],
        hkv=k.shape[1],
        d=q.shape[2],
        segments=cu_q.shape[0] - 1,
        s_q=bucket(max_q),
        s_k=bucket(max_k),
        causal=bool(causal),
        scale=float(scale),
        deterministic=backward and torch.are_deterministic_algorithms_enabled(),
        rows_q=bucket(q.shape[0]) if backward else 0,
        rows_k=bucket(k.shape[0]) if backward else 0,
        device=q.device.index if device_index is None else device_index,
    )


def thd_layout(segments: int, heads: int, s: int, d: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of a packed ``[T, heads, d]`` tensor as cuDNN's ragged ``[b, H, s, D]``."""
    return [segments, heads, s, d], [s * heads * d, d, heads * d, 1]


def stats_layout(segments: int, heads: int, s: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of the packed ``[T, heads]`` stats as cuDNN's ragged ``[b, H, s, 1]``."""
    return [segments, heads, s, 1], [heads * s, 1, heads, 1]


def ragged_offsets(cu: torch.Tensor, per_row: int) -> torch.Tensor:
    """int64 ``[n + 1, 1, 1, 1]`` element offsets of each segment's first row, ``cu * per_row``."""
    return (cu.to(torch.int64) * per_row).view(-1, 1, 1, 1)


def seq_lens(cu: torch.Tensor) -> torch.Tensor:
    """int32 ``[n, 1, 1, 1]`` segment lengths."""
    return (cu[1:] - cu[:-1]).to(torch.int32).view(-1, 1, 1, 1)


def stats_from_lse(lse: torch.Tensor) -> torch.Tensor:
    """Our LSE ``[H, T]`` as cuDNN's packed stats ``[T, H]``, fp32 contiguous."""
    return lse.float().t().contiguous()


def lse_from_stats(stats: torch.Tensor) -> torch.Tensor:
    """cuDNN's packed stats ``[T, H]`` as our LSE ``[H, T]``, contiguous."""
    return stats.t().contiguous()


# Names of a graph's tensors, as ``_run`` binds them.
FORWARD_INPUTS = ("q", "k", "v", "seq_q", "seq_k", "off_q", "off_k", "off_stats")
FORWARD_OUTPUTS = ("o", "stats")
BACKWARD_INPUTS = ("q", "k", "v", "o", "do", "stats", "seq_q", "seq_k", "off_q", "off_k", "off_stats")
BACKWARD_OUTPUTS = ("dq", "dk", "dv")


def declare(cudnn, key: GraphKey, handle=None):
    """A cuDNN graph for ``key`` (not yet planned), and its tensors by name. Runs without a GPU
    up to ``validate`` and ``build_operation_graph`` (the CPU tests do)."""
    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[key.dtype]
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle, name="varlen_blocks"
    )
    b = key.segments
    t = {}

    def index(name, n, dtype):
        t[name] = graph.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)
        return t[name]

    index("seq_q", b, cudnn.data_type.INT32)
    index("seq_k", b, cudnn.data_type.INT32)
    for name in ("off_q", "off_k", "off_stats"):
        index(name, b + 1, cudnn.data_type.INT64)
    q_dims = thd_layout(b, key.hq, key.s_q, key.d)
    k_dims = thd_layout(b, key.hkv, key.s_k, key.d)
    s_dims, s_strides = stats_layout(b, key.hq, key.s_q)

    def packed(name, dims, offsets):
        t[name] = graph.tensor(name=name, dim=dims[0], stride=dims[1], data_type=io, ragged_offset=t[offsets])
        return t[name]

    q, k, v = packed("q", q_dims, "off_q"), packed("k", k_dims, "off_k"), packed("v", k_dims, "off_k")
    mask = {"use_padding_mask": True, "seq_len_q": t["seq_q"], "seq_len_kv": t["seq_k"], "attn_scale": key.scale}
    if key.causal:  # bottom-right: each segment's last row sees its last key (FlashAttention's varlen causal)
        mask["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        mask["diagonal_band_right_bound"] = 0
    if not key.backward:
        o, stats = graph.sdpa(q=q, k=k, v=v, generate_stats=True, name="sdpa", **mask)
        o.set_output(True).set_dim(q_dims[0]).set_stride(q_dims[1]).set_ragged_offset(t["off_q"])
        stats.set_output(True).set_data_type(f32).set_dim(s_dims).set_stride(s_strides)
        stats.set_ragged_offset(t["off_stats"])
        t["o"], t["stats"] = o, stats
        return graph, t
    o, do = packed("o", q_dims, "off_q"), packed("do", q_dims, "off_q")
    t["stats"] = graph.tensor(name="stats", dim=s_dims, stride=s_strides, data_type=f32, ragged_offset=t["off_stats"])
    dq, dk, dv = graph.sdpa_backward(
        q=q,
        k=k,
        v=v,
        o=o,
        dO=do,
        stats=t["stats"],
        max_total_seq_len_q=key.rows_q,
        max_total_seq_len_kv=key.rows_k,
        use_deterministic_algorithm=key.deterministic,
        name="sdpa_backward",
        **mask,
    )
    for name, grad, dims, offsets in (
        ("dq", dq, q_dims, "off_q"),
        ("dk", dk, k_dims, "off_k"),
        ("dv", dv, k_dims, "off_k"),
    ):
        grad.set_output(True).set_dim(dims[0]).set_stride(dims[1]).set_ragged_offset(t[offsets])
        t[name] = grad
    return graph, t


@dataclass
class _Graph:
    key: GraphKey
    graph: object
    tensors: dict  # name -> the graph's tensor
    workspace: int  # bytes


_GRAPHS: dict[GraphKey, _Graph | None] = {}  # None: declined (its calls run on FlashVarlen)
DECLINED: dict[GraphKey, str] = {}
_HANDLES: dict[int, object] = {}


def _handle(cudnn, device: torch.device):
    """The device's cuDNN handle, set to torch's current stream there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _HANDLES.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _HANDLES[index] = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream(index).cuda_stream)
    return handle


def _graph(key: GraphKey, device: torch.device) -> tuple[_Graph | None, object]:
    """The built graph of ``key`` (None where cuDNN declines it) and the device's handle."""
    cudnn = frontend()[0]
    handle = _handle(cudnn, device)
    if key not in _GRAPHS:
        try:
            with torch.cuda.device(device):
                graph, tensors = declare(cudnn, key, handle)
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                _GRAPHS[key] = _Graph(key, graph, tensors, int(graph.get_workspace_size()))
        except Exception as e:  # noqa: BLE001 - a graph that does not build is declined, never a failed step
            # cudnnGraphNotSupportedError where cuDNN has no engine for it; anything else is recorded
            # too (the GPU tests require DECLINED empty, so it cannot pass unseen), and the calls
            # still run, on FlashAttention-2.
            _GRAPHS[key] = None
            DECLINED[key] = f"{type(e).__name__}: {e}"
            logger.warning("cuDNN did not build the varlen graph %s (%s); its calls run on FlashAttention-2", key, e)
    return _GRAPHS[key], handle


def _run(entry: _Graph, handle, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Executes a graph on ``buffers`` (by tensor name) on the handle's stream."""
    workspace = torch.empty(max(entry.workspace, 1), dtype=torch.uint8, device=device)
    # Device addresses: the packed buffers are smaller than the [b, H, s, D] they are declared
    # as (the ragged offsets say where each segment lies), so no extents are compared.
    pack = {entry.tensors[name]: buffer.data_ptr() for name, buffer in buffers.items()}
    entry.graph.execute(pack, workspace, handle=handle)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte aligned start (cuDNN's vector loads)."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _indices(cu_q: torch.Tensor, cu_k: torch.Tensor, hq: int, hkv: int, d: int) -> dict[str, torch.Tensor]:
    return {
        "seq_q": seq_lens(cu_q),
        "seq_k": seq_lens(cu_k),
        "off_q": ragged_offsets(cu_q, hq * d),
        "off_k": ragged_offsets(cu_k, hkv * d),
        "off_stats": ragged_offsets(cu_q, hq),
    }


class CudnnVarlen:
    """cuDNN's ragged attention as ``FlashVarlen``'s calls (module docstring). Inputs fp16/bf16,
    the output in their dtype, the LSE fp32; under torch's deterministic mode the backward is
    cuDNN's deterministic one. Calls of graphs cuDNN declines run on ``FlashVarlen``."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        hq, d = q.shape[1], q.shape[2]
        if q.shape[0] == 0 or cu_q.shape[0] < 2:
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            return out, torch.full((hq, q.shape[0]), float("-inf"), device=q.device)
        key = graph_key(False, q, k, cu_q, max_q, max_k, causal, scale)
        entry, handle = _graph(key, q.device)
        if entry is None:
            return FlashVarlen.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
        q, k, v = _packed(q), _packed(k), _packed(v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        stats = torch.empty(q.shape[0], hq, dtype=torch.float32, device=q.device)
        buffers = {"q": q, "k": k, "v": v, "o": out, "stats": stats, **_indices(cu_q, cu_k, hq, k.shape[1], d)}
        _run(entry, handle, buffers, q.device)
        return out, lse_from_stats(stats)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        hq, d = q.shape[1], q.shape[2]
        # Keys of no segment with rows get no gradient (cuDNN need not write them).
        dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        if q.shape[0] == 0 or cu_q.shape[0] < 2:
            return torch.zeros(q.shape, dtype=q.dtype, device=q.device), dk, dv
        key = graph_key(True, q, k, cu_q, max_q, max_k, causal, scale)
        entry, handle = _graph(key, q.device)
        if entry is None:
            return FlashVarlen.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        inputs = {name: _packed(x) for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout))}
        buffers = {
            **inputs,
            "stats": stats_from_lse(lse),
            "dq": dq,
            "dk": dk,
            "dv": dv,
            **_indices(cu_q, cu_k, hq, k.shape[1], d),
        }
        _run(entry, handle, buffers, q.device)
        return dq, dk, dv
