"""MSA's KL launch table compiled ahead of time for A100 and H100 (scripts/compile_msa_kl.py).

The script runs in a process of its own: Triton compiles only kernels that were not loaded
under the interpreter these tests run with."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "compile_msa_kl.py"


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


def test_every_launch_of_the_default_table_fits_an_a100(tmp_path):
    """Qwen2.5-3B's shape (bf16, head dim 128, 8 heads a group); the top-k index's launches
    are the same kernels and blocks with a row selection read, so the dense index stands
    for both here."""
    rc, rows = _run(tmp_path, "--arch", "80", "--index", "dense")
    assert [r["launch"] for r in rows] == ["lse", "dq", "dk", "fused"]
    for r in rows:
        assert r["fits"] and 0 < r["shared_bytes"] <= 163 * 1024, r
    assert rc == 0


def test_shared_memory_is_what_the_h200_reported(tmp_path):
    """A launch that failed on the H200 (bench_msa_kl.py's sweep, Triton 3.6) with the
    shared memory Triton said it required: the ahead-of-time figure is the same, and the
    script refuses it."""
    rc, rows = _run(tmp_path, "--arch", "90", "--index", "dense", "--launch", "fused", config="fused:32,128,4,2")
    (row,) = rows
    assert (row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]) == (32, 128, 4, 2)
    assert row["shared_bytes"] == 255616 and not row["fits"]
    assert rc == 1


def test_kv_outer_passes_compile_without_wholesale_spills(tmp_path):
    """The KV-outer KL as kv_loss launches it on each architecture: every kernel fits, no
    stack beyond 4 KiB a thread; and the reason Ampere has a table of its own: the 128-key
    backward that sm90 takes spills wholesale on sm80 (if a Triton release stops doing so,
    ``kv_loss.SM80_DEFAULTS`` can go)."""
    rc, rows = _run(tmp_path, "--kl-order", "kv-outer")
    assert {r["arch"] for r in rows} == {80, 90}
    assert {r["launch"] for r in rows} >= {"lse", "bwd", "bwd/reduce", "bwd/sum_slots"}
    for r in rows:
        assert r["fits"] and r["spill_stack_bytes"] <= 4096, r
    assert rc == 0
    rc, rows = _run(
        tmp_path, "--kl-order", "kv-outer", "--arch", "80", "--launch", "bwd", "--kv-configs", "bwd:64,128,8,1,8"
    )
    (bwd,) = [r for r in rows if r["launch"] == "bwd"]
    assert bwd["spill_stack_bytes"] > 8192 and not bwd["fits"] and rc == 1
