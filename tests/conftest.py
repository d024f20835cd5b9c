import collections
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's interpreter, so CI checks their
# logic too. It must be set before any kernel is defined (they are imported lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton_interpreter  # noqa: E402  (after TRITON_INTERPRET is set)

triton_interpreter.install()


@pytest.fixture
def rng():
    """A fresh seed per test, printed so a failure can be replayed with
    MTRAINING_TEST_SEED=<seed>: inputs differ from run to run."""
    seed = int(os.environ.get("MTRAINING_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test on the CPU and, where one is present, on a CUDA device."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


@pytest.fixture
def kdevice(device):
    """``device`` for Triton kernel tests: CPU only under the interpreter; CUDA natively."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    return device


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every kernel output buffer starts as NaN, so a row a kernel fails to write shows."""
    from megatron_mtraining.sparse.kernels.shared import buffers

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(buffers, "new_buffer", poisoned)


@pytest.fixture
def block_bar_steps(monkeypatch):
    """``set(step)``: every ``block_bar`` kernel walks ``step`` keys and rows a step (one
    warp group, one stage), so an index of wider blocks takes several steps a block."""
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    def set_steps(step: int) -> None:
        config = block_bar.LaunchConfig(block_n=step, num_warps=4, num_stages=1, block_m=step)
        for name in block_bar.KERNELS:
            monkeypatch.setitem(block_bar.OVERRIDES, name, config)

    return set_steps


@pytest.fixture
def kernel_backward_calls(monkeypatch):
    """Counts the dense Triton backward's calls (the LSE gradient's path)."""
    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar

    calls = collections.Counter()
    real = block_bar.kernel_backward

    def counted(*args, **kwargs):
        calls["kernel_backward"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(block_bar, "kernel_backward", counted)
    return calls
