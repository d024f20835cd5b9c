"""The vertical-slash index build replayed from CUDA graphs (``sparse.cuda_graphs``), and its
one-launch kernels: the top-p take (``sparse.kernels.index_build.top_p``) and the tile tables
(``sparse.kernels.block_bar.tables_kernel``).

On CPU: the fallback choice, the graph key, the cache's bounds, the packing of the results,
the mass pass rewriting the graph's buffers, and the two kernels in Triton's interpreter. On
a GPU: graphed builds equal eager ones bit for bit, call after call, without touching earlier
calls' results, and the fallbacks build eagerly.
"""

import dataclasses
import gc
import os
import weakref

import pytest
import torch
from documents_reference import random_boundaries

from megatron_mtraining.sparse import (
    VerticalSlashConfig,
    VerticalSlashIndex,
    build_vertical_slash_index,
    cuda_graphs,
    host_tables,
    sparse_attention,
    vertical_slash,
)
from megatron_mtraining.sparse.kernels.block_bar.tables import (
    TileTables,
    keep_tables,
    kept_tables,
    tile_tables,
    vertical_slash_tables,
)

CFG = VerticalSlashConfig(last_q=64, vertical_topp=0.7, slash_topp=0.8, block_size=64, sink_tokens=3, local_window=100)


@pytest.fixture
def graphs(monkeypatch):
    """An empty graph cache for the build, so each test sees only its own graphs."""
    cache = cuda_graphs.GraphedCalls(size=2)
    monkeypatch.setattr(vertical_slash, "_GRAPHS", cache)
    monkeypatch.delenv(cuda_graphs.GRAPHS_ENV, raising=False)
    monkeypatch.delenv("MTRAINING_ATTENTION_BACKEND", raising=False)
    return cache


def qk(rng, seq=3000, heads=(16, 2), d=128, device="cuda", dtype=torch.bfloat16):
    q = torch.randn(1, seq, heads[0], d, generator=rng).to(device, dtype)
    k = torch.randn(1, seq, heads[1], d, generator=rng).to(device, dtype)
    return q, k


def eager(q, k, cfg=CFG, softmax_scale=None):
    """The eager build and its tile tables, as sparse_attention would build them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cuda_graphs.GRAPHS_ENV, "0")
        index = build_vertical_slash_index(q, k, cfg, softmax_scale)
    assert kept_tables(index) is None
    return index, tile_tables(index)


def table_tensors(tables: TileTables) -> dict:
    return {name: t for name, t in vars(tables).items() if isinstance(t, torch.Tensor)}


def assert_same(got: tuple, want: tuple):
    (index, tables), (want_index, want_tables) = got, want
    assert torch.equal(index.vertical, want_index.vertical) and torch.equal(index.slash, want_index.slash)
    assert (index.seq_len, index.block_size) == (want_index.seq_len, want_index.block_size)
    got_t, want_t = table_tensors(tables), table_tensors(want_tables)
    assert got_t.keys() == want_t.keys() and tables.block == want_tables.block
    for name, t in got_t.items():
        assert t.dtype == want_t[name].dtype and torch.equal(t, want_t[name]), name


def snapshot(result: tuple) -> tuple:
    index, tables = result
    copy = VerticalSlashIndex(index.vertical.clone(), index.slash.clone(), index.seq_len, index.block_size)
    return copy, TileTables(tables.block, **{n: t.clone() for n, t in table_tensors(tables).items()})


# ----------------------------------------------------------------------------- CPU


def test_graphs_apply_only_to_cuda_inputs_and_the_switch(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv(cuda_graphs.GRAPHS_ENV, raising=False)
    assert not cuda_graphs.graphs_enabled(t)
    monkeypatch.setenv(cuda_graphs.GRAPHS_ENV, "off")
    with pytest.raises(ValueError, match=r"MTRAINING_INDEX_GRAPHS='off'.*0 \(build eagerly\) or 1"):
        cuda_graphs.graphs_enabled(t)


def test_cpu_build_is_eager(rng, graphs):
    q, k = qk(rng, seq=200, heads=(4, 2), d=16, device="cpu", dtype=torch.float32)
    index = build_vertical_slash_index(q, k, CFG)
    assert kept_tables(index) is None and not graphs.graphs


def recorded_keys(monkeypatch, cache: str) -> list:
    """The keys the build asks ``vertical_slash``'s graph cache ``cache`` for, in order, the
    cache replaced by one that records them and runs the build eagerly, with graphs taken
    as applying and the statistics on the kernels (Triton's interpreter, small tiles)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    from megatron_mtraining.sparse.kernels.index_build import window_stats

    keys = []

    class Recorder:
        def call(self, key, fn, inputs):
            keys.append(key)
            return fn(*inputs(None))

    monkeypatch.setattr(vertical_slash, cache, Recorder())
    monkeypatch.setattr(vertical_slash, "graphs_enabled", lambda *tensors: True)
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, chunk_blocks=2))
    return keys


def test_build_keys_its_graph_by_what_the_capture_fixes(rng, monkeypatch):
    """The build's graph key holds what the captured code (everything after the mass pass)
    and its input buffers (the mass pass's outputs) depend on besides values: batch, query
    heads, length, config and the mass pass's tiles. The softmax scale, the dtype, the KV
    heads and the row passes' tiles reach only the passes run outside the graph, so one graph
    serves them all. The build keeps the tile tables it made. On CPU: the cache records keys and
    runs the build eagerly (the statistics kernels in Triton's interpreter)."""
    from megatron_mtraining.sparse.kernels.index_build import window_stats

    keys = recorded_keys(monkeypatch, "_GRAPHS")
    cfg = VerticalSlashConfig(last_q=32, block_size=16)

    def build(seq=100, heads=(4, 2), dtype=torch.float16, config=cfg, **kwargs):
        q, k = qk(rng, seq=seq, heads=heads, d=16, device="cpu", dtype=dtype)
        return build_vertical_slash_index(q, k, config, **kwargs)

    index = build()
    assert kept_tables(index) is not None
    assert_same((index, kept_tables(index)), (index, vertical_slash_tables(index.to("cpu"))))
    build()
    build(softmax_scale=0.5)
    build(dtype=torch.float32)
    build(heads=(4, 1))
    monkeypatch.setattr(window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=16, block_n=16, chunk_blocks=2))
    build()
    assert len(set(keys)) == 1
    build(config=VerticalSlashConfig(last_q=32, block_size=32))
    build(seq=80)
    build(heads=(2, 2))
    monkeypatch.setattr(window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, block_mass=16))
    build()
    assert len(set(keys)) == 5


def document_bounds(rng, seq: int) -> torch.Tensor:
    """Packed documents, some shorter than ``DOC_CFG.dense_below`` (dense, no statistics)."""
    return random_boundaries(rng, seq, DOC_CFG.block_size)


DOC_CFG = dataclasses.replace(CFG, dense_below=64)


def eager_documents(q, k, cu):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cuda_graphs.GRAPHS_ENV, "0")
        return build_vertical_slash_index(q, k, DOC_CFG, cu_seqlens=cu)


def assert_same_lists(got: VerticalSlashIndex, want: VerticalSlashIndex):
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)
    assert got.documents.bounds == want.documents.bounds


def test_document_build_keys_its_graph_by_the_bounds(rng, monkeypatch):
    """The per-document build's graph key holds the documents' bounds (the captured code
    copies tables made from them) beside what the whole sequence's key holds: builds of one
    packing share a key whatever q and k, another packing takes another; each equals the
    eager build, its vertical lists cut after the graph. On CPU: the cache records keys and
    runs the build eagerly (the statistics kernels in Triton's interpreter)."""
    keys = recorded_keys(monkeypatch, "_DOCUMENT_GRAPHS")
    seq = 400  # the one-block document and two of 72-145 tokens get statistics, the short ones none
    packings = [document_bounds(rng, seq) for _ in range(2)]
    for cu in (packings[0], packings[0], packings[1]):
        q, k = qk(rng, seq=seq, heads=(4, 2), d=16, device="cpu", dtype=torch.float32)
        got = build_vertical_slash_index(q, k, DOC_CFG, cu_seqlens=cu)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vertical_slash, "graphs_enabled", lambda *tensors: False)
            assert_same_lists(got, build_vertical_slash_index(q, k, DOC_CFG, cu_seqlens=cu))
        widest = int((got.vertical >= 0).sum(-1).max())
        assert got.vertical.shape[-1] == widest  # cut to the longest list
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]
    assert keys[0][-1] == tuple(packings[0].tolist())


def test_graphs_keep_the_sources_of_their_captures():
    """Host tables copied during a capture are kept by the graph being captured (and go
    with it), not by the process; those of a capture that is not this package's stay."""
    outside = torch.zeros(2)
    host_tables._CAPTURED_SOURCES.append(outside)
    try:
        with host_tables.sources_of_capture() as kept:
            inside = torch.ones(3)
            host_tables._CAPTURED_SOURCES.append(inside)
        assert kept == [inside] and host_tables._CAPTURED_SOURCES[-1] is outside
    finally:
        host_tables._CAPTURED_SOURCES.remove(outside)


def test_mass_pass_rewrites_its_buffers_without_clearing(rng, monkeypatch):
    """The graphed build has the mass kernel write into its graph's buffers without clearing
    them: the kernel stores to the same elements on every call with the same shapes and key
    positions, and the rest keep their first zeros. A second call into the first's buffers
    gives what it gives into new zeros, all keys or a context-parallel shard's (blocks of
    positions held in part or not at all)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    from megatron_mtraining.sparse.kernels.index_build import window_stats

    monkeypatch.setattr(window_stats, "LAUNCH", window_stats.StatsLaunch(block_m=32, block_n=16, block_mass=16))
    seq, w = 90, 20
    shard = torch.cat([torch.arange(s, s + 8) for s in range(0, seq, 40)])

    def mass(positions, out=None):
        q, k = qk(rng, seq=seq, heads=(4, 2), d=16, device="cpu", dtype=torch.float16)
        keys = k if positions is None else k[:, positions]
        windows = vertical_slash.ObservationWindows.whole(seq, w, keys.shape[1])
        parts = window_stats.WindowKernels(q[:, -w:], keys, positions, windows, 0.3, 16)
        row_max = parts.row_max()
        return parts, parts.mass(row_max, parts.row_sum(row_max), out)

    for positions in (None, shard):
        _, buffers = mass(positions)
        assert (buffers[1] == 0).any()
        parts, again = mass(positions, buffers)
        row_max = parts.row_max()
        fresh = parts.mass(row_max, parts.row_sum(row_max))
        assert all(torch.equal(a, b) for a, b in zip(again, fresh, strict=True))


def test_cache_keeps_the_most_recently_used(monkeypatch):
    """Bounds and order of the cache; a key's later calls write into its first call's buffers."""
    made = []

    class Done:
        def synchronize(self):
            pass

    class FakeGraph:
        def __init__(self, fn, inputs):
            made.append(self)
            self.fn, self.inputs, self.done = fn, inputs, Done()

        def write(self, inputs):
            inputs(self.inputs)

        def replay(self):
            return self.fn(*self.inputs)

    monkeypatch.setattr(cuda_graphs, "_Graph", FakeGraph)
    cache = cuda_graphs.GraphedCalls(size=2)
    for i, key in enumerate("abacab"):

        def inputs(out, i=i):
            return (torch.tensor([i]),) if out is None else out[0].fill_(i)

        assert cache.call(key, lambda t, key=key: (key, int(t)), inputs) == (key, i)
    # a, b, (a hit), c evicts b, (a hit), b evicts c
    assert len(made) == 4 and list(cache.graphs) == ["a", "b"]


def test_results_are_rebuilt_from_one_packed_buffer():
    """The packing that returns a replay's results: every tensor field comes back equal, in
    its dtype and shape, from one byte buffer, 16-byte aligned as a fresh allocation (Triton
    compiles again for a pointer of another alignment), and a tensor shared by two fields
    stays shared."""
    vertical = torch.tensor([[[1, 5, -1]]], dtype=torch.int32)
    index = VerticalSlashIndex(vertical, torch.tensor([[[0, 2]]], dtype=torch.int32), seq_len=9, block_size=16)
    tables = TileTables(
        16,
        tiles=torch.arange(6, dtype=torch.int32).view(1, 1, 2, 3),
        tile_count=torch.tensor([[[3, 1]]], dtype=torch.int32),
        tiles_t=torch.zeros(1, 1, 2, 0, dtype=torch.int32),
        tile_t_count=torch.zeros(1, 1, 2, dtype=torch.int32),
        vertical=vertical,
        active=torch.tensor([[[1, 0, 1]]], dtype=torch.int8),
        query_blocks=torch.tensor([7], dtype=torch.int64),  # any dtype packs
    )
    leaves = cuda_graphs._tensor_leaves((index, tables))
    packed = cuda_graphs._pack(leaves).clone()
    got_index, got_tables = cuda_graphs._rebuild((index, tables), leaves, packed)
    assert_same((got_index, got_tables), (index, tables))
    rebuilt = [t for obj in (got_index, got_tables) for t in cuda_graphs._tensor_fields(obj).values()]
    assert packed.data_ptr() % cuda_graphs.ALIGN == 0
    assert all(t.data_ptr() % cuda_graphs.ALIGN == 0 for t in rebuilt)
    assert got_index.vertical.data_ptr() == got_tables.vertical.data_ptr()
    assert got_tables.tiles.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


def test_tables_are_kept_for_the_index_object_while_it_lives():
    """Tables kept for an index (as the graphed build keeps its own) are what ``tile_tables``
    returns for that object; a moved copy builds its own, the index itself holds nothing
    but its fields, and the entry goes with the index."""
    index = VerticalSlashIndex(torch.tensor([[[3]]]).int(), torch.tensor([[[0]]]).int(), seq_len=40, block_size=16)
    marker = TileTables(16, *(torch.zeros(1, 1, 1, 1, dtype=torch.int32),) * 4)
    keep_tables(index, marker)
    assert tile_tables(index) is marker and kept_tables(index) is marker
    moved = index.to("cpu")
    assert kept_tables(moved) is None and tile_tables(moved) is not marker
    assert set(vars(index)) == {f.name for f in dataclasses.fields(index)}
    kept = weakref.ref(marker)
    del index, marker
    gc.collect()
    assert kept() is None


@pytest.mark.parametrize(
    "seq,block,heads,slash_cap",
    [(1000, 64, (4, 2), 8), (300, 16, (3, 1), 8), (130, 16, (2, 2), 8), (1600, 16, (2, 1), 100)],
)
def test_tables_kernel_equals_the_composed_tables(seq, block, heads, slash_cap, rng, device):
    """The one-launch tables against the torch composition (context parallelism's helpers),
    entry for entry: tiles both ways, counts, bar prefixes, vertical pointers, diagonals.
    The last case lists more diagonals than the kernel's chunk of them (64), duplicated
    more than twice that."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    from megatron_mtraining.sparse.kernels.block_bar.tables_kernel import launch_vertical_slash_tables

    q, k = qk(rng, seq=seq, heads=heads, d=16, device="cpu", dtype=torch.float32)
    cfg = VerticalSlashConfig(
        last_q=32, vertical_topp=0.5, slash_topp=0.7, block_size=block, sink_tokens=3, local_window=40,
        vertical_cap=50, slash_cap=slash_cap * block,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
        index = build_vertical_slash_index(q, k, cfg)
    # Duplicated, unsorted diagonals too: slots are ranks, not positions in the list.
    shuffled = VerticalSlashIndex(index.vertical, index.slash.flip(-1).repeat(1, 1, 2), seq, block)
    if slash_cap > 64:
        assert (index.slash >= 0).sum(-1).max() > 64
    for idx in (index, shuffled):
        want = vertical_slash_tables(idx)
        got = launch_vertical_slash_tables(idx.to(device))
        for name, t in got.items():
            assert t.dtype == getattr(want, name).dtype and torch.equal(t.cpu(), getattr(want, name)), name


@pytest.mark.parametrize("kind,world", [("striped", 2), ("striped", 4), ("zigzag", 2), ("zigzag", 4)])
def test_tables_kernel_equals_the_composed_tables_of_ring_pieces(kind, world, rng, device):
    """The one-launch tables of context-parallel pieces against the torch composition,
    entry for entry: every rank's tiles over every chunk (query and key block ids mapped
    through ``BlockMap``s), its whole piece over whole-sequence keys with the bars (the
    all-gather's), and its bars over gathered column keys (the ring's column piece).
    Unsorted, duplicated diagonals and more of them than one chunk (64); padded vertical
    lists."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    from megatron_mtraining.context_parallel import ContextParallelLayout
    from megatron_mtraining.sparse.kernels.block_bar.block_map import BlockMap
    from megatron_mtraining.sparse.kernels.block_bar.tables_kernel import launch_vertical_slash_tables

    block, seq, heads = 16, 16 * 48, 3
    n = seq // block
    # Random diagonals: most of them, unsorted, some twice, -1 padding among them.
    slash = torch.stack([torch.randperm(n, generator=rng)[: 3 * n // 4] for _ in range(heads)])
    slash = torch.cat([slash, slash[:, :10], torch.full((heads, 5), -1)], -1).int().unsqueeze(0)
    vertical = torch.stack([torch.randperm(seq, generator=rng)[:50].sort().values for _ in range(heads)]).int()
    vertical = torch.cat([vertical[:, :-4], torch.full((heads, 4), -1, dtype=torch.int32)], -1).unsqueeze(0)
    index = VerticalSlashIndex(vertical, slash, seq, block)
    layout = ContextParallelLayout(kind, world, seq, stripe=block)

    def blocks(rank, dev):
        return BlockMap.of(layout.positions(rank, dev)[::block] // block, n)

    # The ring's gathered column keys: every column once, ascending, padded at the end.
    columns = vertical[vertical >= 0].unique().int()
    columns = torch.cat([columns, torch.full((7,), -1, dtype=torch.int32)])
    for rank in range(world):
        cases = [(blocks(src, "cpu"), blocks(src, device), False, None) for src in range(world)]
        cases += [(None, None, True, None), (None, None, True, columns)]
        for keys, keys_dev, bars, cols in cases:
            want = vertical_slash_tables(index, blocks(rank, "cpu"), keys, bars, cols)
            got = launch_vertical_slash_tables(
                index.to(device), blocks(rank, device), keys_dev, bars, None if cols is None else cols.to(device)
            )
            names = {"tiles", "tile_count", "tiles_t", "tile_t_count"} | (
                {"bar_count", "vertical_ptr", "active"} if bars else set()
            )
            assert set(got) == names | ({"vertical"} if cols is not None else set())
            for name, t in got.items():
                assert t.dtype == getattr(want, name).dtype and torch.equal(t.cpu(), getattr(want, name)), name
            if cols is None:
                assert int(want.tile_count.sum()) > 0
            else:  # no tiles; the bars index the columns, which are where the positions say
                assert int(want.tile_count.sum()) == 0 and torch.equal(want.bar_positions, index.vertical)
                assert torch.equal(cols[want.vertical.clamp(min=0).long()].masked_fill(want.vertical < 0, -1), vertical)
                assert torch.equal(want.vertical_ptr[..., -1], (vertical >= 0).sum(-1).int())
    with pytest.raises(ValueError, match=r"bars=True is not accepted.*whole-sequence keys"):
        vertical_slash_tables(index, blocks(0, "cpu"), blocks(1, "cpu"), True)


@pytest.mark.parametrize("n,cap,forced", [(3000, 1500, 5), (50, 64, 0), (40, 8, 60)])
def test_top_p_kernel_equals_the_torch_take(n, cap, forced, rng, device):
    """The one-launch top-p take against the torch one on random scores with zero-mass
    entries: the same candidate lists, forced entries first (more of them than scores too)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    from megatron_mtraining.sparse.kernels.index_build.top_p import take_top_p

    scores = torch.rand(2, 3, n, generator=rng) + 0.01
    scores[..., ::7] = 0
    scores = scores.to(device)
    top, order = scores.topk(min(cap, n), dim=-1)
    for p in (0.3, 0.9):
        limit = scores.sum(-1, keepdim=True, dtype=torch.float64) * p
        n_first = min(forced, n)
        want = vertical_slash._taken(top, order, limit, forced, n_first)
        got = take_top_p(top, order, limit, forced, n_first)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [(16, 2), (8, 8)], ids=["gqa8", "mha"])
def test_graphed_build_equals_eager_call_after_call(heads, rng, graphs):
    """Fresh random inputs each call, two shapes interleaved: each graphed build (index and
    tile tables) equals the eager one bit for bit, and earlier calls' results stay intact."""
    kept = []
    for seq in (3000, 4096, 3000, 4096, 3000):
        q, k = qk(rng, seq=seq, heads=heads)
        got = build_vertical_slash_index(q, k, CFG)
        result = (got, tile_tables(got))
        assert result[1] is kept_tables(got)
        assert_same(result, eager(q, k))
        kept.append((result, snapshot(result)))
    for result, copy in kept:
        assert_same(result, copy)
    assert len(graphs.graphs) == 2


@pytest.mark.gpu
@gpu
def test_one_graph_serves_other_scales_dtypes_and_kv_heads(rng, graphs):
    """The graph starts after the passes over K, so builds that differ only in softmax
    scale, dtype or KV heads replay one graph, its buffers rewritten by each call's mass
    pass: each equals its eager build."""
    for heads, dtype, scale in (
        ((16, 2), torch.bfloat16, None),
        ((16, 2), torch.bfloat16, 0.03),
        ((16, 4), torch.float16, None),
        ((16, 2), torch.float32, 0.1),
    ):
        q, k = qk(rng, heads=heads, dtype=dtype)
        got = build_vertical_slash_index(q, k, CFG, softmax_scale=scale)
        assert_same((got, tile_tables(got)), eager(q, k, softmax_scale=scale))
    assert len(graphs.graphs) == 1


@pytest.mark.gpu
@gpu
def test_graphed_build_on_another_stream(rng, graphs):
    q, k = qk(rng)
    first = build_vertical_slash_index(q, k, CFG)
    q2, k2 = qk(rng)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second = build_vertical_slash_index(q2, k2, CFG)
        second = (second, tile_tables(second))
    torch.cuda.current_stream().wait_stream(side)
    assert_same(second, eager(q2, k2))
    assert_same((first, tile_tables(first)), eager(q, k))


@pytest.mark.gpu
@gpu
def test_sparse_attention_uses_the_kept_tables(rng, graphs, monkeypatch):
    from megatron_mtraining.sparse.kernels.block_bar import tables_kernel

    q, k = qk(rng)
    v = torch.randn(k.shape, generator=rng).to(k)
    index = build_vertical_slash_index(q, k, CFG)
    monkeypatch.setattr(tables_kernel, "launch_vertical_slash_tables", lambda *args: pytest.fail("tables built again"))
    out, lse = sparse_attention(q, k, v, index)
    monkeypatch.undo()
    want_out, want_lse = sparse_attention(q, k, v, eager(q, k)[0])
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@gpu
def test_graphed_document_build_equals_eager_call_after_call(rng, monkeypatch):
    """Two packings interleaved, fresh random inputs each call (as a step's layers, then the
    next step's): each graphed per-document build equals the eager one bit for bit, earlier
    results stay intact, and the graphs keep their captures' host tables, the process none."""
    cache = cuda_graphs.GraphedCalls(size=2)
    monkeypatch.setattr(vertical_slash, "_DOCUMENT_GRAPHS", cache)
    monkeypatch.delenv(cuda_graphs.GRAPHS_ENV, raising=False)
    monkeypatch.delenv("MTRAINING_ATTENTION_BACKEND", raising=False)
    seq = 4096
    packings = [document_bounds(rng, seq).cuda() for _ in range(2)]
    sources = len(host_tables._CAPTURED_SOURCES)
    kept = []
    for cu in (packings[0], packings[0], packings[1], packings[0], packings[1]):
        q, k = qk(rng, seq=seq)
        got = build_vertical_slash_index(q, k, DOC_CFG, cu_seqlens=cu)
        assert_same_lists(got, eager_documents(q, k, cu))
        assert kept_tables(got) is not None
        kept.append((got, got.vertical.clone(), got.slash.clone()))
    for got, vertical, slash in kept:
        assert torch.equal(got.vertical, vertical) and torch.equal(got.slash, slash)
    assert len(cache.graphs) == 2 and all(graph.sources for graph in cache.graphs.values())
    assert len(host_tables._CAPTURED_SOURCES) == sources


@pytest.mark.gpu
@gpu
def test_fallbacks_build_eagerly(rng, graphs, monkeypatch):
    """The switch, the reference backend and a capture under way (Megatron's CUDA graphs)
    build eagerly: no graph is made and no tables are kept for the index."""
    q, k = qk(rng)
    want = eager(q, k)
    monkeypatch.setenv(cuda_graphs.GRAPHS_ENV, "0")
    assert kept_tables(build_vertical_slash_index(q, k, CFG)) is None
    monkeypatch.delenv(cuda_graphs.GRAPHS_ENV)
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "reference")
    assert kept_tables(build_vertical_slash_index(q, k, CFG)) is None
    monkeypatch.delenv("MTRAINING_ATTENTION_BACKEND")
    assert not graphs.graphs
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        captured = build_vertical_slash_index(q, k, CFG)
    assert kept_tables(captured) is None and not graphs.graphs
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.vertical, want[0].vertical) and torch.equal(captured.slash, want[0].slash)
