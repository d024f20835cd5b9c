"""The cost model: seconds per training step of a run, by part, from the calibrated constants
(``calibration.py``) and the attention work per rank (``workload.py``).

A step is ``micro-batches x (layers x layer + embedding + output layer and loss)`` plus the
optimizer and the data-parallel gradient exchange. Per layer (one micro-batch, one rank):

* matmuls: the layer's linear layers at the GPU's matmul rate times a fitted factor that
  carries the elementwise work too (norms, RoPE, SwiGLU, residuals run once per matmul pass),
  once per pass (forward, recomputed forward, and twice for the backward); tensor-parallel
  all-gathers and reduce-scatters of the activations (sequence parallelism) per pass, exposed;
* attention: the kernels' time on the rank's work (``kernel_ms``), forward once per pass and
  backward once, on one GPU through the kernel ``sparse.dispatch`` picks, under context
  parallelism as the ring or the all-gather runs it (``attention_call``): the slowest rank's
  pieces, a fitted cost of the ring's keys at other ranks' positions and of each ring step,
  and the transfers each step cannot hide behind its kernels, NVLink inside a node and the
  network across nodes (a hierarchical ring hides each outer transfer behind a whole inner
  ring, but the forward's first, which has the index build and the first step);
* the vertical-slash index build (per pass: the recomputation builds it again), with its
  collectives under CP; MSA's selection (once per layer: it is kept for the recomputation),
  index projections and KL loss (on the KV-outer kernels on one GPU, on the union of tiles
  under CP), the dense KL of MSA's warmup;
* the metric step (attended area and recall) on logging iterations.

Communication figures are per link: ``nvlink`` (inside a node) and ``network`` (across nodes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..sparse.dispatch import KV_OUTER_MAX_BLOCK, KV_OUTER_MAX_SHARE, KV_OUTER_MAX_SHARE_WIDE, VARLEN_MIN_BLOCK
from ..sparse.validation import fail
from ..training.memory import kv_exchange
from .flops import attention_flops, layer_matmul_flops_per_token, mlp_share, model_flops
from .hardware import GPU, network_gb_s
from .workload import PATTERN_SOURCES, AttentionWork, WorkSpec, attention_work

PF = 1e15
DIRECTIONS = ("fwd", "bwd")
# Kernel families with a time per forward PFLOP of their work: "tile" and "bar" are the
# block_bar kernels' tiles and gathered vertical columns (dense attention on block_bar is all
# tiles), "<pattern>_union" a top-k index's union of tiles, "<pattern>_kv_outer" the KV-outer
# kernels on the useful area (an untrained MSA indexer's scattered selections apart),
# "sdpa" / "sdpa_flash" PyTorch's cuDNN / FlashAttention-2, "varlen" / "varlen_flash" a top-k
# index of wide blocks on varlen library calls (``varlen_blocks``) on the useful area: cuDNN's
# ragged attention (sm90) / PyTorch's FlashAttention-2 (sm80's).
FAMILIES = (
    "sdpa",
    "sdpa_flash",
    "varlen",
    "varlen_flash",
    "tile",
    "bar",
    "msa_union",
    "moba_union",
    "msa_kv_outer",
    "msa_untrained_kv_outer",
    "moba_kv_outer",
)


@dataclass
class Constants:
    """Every fitted constant; ``calibration.fit`` builds it from the tables, and says from
    which rows."""

    # family -> (fwd, bwd) ms per forward PFLOP of work; per query block of a block_bar launch.
    kernel_ms_per_pf: dict[str, tuple[float, float]]
    program_ms: tuple[float, float]
    # Ring: cost of keys at other ranks' positions (a share of the kernels' time), ms per
    # ring step; all-gather: ms per call.
    ring_positions: tuple[float, float] = (0.0, 0.0)
    ring_step_ms: tuple[float, float] = (0.0, 0.0)
    allgather_ms: tuple[float, float] = (0.0, 0.0)
    # Layers: non-attention time (matmuls, norms, RoPE, SwiGLU, residuals: each runs once
    # per matmul pass) over the matmuls' FLOPs at the GPU's matmul rate.
    matmul_efficiency: float = 1.0
    # The vertical-slash index build in a step, ms per million tokens; the metric step per
    # layer, ms per million tokens (dense records nothing; MSA adds its block recalls).
    index_ms_per_mtoken: float = 0.0
    index_key_share: float = 0.0  # the share of the build in the passes over the keys
    metrics_ms_per_mtoken: dict[str, float] = field(default_factory=dict)
    # Fixed part: output-layer GEMMs over their floor; passes over the logits over their
    # bytes at HBM bandwidth; the optimizer's time per parameter over HBM bandwidth (ms per
    # GParam at 1 TB/s); embedding ms per million tokens.
    output_efficiency: float = 1.0
    logits_pass_factor: float = 1.0
    optimizer_ms_per_gparam_tbs: float = 0.0
    embedding_ms_per_mtoken: float = 0.0
    # MSA: selection ms per (query, key, KV head, index dim) PFLOP-equivalent; KL on KV-outer
    # per useful PFLOP; KL on the union of tiles per computed PFLOP; warmup KL per causal PFLOP.
    msa_selection_ms_per_pf: float = 0.0
    msa_kl_ms_per_pf: float = 0.0
    msa_kl_union_ms_per_pf: float = 0.0
    msa_warmup_kl_ms_per_pf: float = 0.0
    # block_bar time with 64 x 64 tiles over the same work's with 128 x 128.
    block64_factor: float = 1.0


@dataclass(frozen=True)
class Run:
    """What the cost model reads of a run (``Run.from_args`` reads Megatron's arguments)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    seq: int
    params: int  # on the largest rank
    tp: int = 1
    cp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    # "full" (every layer or recomputed_layers of them), "mlp", "core_attn" or "none"
    recompute: str = "full"
    recomputed_layers: int | None = None
    grad_bytes: int = 4
    distributed_optimizer: bool = True
    sequence_parallel: bool = False
    log_interval: int = 1
    attention: object = None  # MTrainingAttentionConfig
    # The synthetic patterns to take where a type has several (workload.PATTERN_SOURCES).
    sources: tuple[str, ...] = ()
    backend: str = "auto"  # "sdpa" / "triton" force dense attention's kernels
    gpu: GPU = None
    gpus_per_node: int = 8
    network: str = "HDR-200"

    @property
    def shape(self) -> dict:
        return {
            "hidden_size": self.hidden,
            "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads,
            "num_query_groups": self.kv_heads,
            "kv_channels": self.head_dim,
            "padded_vocab_size": self.vocab,
        }

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp

    @property
    def micro_batches(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.world / self.gpus_per_node))

    def replace(self, **changes) -> Run:
        return dataclasses.replace(self, **changes)


@dataclass
class AttentionCall:
    """One layer's attention call on the slowest rank: kernels and exposed transfers (ms)."""

    exchange: str  # single | ring | hierarchical | allgather
    kernels: dict[str, float]  # fwd, bwd
    steps: dict[str, list[float]]  # fwd/bwd -> each ring step's time (its slowest rank's)
    comm_exposed: dict[str, dict[str, float]]  # fwd/bwd -> link -> ms
    comm_total: dict[str, dict[str, float]]
    critical_path: str = ""

    def total(self, direction: str) -> float:
        return self.kernels[direction] + sum(self.comm_exposed[direction].values())


def _ms(pf: float, per_pf: float) -> float:
    return pf / PF * per_pf


def kernel_ms(c: Constants, work: AttentionWork, direction: str, kernel: str, gpu: GPU, rank=None) -> float:
    """The kernels' time of ``work`` on one GPU (``rank`` None: the whole single-GPU call) or
    the all-gathered piece of ``rank`` (its queries against every key, one launch)."""
    i = DIRECTIONS.index(direction)
    d = work.head_dim
    if kernel in LIBRARY_KERNELS:
        return _ms(attention_flops(float(work.useful.sum()), d), c.kernel_ms_per_pf[kernel][i]) * gpu_factor(
            gpu, kernel
        )
    if kernel == "kv_outer":
        family = kv_outer_family(work)
        return (
            _ms(attention_flops(float(work.useful.sum()), d), c.kernel_ms_per_pf[family][i]) * gpu.attention_time_factor
        )
    tiles = work.single_tiles if rank is None else float(work.ring[rank].sum())
    bars = work.single_bars if rank is None else float(work.columns[rank])
    queries = work.seq if rank is None else work.seq // work.cp
    return block_bar_ms(c, work, tiles, bars, queries, 1, direction) * gpu.attention_time_factor


def kv_outer_family(work: AttentionWork) -> str:
    return f"{work.pattern}_untrained_kv_outer" if work.source == "untrained" else f"{work.pattern}_kv_outer"


# Library kernels timed on the useful area, each a family of its own.
LIBRARY_KERNELS = ("sdpa", "sdpa_flash", "varlen", "varlen_flash")


def gpu_factor(gpu: GPU, kernel: str) -> float:
    # PyTorch's fused attention on an sm80 GPU is FlashAttention-2 ("sdpa_flash", and the
    # varlen calls' "varlen_flash"), whose calibration is sm90's: carried like the plugin's kernels.
    flash = kernel in ("sdpa_flash", "varlen_flash")
    return gpu.attention_time_factor if flash and gpu.sdpa_kernel == "sdpa_flash" else 1.0


def block_bar_ms(
    c: Constants, work: AttentionWork, tiles: float, bars: float, queries: int, launches: int, direction: str
) -> float:
    """block_bar kernels' time: tiles (or a top-k index's union) and bars, plus a cost per
    query block and launch."""
    i = DIRECTIONS.index(direction)
    family = "tile" if work.pattern in ("dense", "mtraining") else f"{work.pattern}_union"
    d = work.head_dim
    ms = _ms(attention_flops(tiles, d), c.kernel_ms_per_pf[family][i]) + _ms(
        attention_flops(bars, d), c.kernel_ms_per_pf["bar"][i]
    )
    ms += launches * (queries / work.block) * c.program_ms[i]
    return ms * (c.block64_factor if work.block == 64 else 1.0)


def single_gpu_kernel(run: Run, pattern: str) -> str:
    """The kernel ``sparse.dispatch`` picks for a whole single-GPU call."""
    att = run.attention
    if pattern == "dense":
        if run.backend == "triton":
            return "block_bar"
        return run.gpu.sdpa_kernel
    if pattern in ("msa", "moba"):
        block, topk = _topk_settings(att, pattern)
        if block >= VARLEN_MIN_BLOCK:  # the varlen library calls: cuDNN's on sm90, FlashAttention-2's on sm80
            return "varlen" if run.gpu.sdpa_kernel == "sdpa" else "varlen_flash"
        share = topk * block / run.seq
        limit = KV_OUTER_MAX_SHARE if block <= KV_OUTER_MAX_BLOCK else KV_OUTER_MAX_SHARE_WIDE
        return "kv_outer" if share < limit else "block_bar"
    return "block_bar"


def _topk_settings(att, pattern: str) -> tuple[int, int]:
    if pattern == "msa":
        return att.msa.block_size, att.msa.topk
    return att.moba.chunk_size, att.moba.topk


def work_spec(run: Run, pattern: str) -> WorkSpec:
    att = run.attention
    settings = _topk_settings(att, pattern) if pattern in ("msa", "moba") else None
    if pattern == "mtraining":
        settings = att.mtraining
    source = next((s for s in run.sources if s in PATTERN_SOURCES.get(pattern, ())), None)
    layout = att.layout if run.cp > 1 else "striped"
    stripe = att.stripe if layout == "striped" else 128
    return WorkSpec(pattern, run.seq, run.heads, run.kv_heads, run.head_dim, settings, source, layout, stripe, run.cp)


def exchange_of(run: Run) -> str:
    """How K/V reach the queries (``training.memory.kv_exchange``); the gather inside nodes has
    no calibrated model yet (it has not run on NCCL), so the planner refuses it by name."""
    exchange = kv_exchange(run.attention, run.cp, run.tp, run.gpus_per_node)
    if exchange == "node_allgather":
        fail(
            "attention.kv_exchange",
            "allgather",
            f"'ring' or 'auto' with attention.hierarchy={run.attention.hierarchy} for the planner, which does not "
            "model K/V gathered inside nodes yet",
        )
    return exchange


def _link_gb_s(run: Run, crosses_nodes: bool) -> tuple[str, float]:
    if crosses_nodes:
        return "network", network_gb_s(run.network)
    return "nvlink", run.gpu.nvlink_gb_s


def attention_call(c: Constants, run: Run, pattern: str, work: AttentionWork, index_ms: float = 0.0) -> AttentionCall:
    """The slowest rank's attention in one layer call (forward and backward) with its
    exposed transfers. ``index_ms``: the index build that precedes it (the all-gather's
    transfer overlaps it)."""
    gpu, exchange, b = run.gpu, exchange_of(run), run.micro_batch
    empty = {d: {} for d in DIRECTIONS}
    if exchange == "single":
        kernel = single_gpu_kernel(run, pattern)
        times = {d: b * kernel_ms(c, work, d, kernel, gpu) for d in DIRECTIONS}
        return AttentionCall(exchange, times, {d: [t] for d, t in times.items()}, empty, empty)
    w = run.cp
    kv_bytes = run.local_seq * run.micro_batch * 2 * run.kv_heads * run.head_dim * 2
    if exchange == "allgather":
        kernels = {}
        for d in DIRECTIONS:
            i = DIRECTIONS.index(d)
            ms = b * max(kernel_ms(c, work, d, "block_bar", gpu, rank=r) for r in range(w)) + c.allgather_ms[i]
            kernels[d] = ms
        link, bw = _link_gb_s(run, crosses_nodes=run.cp * run.tp > run.gpus_per_node)
        # The gather (posted before the index build) and the backward's reduce-scatter of
        # whole-sequence dK/dV in the compute dtype.
        moved = (w - 1) * kv_bytes
        gather = moved / (bw * 1e9) * 1e3
        scatter = 2 * moved / (bw * 1e9) * 1e3
        exposed = {"fwd": {link: max(0.0, gather - index_ms)}, "bwd": {link: scatter}}
        moved_ms = {"fwd": {link: gather}, "bwd": {link: scatter}}
        return AttentionCall(exchange, kernels, {d: [t] for d, t in kernels.items()}, exposed, moved_ms)
    inner = run.attention.hierarchy if exchange == "hierarchical" else w
    # Whether a ring's neighbours share a node: TP ranks are consecutive, then CP.
    in_link, in_bw = _link_gb_s(run, inner * run.tp > run.gpus_per_node)
    out_link, out_bw = _link_gb_s(run, w * run.tp > run.gpus_per_node)
    kernels, steps, exposed, total, path = {}, {}, {}, {}, []
    for i, d in enumerate(DIRECTIONS):
        # Each rank's steps, then the slowest rank; a step's time is its slowest rank's.
        per_step = [
            [
                b * block_bar_ms(c, work, float(work.ring[r, s]), 0.0, run.local_seq, 1, d) * (1 + c.ring_positions[i])
                for s in range(w)
            ]
            for r in range(w)
        ]
        columns = [b * block_bar_ms(c, work, 0.0, float(work.columns[r]), 0.0, 0, d) for r in range(w)]
        kernels[d] = max(
            (sum(per_step[r]) + columns[r] * (1 + c.ring_positions[i])) * gpu.attention_time_factor
            + w * c.ring_step_ms[i]
            for r in range(w)
        )
        step_ms = [
            max(per_step[r][s] for r in range(w)) * gpu.attention_time_factor + c.ring_step_ms[i] for s in range(w)
        ]
        step_ms[-1] += max(columns) * gpu.attention_time_factor
        steps[d] = step_ms
        # A chunk's K/V (bf16) and dK/dV accumulator (fp32). Each inner transfer overlaps one
        # step (the next chunk is posted before the step's kernel). Outer transfers
        # (``ring_schedule``): the forward's first next chunk is posted before the index build
        # and needed after the first step; every later one, the backward's K/V (the first is
        # kept from the forward) and accumulators alike, overlaps a whole inner ring.
        kv_ms, inner_ms = kv_bytes / (out_bw * 1e9) * 1e3, kv_bytes * (1 if d == "fwd" else 3) / (in_bw * 1e9) * 1e3
        rings = [step_ms[o * inner : (o + 1) * inner] for o in range(w // inner)]
        exposed[d] = {in_link: sum(max(0.0, inner_ms - t) for ring in rings for t in ring[:-1])}
        total[d] = {in_link: inner_ms * (w - w // inner)}
        if exchange == "hierarchical":
            n_outer = w // inner
            # (transfer, the compute that hides it): forward K/V, the first behind the index
            # build and the first step; backward accumulators (fp32) and K/V but the first.
            if d == "fwd":
                windows = [(kv_ms, index_ms + step_ms[0])] + [(kv_ms, sum(r)) for r in rings[: n_outer - 2]]
            else:
                windows = [(kv_ms * ((o < n_outer - 2) + 2), sum(rings[o])) for o in range(n_outer - 1)]
            exposed[d][out_link] = exposed[d].get(out_link, 0.0) + sum(max(0.0, ms - t) for ms, t in windows)
            total[d][out_link] = total[d].get(out_link, 0.0) + sum(ms for ms, _ in windows)
            slowest = max(ms - t for ms, t in windows)
            hidden = "is hidden" if slowest <= 0 else f"is NOT hidden ({slowest:.2f} ms exposed at most)"
            path.append(
                f"{d}: the outer transfer ({out_link}, {kv_ms:.2f} ms a chunk's K/V) {hidden} behind "
                + ("the index build and the first step, then " if d == "fwd" else "")
                + f"the inner ring ({inner} steps, {min(sum(r) for r in rings):.2f} ms)"
            )
        elif in_link == "network":
            hidden = "hidden behind" if inner_ms <= min(step_ms[:-1]) else "NOT hidden behind"
            path.append(
                f"{d}: a flat ring across nodes: each step's transfer ({inner_ms:.2f} ms) is {hidden} its kernels"
            )
    return AttentionCall(exchange, kernels, steps, exposed, total, "; ".join(path))


def index_build_ms(c: Constants, run: Run, pattern: str) -> tuple[float, dict[str, float]]:
    """One vertical-slash index build (ms) and its collectives' time by link: the passes over
    the keys split over the CP ranks, the selection on every rank, the statistics' sums."""
    if pattern != "mtraining":
        return 0.0, {}
    whole = c.index_ms_per_mtoken * run.seq * run.micro_batch / 1e6
    if run.cp == 1:
        return whole, {}
    ms = whole * (c.index_key_share / run.cp + 1 - c.index_key_share)
    # fp64 column and pooled-diagonal mass, summed over the CP group (a ring all-reduce).
    blocks = run.seq // run.attention.mtraining.block_size
    moved = run.micro_batch * run.heads * (run.seq + blocks) * 8 * 2 * (run.cp - 1) / run.cp
    link, bw = _link_gb_s(run, run.cp * run.tp > run.gpus_per_node)
    return ms, {link: moved / (bw * 1e9) * 1e3}


@dataclass
class LayerPrediction:
    parts: dict[str, float]  # ms per layer per micro-batch on the slowest rank
    attention: AttentionCall
    work: AttentionWork
    comm: dict[str, float]  # exposed ms by link

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _passes(run: Run, layer_recomputed: bool) -> dict[str, float]:
    """Forward passes of the attention, and of the matmuls in forward units (the backward's
    are two)."""
    if not layer_recomputed or run.recompute == "none":
        return {"attention": 1, "matmul": 3}
    if run.recompute == "full":
        return {"attention": 2, "matmul": 4}
    if run.recompute == "core_attn":
        return {"attention": 2, "matmul": 3}
    return {"attention": 1, "matmul": 3 + mlp_share(run.shape)}


def predict_layer(
    c: Constants, run: Run, pattern: str, warmup: bool = False, recomputed: bool = True
) -> LayerPrediction:
    """One layer, one micro-batch, the slowest rank. ``warmup``: MSA's indexer warmup (dense
    main branch, KL against the whole distribution)."""
    gpu, tokens = run.gpu, run.local_seq * run.micro_batch
    passes = _passes(run, recomputed)
    main = "dense" if (pattern == "msa" and warmup) else pattern
    work = attention_work(work_spec(run, main))
    index_ms, index_comm = index_build_ms(c, run, main)
    call = attention_call(c, run, main, work, index_ms)
    matmul_flops = layer_matmul_flops_per_token(run.shape) * tokens / run.tp
    if pattern == "msa":
        msa = run.attention.msa
        matmul_flops += 2 * run.hidden * (run.kv_heads + 1) * msa.index_head_dim * tokens
    matmul_ms = matmul_flops / (gpu.matmul_tflops * 1e12) * 1e3 * c.matmul_efficiency
    parts = {
        "matmuls": matmul_ms * passes["matmul"],
        "attention_fwd": call.kernels["fwd"] * passes["attention"],
        "attention_bwd": call.kernels["bwd"],
    }
    comm: dict[str, float] = {}

    def add(link_ms: dict[str, float], times: float = 1.0):
        for link, ms in link_ms.items():
            comm[link] = comm.get(link, 0.0) + ms * times

    add(call.comm_exposed["fwd"], passes["attention"])
    add(call.comm_exposed["bwd"])
    if main == "mtraining":
        parts["index"] = index_ms * passes["attention"]
        add(index_comm, passes["attention"])
    if pattern == "msa":
        parts.update(_msa_parts(c, run, work, warmup))
    if run.tp > 1 and run.sequence_parallel:
        moved = tokens * run.hidden * 2 * (run.tp - 1) / run.tp
        link, bw = _link_gb_s(run, run.tp > run.gpus_per_node)
        ops = 4 * (passes["attention"] + 1)
        add({link: ops * moved / (bw * 1e9) * 1e3})
    for link, ms in comm.items():
        parts[f"comm_{link}"] = ms
    return LayerPrediction(parts, call, work, comm)


def _msa_parts(c: Constants, run: Run, work: AttentionWork, warmup: bool) -> dict[str, float]:
    msa = run.attention.msa
    seq, w = run.seq, run.cp
    if warmup:
        causal = run.micro_batch * seq * (seq + 1) / 2 * run.heads / w
        return {"msa_kl": _ms(attention_flops(causal, run.head_dim), c.msa_warmup_kl_ms_per_pf)}
    # Selection: every rank's queries score every key's index (one head per KV group).
    scored = run.micro_batch * (seq / w) * seq * run.kv_heads * msa.index_head_dim
    parts = {"msa_selection": scored / PF * c.msa_selection_ms_per_pf}
    if w == 1:
        useful = run.micro_batch * float(work.useful.sum())
        parts["msa_kl"] = _ms(attention_flops(useful, run.head_dim), c.msa_kl_ms_per_pf)
    else:
        computed = run.micro_batch * float(work.ring.sum(1).max())
        parts["msa_kl"] = _ms(attention_flops(computed, run.head_dim), c.msa_kl_union_ms_per_pf)
    return parts


@dataclass
class StepPrediction:
    """One training step of ``run`` with attention ``pattern``: seconds, throughput and parts."""

    pattern: str
    run: Run
    layer: LayerPrediction
    step_s: float
    parts_s: dict[str, float]  # per step, summed over micro-batches and layers
    comm_s: dict[str, float]  # exposed transfers and the gradient exchange, per link
    tokens_per_s: float
    mfu: float
    warmup: bool = False


def predict_step(c: Constants, run: Run, pattern: str, warmup: bool = False) -> StepPrediction:
    """Seconds per training step (one global batch) of ``run`` with attention ``pattern``."""
    gpu, tokens = run.gpu, run.local_seq * run.micro_batch
    n = run.micro_batches
    recomputed_layers = run.layers
    if run.recompute == "full" and run.recomputed_layers is not None:
        recomputed_layers = min(run.recomputed_layers, run.layers)
    layer = predict_layer(c, run, pattern, warmup)
    kept = predict_layer(c, run, pattern, warmup, recomputed=False) if recomputed_layers < run.layers else layer
    parts: dict[str, float] = {}
    for pred, count in ((layer, recomputed_layers), (kept, run.layers - recomputed_layers)):
        for name, ms in pred.parts.items():
            parts[name] = parts.get(name, 0.0) + ms * count * n / 1e3
    out_flops = 2 * run.hidden * run.vocab * tokens / run.tp
    logits_bytes = 3 * tokens * run.vocab / run.tp * 2
    parts["loss"] = n * (
        3 * out_flops / (gpu.matmul_tflops * 1e12) * c.output_efficiency
        + logits_bytes / (gpu.hbm_tb_s * 1e12) * c.logits_pass_factor
    )
    parts["embedding"] = n * c.embedding_ms_per_mtoken * tokens / 1e6 / 1e3
    shards = run.dp * run.cp if run.distributed_optimizer else 1
    parts["optimizer"] = c.optimizer_ms_per_gparam_tbs * run.params / shards / 1e9 / gpu.hbm_tb_s / 1e3
    if run.log_interval == 1:
        metric = c.metrics_ms_per_mtoken.get(pattern if not warmup else "msa", 0.0)
        parts["metrics"] = run.layers * metric * tokens / 1e6 / 1e3
    for link, s in _gradient_exchange_s(run).items():
        parts[f"grads_{link}"] = s
    step = sum(parts.values())
    comm = {
        link: parts.get(f"comm_{link}", 0.0) + parts.get(f"grads_{link}", 0.0)
        for link in ("nvlink", "network")
        if f"comm_{link}" in parts or f"grads_{link}" in parts
    }
    flops = model_flops(run.shape, run.seq, float(layer.work.useful.sum()) / (run.heads * run.seq * (run.seq + 1) / 2))
    useful = run.global_batch * (run.layers * flops["per_layer_useful"] + 3 * flops["output_layer_fwd"])
    tokens_per_s = run.global_batch * run.seq / step
    mfu = useful / step / (run.world * gpu.bf16_peak_tflops * 1e12)
    return StepPrediction(pattern, run, layer, step, parts, comm, tokens_per_s, mfu, warmup)


def _gradient_exchange_s(run: Run) -> dict[str, float]:
    """The gradients' reduction over data x context parallel ranks (reduce-scatter and the
    parameters' all-gather with the distributed optimizer, an all-reduce without), once a
    step and not overlapped (Megatron's overlap flags are off in the recipes)."""
    n = run.dp * run.cp
    if n == 1:
        return {}
    link, bw = _link_gb_s(run, n * run.tp > run.gpus_per_node)
    moved = run.params * (n - 1) / n * (run.grad_bytes + 2 if run.distributed_optimizer else 2 * run.grad_bytes)
    return {link: moved / (bw * 1e9)}
