"""Synthetic attention inputs and patterns for the demo, benchmarks and tests."""

from __future__ import annotations

import torch

from ..sparse import VerticalSlashIndex


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on ``[B, S, H, D]`` (half-split convention)."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32).view(-1, 1) * freqs
    cos, sin = angles.cos().view(1, seq, 1, -1), angles.sin().view(1, seq, 1, -1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def slash_heavy_index(seq: int, block: int, heads: int, gen: torch.Generator) -> VerticalSlashIndex:
    """A vertical-slash index shaped like the MTraining paper's (slash lines dominate):
    per head 8 local block diagonals, 1/16 of the other diagonals at random, 16 sink
    and 64 scattered vertical columns."""
    n = seq // block
    slash, vertical = [], []
    for _ in range(heads):
        far = (torch.randperm(n - 8, generator=gen)[: n // 16] + 8).tolist()
        slash.append(sorted(set(range(8)) | set(far)))
        vertical.append(sorted(set(range(16)) | set(torch.randperm(seq, generator=gen)[:64].tolist())))

    def pad(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)[None]

    return VerticalSlashIndex(pad(vertical), pad(slash), seq_len=seq, block_size=block)


DOCUMENT_MIXES = ("uniform", "lognormal", "one_long")


def sampled_document_bounds(mix: str, seq: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    """``cu_seqlens`` (int32) of one packed sample of ``seq`` tokens whose documents follow
    ``mix``, with mean length about ``mean``:

    * ``uniform``: lengths uniform in ``[1, 2 mean)``;
    * ``lognormal``: log-normal with sigma 1.5, the long tail of web and book corpora
      (ProLong's and Llama 3's long-context mixes);
    * ``one_long``: one document of half the sample at a random place among ``uniform`` ones.

    The last document is cut at ``seq``, as a packing dataset cuts it."""
    if mix not in DOCUMENT_MIXES:
        raise ValueError(f"mix={mix!r} is not accepted: expected one of {DOCUMENT_MIXES}")
    if mix == "lognormal":
        sigma = 1.5
        mu = torch.log(torch.tensor(float(mean))) - sigma**2 / 2  # E[len] = exp(mu + sigma^2 / 2)
        draw = lambda n: (mu + sigma * torch.randn(n, generator=gen)).exp()  # noqa: E731
    else:
        draw = lambda n: 1 + torch.rand(n, generator=gen) * (2 * mean - 1)  # noqa: E731
    lengths = draw(4 * seq // mean + 16).long().clamp(min=1)
    if mix == "one_long":
        lengths = torch.cat(
            [lengths[: int(torch.randint(0, 8, (1,), generator=gen))], torch.tensor([seq // 2]), lengths]
        )
    ends = lengths.cumsum(0)
    ends = ends[ends < seq]
    return torch.cat([torch.tensor([0]), ends, torch.tensor([seq])]).to(torch.int32)
