"""``python -m megatron_mtraining.evaluate`` end to end on CPU / gloo: a tiny model of
``configs/tiny_cpu.yaml`` trained two iterations with ``mtraining`` attention and a tiny BPE,
then evaluated with other attention types (a sparse type with an index branch the checkpoint
lacks, and dense), on one process and on two with CP 2. The teacher-forced scores are
checked against greedy decoding (the harness's brute-force check, exact for both types: no
position's attention depends on later tokens) and the held-out loss of the near-random model
against the uniform distribution's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from eval_fixtures import run_command as run
from eval_fixtures import train_task_tokenizer

from megatron_mtraining.evaluation.tasks import TASKS
from megatron_mtraining.examples.quickstart import module_command, pretrain_command

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
SEQUENCE = ("megatron.seq_length=512", "megatron.max_position_embeddings=512")
VOCAB = 512


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The working directory, with ``ckpt`` (iteration 2), and the tokenizer overrides."""
    tmp = tmp_path_factory.mktemp("evaluate")
    tokenizer = train_task_tokenizer(tmp / "tokenizer")
    overrides = ["megatron.tokenizer_type=HuggingFaceTokenizer", f"megatron.tokenizer_model={tokenizer}", *SEQUENCE]
    training = ["megatron.train_iters=2", "megatron.save=ckpt", "megatron.save_interval=2"]
    run(pretrain_command(1, CONFIG, [*overrides, *training]), tmp)
    return tmp, overrides


def evaluate(trained, processes: int, name: str, *overrides: str) -> tuple[dict, str, Path]:
    tmp, tokenizer = trained
    out = tmp / name
    args = ["--config", str(CONFIG), *tokenizer, *overrides, "--checkpoint", "ckpt", "--output", str(out)]
    args += ["--lengths", "512", "--depths", "0", "1", "--samples", "1", "--greedy-check", "1"]
    args += ["--ppl-docs", "1", "--buckets", "4"]
    output = run(module_command(processes, "megatron_mtraining.evaluate", args), tmp)
    return json.loads((out / "results.json").read_text()), output, out


def check_results(results: dict, out: Path, attention: str, context_parallel: int, tasks=tuple(TASKS)) -> None:
    """The results' structure, the greedy check, and the held-out loss."""
    assert set(results) == {"meta", "plan", "accuracy", "answer_loss", "perplexity", "greedy_check", "samples"}
    meta = results["meta"]
    assert meta["iteration"] == 2 and meta["context_parallel_size"] == context_parallel
    assert meta["attention"]["type"] == attention
    accuracy = results["accuracy"]
    assert set(accuracy["by_task"]) == set(tasks) and all(set(v) == {"512"} for v in accuracy["by_task"].values())
    assert all(0 <= v["512"] <= 1 for v in accuracy["by_task"].values())
    assert set(accuracy["needle_by_length_depth"]["512"]) == {"0.0", "1.0"}
    records = results["samples"]
    assert len(records) == sum(2 if TASKS[task].has_depth else 1 for task in tasks)
    for record in records:
        predicted, greedy, answer = record["predicted_ids"], record["greedy_ids"], record["answer_ids"]
        # Greedy decoding follows the teacher-forced predictions up to their first error.
        first_error = next(
            (j for j, (p, a) in enumerate(zip(predicted, answer, strict=True)) if p != a), len(answer) - 1
        )
        assert greedy[: first_error + 1] == predicted[: first_error + 1], record
        assert record["correct"] == (greedy == answer)
        assert math.isfinite(record["answer_loss"])
    assert results["greedy_check"] == {"samples": len(records), "agree": len(records)}
    held_out = results["perplexity"]["512"]
    assert [b["tokens"] for b in held_out["buckets"]] == [128] * 4
    # Two steps from a random start: close to the uniform distribution's loss.
    assert abs(held_out["loss"] - math.log(VOCAB)) < 0.5, held_out
    assert held_out["perplexity"] == pytest.approx(math.exp(held_out["loss"]))
    for name in ("results.md", "accuracy_heatmap.png", "loss_by_position.png"):
        assert (out / name).is_file(), name
    assert "| niah_single |" in (out / "results.md").read_text()


def test_one_process_evaluates_another_attention_type_and_logs_the_figures(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp = trained[0]
    results, output, out = evaluate(trained, 1, "msa", "attention.type=msa", f"megatron.tensorboard_dir={tmp / 'tb'}")
    assert "attention switch on load from ckpt (iteration 2): 'mtraining' -> 'msa'" in output
    check_results(results, out, "msa", 1)
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    assert {"eval/accuracy/average", "eval/perplexity/512"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("eval/accuracy/average")] == [2]
    assert {"eval/accuracy_heatmap", "eval/loss_by_position"} <= set(events.Tags()["images"])


def test_two_processes_with_context_parallelism(trained):
    # The tasks with short answers: the greedy check runs a forward per answer token.
    tasks = ("niah_single", "niah_multikey", "common_words")
    cp2 = ("attention.type=dense", "megatron.context_parallel_size=2", "--tasks", *tasks)
    results, _, out = evaluate(trained, 2, "cp2", *cp2)
    check_results(results, out, "dense", 2, tasks)


@pytest.mark.parametrize(
    "given, want",
    [(None, (8192, 16384)), (["4096", "16384"], "bad value for --lengths: 4096 .*msa.topk=64 is not accepted")],
)
def test_default_lengths_leave_out_what_the_attention_cannot_be_sparse_at(given, want, capsys):
    """MSA at 64 blocks of 64 takes every block of 4096 tokens: the default lengths leave 4096
    out and say why; a length given with --lengths is an error naming the setting."""
    from megatron_mtraining.evaluate import _parse_cli, _plan
    from megatron_mtraining.training.yaml_config import ConfigError, load_config

    study = CONFIG.parent / "study" / "continue.yaml"
    run_config = load_config(study, ["attention.type=msa", "attention.msa.topk=64"])
    cli = _parse_cli(["--config", str(study), *(["--lengths", *given] if given else [])])
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            _plan(cli, run_config)
        return
    assert _plan(cli, run_config).lengths == want
    assert (
        "[eval] length 4096 left out: MTrainingAttentionConfig.msa.topk=64 is not accepted" in capsys.readouterr().out
    )
