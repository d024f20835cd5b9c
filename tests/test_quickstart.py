"""The embedded default, ``python -m megatron_mtraining.examples.quickstart``, shortened for CI.

One run of every stage with 4 steps on 1024-token samples (2 gloo processes, CP 2 on a CPU):
the data files, the checkpoint of the phase-1 iteration, the resume at exactly that iteration,
finite losses, TensorBoard and offline W&B output (where W&B is installed), and the summary
naming them. A second call reuses every stage; a failing training phase shows its log's end
and exits non-zero.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_mtraining.examples.quickstart import LOADED, Launch, main, plan_launch
from megatron_mtraining.training.metrics_line import parse_metrics

SHORT = ["--steps", "4", "megatron.seq_length=1024", "megatron.max_position_embeddings=1024"]


def quickstart(workdir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_mtraining.examples.quickstart", "--workdir", str(workdir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    proc.stdout += proc.stderr
    return proc


def stage_headers(output: str) -> list[tuple[int, str]]:
    return [(int(n), title) for n, title in re.findall(r"^\[(\d)/6\] (.*)$", output, re.M)]


def summary_rows(output: str) -> dict[str, str]:
    summary = output.split("[6/6] Summary", 1)[1]
    return dict(re.findall(r"^  (\w+) +(.*)$", summary, re.M))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("quickstart") / "qs"
    proc = quickstart(workdir, *SHORT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return workdir, proc.stdout


def test_every_stage_runs_and_phase_2_resumes_at_the_saved_iteration(run):
    workdir, output = run
    headers = stage_headers(output)
    assert [n for n, _ in headers] == [1, 2, 3, 4, 5, 6], output
    assert not any("reused" in title for _, title in headers)
    assert (workdir / "data/synthetic/long.jsonl").stat().st_size > 10**6
    assert (workdir / "data/synthetic/tokenizer/tokenizer.json").is_file()
    assert (workdir / "data/synthetic/mix.bin").stat().st_size > 10**6
    # Phase 1 trains 1-2 and saves 2; phase 2 loads exactly 2 and trains 3-4.
    phase1, phase2 = ((workdir / "logs" / f"phase{i}.log").read_text() for i in (1, 2))
    assert (workdir / "checkpoints/iter_0000002").is_dir() and (workdir / "checkpoints/iter_0000004").is_dir()
    assert LOADED.findall(phase1) == [] and LOADED.findall(phase2) == ["2"]
    first, second = parse_metrics(phase1), parse_metrics(phase2)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    losses = [float(m["lm_loss"]) for m in (*first.values(), *second.values())]
    assert all(math.isfinite(v) and 0 < v < 10 for v in losses), losses
    # Two processes with CP 2 on a CPU or two GPUs; one process with CP 1 on a single GPU.
    context_parallel = 2 if plan_launch(torch.cuda.device_count()).processes > 1 else 1
    assert f"context-parallel size: {context_parallel}" in phase1
    assert 0 < float(second[4]["attended_fraction"]) < 1, second[4]
    # The console shows each iteration and the resume check.
    assert re.search(r"iteration 3/4 \| lm_loss \d", output) and "resumed at iteration 2, as saved" in output


def test_summary_names_the_outputs(run):
    workdir, output = run
    rows = summary_rows(output)
    events = sorted((workdir / "tensorboard").glob("events.out.tfevents.*"))
    runs = sorted((workdir / "wandb/wandb").glob("offline-run-*"))
    assert len(events) == 2 and all(e.name in rows["tensorboard"] for e in events), events  # one per phase
    if importlib.util.find_spec("wandb") is None:  # as on the GPU machines' image: the run goes on without it
        assert runs == [] and rows["wandb"].startswith("not installed"), rows["wandb"]
    else:
        assert len(runs) == 2 and all(str(r) in rows["wandb"] for r in runs), runs
    assert f"tensorboard --logdir {workdir / 'tensorboard'}" in rows["view"]
    assert str(workdir / "checkpoints/iter_0000002") in rows["checkpoints"]
    assert str(workdir / "logs/phase2.log") in rows["logs"]
    first = parse_metrics((workdir / "logs/phase1.log").read_text())[1]["lm_loss"]
    last = parse_metrics((workdir / "logs/phase2.log").read_text())[4]["lm_loss"]
    assert rows["loss"] == f"{float(first):.4f} at iteration 1 -> {float(last):.4f} at iteration 4"
    assert "megatron.ckpt_step=2" in rows["resume"] and "--fresh" in rows["rerun"]
    # The evaluation reads the last checkpoint: the workdir's, with no phase's ckpt_step.
    assert "megatron_mtraining.evaluate" in rows["evaluate"] and "ckpt_step" not in rows["evaluate"]
    assert f"cd {workdir.resolve()} " in rows["evaluate"] and "--checkpoint checkpoints" in rows["evaluate"]


def test_second_call_reuses_every_stage(run):
    workdir, output = run
    again = quickstart(workdir, *SHORT)
    assert again.returncode == 0, again.stdout[-3000:]
    titles = [title for n, title in stage_headers(again.stdout) if n < 6]
    assert len(titles) == 5 and all(t.endswith("(reused: done before; --fresh redoes it)") for t in titles)
    assert "log:" not in again.stdout
    assert summary_rows(again.stdout)["loss"] == summary_rows(output)["loss"]


def test_failed_phase_prints_the_log_end_and_exits_non_zero(run, tmp_path):
    workdir = tmp_path / "qs"
    shutil.copytree(run[0], workdir)
    # A hidden size of 66 does not split into the config's four heads: Megatron refuses at
    # start-up (the YAML checks pass it on).
    proc = quickstart(workdir, *SHORT, "megatron.hidden_size=66")
    assert proc.returncode != 0
    assert "the training settings differ from the recorded run's" in proc.stdout
    assert re.search(r"error: training phase1 failed \(exit code \d+\); the end of its log:", proc.stdout)
    assert "Megatron rejected the arguments" in proc.stdout
    assert f"full log: {workdir / 'logs/phase1.log'}" in proc.stdout
    assert "[5/6]" not in proc.stdout


def test_launch_follows_the_gpus():
    assert plan_launch(0) == Launch(2, "cpu")
    assert (plan_launch(2).processes, plan_launch(2).device, plan_launch(8).processes) == (2, "cuda", 2)
    one = plan_launch(1)
    assert (one.processes, one.device, one.overrides()) == (1, "cuda", ["megatron.context_parallel_size=1"])
    assert "context parallelism 1" in one.note and plan_launch(2).overrides() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "1"], r"--steps=1 is too few: accepted an integer >= 2"),
        (["megatron.train_iters=5"], r"override 'megatron.train_iters=5': the quickstart sets megatron.train_iters"),
        (
            ["--config", "nothere.yaml"],
            r"--config='nothere.yaml': no such file, and no recipe of that name is packaged .*quickstart\.yaml",
        ),
    ],
)
def test_bad_arguments_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert re.search(message, capsys.readouterr().err)
