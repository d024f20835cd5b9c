"""Packed-document test inputs and the independent block-diagonal causal mask."""

import torch


def random_boundaries(rng, seq: int, block: int = 16) -> torch.Tensor:
    """int32 ``[0, ..., seq]``: a document of one token, a boundary on a block edge, a
    document of exactly one block, a run of short documents (1 to 8 tokens), then two long
    documents split at a random place (usually inside a block)."""

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=rng))

    cuts = [1, block, 2 * block]
    while cuts[-1] < 2 * block + seq // 8:
        cuts.append(cuts[-1] + between(1, 9))
    cuts.append((seq + cuts[-1]) // 2 + between(-block // 2, block // 2))
    return torch.tensor([0, *cuts, seq], dtype=torch.int32)


def block_diagonal(cu: torch.Tensor, seq: int) -> torch.Tensor:
    """``[S, S]``: key at or before the row, in the row's document (written from the bounds
    with a loop, independent of ``Documents``)."""
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return mask
