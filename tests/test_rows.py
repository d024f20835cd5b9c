"""The row kernels (``kernels/shared/rows.py``; Triton, the interpreter on CPU) give exactly
PyTorch's ``x[order]`` and ``index_add_``: copies bit for bit, fp32 sums of the same values."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_mtraining.sparse.kernels import triton_available

pytestmark = [
    pytest.mark.skipif(
        not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
        reason="needs Triton on CUDA or TRITON_INTERPRET=1",
    ),
    pytest.mark.usefixtures("poisoned_outputs"),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, msg=""):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), msg
    assert torch.equal(got.cpu().view(BITS[got.dtype]), want.cpu().view(BITS[want.dtype])), msg


def rows_of(rng, n, d, dtype, device):
    """Random rows with the values a copy could get wrong: signed zeros, infinities, subnormals."""
    x = torch.randn(n, d, generator=rng) * torch.rand(n, 1, generator=rng) * 100
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), torch.finfo(dtype).smallest_normal / 4])
    x.view(-1)[: len(specials)] = specials
    return x.to(device, dtype)


def order_of(rng, n, count, repeats, device, dtype=torch.int32):
    order = torch.randint(0, n, (count,), generator=rng) if repeats else torch.randperm(n, generator=rng)[:count]
    return order.to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [8, 72, 128, 256])
def test_gather_rows_is_indexing(d, dtype, rng, kdevice):
    """Three sources of one width, of two dtypes, and a 1-D one in one call; an order shorter
    than the rows, repeating some; int32 and int64 orders."""
    from megatron_mtraining.sparse.kernels.shared.rows import gather_rows

    n = 203
    sources = [rows_of(rng, n, d, dt, kdevice) for dt in (dtype, dtype, torch.float32)]
    lse = torch.randn(n, generator=rng).to(kdevice)
    for order_dtype in (torch.int32, torch.int64):
        order = order_of(rng, n, 150, True, kdevice, order_dtype)
        got = gather_rows(order, *sources, lse)
        assert len(got) == 4
        for i, (g, x) in enumerate(zip(got, (*sources, lse), strict=True)):
            assert_same_bits(g, x[order], f"source {i}, {order_dtype}")


@pytest.mark.parametrize("count", [0, 1, 97])
def test_gather_rows_of_any_count(count, rng, kdevice):
    """An empty order (no launch, empty results), one row, and the sources spread over two
    launches (more than ``MATRICES`` 2-D, two 1-D), in the caller's order."""
    from megatron_mtraining.sparse.kernels.shared.rows import MATRICES, gather_rows

    n, d = 120, 72
    sources = [rows_of(rng, n, d, torch.bfloat16, kdevice) for _ in range(MATRICES + 1)]
    sources.insert(2, torch.randn(n, generator=rng).to(kdevice))
    sources.append(torch.randn(n, generator=rng).to(kdevice, torch.float16))
    order = order_of(rng, n, count, False, kdevice)
    got = gather_rows(order, *sources)
    assert len(got) == len(sources)
    for i, (g, x) in enumerate(zip(got, sources, strict=True)):
        assert_same_bits(g, x[order], f"source {i}")
    (only,) = gather_rows(order, torch.randn(n, generator=rng).to(kdevice))  # a 1-D source alone
    assert only.shape == (count,)


@pytest.mark.parametrize("part_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [8, 72, 128, 256])
def test_add_rows_is_index_add(d, part_dtype, rng, kdevice):
    """Into an fp32 target: each row at most once, an order shorter than the rows, and a part
    whose rows lie apart (a slice of wider rows)."""
    from megatron_mtraining.sparse.kernels.shared.rows import add_rows

    n, count = 211, 160
    target = rows_of(rng, n, d, torch.float32, kdevice)
    order = order_of(rng, n, count, False, kdevice, torch.int64)
    wide = rows_of(rng, count, d + 8, part_dtype, kdevice)
    if kdevice.type == "cpu" and part_dtype == torch.bfloat16:
        # Triton's interpreter converts bf16 subnormals to fp32 wrongly (2^-128 to 0, 1e-39 to
        # 4.4e-39), which shows where the part's subnormal lands on the target's (order[0] == 0:
        # one seed in 211). A GPU converts them exactly, and its run keeps them.
        tiny = wide.float().abs() < torch.finfo(part_dtype).smallest_normal
        wide = torch.where(tiny, wide * 0, wide)
    for part in (wide[:, :d].contiguous(), wide[:, 8:]):
        want = target.clone().index_add_(0, order, part.float())
        add_rows(target, order, part)
        assert_same_bits(target, want, f"part strides {part.stride()}")


def test_add_rows_of_no_row_changes_nothing(rng, kdevice):
    from megatron_mtraining.sparse.kernels.shared.rows import add_rows

    target = torch.randn(10, 128, generator=rng).to(kdevice)
    want = target.clone()
    add_rows(target, torch.zeros(0, dtype=torch.int32, device=kdevice), torch.zeros(0, 128, device=kdevice))
    assert_same_bits(target, want)


def test_bad_arguments_say_why(kdevice):
    from megatron_mtraining.sparse.kernels.shared.rows import MAX_D, add_rows, gather_rows

    order = torch.zeros(3, dtype=torch.int32, device=kdevice)
    x = torch.zeros(4, 16, device=kdevice)
    with pytest.raises(ValueError, match="share one width"):
        gather_rows(order, x, torch.zeros(4, 8, device=kdevice))
    with pytest.raises(ValueError, match="share one width"):
        gather_rows(order, torch.zeros(4, MAX_D + 1, device=kdevice))
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(order, x.t())
    with pytest.raises(ValueError, match="int32 or int64"):
        gather_rows(order.float(), x)
    with pytest.raises(ValueError, match="fp32"):
        add_rows(x.half(), order, x[:3])
    with pytest.raises(ValueError, match="part must be"):
        add_rows(x, order, x[:3, ::2])
