"""attended_area: the vectorised counts against the dense mask and the kernels' key lists,
for every index type, whole and as a context-parallel rank's step."""

import pytest
import torch
from host_reads import HostReads

from megatron_mtraining.context_parallel import ContextParallelLayout, StepIndex
from megatron_mtraining.sparse import BlockTopKIndex, DenseIndex, VerticalSlashIndex
from megatron_mtraining.sparse.index import VerticalSlashPart, _correlate

# Lengths not a multiple of the block (but of what the layouts below need), and one that is.
SEQ_LENS = (40, 200, 256)


def _sorted_padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([sorted(r) + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def _choose(gen, population: int, at_most: int) -> list[int]:
    count = int(torch.randint(0, min(at_most, population) + 1, (1,), generator=gen))
    return torch.randperm(population, generator=gen)[:count].tolist()


def random_vertical_slash(gen, batch, heads, seq, block) -> VerticalSlashIndex:
    """Per head a random set of columns and of block diagonals (diagonal 0 included or not),
    -1 padded to a common width."""
    n = -(-seq // block)
    width_v, width_s = 6, n + 1
    vertical = [[_choose(gen, seq, width_v) for _ in range(heads)] for _ in range(batch)]
    slash = [[_choose(gen, n, n) for _ in range(heads)] for _ in range(batch)]
    return VerticalSlashIndex(
        torch.stack([_sorted_padded(v, width_v) for v in vertical]),
        torch.stack([_sorted_padded(s, width_s) for s in slash]),
        seq_len=seq,
        block_size=block,
    )


def random_block_topk(gen, batch, heads, selection_heads, seq, block, k=3) -> BlockTopKIndex:
    """Per row and selection head up to k random blocks of the whole sequence (own block or
    not, later blocks too: causality removes them), -1 padded."""
    n = -(-seq // block)
    blocks = torch.stack(
        [
            torch.stack([_sorted_padded([_choose(gen, n, k) for _ in range(selection_heads)], k) for _ in range(seq)])
            for _ in range(batch)
        ]
    )
    return BlockTopKIndex(blocks, block_size=block, num_heads=heads)


def random_index(kind, gen, seq, device):
    batch, heads = 2, 4
    if kind == "dense":
        return DenseIndex(batch, heads, seq, device)
    if kind == "moba":
        return random_block_topk(gen, batch, heads, heads, seq, 16).to(device)
    if kind == "msa":  # one selection head per GQA group
        return random_block_topk(gen, batch, heads, 2, seq, 8).to(device)
    index = random_vertical_slash(gen, batch, heads, seq, 16).to(device)
    return index if kind == "vertical_slash" else VerticalSlashPart(index, kind)


KINDS = ("dense", "vertical_slash", "tiles", "bars", "moba", "msa")


def dense_mask(index) -> torch.Tensor:
    """``[B, Hq, S, S]``; a part's from its index's: the tiles are the index without its
    columns, the bars the rest."""
    if not isinstance(index, VerticalSlashPart):
        return index.to_dense_mask(index.seq_len)
    whole = index.index
    no_columns = torch.full_like(whole.vertical[..., :1], -1)
    tiles = VerticalSlashIndex(no_columns, whole.slash, whole.seq_len, whole.block_size).to_dense_mask(whole.seq_len)
    return tiles if index.part == "tiles" else whole.to_dense_mask(whole.seq_len) & ~tiles


def from_key_lists(index, bounded: bool = False) -> torch.Tensor:
    """The count the kernels see: every row chunk's key lists (``bounded``: as the recall
    reads them, ``bounded_key_lists``), masked by ``visible``."""
    area = torch.zeros(index.batch_size, index.selection_heads, dtype=torch.int64, device=index.device)
    for q0, q1 in index.query_ranges(index.seq_len):
        keys = index.bounded_key_lists(q0, q1) if bounded else index.key_lists(q0, q1)
        area += index.visible(keys, q0, q1).flatten(2).sum(-1)
    return area.repeat_interleave(index.num_heads // index.selection_heads, dim=1)


@pytest.mark.parametrize("seq", SEQ_LENS)
@pytest.mark.parametrize("kind", KINDS)
def test_whole_index(kind, seq, rng, device):
    index = random_index(kind, rng, seq, device)
    area = index.attended_area()
    assert area.dtype == torch.int64 and area.shape == (index.batch_size, index.num_heads)
    assert area.device.type == device.type
    assert torch.equal(area, dense_mask(index).sum((-2, -1)))
    assert torch.equal(area, from_key_lists(index))
    assert torch.equal(area, from_key_lists(index, bounded=True))


def layouts(seq):
    """Every layout at 4 ranks, stripes whole blocks (8, 16) and not (4, 10)."""
    yield ContextParallelLayout("contiguous", 4, seq)
    yield ContextParallelLayout("zigzag", 4, seq)
    for stripe in (4, 8, 10, 16):
        if seq % (4 * stripe) == 0:
            yield ContextParallelLayout("striped", 4, seq, stripe=stripe)


@pytest.mark.parametrize("seq", SEQ_LENS)
@pytest.mark.parametrize("kind", KINDS)
def test_ring_steps(kind, seq, rng, device):
    """Each rank's rows against each rank's chunk: the dense mask at those rows and keys."""
    index = random_index(kind, rng, seq, device)
    mask = dense_mask(index)
    for layout in layouts(seq):
        for rank in range(layout.cp_size):
            rows = layout.positions(rank)
            for source in range(layout.cp_size):
                keys = layout.positions(source)
                step = StepIndex(index, rows.to(device), keys.to(device))
                want = mask[:, :, rows.to(device)][..., keys.to(device)].sum((-2, -1))
                assert torch.equal(step.attended_area(), want), (layout, rank, source)


@pytest.mark.parametrize("kind", KINDS)
def test_any_rows_and_padded_keys(kind, rng, device):
    """Rows in any order and keys a random -1 padded subset (as the gathered vertical
    columns of the local bar pass): the dense mask at those rows and keys."""
    seq = 200
    index = random_index(kind, rng, seq, device)
    mask = dense_mask(index)
    for _ in range(4):
        rows = torch.randperm(seq, generator=rng)[: int(torch.randint(1, seq + 1, (1,), generator=rng))]
        keys = torch.randperm(seq, generator=rng)[: int(torch.randint(0, seq + 1, (1,), generator=rng))].sort().values
        padded = torch.cat([keys, torch.full((int(torch.randint(0, 9, (1,), generator=rng)),), -1)])
        step = StepIndex(index, rows.to(device), padded.to(device))
        want = mask[:, :, rows.to(device)][..., keys.to(device)].sum((-2, -1))
        assert torch.equal(step.attended_area(), want)
        assert torch.equal(step.attended_area(), from_key_lists(step))


def test_ring_parts_add_up_to_the_index(rng):
    """Tiles on every ring step plus bars over the gathered columns make the whole area."""
    seq = 256
    index = random_vertical_slash(rng, 2, 4, seq, 16)
    columns = torch.unique(index.vertical[index.vertical >= 0])
    columns = torch.cat([columns, torch.full((3,), -1)])
    for layout in layouts(seq):
        total = torch.zeros(2, 4, dtype=torch.int64)
        for rank in range(4):
            rows = layout.positions(rank)
            total += StepIndex(VerticalSlashPart(index, "bars"), rows, columns).attended_area()
            for source in range(4):
                total += StepIndex(VerticalSlashPart(index, "tiles"), rows, layout.positions(source)).attended_area()
        assert torch.equal(total, index.attended_area()), layout


@pytest.mark.parametrize("kind", KINDS)
def test_reads_nothing_on_host(kind, rng):
    """The ring records every step's area, the metrics the index's area and the recall's key
    lists; a host read there would stall each step on the GPU."""
    index = random_index(kind, rng, 256, "cpu")
    layout = ContextParallelLayout("striped", 4, 256, stripe=16)
    step = StepIndex(index, layout.positions(1), layout.positions(2))
    with HostReads() as reads:
        index.attended_area()
        step.attended_area()
        if not isinstance(index, VerticalSlashPart):  # what the recall metric reads
            index.bounded_key_lists(64, 128)
    assert reads.count == 0


def test_correlation_is_exact_at_large_counts(rng):
    """The FFT correlation at 2K blocks of up to 128 tokens equals the direct sum."""
    n = 2048
    a, b = torch.randint(0, 129, (2, n), generator=rng)
    shifted = torch.nn.functional.pad(b, (n - 1, 0)).unfold(0, n, 1).flip(0)  # [d, j] = b[j - d]
    assert torch.equal(_correlate(a, b), (shifted * a).sum(-1))


@pytest.mark.parametrize("seq", SEQ_LENS)
def test_part_block_areas_closed_form(seq, rng):
    """The tiles' and the bars' per-block areas (closed forms at the index's block) equal the
    generic count over the kernels' key lists."""
    for _ in range(3):
        index = random_vertical_slash(rng, 2, 3, seq, 16)
        for part in ("tiles", "bars"):
            piece = VerticalSlashPart(index, part)
            assert torch.equal(piece.block_areas(16), super(VerticalSlashPart, piece).block_areas(16)), part
