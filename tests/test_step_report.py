"""The step report's breakdown (``training/step_report.py``): each operation's time goes to
the part, layer and phase that ran it, recomputation included, on a small CPU model whose
parts are known."""

from __future__ import annotations

import itertools
import re
import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron_mtraining.megatron.profiler_ranges import part_range
from megatron_mtraining.training.step_report import MIN_GAP_MS, StepReport, _annotate, breakdown, idle_gaps


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(width, 4 * width)
        self.linear_fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(x)))


def _profile(recompute: bool):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(64) for _ in range(2))
    for number, block in enumerate(blocks, 1):
        _annotate(block, f"layer:{number}")
        _annotate(block.linear_fc1, "matmuls")
        _annotate(block.linear_fc2, "matmuls")
    x = torch.randn(256, 64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
        with part_range("loss"):
            loss = h.square().mean()
        loss.backward()
    return breakdown(prof, 1.0, on_device=False)


def test_parts_layers_and_phases():
    report = _profile(recompute=False)
    parts = report["parts_ms"]
    assert set(report["layers_ms"]) == {"1", "2"}
    # Each linear's forward is an addmm and its backward two mm: both land in matmuls.
    assert parts["matmuls"]["forward"] > 0 and parts["matmuls"]["backward"] > 0
    assert parts["matmuls"]["recompute"] == 0
    # GELU and the residual add run in the layer outside its named modules.
    assert parts["elementwise"]["forward"] > 0 and parts["elementwise"]["backward"] > 0
    assert parts["loss"]["forward"] > 0 and parts["loss"]["backward"] > 0
    assert report["summed_ms"] == pytest.approx(sum(sum(p.values()) for p in parts.values()), abs=0.05)
    assert all(name.startswith(("forward:", "backward:")) for top in report["top_kernels_ms"].values() for name in top)


def test_recomputation_is_its_own_phase():
    plain, recomputed = _profile(recompute=False), _profile(recompute=True)
    parts = recomputed["parts_ms"]
    # (PyTorch's checkpoint stops recomputing once the backward has what it needs.)
    assert parts["matmuls"]["recompute"] > 0
    # The recomputed forward's nodes are the ones the backward runs: still matmuls.
    assert parts["matmuls"]["backward"] > 0
    assert "loss" in parts and parts["loss"]["recompute"] == 0
    assert set(recomputed["layers_ms"]) == set(plain["layers_ms"])


def test_kernels_in_catch_all_parts_are_filed_by_name(monkeypatch):
    """A kernel that lands in ``other`` or a layer's ``elementwise`` goes to the part
    ``NAMED_KERNELS`` names for it; the same kernel inside a named part stays there. (On CPU
    the "kernels" are ATen operations.)"""
    from megatron_mtraining.training import step_report

    monkeypatch.setattr(step_report, "NAMED_KERNELS", ((re.compile(r"^aten::sin$"), "msa_index"),))
    x = torch.randn(4096)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with part_range("other"):
            x.sin()
            x.cos()
        with part_range("layer:1"):
            x.sin()
        with part_range("loss"):
            x.sin()
    parts = breakdown(prof, 1.0, on_device=False)["top_kernels_ms"]
    assert "forward: aten::sin" in parts["msa_index"] and "forward: aten::sin" in parts["loss"]
    assert "forward: aten::cos" in parts["other"] and "forward: aten::sin" not in parts["other"]
    assert "elementwise" not in parts


@pytest.mark.parametrize(
    "kernel, part",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0",
         "attention"),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void*)", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>>", "attention"),
        ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128>>", "attention"),
        ("_block_select_kernel", "msa_index"),
        ("_topk_blocks_kernel", "index"),
        ("_row_stats_kernel", "other"),  # ambiguous: mtraining's index build and the recall metric
        ("_loss_row_stats_kernel", "loss"),
        ("_loss_softmax_grad_kernel", "loss"),
        ("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", "other"),
        ("triton_poi_fused_mul_silu_split_0", "other"),
    ],
)  # fmt: skip
def test_the_named_kernels_of_the_step_on_a_gpu(kernel, part):
    """The device's kernel names (from the H200 profiles) that name their part, and those that do not."""
    from megatron_mtraining.training.step_report import _named_part

    assert _named_part(kernel, "other") == part
    assert _named_part(kernel, "matmuls") == "matmuls"


def test_idle_gaps_name_the_longest_and_what_the_host_did():
    ms = 1_000_000
    # Device: k1 [0, 2], k2 [1, 3] (overlapping: no gap), k3 [7, 8], k4 [8.01, 9], k5 [9.5, 10].
    device = [(0, 2 * ms, "k1"), (1 * ms, 3 * ms, "k2"), (7 * ms, 8 * ms, "k3"), (8 * ms + 10_000, 9 * ms, "k4")]
    device.append((int(9.5 * ms), 10 * ms, "k5"))
    host = [
        (0, 10 * ms, "mtraining::layer:1"),
        (int(3.5 * ms), int(6.5 * ms), "cudaStreamSynchronize"),
        (int(9.1 * ms), int(9.4 * ms), "mtraining::attention"),
        (11 * ms, 12 * ms, "cudaLaunchKernel"),  # after the last kernel: in no gap
    ]
    report = idle_gaps(device, host, top=1)
    # Gaps of at least MIN_GAP_MS: 3 -> 7 and 9 -> 9.5; 8 -> 8.01 is shorter.
    assert MIN_GAP_MS * 1e6 > 10_000
    assert report["gaps"] == 2 and report["gaps_ms"] == pytest.approx(4.5) and report["events"] == 5
    (longest,) = report["longest"]
    assert longest == {
        "ms": 4.0,
        "at_ms": 3.0,
        "after": "k2",
        "before": "k3",
        "host": ["mtraining::layer:1", "cudaStreamSynchronize"],
    }
    second = idle_gaps(device, host, top=2)["longest"][1]
    assert (second["after"], second["before"], second["host"]) == (
        "k4",
        "k5",
        ["mtraining::layer:1", "mtraining::attention"],
    )


def test_idle_gaps_name_the_sampled_frame_at_each_gap():
    """With the host's sampled frames (disjoint intervals, some time in none), each gap names
    the interval holding its middle, as a brute-force search over every interval finds it;
    ``by_frame_ms`` sums every gap by it."""
    import random

    rng = random.Random()
    frames, t = [], 0
    while t < 100_000_000:
        length = rng.randint(50_000, 3_000_000)
        if rng.random() < 0.9:
            frames.append((t, t + length, f"megatron_mtraining/f.py(1): f{rng.randint(0, 5)}"))
        t += length
    # Kernels with gaps of 0.1-2 ms between them, some of them past the last frame.
    device, t = [], 0
    while t < 110_000_000:
        device.append((t, t + 500_000, "k"))
        t += 500_000 + rng.randint(100_000, 2_000_000)
    report = idle_gaps(device, [], top=5, frames=rng.sample(frames, len(frames)))

    def holding(t):
        return next((name for lo, hi, name in frames if lo <= t < hi), None)

    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in itertools.pairwise(device) if b[0] - a[1] >= MIN_GAP_MS * 1e6]
    for gap, (_, lo, hi) in zip(report["longest"], sorted(gaps, key=lambda g: -g[0]), strict=False):
        assert gap["frame"] == holding((lo + hi) // 2)
    expected = {}
    for length, lo, hi in gaps:
        expected[holding((lo + hi) // 2)] = expected.get(holding((lo + hi) // 2), 0) + length
    for name, ms in report["by_frame_ms"].items():
        assert ms == pytest.approx(expected[name] / 1e6, abs=1e-3)
    assert sorted(report["by_frame_ms"].values(), reverse=True)[0] == pytest.approx(
        max(expected.values()) / 1e6, abs=1e-3
    )
    assert "frame" not in idle_gaps(device, [], top=1)["longest"][0]


def test_compiles_are_reported_by_iteration_and_the_users_hooks_kept(monkeypatch, tmp_path):
    """Triton's JIT hooks, called as Triton calls them around a compile, land in the report:
    those before the steady iterations counted, those in them by kernel and iteration; hooks
    set before the report still run (a True from the first still skips the compile) and are
    back once it is written."""
    knobs = pytest.importorskip("triton").knobs.runtime
    seen = []
    monkeypatch.setattr(knobs, "jit_cache_hook", lambda **kw: seen.append(("before", kw["fn"].name)) or False)
    monkeypatch.setattr(knobs, "jit_post_compile_hook", lambda **kw: seen.append(("after", kw["fn"].name)))
    users = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    report = StepReport(tmp_path / "report.json", profile_step=None)

    def compile_(name):
        info = types.SimpleNamespace(name=name)
        assert knobs.jit_cache_hook(key=name, repr=name, fn=info, compile={}) is False
        knobs.jit_post_compile_hook(key=name, repr=name, fn=info, compile={})

    compile_("setup")  # before the first iteration
    for iteration, names in enumerate([["a", "b"], [], ["c"], [], ["d"]]):
        report.begin_iteration(iteration, train_iters=100)
        for name in names:
            compile_(name)
    written = report.write(types.SimpleNamespace(global_batch_size=1, seq_length=8))["compiles"]
    assert written["before_steady"] == 3 and written["before_steady_s"] >= 0
    assert [(e["iteration"], e["kernel"]) for e in written["steady"]] == [(2, "c"), (4, "d")]
    assert seen == [(when, n) for n in ["setup", "a", "b", "c", "d"] for when in ("before", "after")]
    assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == users
    monkeypatch.setattr(knobs, "jit_cache_hook", lambda **kw: True)
    skipping = StepReport(tmp_path / "skip.json", profile_step=None)
    assert knobs.jit_cache_hook(key="k", repr="k", fn=types.SimpleNamespace(name="k"), compile={}) is True
    skipping.compiles.close()
