"""The package's Triton kernels compiled ahead of time for A100 and H100
(scripts/compile_kernels.py).

The script runs in a process of its own: Triton compiles only kernels that were not loaded
under the interpreter these tests run with."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "compile_kernels.py"


def _run(tmp_path, *args, config=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MTRAINING_KL_CONFIG")}
    if config:
        env["MTRAINING_KL_CONFIG"] = config
    out = tmp_path / "resources.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], env=env, capture_output=True, text=True
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())["rows"]


# One case an architecture: two processes of half the length, which the xdist workers share.
@pytest.mark.parametrize("arch", [80, 90], ids=["a100", "h100"])
def test_every_default_launch_fits_an_a100_and_an_h100(arch, tmp_path):
    """Every family at Qwen2.5-3B's shape (bf16, head dim 128, 8 heads a group, blocks of
    128): shared memory within the GPU's and no stack beyond 4 KiB a thread, with the launch
    parameters each architecture gets."""
    rc, rows = _run(tmp_path, "--arch", str(arch))
    assert {r["arch"] for r in rows} == {arch}
    for family in ("kl", "kl-kv-outer", "attention", "kv-outer", "msa-kv-outer", "window", "combine", "gate"):
        assert any(r["family"] == family for r in rows), family
    assert {r["index"] for r in rows if r["family"] == "attention"} == {"dense", "v-s", "top-k"}
    limit = {80: 163, 90: 227}[arch] * 1024
    for r in rows:
        assert r["fits"] and 0 <= r["shared_bytes"] <= limit and r["spill_stack_bytes"] <= 4096, r
    # Ampere's dK/dV programs take 64 keys (block_bar.attention.launch_config), Hopper's 128.
    dkdv = {r["block_n"] for r in rows if r["kernel"] == "_tile_dkdv_kernel"}
    assert dkdv == {{80: 64, 90: 128}[arch]}
    assert rc == 0


def test_shared_memory_is_what_the_h200_reported(tmp_path):
    """A launch that failed on the H200 (bench_msa_kl.py's sweep, Triton 3.6) with the
    shared memory Triton said it required: the ahead-of-time figure is the same, and the
    script refuses it."""
    rc, rows = _run(
        tmp_path, "--family", "kl", "--arch", "90", "--index", "dense", "--launch", "fused", config="fused:32,128,4,2"
    )
    (row,) = rows
    assert (row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]) == (32, 128, 4, 2)
    assert row["shared_bytes"] == 255616 and not row["fits"]
    assert rc == 1


def test_the_128_key_kl_backward_spills_wholesale_on_ampere(tmp_path):
    """Why Ampere has a KV-outer KL table of its own (``kv_loss.SM80_DEFAULTS``): the
    128-key backward that sm90 takes compiles to a stack of many KiB a thread on sm80. If a
    Triton release stops doing so, that table can go."""
    args = ("--family", "kl-kv-outer", "--launch", "bwd", "--kv-configs", "bwd:64,128,8,1,8")
    rc, rows = _run(tmp_path, *args)
    spill = {r["arch"]: r["spill_stack_bytes"] for r in rows if r["launch"] == "bwd"}
    assert spill[80] > 8192 and spill[90] <= 4096
    assert rc == 1


@pytest.mark.slow
def test_the_window_passes_fit_an_a100_and_an_h100(tmp_path):
    """The window-statistics passes (the vertical-slash build's, the index recall's kept sums,
    and MSA's block sums for its block recall) at the recipes' shape, with packed documents."""
    launches = ("row_max", "row_sum", "kept_sums", "block_sums", "mass", "pool")
    rc, rows = _run(tmp_path, "--family", "window", "--documents", "--launch", *launches)
    assert {(r["launch"], r["arch"]) for r in rows} == {(launch, arch) for launch in launches for arch in (80, 90)}
    for r in rows:
        assert r["fits"], r
    assert rc == 0
