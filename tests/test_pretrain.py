"""The training entry point, ``python -m megatron_mtraining.pretrain``, end to end on CPU/gloo.

Each run is a subprocess on ``configs/tiny_cpu.yaml`` (2 layers, hidden 64, sequence 256,
Megatron's mock data, 6 steps). Losses are read from the entry point's own per-step line,
which prints the LM loss over the step's tokens at full precision (Megatron's line rounds
and, on the first step after a resume, averages two steps).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_mtraining.examples.quickstart import pretrain_command
from megatron_mtraining.training.metrics_line import parse_metrics as metrics
from megatron_mtraining.training.metrics_line import parse_validation
from megatron_mtraining.training.yaml_config import ConfigError, load_config

# CI installs W&B (the dev extra); the GPU machines' image has none, and the tests run there too.
HAS_WANDB = importlib.util.find_spec("wandb") is not None
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
# The tests compare runs bit for bit (resumes, runs with and without evaluations). On CPU every
# run repeats; CUDA runs repeat only in deterministic mode (docs/reliability.md: atomics, cuDNN,
# NCCL's algorithms), so there every run asks for it. Seen on an H200: MoBA at CP 2 differed
# between two runs in the 7th digit of the third step's loss without it.
DETERMINISTIC = ("megatron.deterministic_mode=true",) if torch.cuda.is_available() else ()


def pretrain(tmp: Path, *overrides: str, world: int = 1, config: Path = CONFIG, check: bool = True):
    """Runs the entry point in ``tmp``; returns the completed process (output in ``.stdout``)."""
    cmd = pretrain_command(world, config, [*DETERMINISTIC, *overrides])
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    proc.stdout += proc.stderr
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}"
    return proc


def losses(output: str) -> dict[int, float]:
    return {it: float(m["lm_loss"]) for it, m in metrics(output).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six mtraining steps on one process, with TensorBoard and offline W&B."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    wandb = ()
    if HAS_WANDB:
        wandb = (
            "megatron.wandb_project=tiny",
            "megatron.wandb_exp_name=uninterrupted",
            f"megatron.wandb_save_dir={tmp / 'wandb'}",
        )
    proc = pretrain(tmp, f"megatron.tensorboard_dir={tmp / 'tb'}", *wandb)
    return tmp, proc.stdout


def test_training_lowers_the_loss_and_logs_metrics(uninterrupted):
    tmp, output = uninterrupted
    loss = losses(output)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert loss[6] < loss[1] - 0.5, loss
    lines = metrics(output)
    assert 0.3 < float(lines[6]["attended_fraction"]) < 1.0, lines[6]  # mtraining attends a part
    assert 0.0 < float(lines[6]["index_recall"]) <= 1.0, lines[6]
    # The out-of-sample recall (rows that did not build the index) prints beside the in-sample one.
    assert 0.0 < float(lines[6]["index_recall_heldout"]) < 1.0, lines[6]
    assert list(lines[6]).index("index_recall_heldout") == list(lines[6]).index("index_recall") + 1, lines[6]
    assert float(lines[6]["tokens/s"]) > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    want = {"lm loss", "mtraining/lm_loss", "mtraining/tokens_per_second", "attended_fraction", "index_recall_heldout"}
    assert want | {"moe/index_recall_heldout_layer_1"} <= tags, tags
    assert [e.value for e in events.Scalars("mtraining/lm_loss")] == pytest.approx([loss[i] for i in range(1, 7)])
    # Each evaluation (at 3 and 6, then Megatron's final validation and test) under validation/.
    evaluations = parse_validation(output)
    assert [it for it, _ in evaluations] == [3, 6, 6, 6], evaluations
    logged = [(e.step, e.value) for e in events.Scalars("validation/lm_loss")]
    assert logged == [(it, pytest.approx(float(m["lm_loss"]))) for it, m in evaluations], logged
    assert {"validation/attended_fraction", "validation/moe/attended_fraction_layer_1"} <= tags, tags
    if HAS_WANDB:
        assert list((tmp / "wandb" / "wandb").glob("offline-run-*")), "no offline W&B run was written"


RECOMPUTE = (
    "megatron.recompute_granularity=full",
    "megatron.recompute_method=uniform",
    "megatron.recompute_num_layers=1",
)


def _moba_fraction(seq: int, chunk: int, topk: int) -> float:
    """MoBA's attended share of the causal pairs: each query attends its own chunk causally
    and ``topk - 1`` whole earlier chunks where there are that many (data-independent)."""
    chunks = seq // chunk
    area = sum(chunk * (chunk + 1) / 2 + chunk * chunk * min(topk - 1, c) for c in range(chunks))
    return area / (seq * (seq + 1) / 2)


@pytest.mark.parametrize(
    "attention, interval, extra",
    [
        ("dense", 1, RECOMPUTE),
        ("moba", 2, RECOMPUTE),
        ("moba", 3, ("megatron.global_batch_size=4",)),
    ],
    ids=["dense-every-step-recompute", "moba-interval2-recompute", "moba-interval3-2microbatches"],
)
def test_logged_attended_fraction_is_the_index_area(attention, interval, extra, tmp_path):
    """The logged fraction of each interval equals the attended area of the index over the
    causal pairs, whatever the interval, the micro-batches and activation recomputation
    (which runs the attention again in the backward and must not count twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_mtraining.sparse import MoBAConfig, build_moba_index

    config = load_config(CONFIG)
    seq = config.megatron["seq_length"]
    moba = config.attention.moba
    if attention == "dense":
        want = 1.0
    else:
        want = _moba_fraction(seq, moba.chunk_size, moba.topk)
        # The closed form against the index itself, on fresh inputs.
        q, k = torch.randn(1, seq, 4, 16), torch.randn(1, seq, 2, 16)
        area = build_moba_index(q, k, MoBAConfig(chunk_size=moba.chunk_size, topk=moba.topk)).attended_area()
        assert float(area.double().mean()) / (seq * (seq + 1) / 2) == pytest.approx(want, abs=1e-12)
    output = pretrain(
        tmp_path,
        f"attention.type={attention}",
        f"megatron.log_interval={interval}",
        f"megatron.tensorboard_dir={tmp_path / 'tb'}",
        *extra,
    ).stdout
    assert sorted(metrics(output)) == list(range(interval, 7, interval))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("attended_fraction")}
    assert sorted(logged) == list(range(interval, 7, interval))
    assert all(value == pytest.approx(want, abs=1e-6) for value in logged.values()), (logged, want)


CP2_STRIPED = ("megatron.context_parallel_size=2", "attention.layout=striped")


@pytest.fixture(scope="module")
def cp2_striped(tmp_path_factory):
    """Six mtraining steps on two processes, CP 2 with the striped layout."""
    return pretrain(tmp_path_factory.mktemp("cp2"), *CP2_STRIPED, world=2).stdout


def test_context_parallel_2_striped_lowers_the_loss(uninterrupted, cp2_striped, tmp_path):
    output = cp2_striped
    assert "context-parallel size: 2" in output
    loss = losses(output)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert loss[6] < loss[1] - 0.5, loss
    last = metrics(output)[6]
    assert 0.3 < float(last["attended_fraction"]) < 1.0, last
    assert float(last["worker_imbalance"]) >= 1.0 and float(last["step_imbalance"]) >= 1.0, last
    # Step 1 of a two-process run starts from the same state whatever the layout: Megatron's
    # own zigzag order gives the same loss, and the recall over the ranks' keys scores the
    # same index.
    zigzag = pretrain(
        tmp_path, "megatron.context_parallel_size=2", "attention.layout=zigzag", "megatron.train_iters=2", world=2
    ).stdout
    first, want = metrics(output)[1], metrics(zigzag)[1]
    assert float(first["lm_loss"]) == pytest.approx(float(want["lm_loss"]), rel=1e-6), (first, want)
    assert float(first["index_recall"]) == pytest.approx(float(want["index_recall"]), abs=1e-4), (first, want)
    # One process starts from the same state too (the CPU patches keep the CPU generator out of
    # Megatron's JIT warmup, whose tensors are seq_length / CP long).
    one = metrics(uninterrupted[1])[1]
    assert float(first["lm_loss"]) == pytest.approx(float(one["lm_loss"]), rel=1e-6), (first, one)
    assert float(first["index_recall"]) == pytest.approx(float(one["index_recall"]), abs=1e-4), (first, one)
    assert 0.0 < float(last["index_recall"]) < 1.0, last
    # The held-out rows are drawn from the iteration, the same under CP as on one process.
    for line in (first, want):
        assert float(line["index_recall_heldout"]) == pytest.approx(float(one["index_recall_heldout"]), abs=1e-4)


def test_resume_reproduces_the_next_steps_exactly(uninterrupted, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = pretrain(tmp_path, f"megatron.save={ckpt}", "megatron.save_interval=3", "megatron.exit_interval=3")
    assert (ckpt / "iter_0000003").is_dir()
    resumed = pretrain(tmp_path, f"megatron.load={ckpt}").stdout
    assert "attention switch" not in resumed
    want, before, after = losses(uninterrupted[1]), losses(first.stdout), losses(resumed)
    assert before == {i: want[i] for i in (1, 2, 3)}
    assert after == {i: want[i] for i in (4, 5, 6)}, (after, want)
    # A longer run decays the learning rate over more steps: not the checkpoint's schedule.
    changed = pretrain(tmp_path, f"megatron.load={ckpt}", "megatron.train_iters=12", check=False)
    assert changed.returncode != 0 and "Traceback" not in changed.stdout, changed.stdout[-3000:]
    assert "config error: megatron.load=" in changed.stdout and "use_checkpoint_opt_param_scheduler" in changed.stdout
    assert "[mtraining] iteration" not in changed.stdout  # stopped before training


def test_checkpoint_killed_while_saving_is_not_loaded(uninterrupted, tmp_path):
    """SIGKILL during the save of iteration 6, after its shards are written and before its
    ``metadata.json`` and the tracker: the restart resumes from iteration 3, steps 4-6 equal
    the uninterrupted run's, and the half-written ``iter_0000006`` is overwritten whole."""
    ckpt = tmp_path / "ckpt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    log = tmp_path / "paused.log"
    cmd = [sys.executable, str(Path(__file__).with_name("paused_save.py")), "6", "--config", str(CONFIG)]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        # A session of its own: the kill reaches Megatron's checkpoint writer processes too.
        proc = subprocess.Popen(
            [*cmd, f"megatron.save={ckpt}", "megatron.save_interval=3"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 600
            while "SAVE PAUSED" not in log.read_text():
                assert proc.poll() is None, f"the run ended before the paused save:\n{log.read_text()[-6000:]}"
                assert time.monotonic() < deadline, log.read_text()[-6000:]
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    partial = ckpt / "iter_0000006"
    assert list(partial.glob("*.distcp")) and not (partial / "metadata.json").exists(), list(partial.iterdir())
    assert tracker.read_text() == "3"
    resumed = pretrain(tmp_path, f"megatron.load={ckpt}", f"megatron.save={ckpt}", "megatron.save_interval=3").stdout
    assert re.search(r"successfully loaded checkpoint from .* at iteration 3", resumed), resumed[-3000:]
    want = losses(uninterrupted[1])
    assert losses(resumed) == {i: want[i] for i in (4, 5, 6)}, (losses(resumed), want)
    assert tracker.read_text() == "6" and (partial / "metadata.json").is_file()
    assert not list(ckpt.glob("*.tmp.*")), list(ckpt.iterdir())


# (overrides, processes): MSA resumes past its 2 warmup steps (the warmup counter and the index
# projections come from the checkpoint), evaluating after every step; mtraining, MoBA and MSA
# under CP 2 resume the striped ring, MSA again past its warmup.
EXACT_RESUMES = {
    "dense": (("attention.type=dense",), 1),
    "msa": (("attention.type=msa", "megatron.eval_interval=1"), 1),
    "msa-cp2-striped": (("attention.type=msa", *CP2_STRIPED), 2),
    "mtraining-cp2-striped": (CP2_STRIPED, 2),
    "moba-cp2-striped": (("attention.type=moba", *CP2_STRIPED), 2),
}


@pytest.fixture(scope="module")
def msa_whole(tmp_path_factory):
    """Six MSA steps on one process (2 warmup steps), evaluating after each."""
    return pretrain(tmp_path_factory.mktemp("msa"), *EXACT_RESUMES["msa"][0]).stdout


# MSA and MoBA at CP 2 repeat what mtraining at CP 2 and MSA at CP 1 check by default; dense
# at CP 1 what mtraining at CP 1 does (test_resume_reproduces_the_next_steps_exactly).
SLOW_RESUMES = ("dense", "msa-cp2-striped", "moba-cp2-striped")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_RESUMES else c for c in EXACT_RESUMES]
)
def test_resume_is_exact(case, request, tmp_path):
    overrides, world = EXACT_RESUMES[case]
    shared = {"mtraining-cp2-striped": "cp2_striped", "msa": "msa_whole"}
    if case in shared:
        whole = request.getfixturevalue(shared[case])
    else:
        whole = pretrain(tmp_path, *overrides, world=world).stdout
    ckpt = tmp_path / "ckpt"
    saving = ("megatron.save_interval=3", "megatron.exit_interval=3")
    first = pretrain(tmp_path, *overrides, f"megatron.save={ckpt}", *saving, world=world).stdout
    resumed = pretrain(tmp_path, *overrides, f"megatron.load={ckpt}", world=world).stdout
    want, before, after = losses(whole), losses(first), losses(resumed)
    assert before == {i: want[i] for i in (1, 2, 3)}, (before, want)
    assert after == {i: want[i] for i in (4, 5, 6)}, (after, want)
    # Samples continue where the checkpoint stopped: none repeated, none skipped.
    assert re.search(r"iteration\s+4/\s*6 \| consumed samples:\s+8 \|", resumed), resumed[-3000:]
    # So do the held-out samples: the evaluations after the resume are the uninterrupted run's.
    evaluations = parse_validation(whole)
    assert parse_validation(first) == [e for e in evaluations if e[0] <= 3], (parse_validation(first), evaluations)
    assert parse_validation(resumed) == [e for e in evaluations if e[0] > 3], (parse_validation(resumed), evaluations)


def test_dense_checkpoint_resumes_as_mtraining(tmp_path):
    ckpt = tmp_path / "dense"
    saving = ("megatron.save_interval=3", "megatron.exit_interval=3")
    pretrain(tmp_path, "attention.type=dense", f"megatron.save={ckpt}", *saving)
    output = pretrain(tmp_path, f"megatron.load={ckpt}").stdout
    assert re.search(r"attention switch on load from .* \(iteration 3\): 'dense' -> 'mtraining'", output), output[
        -3000:
    ]
    # The same parameters: the optimizer state and the schedule carry over.
    assert "no_load_optim -> True" not in output
    lines = metrics(output)
    assert sorted(lines) == [4, 5, 6]
    assert all(0.0 < float(m["attended_fraction"]) < 1.0 for m in lines.values()), lines
    assert all(math.isfinite(float(m["lm_loss"])) for m in lines.values())


def test_dense_checkpoint_resumes_as_msa(tmp_path):
    ckpt = tmp_path / "dense"
    pretrain(
        tmp_path,
        "attention.type=dense",
        f"megatron.save={ckpt}",
        "megatron.save_interval=3",
        "megatron.exit_interval=3",
    )
    output = pretrain(tmp_path, "attention.type=msa", f"megatron.load={ckpt}").stdout
    assert re.search(r"attention switch on load from .* \(iteration 3\): 'dense' -> 'msa'", output), output[-3000:]
    assert "no_load_optim -> True" in output
    # The index projections are requested from the checkpoint, found missing and kept fresh.
    missing = re.search(r"Unexpected keys \(for this rank\): (\{.*\})", output)
    assert missing and "index_branch.linear_q.weight" in missing.group(1), output[-3000:]
    lines = metrics(output)
    assert sorted(lines) == [4, 5, 6]
    assert all(math.isfinite(float(m["lm_loss"])) and "msa_kl_loss" in m for m in lines.values())
    # MSA warmup (2 steps in the config) counts from the switch: dense, dense, then sparse.
    assert [float(lines[i]["attended_fraction"]) for i in (4, 5)] == [1.0, 1.0]
    # Warmup attends densely: nothing is lost. After it, the index keeps part of the mass.
    assert [float(lines[i][name]) for i in (4, 5) for name in ("index_recall", "index_recall_heldout")] == [1.0] * 4
    assert 0.0 < float(lines[6]["index_recall"]) < 1.0 and 0.0 < float(lines[6]["index_recall_heldout"]) < 1.0
    assert float(lines[6]["attended_fraction"]) < 0.9
    # MSA's indexer figures print beside the KL in warmup and after.
    for name in ("msa_block_recall", "msa_score_recall"):
        assert all(0.0 < float(lines[i][name]) <= 1.0 for i in (4, 5, 6)), (name, lines)


def _write_indexed(prefix: Path, documents) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=np.int32), [len(doc)])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.slow  # three runs of the entry point; the in-process twin is test_megatron_attention's
def test_msa_selecting_every_block_continues_a_dense_checkpoint_as_dense(tmp_path, rng):
    """The study's continued stage (issue 23) in small: a dense checkpoint continued with
    ``finetune`` (iteration 0, a fresh optimizer, MSA's index projections fresh) as dense and
    as MSA, on packed documents attended within themselves, two micro-batches a step. Every
    document spans at most 14 blocks of 16 and MSA selects 15, so after its 2 warmup steps
    MSA selects every block a row sees: its main branch is dense attention. Whatever else
    MSA adds (the KL through Megatron's loss-scale hook, the index projections in the
    optimizer, the attention switch on load, the logged loss) must then leave the training
    unchanged: each step's logged lm_loss equals dense's to fp32 rounding (measured: equal or
    a few ulp apart). Weights drawn with std 0.2 make attention peaked, so the KL is of the
    order of nats and its gradients large; gradient clipping is off, since the norm it
    divides by holds the index branch's gradients too (Megatron's global norm, by design),
    which the logged grad norms show."""
    config = load_config(CONFIG)
    eod = config.megatron["vocab_size"] - 1  # Megatron's NullTokenizer
    # At most 201 tokens with the EOD: 15 + 201 <= 14 * 16, so at most 14 blocks at any offset.
    lengths = torch.randint(40, 201, (200,), generator=rng).tolist()
    _write_indexed(tmp_path / "docs", [torch.randint(0, eod, (n,), generator=rng).tolist() + [eod] for n in lengths])
    common = (
        "megatron.mock_data=false",
        f"megatron.data_path=[{tmp_path / 'docs'}]",
        "megatron.split=98,2,0",
        "megatron.reset_attention_mask=true",
        "megatron.micro_batch_size=1",
        "megatron.global_batch_size=2",
        "megatron.eval_interval=1000",
        "megatron.init_method_std=0.2",
    )
    ckpt = tmp_path / "dense"
    saving = (f"megatron.save={ckpt}", "megatron.save_interval=3", "megatron.train_iters=3")
    pretrain(tmp_path, *common, "attention.type=dense", *saving)
    cont = (
        *common,
        f"megatron.load={ckpt}",
        "megatron.finetune=true",
        "megatron.train_iters=8",
        "megatron.clip_grad=0",
    )
    dense_output = pretrain(tmp_path, *cont, "attention.type=dense").stdout
    output = pretrain(tmp_path, *cont, "attention.type=msa", "attention.msa.topk=15").stdout
    dense, msa = metrics(dense_output), metrics(output)
    assert re.search(r"attention switch on load .*'dense' -> 'msa'", output), output[-3000:]
    assert sorted(dense) == sorted(msa) == list(range(1, 9)), (dense, msa)
    for it in range(1, 9):
        # Every block each row sees, in warmup (dense) and after it (all 15 selected).
        assert float(msa[it]["attended_fraction"]) == 1.0, (it, msa[it])
        assert float(msa[it]["msa_kl_loss"]) > 1.0, (it, msa[it])
        # The documents' share of the causal area: the same samples in both runs, below 1
        # (every sample packs several documents).
        area = float(msa[it]["document_area"])
        assert area == float(dense[it]["document_area"]) and 0.0 < area < 1.0, (it, msa[it], dense[it])
        want, got = float(dense[it]["lm_loss"]), float(msa[it]["lm_loss"])
        assert abs(got - want) <= 1e-6 * want, (it, got, want)
    # Megatron's own line: the same learning rate each step, and the grad norm larger by the
    # index branch's share.
    rates = [re.findall(r"learning rate: (\S+)", text) for text in (output, dense_output)]
    assert len(rates[0]) == 8 and rates[0] == rates[1], rates
    norms = [[float(v) for v in re.findall(r"grad norm: ([0-9.]+)", text)] for text in (output, dense_output)]
    assert len(norms[0]) == 8 and all(m > d for m, d in zip(*norms, strict=True)), norms


def test_indexed_dataset_trains(tmp_path, rng):
    prefix = tmp_path / "docs"
    _write_indexed(prefix, torch.randint(0, 127, (64, 300), generator=rng).tolist())
    # Megatron's split holds out whole documents (here one of 64, at 2%) for the evaluations.
    output = pretrain(
        tmp_path,
        "megatron.mock_data=false",
        f"megatron.data_path=[{prefix}]",
        "megatron.split=98,2,0",
        "megatron.train_iters=3",
    ).stdout
    assert "Building GPTDataset splits" in output
    assert sorted(losses(output)) == [1, 2, 3] and all(math.isfinite(v) for v in losses(output).values())
    assert [it for it, _ in parse_validation(output)] == [3, 3], parse_validation(output)


def _training(output: str) -> dict[int, dict[str, str]]:
    """The training lines without their timing."""
    return {it: {k: v for k, v in m.items() if k != "tokens/s"} for it, m in metrics(output).items()}


@pytest.mark.parametrize("world", [1, 2], ids=["cp1", "cp2-striped"])
def test_validation_loss_equals_a_plain_forward_of_the_checkpoint(world, tmp_path, rng):
    """Evaluation on ``megatron.valid_data_path`` with ``mtraining`` attention, one process
    and CP 2 striped. Every held-out document is one fresh random sequence of ``seq_length``
    tokens, so every validation sample is that sequence (its first token the last label)
    whatever Megatron's shuffles: the validation loss at iteration 3 equals the fp64 cross
    entropy of the logits that a plain forward of the checkpoint saved there gives it (one
    device, no Megatron schedule). With ``--check-finite`` and ``--step-report`` (one
    process), evaluating after every step: both stay quiet and the report keeps the
    evaluations out of the iterations and the profile."""
    from megatron_mtraining.convert import load_megatron_checkpoint
    from megatron_mtraining.convert.hf_export import checkpoint_folder, checkpoint_spec
    from megatron_mtraining.convert.hf_import import single_process_megatron

    config = load_config(CONFIG)
    seq, vocab = config.megatron["seq_length"], config.megatron["vocab_size"]
    # Training text from 4 token ids, which three steps start to learn; held-out text from the
    # others, whose loss so rises above the training loss: the two cannot be confused.
    train = torch.randint(0, 4, (64, 300), generator=rng)
    held_out = torch.randint(4, vocab, (seq,), generator=rng)
    _write_indexed(tmp_path / "train", train.tolist())
    _write_indexed(tmp_path / "valid", [held_out.tolist()] * 8)
    ckpt = tmp_path / "ckpt"
    overrides = [
        "megatron.mock_data=false",
        f"megatron.train_data_path=[{tmp_path / 'train'}]",
        f"megatron.valid_data_path=[{tmp_path / 'valid'}]",
        "megatron.split=null",
        "megatron.train_iters=3",
        "megatron.eval_iters=2",
        f"megatron.save={ckpt}",
        "megatron.save_interval=3",
    ]
    if world == 2:
        overrides += CP2_STRIPED
    else:
        overrides += ["megatron.eval_interval=1", "--check-finite", "--step-report", str(tmp_path / "report.json")]
        overrides += ["--step-trace", str(tmp_path / "trace.json.gz"), "--step-stacks"]
    output = pretrain(tmp_path, *overrides, world=world).stdout
    evaluations = parse_validation(output)
    # The evaluation at iteration 3 and the one Megatron runs after training read the same samples.
    assert [it for it, _ in evaluations] == ([1, 2, 3, 3] if world == 1 else [3, 3]), evaluations
    got = float(evaluations[-1][1]["lm_loss"])
    assert evaluations[-2][1] == evaluations[-1][1], evaluations
    assert 0.3 < float(evaluations[-1][1]["attended_fraction"]) < 1.0, evaluations
    megatron_line = re.search(r"validation loss at iteration 3 \| lm loss value: (\S+) \|", output)
    assert megatron_line and float(megatron_line.group(1)) == pytest.approx(got, rel=1e-6), output[-3000:]

    with single_process_megatron():
        spec = checkpoint_spec(checkpoint_folder(ckpt), model_type="llama")  # tiny_cpu has no QKV bias
        model, _ = load_megatron_checkpoint(ckpt, attention=config.attention, spec=spec)
        # Megatron's RoPE moves its table to the GPU wherever one exists: so must the rest.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(device).eval()
        with torch.no_grad():
            tokens, positions = held_out.view(1, -1).to(device), torch.arange(seq, device=device).view(1, -1)
            logits = model(tokens, positions, None).double().cpu()
    labels = torch.cat([held_out[1:], held_out[:1]])
    want = torch.nn.functional.cross_entropy(logits[0], labels).item()
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    # Not the training data's loss: the held-out sequence is what was evaluated.
    assert want > float(metrics(output)[3]["lm_loss"]) + 0.1, (want, metrics(output)[3])
    if world == 1:
        import gzip
        import json

        report = json.loads((tmp_path / "report.json").read_text())
        assert len(report["evaluation_s"]) == 4 and all(t > 0 for t in report["evaluation_s"]), report
        assert len(report["iteration_s"]) == 2 and all(t > 0 for t in report["iteration_s"]), report
        assert report["profile"]["iteration"] == 2, report["profile"]
        # The profiled step's trace, with the parts' ranges the report reads.
        with gzip.open(tmp_path / "trace.json.gz", "rt") as trace:
            names = {event.get("name") for event in json.load(trace)["traceEvents"]}
        assert {"mtraining::layer:1", "mtraining::attention"} <= names, sorted(
            n for n in names if "mtraining" in str(n)
        )
        # --step-stacks: the step's host sampled, the package's frames among what it ran.
        host = report["profile"]["host"]
        assert host["samples"] > 10 and any(f.startswith("megatron_mtraining/") for f in host["host_ms_by_frame"]), host


@pytest.mark.parametrize("case", ["msa", "mtraining-cp2-striped"])
def test_evaluation_leaves_training_unchanged(case, request, tmp_path):
    """The same runs with and without evaluations log the same training lines (loss, KL,
    attended fraction, recalls, imbalance): MSA through its indexer warmup (evaluating after
    every step), and mtraining under CP 2. The evaluations attend as the next training
    step will: MSA's densely while warmup lasts."""
    with_eval = request.getfixturevalue({"msa": "msa_whole", "mtraining-cp2-striped": "cp2_striped"}[case])
    overrides, world = EXACT_RESUMES[case]
    without = pretrain(tmp_path, *overrides, "megatron.eval_iters=0", world=world).stdout
    assert parse_validation(without) == [] and "validation loss" not in without
    assert _training(with_eval) == _training(without)
    evaluations = parse_validation(with_eval)
    if case == "msa":
        # After iteration 1 (warmup: 2 steps) the next step attends densely, from 2 sparsely.
        assert [it for it, _ in evaluations] == [1, 2, 3, 4, 5, 6, 6, 6], evaluations
        fractions = [float(m["attended_fraction"]) for _, m in evaluations]
        assert fractions[0] == 1.0 and all(f < 0.9 for f in fractions[1:]), evaluations
        assert [float(metrics(with_eval)[i]["attended_fraction"]) for i in (1, 2)] == [1.0, 1.0]
    else:
        assert [it for it, _ in evaluations] == [3, 6, 6, 6], evaluations
        assert all(0.3 < float(m["attended_fraction"]) < 1.0 for _, m in evaluations), evaluations
    assert all(math.isfinite(float(m["lm_loss"])) for _, m in evaluations), evaluations


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("megatron: {num_layerz: 2}\n", [], r"unknown Megatron argument 'megatron.num_layerz'"),
        ("megatron: {num_layers: two}\n", [], r"bad value for 'megatron.num_layers': 'two'"),
        ("megatron: {bf16: 3}\n", [], r"'megatron.bf16' is a flag"),
        ("megatron: {}\nmodel: {}\n", [], r"unknown section 'model'"),
        ("attention: {type: sparse}\n", [], r"MTrainingAttentionConfig.type='sparse'"),
        ("attention: {mtraining: {vertical_top: 0.9}}\n", [], r"attention.mtraining.vertical_top"),
        ("megatron: {}\n", ["megatron.lr=fast"], r"override 'megatron.lr=fast'.*bad value for 'megatron.lr'"),
        ("megatron: {}\n", ["attention.msa.topk=0"], r"override 'attention.msa.topk=0'.*topk"),
        ("megatron: {}\n", ["optimizer.lr=1"], r"must start with one of the sections megatron, attention"),
        (
            "megatron: {mock_data: false, valid_data_path: [v], train_data_path: [t], split: '98,2,0'}\n",
            [],
            r"bad value for 'megatron.split': '98,2,0' \(accepted: null with megatron.train_data_path",
        ),
        (
            "megatron: {mock_data: false, data_path: [d], split: '100,0,0', eval_iters: 1, eval_interval: 5}\n",
            [],
            r"'megatron.eval_iters' is 1 and the split holds out no validation documents",
        ),
        (
            "megatron: {mock_data: false, train_data_path: [t], eval_iters: 1, eval_interval: 5}\n",
            [],
            r"'megatron.eval_iters' is 1 but 'megatron.valid_data_path' is not set",
        ),
    ],
)
def test_bad_config_names_the_key_and_the_file(tmp_path, yaml_text, overrides, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path, overrides)
    if not overrides:
        assert str(path) in str(err.value)


def test_a_split_without_documents_is_refused_before_start_up(tmp_path):
    """Megatron's dataset builder never returns on a needed split that gets no document."""
    _write_indexed(tmp_path / "docs", [[1, 2, 3]] * 64)
    data = ["megatron.mock_data=false", f"megatron.data_path=[{tmp_path / 'docs'}]", "megatron.eval_iters=1"]
    assert load_config(CONFIG, [*data, "megatron.split=98,2,0"]).empty_splits() == []
    # 0.5% of 64 documents rounds to none; without evaluation the validation split is not read.
    assert load_config(CONFIG, [*data, "megatron.split=995,5,0", "megatron.eval_iters=0"]).empty_splits() == []
    proc = pretrain(tmp_path, *data, "megatron.split=995,5,0", check=False)
    assert proc.returncode != 0 and "initializing torch distributed" not in proc.stdout
    assert re.search(
        r"'megatron.split' '995,5,0' gives the validation split no document of .* \(64 documents\)", proc.stdout
    )


def test_bad_config_fails_at_start_up(tmp_path):
    proc = pretrain(tmp_path, "megatron.train_iterz=5", check=False)
    assert proc.returncode != 0
    assert "config error: override 'megatron.train_iterz=5': unknown Megatron argument" in proc.stdout
    assert "initializing torch distributed" not in proc.stdout
