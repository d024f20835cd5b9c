"""KV-outer kernels of top-k block attention (MSA, MoBA) against fp64 dense attention, and
the reverse index and work lists they run on.

As in test_kernels.py: without CUDA the kernels run in Triton's interpreter (fp32 / fp16),
with kernel outputs poisoned with NaN. Small query chunks and items force the streaming
over several chunks and the split of a block's queries over several programs on tiny inputs.
"""

import dataclasses

import pytest
import torch
from test_kernels import (
    check,
    make_index,
    make_inputs,
    pytestmark,  # noqa: F401  (the kernel tests' skip mark and poisoned outputs apply here too)
)

from megatron_mtraining.sparse import (
    BlockTopKIndex,
    MoBAConfig,
    MSAConfig,
    build_moba_index,
    msa_select_blocks,
    sparse_attention,
)
from megatron_mtraining.sparse import dispatch as api
from megatron_mtraining.sparse.kernels.kv_outer.reverse_index import reverse_index, work_list


@pytest.fixture(autouse=True)
def kv_outer_everywhere(monkeypatch):
    """Every top-k index here runs on the KV-outer kernels, whatever its share of the keys."""
    monkeypatch.setattr(api, "KV_OUTER_MAX_BLOCK", 1 << 30)
    monkeypatch.setattr(api, "KV_OUTER_MAX_SHARE", float("inf"))


@pytest.fixture
def kv():
    from megatron_mtraining.sparse.kernels.kv_outer import attention

    return attention


def small_work(monkeypatch, kv, chunk=16, tiles_per_item=2, block_n=16):
    """Query chunks of ``chunk`` tokens, 32-row tiles (16 for fp32) of at most ``tiles_per_item``
    per item, keys ``block_n`` a step (blocks of 32 take two), and dK/dV partials that may take
    as much memory as the dQ slots, so that tiny inputs split their groups."""
    for name in kv.CHUNKS:
        monkeypatch.setitem(kv.CHUNKS, name, kv.Streaming(buffer_share=0.0, min_chunk=chunk))
    monkeypatch.setattr(kv, "PARTIAL_SHARE", 1.0)
    for name, cfg in kv.DEFAULTS.items():
        if isinstance(cfg, kv.PassConfig):
            small = dataclasses.replace(cfg, block_m=32, block_n=block_n, num_stages=1, tiles_per_item=tiles_per_item)
            monkeypatch.setitem(kv.OVERRIDES, name, small)


class Launches:
    """Stands in for a kernel: records each launch's grid and arguments, and runs it on
    ``kernel`` if one is given."""

    def __init__(self, kernel=None):
        self.kernel, self.calls, self.kwargs = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args))
            self.kwargs.append(kwargs)
            if self.kernel is not None:
                self.kernel[grid](*args, **kwargs)

        return launch


def random_selection(gen, b, s, hs, k, n_blocks):
    """Ascending, -1 padded selections, some of blocks after the token's own (invisible)."""
    chosen = torch.rand(b, s, hs, n_blocks, generator=gen).argsort(-1)[..., :k]
    chosen = torch.where(torch.rand(chosen.shape, generator=gen) < 0.2, n_blocks, chosen)  # unselected slots
    ordered = chosen.sort(-1).values
    return torch.where(ordered < n_blocks, ordered, -1).int()


@pytest.mark.parametrize("pool", [1000, 3])
def test_reverse_index_and_work_list_match_a_loop(pool, rng):
    """Per (chunk, batch, KV head, key block, selection head) the tokens that chose the block,
    ascending, with their slots, as a plain loop lists them; the work list's items cover each
    group's tiles in order, in tiles of at most T tokens of one segment, longest items first,
    with partial buffers numbered per chunk for the split groups only. Items take at most
    ``cap`` tiles, more in chunks whose split groups would need more than ``pool`` partials."""
    b, s, hs, k, hkv, n_blocks, chunk, tokens, cap = 2, 37, 4, 3, 2, 5, 10, 2, 2
    blocks = random_selection(rng, b, s, hs, k, n_blocks)
    rev = reverse_index(blocks, hkv, n_blocks, chunk)
    work = work_list(rev, tokens, cap, partial_pool=pool)
    per_kv, n_groups = hs // hkv, b * hkv * n_blocks

    def decode(entry):  # (batch, token, selection head, slot)
        return entry // (s * hs * k), entry // (hs * k) % s, entry // k % hs, entry % k

    for c in range(rev.n_chunks):
        items = range(int(work.chunk_items[c]), int(work.chunk_items[c + 1]))
        sizes = work.items[items.start : items.stop, 2]
        assert (sizes[1:] <= sizes[:-1]).all() and sizes.min() >= 1
        if pool == 1000:
            assert sizes.max() <= cap
        covered = {}
        for item in items:
            group, first, n_tiles = work.items[item].tolist()
            for tile in range(first, first + n_tiles):
                start, n = work.tiles[tile].tolist()
                assert 1 <= n <= tokens
                entries = [decode(e) for e in rev.entries[start : start + n].tolist()]
                assert len({e[2] for e in entries}) == 1
                covered.setdefault(group, []).extend(entries)
        expected_splits, partial = [], 0
        for bi in range(b):
            for kvh in range(hkv):
                for kb in range(n_blocks):
                    group = (bi * hkv + kvh) * n_blocks + kb
                    want = [
                        (bi, t, kvh * per_kv + sub, slot)
                        for sub in range(per_kv)
                        for t in range(c * chunk, min(s, (c + 1) * chunk))
                        for slot in range(k)
                        if blocks[bi, t, kvh * per_kv + sub, slot] == kb
                    ]
                    assert covered.get(group, []) == want
                    group_items = [i for i in items if work.items[i, 0] == group]
                    got = [int(work.partial[i]) for i in group_items]
                    if len(group_items) > 1:
                        assert got == list(range(partial, partial + len(got)))
                        expected_splits.append([group, partial, len(got)])
                        partial += len(got)
                    else:
                        assert got in ([], [-1])
        splits = work.splits[int(work.chunk_splits[c]) : int(work.chunk_splits[c + 1])].tolist()
        assert splits == expected_splits
        assert partial <= pool and len(splits) <= work.splits_per_chunk
        assert len(items) <= work.items_per_chunk
    assert n_groups == rev.n_groups


@pytest.mark.parametrize("kind", ["msa", "moba"])
@pytest.mark.parametrize(
    "b,s,hq,hkv,d,block",
    [(2, 83, 6, 2, 24, 16), (1, 70, 4, 4, 16, 16), (1, 100, 4, 1, 32, 32)],
    ids=["gqa3-d24-b2-ragged", "mha-d16", "gqa4-block32"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_streamed_kernels_match_dense(kind, b, s, hq, hkv, d, block, dtype, rng, kdevice, kv, monkeypatch):
    """Several query chunks, split blocks, and (MoBA: chunks of two index blocks; ``block32``:
    both) blocks wider than one key step, which take the separate dQ kernel."""
    small_work(monkeypatch, kv)
    q, k, v = make_inputs(rng, b, s, hq, hkv, d, dtype, kdevice)
    check(q, k, v, make_index(kind, q, k, block), rng)


def _merged_forward_params():
    """Every kind in fp32; fp16 too behind ``-m slow`` for MSA and MoBA (the interpreter takes
    10-15 s a case), in the default run for the small ones."""
    for kind in ("msa", "moba", "sink", "empty-rows"):
        yield pytest.param(kind, torch.float32, id=f"{kind}-fp32")
        slow = kind in ("msa", "moba")
        yield pytest.param(kind, torch.float16, id=f"{kind}-fp16", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("kind,dtype", _merged_forward_params())
def test_forward_merged_in_the_attention_kernel(kind, dtype, rng, kdevice, kv, monkeypatch):
    """``FWD_MERGE_CHUNK``: the attention kernel takes its items by tickets, a launch per
    window of several query chunks, and merges each token when its last slot is written.
    Output and LSE equal the separate merge's and, with the gradients, fp64 dense attention's;
    every launch took every item of its window, and the counts are back at zero. MoBA's
    blocks of 32 take two key steps; ``sink``: every token also chooses block 0, so one
    block's tokens span every item of a window; ``empty-rows``: tokens that choose nothing or
    only a later block stay at zeros and -inf."""
    small_work(monkeypatch, kv, chunk=32)
    b, s, hq, hkv, d = {"sink": (1, 96, 4, 2, 16), "empty-rows": (1, 64, 4, 2, 16)}.get(kind, (2, 83, 6, 2, 24))
    q, k, v = make_inputs(rng, b, s, hq, hkv, d, dtype, kdevice)
    if kind == "sink":
        index = sink_index(rng, s, hq, hkv, 16, kdevice)
    elif kind == "empty-rows":
        blocks = torch.full((1, s, 2, 2), -1, dtype=torch.int32)
        blocks[0, 20:, :, 0] = 0
        blocks[0, 40:, 1, 1] = 2
        blocks[0, 5:10, 0, 0] = 3
        index = BlockTopKIndex(blocks=blocks, block_size=16, num_heads=hq).to(kdevice)
    else:
        index = make_index(kind, q, k, 16)
    separate, separate_lse = sparse_attention(q, k, v, index, backend="triton")
    monkeypatch.setattr(kv, "FWD_MERGE_CHUNK", 8)
    launches = Launches(kv.kernels._fwd_merging_kernel)
    monkeypatch.setattr(kv.kernels, "_fwd_merging_kernel", launches)
    out, lse, _ = check(q, k, v, index, rng)
    torch.testing.assert_close(out, separate, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    torch.testing.assert_close(lse, separate_lse, rtol=1e-6, atol=1e-6)
    (grid,), args = launches.calls[0]
    chunk_items, count, tickets, n_chunks = args[6], args[10], args[11], args[16]
    assert [a[14] for _, a in launches.calls] == list(range(-(-s // 32)))  # a launch per window of 32 tokens
    assert args[15] == 4 and n_chunks == -(-s // 8)  # of four chunks of 8 tokens
    assert int(count.abs().sum()) == 0
    for w in range(len(launches.calls)):
        items = int(chunk_items[min(4 * (w + 1), n_chunks)] - chunk_items[4 * w])
        # Every program took tickets until one past the window's items.
        assert int(tickets[w]) == items + grid


def sink_index(gen, s, hq, hs, block, device):
    """Every token chooses block 0, its own block and one random earlier block."""
    pos = torch.arange(s)
    own = pos // block
    other = (torch.rand(s, hs, generator=gen) * own.view(-1, 1)).long()
    chosen = torch.stack((torch.zeros_like(other), other, own.view(-1, 1).expand_as(other)), -1)
    dup = chosen[..., 1:] == chosen[..., :-1]
    chosen[..., 1:] = torch.where(dup, -1, chosen[..., 1:])
    ordered = torch.where(chosen >= 0, chosen, 1 << 20).sort(-1).values
    blocks = torch.where(ordered < (1 << 20), ordered, -1).int().unsqueeze(0)
    return BlockTopKIndex(blocks=blocks, block_size=block, num_heads=hq).to(device)


@pytest.mark.parametrize("hq,hs,hkv", [(4, 2, 2), (4, 4, 2)], ids=["msa-like", "moba-like"])
def test_sink_block_is_split_and_backward_is_deterministic(hq, hs, hkv, rng, kdevice, kv, monkeypatch):
    """A block every query chose: its tiles of a 48-token chunk go to several programs in
    both passes (dK/dV through partials, which a reduction of fewer programs than the
    chunk's split groups adds), the results match dense attention and a second backward is
    bitwise identical."""
    small_work(monkeypatch, kv, chunk=48, tiles_per_item=1)
    lists = []
    real = kv.work_list
    monkeypatch.setattr(kv, "work_list", lambda *a, **kw: lists.append(real(*a, **kw)) or lists[-1])
    monkeypatch.setattr(kv, "reduce_programs", lambda device: 2)  # on CUDA too
    reduce = Launches(kv.kernels._reduce_kernel)
    monkeypatch.setattr(kv.kernels, "_reduce_kernel", reduce)
    q, k, v = make_inputs(rng, 1, 96, hq, hkv, 16, torch.float32, kdevice)
    index = sink_index(rng, 96, hq, hs, 16, kdevice)
    _, _, grads = check(q, k, v, index, rng)
    fwd, bwd = lists
    for work in (fwd, bwd):
        sink_items = work.items[: int(work.chunk_items[1]), 0] == 0  # group (batch 0, KV head 0, block 0)
        assert int(sink_items.sum()) > 1
    assert int(bwd.chunk_splits[1]) >= 1 and int(bwd.partial[: int(bwd.chunk_items[1])].max()) >= 1
    assert {grid for grid, _ in reduce.calls} == {(2,)}
    assert int((bwd.chunk_splits[1:] - bwd.chunk_splits[:-1]).max()) > 2

    out, lse = sparse_attention(q, k, v, index, backend="triton")
    g = torch.randn(out.shape, generator=rng).to(kdevice)
    runs = [torch.autograd.grad((out * g).sum(), (q, k, v), retain_graph=True) for _ in range(2)]
    for a, e in zip(*runs, strict=True):
        assert torch.equal(a, e)


def test_dq_slots_are_bf16_for_bf16_inputs(rng, kv, monkeypatch):
    """The backward's dQ slots are bf16 for bf16 inputs and fp32 for fp16 and fp32 ones, at
    ``buffer_share`` of q's bytes whatever their dtype (bf16's chunks twice fp16's), with a
    dK/dV partial pool of ``PARTIAL_SHARE`` of their bytes. The launches are recorded, not run:
    the interpreter has no bf16."""
    monkeypatch.setitem(kv.CHUNKS, "bwd", kv.Streaming(buffer_share=1.0, min_chunk=1))
    b, s, hq, hkv, d, block = 1, 128, 4, 2, 16, 16
    blocks = random_selection(rng, b, s, hkv, 2, s // block)
    chunks = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        names = ("_delta_kernel", "_bwd_kernel", "_dq_kernel", "_reduce_kernel", "_sum_slots_kernel")
        launches = {name: Launches() for name in names}
        for name, spy in launches.items():
            monkeypatch.setattr(kv.kernels, name, spy)
        q = torch.randn(b, s, hq, d).to(dtype)
        k, v = (torch.randn(b, s, hkv, d).to(dtype) for _ in range(2))
        p = kv._Problem.of(q, k, v, BlockTopKIndex(blocks=blocks, block_size=block, num_heads=hq), d**-0.5)
        kv.kv_outer_backward(p, q, torch.zeros(b, hq, s), q, None)
        sums = launches["_sum_slots_kernel"].calls
        dq_buf, chunks[dtype] = sums[0][1][0], sums[0][1][4]  # DQ_BUF, CHUNK
        assert dq_buf.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        assert len(sums) == s // chunks[dtype] and dq_buf.nbytes == q.nbytes
        assert all(args[15] is dq_buf for _, args in launches["_bwd_kernel"].calls)  # DQ_BUF
        dk_part = launches["_reduce_kernel"].calls[0][1][2]  # DK_PART
        assert 2 * dk_part.nbytes == kv.PARTIAL_SHARE * dq_buf.nbytes
    assert chunks[torch.bfloat16] == 2 * chunks[torch.float16] == 64


def test_rows_with_no_visible_key(rng, kdevice, kv, monkeypatch):
    """Tokens that chose nothing, or only blocks after their own, get zeros and -inf; the
    gradients stay finite and match."""
    small_work(monkeypatch, kv)
    s, block = 64, 16
    blocks = torch.full((1, s, 2, 2), -1, dtype=torch.int32)
    blocks[0, 20:, :, 0] = 0  # rows 20.. see block 0
    blocks[0, 40:, 1, 1] = 2  # head 1: rows 40.. also block 2 (rows 40-47 only partly)
    blocks[0, 5:10, 0, 0] = 3  # rows 5-9 chose a later block only
    q, k, v = make_inputs(rng, 1, s, 4, 2, 16, torch.float32, kdevice)
    index = BlockTopKIndex(blocks=blocks, block_size=block, num_heads=4).to(kdevice)
    out, lse, _ = check(q, k, v, index, rng)
    assert torch.equal(out[0, :20], torch.zeros_like(out[0, :20]))
    assert torch.isneginf(lse[0, :, :20]).all()


@pytest.mark.parametrize("hq,hkv", [(4, 2), (16, 1)], ids=["gqa2", "group16"])
def test_one_selection_for_all_heads(hq, hkv, rng, kdevice, kv, monkeypatch):
    """One selection head for every query head: each KV head reads it (``gqa2``), or its 16
    heads fill a tile of two tokens (``group16``)."""
    small_work(monkeypatch, kv)
    q, k, v = make_inputs(rng, 1, 50, hq, hkv, 16, torch.float32, kdevice)
    blocks = random_selection(rng, 1, 50, 1, 2, 4).to(kdevice)
    check(q, k, v, BlockTopKIndex(blocks=blocks, block_size=16, num_heads=hq), rng)


def test_launch_defaults_are_the_sweeps_winners(kv):
    """What runs without overrides: the launch sweep's winners on an H200 (docs/benchmarks.md,
    "MSA's tuned launches"); a change here is a measured decision, not a refactor's."""
    expected = {
        "fwd": kv.PassConfig(block_m=64, block_n=128, num_warps=4, num_stages=1, tiles_per_item=8),
        "bwd": kv.PassConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, tiles_per_item=8),
        "dq": kv.PassConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, tiles_per_item=32),
        "merge": kv.RowConfig(rows=64, num_warps=2, num_stages=3),
        "sum_slots": kv.RowConfig(rows=8, num_warps=8, num_stages=3),
        "reduce": kv.RowConfig(rows=8, num_warps=8, num_stages=3),
    }
    assert expected == kv.DEFAULTS
    assert kv.OVERRIDES == {}
    assert all(kv.launch_config(name) is cfg for name, cfg in kv.DEFAULTS.items())


def test_row_kernel_overrides_change_the_launch_not_the_result(rng, kdevice, kv, monkeypatch):
    """Other rows, warps and stages for the merge, the slot sum and the reduction (rows capped
    at the block): their grids and constexprs change, and output, LSE and gradients are
    bitwise those of the defaults (each row's slots, and each key's partials, are added in
    the same order whatever a program's rows)."""
    small_work(monkeypatch, kv, chunk=32, tiles_per_item=1)
    monkeypatch.setattr(kv, "reduce_programs", lambda device: 64)  # a grid bounded by the units
    q, k, v = make_inputs(rng, 1, 96, 4, 2, 16, torch.float32, kdevice)
    index = sink_index(rng, 96, 4, 2, 16, kdevice)
    g = torch.randn(q.shape, generator=rng).to(kdevice)
    names = ("_merge_kernel", "_sum_slots_kernel", "_reduce_kernel")

    def run():
        spies = {name: Launches(getattr(kv.kernels, name)) for name in names}
        with monkeypatch.context() as m:
            for name, spy in spies.items():
                m.setattr(kv.kernels, name, spy)
            out, lse = kv.KVOuterAttention.apply(q, k, v, index, 16**-0.5)
            grads = torch.autograd.grad(out, (q, k, v), g)
        return (out, lse, *grads), {name: (spy.calls[0][0], spy.kwargs[0]) for name, spy in spies.items()}

    want, default = run()
    overrides = {
        "merge": kv.RowConfig(rows=16, num_warps=4, num_stages=1),
        "sum_slots": kv.RowConfig(rows=32, num_warps=2, num_stages=2),
        "reduce": kv.RowConfig(rows=32, num_warps=2, num_stages=4),
    }
    for entry, cfg in overrides.items():
        assert cfg != kv.DEFAULTS[entry], "an override equal to the default tests nothing"
        monkeypatch.setitem(kv.OVERRIDES, entry, cfg)
    got, tuned = run()
    slot_rows = 32 * 4  # a chunk's (token, head) rows

    def launch(cfg, capped):  # the reduction's rows are capped at the block of 16
        return {
            "ROWS": min(cfg.rows, 16) if capped else cfg.rows,
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
        }

    for entry, launches in (("default", default), ("override", tuned)):
        configs = kv.DEFAULTS if entry == "default" else overrides
        for name in ("merge", "sum_slots"):
            assert launches[f"_{name}_kernel"][0] == (slot_rows // configs[name].rows,), (entry, name)
        for name in ("merge", "sum_slots", "reduce"):
            keys = {key: launches[f"_{name}_kernel"][1][key] for key in ("ROWS", "num_warps", "num_stages")}
            assert keys == launch(configs[name], name == "reduce"), (entry, name)
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize(
    "name,cfg,message",
    [
        (
            "merge",
            ("row", 12, 4, 3),
            r"kv_outer\.OVERRIDES\['merge'\]\.rows=12 is not accepted: expected a power of two",
        ),
        (
            "sum_slots",
            ("row", 16, 3, 3),
            r"\['sum_slots'\]\.num_warps=3 is not accepted: expected a power of two from 1",
        ),
        ("reduce", ("row", 16, 4, 0), r"\['reduce'\]\.num_stages=0 is not accepted: expected an integer >= 1"),
        ("fwd", ("pass", 48, 128, 4, 2, 8), r"\['fwd'\]\.block_m=48 is not accepted: expected a power of two >= 16"),
        ("bwd", ("pass", 64, 8, 8, 2, 8), r"\['bwd'\]\.block_n=8 is not accepted: expected a power of two >= 16"),
        ("dq", ("pass", 64, 64, 4, 2, 0), r"\['dq'\]\.tiles_per_item=0 is not accepted"),
        ("bwd", ("row", 16, 4, 3), r"\['bwd'\]=RowConfig\(.*\) is not accepted: expected a PassConfig"),
        (
            "merg",
            ("row", 16, 4, 3),
            r"kv_outer\.OVERRIDES key='merg' is not accepted: expected one of fwd, bwd, dq, merge",
        ),
    ],
)
def test_bad_overrides_are_refused(name, cfg, message, kv, monkeypatch):
    """An override names a kernel of ``DEFAULTS`` and holds values its launch takes; the
    error names the entry, the value and what is accepted."""
    kind, *values = cfg
    monkeypatch.setitem(kv.OVERRIDES, name, (kv.RowConfig if kind == "row" else kv.PassConfig)(*values))
    with pytest.raises(ValueError, match=message):
        kv.launch_config("merge" if name == "merg" else name)


def test_the_forward_refuses_a_bad_override_before_it_launches(rng, kv, monkeypatch):
    monkeypatch.setitem(kv.OVERRIDES, "merge", kv.RowConfig(rows=24, num_warps=4, num_stages=3))
    spies = {name: Launches() for name in ("_fwd_kernel", "_merge_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(kv.kernels, name, spy)
    q, k, v = make_inputs(rng, 1, 32, 2, 1, 16, torch.float32, "cpu")
    index = BlockTopKIndex(blocks=torch.zeros(1, 32, 1, 1, dtype=torch.int32), block_size=16, num_heads=2)
    with pytest.raises(ValueError, match=r"\['merge'\]\.rows=24 is not accepted"):
        kv.KVOuterAttention.apply(q, k, v, index, 0.25)
    assert not any(spy.calls for spy in spies.values())


def test_block_size_must_be_a_power_of_two(rng, kdevice):
    q, k, v = make_inputs(rng, 1, 40, 2, 1, 16, torch.float32, kdevice)
    index = BlockTopKIndex(blocks=torch.zeros(1, 40, 1, 1, dtype=torch.int32), block_size=24, num_heads=2)
    with pytest.raises(ValueError, match="index.block_size=24"):
        sparse_attention(q, k, v, index.to(kdevice), backend="triton")


def gpu_index(kind, q, k, block):
    b, s, hq, _ = q.shape
    if kind == "msa":
        q_idx = q.detach().float().unflatten(2, (k.shape[2], -1)).mean(3)
        k_idx = k.detach().float().mean(2, keepdim=True)
        return msa_select_blocks(q_idx, k_idx, MSAConfig(block_size=block, topk=8, index_head_dim=q.shape[-1]), hq)
    return build_moba_index(q, k, MoBAConfig(chunk_size=block, topk=4))


@pytest.mark.gpu
@pytest.mark.parametrize("merge_chunk", [0, 256], ids=["merge-kernel", "merge-in-attention"])
@pytest.mark.parametrize("kind", ["msa", "moba"])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("s", [1000, 4096])
def test_kv_outer_on_gpu_shapes(kind, block, s, merge_chunk, rng, device, kv, monkeypatch):
    """bf16, head dim 128, 16 query heads over 2 KV heads, default launch parameters, the
    forward's merge in a kernel of its own or in the attention kernel (``FWD_MERGE_CHUNK``),
    whose programs run concurrently here: its counts and the ordering of its stores matter."""
    if device.type != "cuda":
        pytest.skip("GPU shapes")
    monkeypatch.setattr(kv, "FWD_MERGE_CHUNK", merge_chunk)
    q, k, v = make_inputs(rng, 1, s, 16, 2, 128, torch.bfloat16, device)
    check(q, k, v, gpu_index(kind, q, k, block), rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.bfloat16, 256), (torch.float32, 256)])
def test_kv_outer_wide_rows_on_gpu(dtype, d, rng, device):
    """Rows of more than 256 bytes take smaller tiles, which must fit in shared memory."""
    if device.type != "cuda":
        pytest.skip("GPU shapes")
    q, k, v = make_inputs(rng, 1, 700, 8, 2, d, dtype, device)
    check(q, k, v, gpu_index("msa", q, k, 128), rng)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["msa", "moba"])
def test_kv_outer_backward_is_deterministic_on_gpu(kind, rng, device):
    if device.type != "cuda":
        pytest.skip("GPU only")
    q, k, v = make_inputs(rng, 1, 4096, 16, 2, 128, torch.bfloat16, device)
    index = gpu_index(kind, q, k, 64)
    g = torch.randn(q.shape, generator=rng).to(device, torch.bfloat16)
    runs = [torch.autograd.grad(sparse_attention(q, k, v, index, backend="triton")[0], (q, k, v), g) for _ in range(3)]
    for again in runs[1:]:
        for a, e in zip(runs[0], again, strict=True):
            assert torch.equal(a, e)
