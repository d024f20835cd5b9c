"""Worker bodies for the gloo context-parallel tests (spawned processes import this)."""

import contextlib

import torch
import torch.distributed as dist
from host_reads import HostReads

from megatron_mtraining.context_parallel import (
    ContextParallelLayout,
    RingStats,
    ring_attention,
    ring_work,
    simulate_ring_areas,
)
from megatron_mtraining.context_parallel.hierarchy import hierarchy_ranks, new_hierarchy
from megatron_mtraining.context_parallel.ring_schedule import Accumulators, RingSchedule
from megatron_mtraining.patterns.dense import DensePattern
from megatron_mtraining.patterns.moba import MoBAPattern
from megatron_mtraining.patterns.msa import MSAPattern
from megatron_mtraining.patterns.vertical_slash import VerticalSlashPattern
from megatron_mtraining.sparse import (
    DenseIndex,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    build_moba_index,
    build_vertical_slash_index,
    msa_select_blocks,
    sparse_attention,
)

PATTERNS = ("dense", "vertical_slash", "moba", "msa")


def _global_index(kind, q, k, gen):
    b, s, hq, _ = q.shape
    if kind == "dense":
        return DenseIndex(b, hq, s), DensePattern()
    if kind == "vertical_slash":
        cfg = VerticalSlashConfig(last_q=16, vertical_topp=0.6, slash_topp=0.6, block_size=16, sink_tokens=2)
        return build_vertical_slash_index(q, k, cfg), VerticalSlashPattern(cfg)
    if kind == "moba":
        cfg = MoBAConfig(chunk_size=32, topk=3)
        return build_moba_index(q, k, cfg), MoBAPattern(cfg)
    q_idx = torch.randn(b, s, k.shape[2], 8, generator=gen, dtype=torch.float64)
    k_idx = torch.randn(b, s, 1, 8, generator=gen, dtype=torch.float64)
    cfg = MSAConfig(block_size=16, topk=3, index_head_dim=8)
    return msa_select_blocks(q_idx, k_idx, cfg, hq), MSAPattern(cfg, q_idx, k_idx)


def check_ring_equals_single_device(rank, world, seed, seq, inner_size=None, kinds=PATTERNS, kv_exchange="auto"):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = 2, 4, 2, 8
    hierarchy = new_hierarchy(inner_size) if inner_size else None
    for kind in kinds:
        q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
        g_out = torch.randn(b, seq, hq, d, generator=gen, dtype=torch.float64)
        g_lse = torch.randn(b, hq, seq, generator=gen, dtype=torch.float64)
        index, pattern = _global_index(kind, q, k, gen)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = sparse_attention(qr, kr, vr, index)
        grads = torch.autograd.grad((out * g_out).sum() + (lse.double() * g_lse).sum(), (qr, kr, vr))
        # With nodes, striping numbered node-major too (the node gather's balanced layout).
        node_major = [("striped", inner_size)] if inner_size else []
        for layout_kind, node_size in [("contiguous", None), ("zigzag", None), ("striped", None), *node_major]:
            layout = ContextParallelLayout(layout_kind, world, seq, stripe=16, node_size=node_size)
            where = f"cp={world} inner={inner_size} {kv_exchange} rank={rank} {kind} {layout_kind} node {node_size}"
            lq, lk, lv = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
            local_pattern = pattern
            if isinstance(pattern, MSAPattern):  # each rank has its tokens' index queries and keys
                local_pattern = pattern.with_inputs(
                    layout.shard(pattern.q_idx, rank), layout.shard(pattern.k_idx, rank)
                )
            if kind != "dense":
                built = local_pattern.distributed_index(lq, lk, layout, None, d**-0.5)
                if kind == "vertical_slash":
                    assert torch.equal(built.vertical, index.vertical) and torch.equal(built.slash, index.slash), where
                else:
                    mine = layout.positions(rank)
                    assert torch.equal(built.blocks[:, mine], index.blocks[:, mine]), where
            stats = RingStats(time_kernels=True)
            l_out, l_lse = ring_attention(
                lq, lk, lv, local_pattern, layout, None, hierarchy=hierarchy, stats=stats, kv_exchange=kv_exchange
            )
            torch.testing.assert_close(
                l_out, layout.shard(out, rank), atol=1e-12, rtol=0, msg=lambda m, where=where: f"{where}: {m}"
            )
            torch.testing.assert_close(l_lse, layout.shard(lse, rank, dim=2), atol=1e-6, rtol=0)
            loss = (l_out * layout.shard(g_out, rank)).sum() + (l_lse.double() * layout.shard(g_lse, rank, dim=2)).sum()
            for name, got, full in zip("qkv", torch.autograd.grad(loss, (lq, lk, lv)), grads, strict=True):
                torch.testing.assert_close(
                    got,
                    layout.shard(full, rank),
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m, n=name, where=where: f"{where} d{n}: {m}",
                )
            # The recorded areas (ring steps and the local bar pass) add up to the index's area.
            ring_area, local_area = stats.gather()
            total = ring_area.sum() + local_area.sum()
            assert total == float(index.attended_area().sum()), (where, total)
            if ring_area.shape[1] == world:  # the ring, step by step (one order, flat or hierarchical)
                simulated = simulate_ring_areas(ring_work(index), layout, 16)
                assert torch.equal(ring_area, simulated), (where, ring_area, simulated)
            elif inner_size and kv_exchange == "allgather":  # the node gather, by outer step
                assert ring_area.shape[1] == world // inner_size, where
                simulated = simulate_ring_areas(ring_work(index), layout, 16, node_size=inner_size)
                assert torch.equal(ring_area, simulated), (where, ring_area, simulated)
            # Timed: every piece with work has forward and backward time. A rank's column
            # piece runs whenever the index has columns, even where none is visible to its
            # queries outside their tiles (area 0): telling would read the index on the host.
            for phase in ("fwd", "bwd"):
                step_ms, local_ms, wait_ms = stats.gather_times(phase)
                assert step_ms.shape == ring_area.shape and local_ms.shape == wait_ms.shape == (world,), where
                assert torch.all(step_ms[ring_area > 0] > 0), (where, phase, step_ms, ring_area)
                assert torch.all(local_ms[local_area > 0] > 0), (where, phase, local_ms, local_area)
                assert torch.all(wait_ms >= 0), (where, phase, wait_ms)


def check_hierarchy_errors(rank, world):
    """Bad hierarchies and groups are named errors (world 4: nodes of 2)."""
    import pytest

    layout = ContextParallelLayout("striped", world, 64, stripe=4)
    q = torch.randn(1, 64 // world, 2, 8, dtype=torch.float64)
    kv = q[:, :, :1]
    inner, outer = new_hierarchy(2)
    everyone = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match=r"hierarchy='inner 4 x outer 2'.*== cp_size \(4\)"):
        ring_attention(q, kv, kv, DensePattern(), layout, None, hierarchy=(everyone, outer))
    with pytest.raises(ValueError, match=r"hierarchy=.*\(inner_group, outer_group\)"):
        ring_attention(q, kv, kv, DensePattern(), layout, None, hierarchy=(inner,))
    with pytest.raises(ValueError, match=r"hierarchy=.*\(its node\)"):
        ring_attention(q, kv, kv, DensePattern(), layout, None, hierarchy=(outer, inner))
    with pytest.raises(ValueError, match=r"layout.cp_size=2 .*size of cp_group \(4\)"):
        ring_attention(q, kv, kv, DensePattern(), ContextParallelLayout("striped", 2, 64, stripe=4), None)
    with pytest.raises(ValueError, match=r"pattern='dict'"):
        ring_attention(q, kv, kv, {}, layout, None)
    with pytest.raises(ValueError, match=r"kv_exchange='p2p'.*auto, ring, allgather"):
        ring_attention(q, kv, kv, DensePattern(), layout, None, kv_exchange="p2p")


def check_ring_with_kernels(rank, world, seed, seq, inner_size=None, dtype=torch.float32, kv_exchange="ring"):
    """The ring (or the all-gather) on the Triton kernels (CUDA, or the interpreter on CPU)
    in ``dtype`` against single-device fp64 attention: every step's tile tables, the
    local bar pass and the gradients that travel back. Kernel outputs are poisoned with
    NaN, so a row left unwritten by the in-kernel accumulation shows."""
    from megatron_mtraining.context_parallel import ring_work
    from megatron_mtraining.context_parallel.layout import TokenPositions
    from megatron_mtraining.context_parallel.step_tables import StepTables
    from megatron_mtraining.sparse import VerticalSlashIndex
    from megatron_mtraining.sparse.index import VerticalSlashPart
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar
    from megatron_mtraining.sparse.kernels.shared import buffers

    buffers.new_buffer = lambda shape, dt, dev: torch.full(shape, float("nan"), dtype=dt, device=dev)
    forward = block_bar.kernel_forward
    launches = []  # per forward launch: whether it attended gathered columns beside its tiles

    def recording_forward(*args, columns=None, **kwargs):
        launches.append(columns is not None)
        return forward(*args, columns=columns, **kwargs)

    block_bar.kernel_forward = recording_forward
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = 1, 4, 2, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hierarchy = new_hierarchy(inner_size) if inner_size else None
    tol = {torch.float32: 2e-5, torch.float16: 4e-3}[dtype]
    for kind in ("dense", "vertical_slash", "msa"):
        q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
        g_out = torch.randn(b, seq, hq, d, generator=gen, dtype=torch.float64)
        index, _ = _global_index(kind, q, k, gen)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = sparse_attention(qr, kr, vr, index)
        grads = torch.autograd.grad((out * g_out).sum(), (qr, kr, vr))
        node_gather = inner_size is not None and kv_exchange == "allgather"
        node_size = inner_size if node_gather else None  # the node gather's balanced numbering
        for layout_kind in ("striped", "zigzag"):
            layout = ContextParallelLayout(layout_kind, world, seq, stripe=16, node_size=node_size)
            where = f"kernels cp={world} inner={inner_size} {kv_exchange} {dtype} rank={rank} {kind} {layout_kind}"
            # Every step has tile tables (no silent fallback) wide enough for every list.
            mine = layout.token_positions(rank, "cpu")
            chunks = [layout.token_positions(src, "cpu") for src in range(world)]
            if node_gather:
                chunks = [
                    layout.gathered(tuple(range(n, n + inner_size)), "cpu").keys for n in range(0, world, inner_size)
                ]
            for keys in chunks:
                step = StepTables(ring_work(index), mine).of(keys)
                assert step is not None, where
                assert step.tile_count.max() <= step.tiles.shape[-1], where
                assert step.tile_t_count.max() <= step.tiles_t.shape[-1], where
            if isinstance(index, VerticalSlashIndex):
                columns = TokenPositions(torch.unique(index.vertical[index.vertical >= 0]), "cpu")
                assert StepTables(VerticalSlashPart(index, "bars"), mine).of(columns) is not None, where
            lq, lk, lv = (layout.shard(t, rank).to(device, dtype).requires_grad_() for t in (q, k, v))
            launches.clear()
            l_out, l_lse = ring_attention(
                lq,
                lk,
                lv,
                index.to(device),
                layout,
                None,
                hierarchy=hierarchy,
                backend="triton",
                kv_exchange=kv_exchange,
            )
            if kv_exchange == "ring" or node_gather:
                # The columns ride the last step's launch: one launch per step, no column piece.
                has_columns = isinstance(index, VerticalSlashIndex) and bool((index.vertical >= 0).any())
                assert launches[-1] == has_columns and not any(launches[:-1]), (where, launches)
                assert len(launches) <= world, (where, launches)
            else:
                # One launch in all, the vertical columns in the same tables as the tiles.
                assert launches == [False], (where, launches)
            assert l_out.dtype == dtype and l_lse.dtype == torch.float32, where
            torch.testing.assert_close(l_out.double().cpu(), layout.shard(out, rank), atol=tol, rtol=0)
            torch.testing.assert_close(l_lse.double().cpu(), layout.shard(lse, rank, dim=2).double(), atol=tol, rtol=0)
            loss = (l_out.double() * layout.shard(g_out, rank).to(device)).sum()
            for name, got, full in zip("qkv", torch.autograd.grad(loss, (lq, lk, lv)), grads, strict=True):
                assert got.dtype == dtype, where
                torch.testing.assert_close(
                    got.double().cpu(), layout.shard(full, rank), atol=5 * tol, rtol=0,
                    msg=lambda m, n=name, where=where: f"{where} d{n}: {m}",
                )  # fmt: skip


def check_host_reads(rank, world, seq_lens, kv_exchange):
    """Host reads per ring_attention forward and backward on the kernels (striped), after a
    first call has cached the layout's position facts: none for a vertical-slash or dense
    index, nor for a vertical-slash config (the distributed index build included), one (the
    table widths, ``StepTables``) for a top-k index; the same at every length and ring size."""
    gen = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seq in seq_lens:
        layout = ContextParallelLayout("striped", world, seq, stripe=32)  # whole blocks of every pattern
        for kind in PATTERNS:
            q, k, v = (torch.randn(1, seq, h, 16, generator=gen) for h in (2, 1, 1))
            index, pattern = _global_index(kind, q.double(), k.double(), gen)
            lq, lk, lv = (layout.shard(t, rank).to(device).requires_grad_() for t in (q, k, v))
            expected = [(index.to(device), int(kind in ("moba", "msa")))]
            if kind == "vertical_slash":
                with HostReads() as build:
                    pattern.distributed_index(lq, lk, layout, None, lq.shape[-1] ** -0.5)
                assert build.count == 0, (rank, seq, build.count)
                expected.append((pattern, 0))
            for pat, reads in expected:
                where = f"cp={world} rank={rank} seq={seq} {kind} {type(pat).__name__}"
                ring_attention(lq, lk, lv, pat, layout, None, backend="triton", kv_exchange=kv_exchange)
                with HostReads() as fwd:
                    out, _ = ring_attention(lq, lk, lv, pat, layout, None, backend="triton", kv_exchange=kv_exchange)
                with HostReads() as bwd:
                    torch.autograd.grad(out.sum(), (lq, lk, lv))
                assert (fwd.count, bwd.count) == (reads, 0), (where, fwd.count, bwd.count)


def check_ring_with_nothing_attended(rank, world, backend, kv_exchange):
    """An index that attends nothing (no diagonal, no column): no piece of the ring runs
    (the all-gather's one piece finds no tile), and every row gets what a row with no
    visible key gets on one device, out 0 and lse -inf, with zero gradients, never NaN."""
    from megatron_mtraining.sparse import VerticalSlashIndex

    seq, hq, hkv, d = 64, 4, 2, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    index = VerticalSlashIndex(
        torch.empty(1, hq, 0, dtype=torch.int32), torch.full((1, hq, 2), -1, dtype=torch.int32), seq, 16
    ).to(device)
    layout = ContextParallelLayout("striped", world, seq, stripe=16)
    q, k, v = (torch.randn(1, layout.local_len, h, d, device=device).requires_grad_() for h in (hq, hkv, hkv))
    out, lse = ring_attention(q, k, v, index, layout, None, backend=backend, kv_exchange=kv_exchange)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all()), rank
    for g in torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v)):
        assert torch.equal(g, torch.zeros_like(g)), rank


def check_ring_with_documents(
    rank,
    world,
    seed,
    seq,
    kernels: bool,
    kv_exchange: str,
    layouts=("contiguous", "zigzag", "striped"),
    inner_size: int | None = None,
):
    """Packed documents over the ring (or the all-gather): each pattern's distributed index
    with ``cu_seqlens`` equals the single-device one, and the rank's attention (fp64 on the
    reference path, or fp32 on the Triton kernels with poisoned outputs) equals fp64 dense
    attention under the index's mask, which stays inside the block-diagonal causal mask,
    gradients included; the recorded areas add up to the index's. ``layouts``: the kinds
    (``balanced`` placed by the boundaries); ``inner_size``: a hierarchical ring, inner rings
    of that many ranks (with ``allgather``, K/V gathered inside nodes of that many)."""
    from dense_reference import dense_attention, finite
    from documents_reference import block_diagonal, random_boundaries

    if kernels:
        from megatron_mtraining.sparse.kernels.shared import buffers

        buffers.new_buffer = lambda shape, dt, dev: torch.full(shape, float("nan"), dtype=dt, device=dev)
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = 1, 4, 2, 16
    # The ring's LSE is fp32, so its gradient's share is too (as in check_ring_equals_single_device).
    dtype, tol, grad_tol = (torch.float32, 2e-5, 1e-4) if kernels else (torch.float64, 1e-10, 1e-5)
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    hierarchy = new_hierarchy(inner_size) if inner_size else None
    cu = random_boundaries(gen, seq)
    allowed = block_diagonal(cu, seq)
    vs = VerticalSlashConfig(last_q=16, vertical_topp=0.5, slash_topp=0.5, block_size=16, sink_tokens=2, dense_below=32)
    msa = MSAConfig(block_size=16, topk=3, index_head_dim=8)
    for kind in PATTERNS:
        q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))
        scale = d**-0.5
        if kind == "msa":
            q_idx, k_idx = (torch.randn(b, seq, h, 8, generator=gen, dtype=torch.float64) for h in (hkv, 1))
            pattern = MSAPattern(msa, q_idx, k_idx)
        else:
            pattern = {"dense": DensePattern(), "vertical_slash": VerticalSlashPattern(vs)}.get(kind)
            # On the kernels a rank's tokens are whole tiles (a top-k tile is its block): chunks
            # of one stripe. The reference path takes chunks spanning two stripes, so ranks.
            pattern = pattern or MoBAPattern(MoBAConfig(chunk_size=16 if kernels else 32, topk=3))
        index = pattern.local_index(q, k, scale, cu)
        mask = index.to_dense_mask(seq)
        assert not (mask & ~allowed).any(), kind
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        out, lse = dense_attention(qr, kr, vr, mask, scale)
        g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad((out * g_out).sum() + (finite(lse) * g_lse).sum(), (qr, kr, vr))
        # The node gather's ranks numbered node-major, as the config does.
        node_size = inner_size if inner_size and kv_exchange == "allgather" else None
        for layout_kind in layouts:
            layout = ContextParallelLayout(layout_kind, world, seq, stripe=16, documents=cu, node_size=node_size)
            where = f"documents cp={world} inner={inner_size} {kv_exchange} kernels={kernels} rank={rank} {kind} {layout_kind}"
            lq, lk, lv = (layout.shard(t, rank).to(device).requires_grad_() for t in (q, k, v))
            local = pattern
            if kind == "msa":  # each rank has its tokens' index queries and keys
                local = pattern.with_inputs(layout.shard(q_idx, rank), layout.shard(k_idx, rank))
            built = local.distributed_index(lq, lk, layout, None, scale, cu.to(device))
            if kind == "vertical_slash":
                assert torch.equal(built.vertical, index.vertical) and torch.equal(built.slash, index.slash), where
            elif kind != "dense":
                mine = layout.positions(rank)
                assert torch.equal(built.blocks[:, mine], index.blocks[:, mine]), where
            stats = RingStats()
            l_out, l_lse = ring_attention(
                lq, lk, lv, local, layout, None, hierarchy=hierarchy, softmax_scale=scale, stats=stats,
                kv_exchange=kv_exchange, backend="triton" if kernels else None, cu_seqlens=cu.to(device),
            )  # fmt: skip
            assert not l_out.isnan().any(), where
            torch.testing.assert_close(
                l_out.double().cpu(), layout.shard(out, rank), atol=tol, rtol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
            torch.testing.assert_close(
                finite(l_lse.double().cpu()), finite(layout.shard(lse, rank, dim=2)), atol=max(tol, 1e-6), rtol=0
            )
            loss = (l_out.double() * layout.shard(g_out, rank).to(device)).sum()
            loss = loss + (finite(l_lse.double()) * layout.shard(g_lse, rank, dim=2).to(device)).sum()
            for name, got, full in zip("qkv", torch.autograd.grad(loss, (lq, lk, lv)), grads, strict=True):
                torch.testing.assert_close(
                    got.double().cpu(), layout.shard(full, rank), atol=grad_tol, rtol=0,
                    msg=lambda m, n=name, w=where: f"{w} d{n}: {m}",
                )  # fmt: skip
            ring_area, local_area = stats.gather()
            assert ring_area.sum() + local_area.sum() == float(index.attended_area().sum()), where


def check_document_statistics_reduced_once(rank, world, seed, seq):
    """The per-document vertical-slash index over ``world`` ranks with every document sparse
    (``dense_below`` 0: documents of one token, shorter than the window, of one block) equals
    the single-device one in every layout, and takes five collectives (the windows' gather,
    the row maxima and normalisers, the column and diagonal mass) whatever the number of
    documents."""
    from documents_reference import random_boundaries

    gen = torch.Generator().manual_seed(seed)
    cu = random_boundaries(gen, seq)
    config = VerticalSlashConfig(
        last_q=16, vertical_topp=0.5, slash_topp=0.5, block_size=16, sink_tokens=2, local_window=24, dense_below=0
    )
    q, k = (torch.randn(1, seq, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2))
    pattern = VerticalSlashPattern(config)
    want = pattern.local_index(q, k, 0.25, cu)
    collectives = []
    reduce = dist.all_reduce
    dist.all_reduce = lambda t, *args, **kwargs: collectives.append(t.shape) or reduce(t, *args, **kwargs)
    try:
        for kind in ("contiguous", "zigzag", "striped", "balanced"):
            layout = ContextParallelLayout(kind, world, seq, stripe=16, documents=cu)
            collectives.clear()
            got = pattern.distributed_index(layout.shard(q, rank), layout.shard(k, rank), layout, None, 0.25, cu)
            assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash), kind
            assert len(collectives) == 5, (kind, len(cu) - 1, collectives)
    finally:
        dist.all_reduce = reduce


@contextlib.contextmanager
def ring_traffic_only(limit: int):
    """Inside: every collective fails, and each point-to-point message (``batch_isend_irecv``,
    as ``RingExchange`` sends) must hold at most ``limit`` elements; yields the list of the
    message sizes seen."""
    names = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "broadcast", "all_to_all")
    saved = {name: getattr(dist, name) for name in (*names, "batch_isend_irecv")}
    sizes = []

    def refused(name):
        def call(*args, **kwargs):
            raise AssertionError(f"dist.{name} called inside the MSA KL ring")

        return call

    def batch(ops):
        for op in ops:
            sizes.append(op.tensor.numel())
            assert op.tensor.numel() <= limit, f"a ring message of {op.tensor.numel()} elements (limit {limit})"
        return saved["batch_isend_irecv"](ops)

    for name in names:
        setattr(dist, name, refused(name))
    dist.batch_isend_irecv = batch
    try:
        yield sizes
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def kl_launches():
    """Yields the names of the fused KL launches made inside, in order (none where Triton is
    not installed)."""
    launches = []
    try:
        from megatron_mtraining.sparse.kernels.msa_kl import loss  # imports Triton
    except ImportError:
        yield launches
        return
    names = ("index_lse", "kl_dq", "kl_dk", "kl_fused")
    saved = {name: getattr(loss, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            launches.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(loss, name, counted(name))
    try:
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(loss, name, fn)


MSA_KL_CASES = [
    # index kind, layout, batch, packed documents (cu_seqlens) or None
    ("topk", "striped", 2, None),
    ("topk", "zigzag", 1, None),
    ("topk", "contiguous", 2, None),
    ("dense", "striped", 1, None),
    ("dense", "zigzag", 2, None),
    ("dense", "contiguous", 1, None),
]
MSA_KL_DOCUMENT_CASES = [
    ("topk", "striped", 1, (0, 37, 80, 128)),
    ("dense", "zigzag", 1, (0, 50, 51, 128)),
]
# Fresh random boundaries per run (``documents_reference.random_boundaries``).
MSA_KL_RANDOM_DOCUMENT_CASES = [
    ("topk", "balanced", 1, "random"),
    ("dense", "zigzag", 1, "random"),
]


def check_msa_kl_ring(rank, world, seed, backend, dtype, cases, ring_lse=False):
    """MSA's KL under context parallelism (``ring_msa_kl``) on fresh random inputs: the zero
    scalar back-propagates and the value reaches ``on_value`` in the backward; the values
    summed over the ranks and the gradients of q_idx / k_idx (each rank's rows and keys)
    equal ``msa_kl_loss`` on the whole sequence. Inside the KL no collective runs and no
    message exceeds this rank's keys (``ring_traffic_only``). ``ring_lse``: the teacher's
    LSE from ``ring_attention`` (fp32), else the fp64/fp32 whole-sequence one, sharded.
    A case's documents ``"random"``: fresh random boundaries; the layout gets the documents
    (the balanced one places its stripes by them)."""
    from documents_reference import random_boundaries

    from megatron_mtraining.context_parallel.msa_kl import ring_msa_kl
    from megatron_mtraining.sparse import msa_kl_loss
    from megatron_mtraining.sparse.documents import packed_documents
    from megatron_mtraining.sparse.reference import forward_partial

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    seq, hq, hkv, d, di, block = 128, 4, 2, 16, 16, 16
    scale = 0.9 / d**0.5
    exact = dtype == torch.float64 and not ring_lse
    rtol = 1e-9 if exact else 2e-4
    for kind, layout_kind, b, cu in cases:
        if cu == "random":
            cu = tuple(random_boundaries(gen, seq).tolist())
        where = f"cp={world} rank={rank} {backend} {kind} {layout_kind} b={b} documents={cu}"
        layout = ContextParallelLayout(layout_kind, world, seq, stripe=16, documents=cu)
        q, k, v = (torch.randn(b, seq, h, d, generator=gen, dtype=dtype).to(device) for h in (hq, hkv, hkv))
        q_idx = torch.randn(b, seq, hkv, di, generator=gen, dtype=dtype).to(device)
        k_idx = torch.randn(b, seq, 1, di, generator=gen, dtype=dtype).to(device)
        g = float(torch.rand((), generator=gen)) + 0.5
        cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
        if kind == "dense":
            index = DenseIndex(b, hq, seq, device=device, documents=packed_documents(cu_seqlens, seq, device))
        else:
            cfg = MSAConfig(block_size=block, topk=3, index_head_dim=di)
            index = msa_select_blocks(q_idx, k_idx, cfg, hq, cu_seqlens=cu_seqlens)
        qr, kr = (t.clone().requires_grad_() for t in (q_idx, k_idx))
        want = msa_kl_loss(q, k, qr, kr, index, scale)
        (g * want).backward()

        mine = [layout.shard(t, rank) for t in (q, k, v, q_idx, k_idx)]
        lq, lk, lv, lqi, lki = mine
        if ring_lse:
            _, lse = ring_attention(lq, lk, lv, index, layout, None, softmax_scale=scale, kv_exchange="ring")
        else:
            lse = layout.shard(forward_partial(q, k, v, index, scale)[1], rank, dim=2)
        qi, ki = lqi.clone().requires_grad_(), lki.clone().requires_grad_()
        recorded = []
        limit = max(lk.numel(), lki.numel())  # this rank's keys (the dk_idx accumulator is smaller)
        with ring_traffic_only(limit) as sizes, kl_launches() as launches:
            out = ring_msa_kl(lq, lk, qi, ki, index, lse, layout, None, scale, recorded.append, backend)
            assert out.shape == () and out.item() == 0.0 and not recorded, where  # no KL forward
            (g * out).backward()
        assert sizes, where  # the ring ran
        if backend == "triton":  # the steps that attend run on the fused kernels, the others launch nothing
            # Each step's backward: one pass, or the dQ and dK kernels (deterministic mode).
            backward = launches.count("kl_fused") + launches.count("kl_dk")
            assert launches.count("kl_dq") == launches.count("kl_dk"), (where, launches)
            assert 0 < launches.count("index_lse") == backward <= world, (where, launches)
        else:
            assert not launches, (where, launches)
        assert len(recorded) == 1 and recorded[0].shape == () and recorded[0].dtype == torch.float32, where
        value = recorded[0].double().clone()
        dist.all_reduce(value)
        torch.testing.assert_close(
            value, want.detach().double(), rtol=1e-6, atol=1e-7, msg=lambda m, w=where: f"{w} value: {m}"
        )
        for name, got, full in (("dq_idx", qi.grad, qr.grad), ("dk_idx", ki.grad, kr.grad)):
            assert got.dtype == dtype, where
            parts = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(parts, got.contiguous())
            whole = layout.unshard(parts)
            tol = rtol * full.abs().max().item()
            torch.testing.assert_close(whole, full, rtol=rtol, atol=tol, msg=lambda m, w=where, n=name: f"{w} {n}: {m}")


def check_ring_schedule(rank, world, inner_size):
    """``RingSchedule`` and ``Accumulators`` alone, on chunks that name their owner: at step
    ``s`` rank ``r`` holds rank ``(r - s) mod W``'s chunk, forward and backward; every rank's
    own dK/dV is the sum of the parts of every rank that held its chunk; K/V cross nodes
    ``O - 1`` times a rank in the forward and ``O - 2`` in the backward (the first next chunk
    is kept), accumulators ``O`` times; within a node a rank sends at most one chunk a step
    but for its next chunk's one hop to local 0."""
    inner, outer = hierarchy_ranks(list(range(world)), rank, new_hierarchy(inner_size))
    g, n_outer, node, local = len(inner), len(outer), rank // inner_size, rank % inner_size
    sends = []
    batch = dist.batch_isend_irecv

    def counted(ops):
        sends.extend((op.peer // inner_size != node, op.tensor.numel()) for op in ops if op.op is dist.isend)
        return batch(ops)

    def chunk(value: float, sizes: tuple[int, int]) -> list[torch.Tensor]:
        return [torch.full((n,), value, dtype=torch.float64) for n in sizes]

    def counts(numel: int) -> tuple[int, int]:
        """(messages across nodes, within the node) of this size so far."""
        found = [across for across, n in sends if n == numel]
        return sum(found), len(found) - sum(found)

    two = n_outer > 1
    dist.batch_isend_irecv = counted
    try:
        own = chunk(rank, (3, 2))
        fwd = RingSchedule(inner, outer)
        fwd.post_first(own)
        held = [(int(c[0][0]), fwd.source(o, i)) for o, i, c in fwd.chunks(own)]
        assert held == [((rank - s) % world,) * 2 for s in range(world)], (rank, held)
        across, within = counts(3)
        ring_hops = g - 1 if local < g - 1 or not two else 0
        assert (across, within) == (n_outer - 1, n_outer * (ring_hops + (two and local > 0))), (rank, across, within)
        sends.clear()

        bwd = RingSchedule(inner, outer, phase="bwd", first_next=fwd.first_next)
        accumulators = Accumulators(bwd, lambda: chunk(0.0, (5, 4)))
        for o, i, c in bwd.chunks(own):
            s = o * g + i
            assert int(c[0][0]) == (rank - s) % world, (rank, o, i)
            accumulators.add(i, chunk(rank * 1000.0 + s, (5, 4)))
        dk, dv = accumulators.own()
        want = sum(((rank + s) % world) * 1000.0 + s for s in range(world))
        assert torch.equal(dk, torch.full((5,), want, dtype=torch.float64)), (rank, dk, want)
        assert torch.equal(dv, torch.full((4,), want, dtype=torch.float64)), (rank, dv, want)
        assert counts(3)[0] == max(0, n_outer - 2), rank
        assert counts(5)[0] == (n_outer if two else 0), rank
    finally:
        dist.batch_isend_irecv = batch
