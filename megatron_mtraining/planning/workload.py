"""What each rank's attention computes in one layer call: attended (query head, query, key)
triples per rank and ring step, from the real index builders and the ring's own schedule.

* ``mtraining``: a vertical-slash index at the run's length, built by the single-device
  builder's maths (``window_statistics_from_parts`` + ``select_vertical_slash``, the CPU path
  of ``build_vertical_slash_index``) on a synthetic pattern, or the kernel benchmark's index:

  - ``diffuse``: i.i.d. Gaussian queries and keys, the attention of a randomly initialised
    model (the mock-data training steps of ``docs/benchmarks.md``): no column or diagonal
    stands out, so the top-p budgets fill their caps. The caps bound every index the builder
    can return, so this is the most work the pattern can ask for at these settings;
  - ``natural``: ``scripts/bench_kernels.py``'s index (:func:`natural_index`), grown to a
    fixed density, the one the kernel and context-parallel tables were measured on.

  The ring's tiles per rank and step come from ``simulate_ring_areas`` on the layout (one
  order for the flat and the hierarchical ring); the vertical columns are each rank's local piece (``ring_work``).
* ``dense``: the causal triangle, split by the same simulation.
* ``msa`` / ``moba``: every query selects ``topk`` blocks (its own included), so the useful
  area has a closed form. The kernels that take a top-k index under context parallelism
  compute the union of a query block's selections (``block_bar``); the useful share of that
  union is the recorded one (``kernels.json`` ``union_share``, measured on the kernel
  benchmark's structured indexes). Ranks and steps share the area as the causal triangle
  does.

Building a diffuse index at 512K tokens takes a couple of minutes on a CPU; indexes are kept
in ``$MTRAINING_PLAN_CACHE`` (default ``~/.cache/megatron_mtraining/plan``). The works of the
calibration rows are kept in ``calibration/workloads.json`` (``python -m
megatron_mtraining.plan --refresh-workloads`` rewrites it), so that predicting a recorded
measurement needs no index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..context_parallel import ContextParallelLayout, imbalance_degrees, ring_work, simulate_ring_areas
from ..sparse import VerticalSlashConfig
from ..sparse.index import DenseIndex, VerticalSlashIndex, VerticalSlashPart
from ..sparse.vertical_slash import select_vertical_slash, window_statistics_from_parts
from .tables import table

# The synthetic patterns per attention type, the first the default.
PATTERN_SOURCES = {"mtraining": ("diffuse", "natural"), "msa": ("structured", "untrained"), "moba": ("structured",)}
# The kernel benchmark grows its index to this attended fraction (docs/benchmarks.md: 0.046 -
# 0.049 from 32K to 1M tokens).
NATURAL_DENSITY = 0.05
_CACHE_VERSION = 1


def natural_index(seq: int, block: int, density: float, gen: torch.Generator, heads: int) -> VerticalSlashIndex:
    """A vertical-slash index shaped like the paper's (slash lines dominate): per head
    the local block diagonals, a few far ones, sink columns and scattered columns,
    grown until the attended fraction reaches ``density`` (``scripts/bench_kernels.py``'s
    index, on the CPU)."""
    n_blocks = seq // block
    causal = seq * (seq + 1) / 2
    slash, vertical = [], []
    for _ in range(heads):
        diags, cols = list(range(4)), list(range(64))
        tiles = sum(n_blocks - d for d in diags) * block * block  # approximate areas, good enough to aim
        bars = sum(seq - c for c in cols)
        far = torch.randperm(n_blocks - 4, generator=gen)[: n_blocks // 8].add(4).tolist()
        scattered = iter(torch.randperm(seq - 64, generator=gen).add(64).tolist())
        while tiles + bars < density * causal:
            if far and tiles < 0.7 * density * causal:
                diags.append(far.pop())
                tiles += (n_blocks - diags[-1]) * block * block
            else:
                cols.append(next(scattered))
                bars += seq - cols[-1]
        slash.append(sorted(diags))
        vertical.append(sorted(cols))

    def pad(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32).unsqueeze(0)

    return VerticalSlashIndex(pad(vertical), pad(slash), seq_len=seq, block_size=block)


def _cache_dir() -> Path:
    return Path(os.environ.get("MTRAINING_PLAN_CACHE", Path.home() / ".cache" / "megatron_mtraining" / "plan"))


def vertical_slash_index(
    seq: int, config: VerticalSlashConfig, heads: int, kv_heads: int, head_dim: int, source: str = "diffuse"
) -> VerticalSlashIndex:
    """The vertical-slash index of ``source`` (``PATTERN_SOURCES["mtraining"]``) at ``seq``
    tokens, one sample, kept on disk (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    if source == "natural":
        return natural_index(seq, config.block_size, NATURAL_DENSITY, gen, heads)
    key = f"v{_CACHE_VERSION}-diffuse-{seq}-{heads}-{kv_heads}-{head_dim}-" + "-".join(
        f"{name}{getattr(config, name)}"
        for name in ("last_q", "vertical_topp", "slash_topp", "vertical_cap", "slash_cap", "block_size")
        + ("sink_tokens", "local_window")
    )
    path = _cache_dir() / f"{key}.pt"
    if path.exists():
        vertical, slash = torch.load(path)
        return VerticalSlashIndex(vertical, slash, seq_len=seq, block_size=config.block_size)
    window = min(config.last_q, seq)
    q_window = torch.randn(1, window, heads, head_dim, generator=gen)
    k = torch.randn(1, seq, kv_heads, head_dim, generator=gen)
    stats = window_statistics_from_parts(q_window, k, None, seq, config, head_dim**-0.5)
    index = select_vertical_slash(stats, config, seq)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save((index.vertical, index.slash), path)
    return index


def topk_useful_pairs(seq: int, block: int, topk: int, heads: int) -> float:
    """Attended triples of a top-k block selection where every query takes its own block (up
    to itself) and ``topk - 1`` whole earlier blocks where there are that many."""
    n = -(-seq // block)
    full = seq // block
    own = full * block * (block + 1) / 2 + (seq - full * block) * (seq - full * block + 1) / 2
    # Rows of block j (all but a partial last block's) take min(topk - 1, j) earlier blocks.
    earlier = sum(min(topk - 1, j) * block * min(block, seq - j * block) for j in range(n))
    return heads * (own + earlier)


def union_share(pattern: str, source: str, seq: int) -> float:
    """Recorded useful share of the union-of-tiles area of a top-k ``pattern`` on ``source``
    queries (``kernels.json``), interpolated in log(seq), held past the first and last points."""
    name = pattern if source == "structured" else f"{pattern}-{source}"
    points = sorted((p["seq"], p["share"]) for p in table("kernels")["union_share"][name])
    if seq <= points[0][0]:
        return points[0][1]
    for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False):
        if seq <= s1:
            t = math.log(seq / s0) / math.log(s1 / s0)
            return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0)))
    return points[-1][1]


@dataclass
class AttentionWork:
    """One layer's attention work per rank for one sample. Triples count (query head, query,
    key) attended. ``ring[r, s]``: what rank ``r`` computes on the tile kernels at ring step
    ``s`` (for a top-k index the union of tiles its query blocks walk); ``columns[r]``: its
    vertical-column piece (bars); ``useful[r]``: what it attends (the useful FLOPs)."""

    pattern: str
    source: str | None
    seq: int
    heads: int
    head_dim: int
    block: int
    ring: torch.Tensor
    columns: torch.Tensor
    useful: torch.Tensor
    # Tile triples of the whole computation on one GPU (CP 1), and bar triples.
    single_tiles: float
    single_bars: float

    @property
    def cp(self) -> int:
        return self.ring.shape[0]

    @property
    def degrees(self) -> tuple[float, float]:
        """(worker, step) imbalance degrees of the ring's area."""
        return imbalance_degrees(self.ring) if self.cp > 1 else (1.0, 1.0)

    def to_json(self) -> dict:
        return {
            "ring": self.ring.tolist(),
            "columns": self.columns.tolist(),
            "useful": self.useful.tolist(),
            "single": [self.single_tiles, self.single_bars],
        }

    @classmethod
    def from_json(cls, spec: WorkSpec, block: int, data: dict) -> AttentionWork:
        t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        ring, columns, useful = t(data["ring"]), t(data["columns"]), t(data["useful"])
        head = (spec.pattern, spec.source, spec.seq, spec.heads, spec.head_dim, block)
        return cls(*head, ring, columns, useful, *data["single"])


@dataclass(frozen=True)
class WorkSpec:
    """What determines an :class:`AttentionWork`: the pattern and its settings (a
    ``VerticalSlashConfig``, or ``(block, topk)`` for MSA / MoBA, None for dense), the
    synthetic pattern (``PATTERN_SOURCES``; None: the type's default), the sequence, the
    layout and the ring."""

    pattern: str
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    settings: object = None
    source: str | None = None
    layout: str = "striped"
    stripe: int = 128
    cp: int = 1

    def __post_init__(self):
        sources = PATTERN_SOURCES.get(self.pattern, (None,))
        if self.source is None:
            object.__setattr__(self, "source", sources[0])
        elif self.source not in sources:
            raise ValueError(
                f"pattern source {self.source!r} is not one of {self.pattern}'s (accepted: {', '.join(map(str, sources))})"
            )

    def replace_layout(self) -> WorkSpec:
        """The same index with no layout (what per-block tables depend on)."""
        return dataclasses.replace(self, layout="striped", stripe=128, cp=1)

    @property
    def key(self) -> str:
        """The key of a calibration row's work in ``workloads.json``."""
        if isinstance(self.settings, VerticalSlashConfig):
            c = self.settings
            settings = (
                f"b{c.block_size}-q{c.last_q}-v{c.vertical_topp}x{c.vertical_cap}-s{c.slash_topp}x{c.slash_cap}"
                f"-sink{c.sink_tokens}-w{c.local_window}"
            )
        else:
            settings = "-" if self.settings is None else "b{}-k{}".format(*self.settings)
        return f"{self.pattern}:{self.source}:{settings}:{self.seq}:{self.layout}:{self.stripe}:{self.cp}"


# While ``recording`` runs: every work asked for, computed afresh (``--refresh-workloads``).
_recorded: dict[str, AttentionWork] | None = None


def attention_work(spec: WorkSpec) -> AttentionWork:
    """The :class:`AttentionWork` of ``spec``: the calibration rows' from ``workloads.json``,
    any other computed (see the module docstring)."""
    if _recorded is not None:
        if spec.key not in _recorded:
            _recorded[spec.key] = compute_work(spec)
        return _recorded[spec.key]
    stored = table("workloads")["works"].get(spec.key)
    if stored is not None:
        return AttentionWork.from_json(spec, _block(spec), stored)
    return compute_work(spec)


@contextlib.contextmanager
def recording():
    """Every work asked for inside, computed and kept: ``{key: work}``."""
    global _recorded
    _recorded = found = {}
    try:
        yield found
    finally:
        _recorded = None


def _block(spec: WorkSpec) -> int:
    if spec.pattern == "mtraining":
        return spec.settings.block_size
    return 128


@functools.lru_cache(maxsize=256)
def compute_work(spec: WorkSpec) -> AttentionWork:
    """``spec``'s work, computed (kept for the process: a plan and a search ask for the same
    ones many times)."""
    seq, cp, block = spec.seq, spec.cp, _block(spec)
    head = (spec.pattern, spec.source, seq, spec.heads, spec.head_dim, block)
    if spec.pattern == "mtraining":
        index = vertical_slash_index(seq, spec.settings, spec.heads, spec.kv_heads, spec.head_dim, spec.source)
        tiles_index, bars = ring_work(index), VerticalSlashPart(index, "bars")
        if cp == 1:  # the closed-form areas; no per-block table
            tiles, bar = float(tiles_index.attended_area().sum()), float(bars.attended_area().sum())
            t = torch.tensor([[tiles]], dtype=torch.float64)
            return AttentionWork(*head, t, torch.tensor([bar], dtype=torch.float64), t.sum(1) + bar, tiles, bar)
        tiles, bar = _block_areas(spec.replace_layout())
        layout = ContextParallelLayout(spec.layout, cp, seq, stripe=spec.stripe)
        ring = simulate_ring_areas(tiles_index, layout, block, tiles)
        # A rank's bars are its rows' (the ring simulation's rows, summed over steps).
        columns = simulate_ring_areas(bars, layout, block, bar).sum(1)
        return AttentionWork(*head, ring, columns, ring.sum(1) + columns, float(ring.sum()), float(columns.sum()))
    if cp == 1:
        ring = torch.tensor([[spec.heads * seq * (seq + 1) / 2]], dtype=torch.float64)
    else:
        layout = ContextParallelLayout(spec.layout, cp, seq, stripe=spec.stripe)
        ring = simulate_ring_areas(DenseIndex(1, spec.heads, seq), layout, block)
    total, none = float(ring.sum()), torch.zeros(cp, dtype=torch.float64)
    if spec.pattern == "dense":
        return AttentionWork(*head, ring, none, ring.sum(1), total, 0.0)
    topk_block, topk = spec.settings
    useful = topk_useful_pairs(seq, topk_block, topk, spec.heads) / total
    computed = ring * (useful / union_share(spec.pattern, spec.source, seq))
    return AttentionWork(*head, computed, none, ring.sum(1) * useful, float(computed.sum()), 0.0)


@functools.lru_cache(maxsize=8)
def _block_areas(spec: WorkSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A vertical-slash index's tile and bar areas per (query block, key block), once per
    index whatever the layout."""
    index = vertical_slash_index(spec.seq, spec.settings, spec.heads, spec.kv_heads, spec.head_dim, spec.source)
    block = spec.settings.block_size
    return ring_work(index).block_areas(block), VerticalSlashPart(index, "bars").block_areas(block)
