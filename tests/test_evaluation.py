"""The evaluation harness without Megatron: task generators against their solvers, the
teacher-forced score against fixture models (one that copies the answer, a random one, a
noisy one) and against greedy decoding of a small causal model, loss by position, held-out
windows, the report, and the command line's checks."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_fixtures import codec_of, train_task_tokenizer

from megatron_mtraining.evaluation import report
from megatron_mtraining.evaluation.harness import (
    EvalPlan,
    evaluate,
    greedy_answer,
    position_losses,
    score_sample,
    teacher_forced,
)
from megatron_mtraining.evaluation.held_out import HeldOut
from megatron_mtraining.evaluation.tasks import TASKS, make_sample

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = train_task_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    codec, eod = codec_of(path)
    return path, codec, eod


@pytest.fixture
def codec(tokenizer):
    return tokenizer[1]


def _seed(rng: torch.Generator) -> int:
    return int(torch.randint(0, 2**31, (1,), generator=rng))


def test_tasks_are_deterministic_exact_in_length_and_solved_from_their_text(codec, rng):
    pick = random.Random(_seed(rng))
    for name, task in TASKS.items():
        for _ in range(6):
            seed, index = pick.randrange(10**6), pick.randrange(9)
            length, depth = pick.randrange(400, 1500), pick.random()
            sample = make_sample(name, length, depth, seed, index, codec)
            assert make_sample(name, length, depth, seed, index, codec) == sample
            assert len(sample.ids()) == length + 1
            assert task.solve(codec.decode(sample.context)) == sample.answer, (name, seed, length, depth, index)
            assert codec.decode(sample.answer_ids) == " " + sample.answer
            assert sample.depth == (depth if task.has_depth else None)
            other = make_sample(name, length, depth, seed + 1, index, codec)
            assert other.context != sample.context and other.answer != sample.answer


def test_a_needle_sits_at_its_depth(codec, rng):
    pick = random.Random(_seed(rng))
    length = 2048
    for task in ("niah_single", "niah_multikey"):
        for depth in (0.0, 0.5, 1.0, pick.random()):
            sample = make_sample(task, length, depth, pick.randrange(10**6), 0, codec)
            text = codec.decode(sample.context)
            key = re.findall(r"magic number for (\S+) mentioned", text)[-1]
            needle = f" One of the special magic numbers for {key} is: {sample.answer}."
            assert codec.decode(sample.context[sample.position :]).startswith(needle)
            assert text.count(f"numbers for {key} is:") == 1
            # Depth is the share of the filler before the needle; the other pieces take the rest.
            assert abs(sample.position / length - depth) < 0.12, (task, depth, sample.position)


def test_a_length_too_short_for_a_task_is_named(codec):
    with pytest.raises(ValueError, match=r"length=64: too short for the variable_tracking task"):
        make_sample("variable_tracking", 64, None, 0, 0, codec)
    with pytest.raises(ValueError, match=r"length=40: too short for the common_words task"):
        make_sample("common_words", 40, None, 0, 0, codec)


class CopyingModel:
    """A causal fixture model that knows the samples' contexts and copies each answer, read
    from the context by the task's solver; with ``wrong`` it errs at that rate per answer
    token. Elsewhere it predicts random tokens."""

    def __init__(self, plan: EvalPlan, codec, vocab: int, seed: int, wrong: float = 0.0):
        self.answers = {}
        for task, length, depth, index in plan.items():
            sample = make_sample(task, length, depth, plan.seed, index, codec)
            self.answers[sample.context] = codec.piece(TASKS[task].solve(codec.decode(sample.context)))
        self.lengths = {len(context) for context in self.answers}
        self.vocab, self.wrong, self.random = vocab, wrong, torch.Generator().manual_seed(seed)

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor):
        predictions = torch.randint(self.vocab, tokens.shape, generator=self.random)
        seen = tokens.tolist()
        for n in self.lengths:
            answer = self.answers.get(tuple(seen[:n]))
            if answer is None:
                continue
            for j, token in enumerate(answer):
                # Position n - 1 + j predicts answer token j from the answer's first j tokens.
                if n - 1 + j >= len(seen) or seen[n : n + j] != answer[:j]:
                    break
                erring = float(torch.rand((), generator=self.random)) < self.wrong
                predictions[n - 1 + j] = (token + 1) % self.vocab if erring else token
        return torch.zeros(tokens.shape), predictions


PLAN = EvalPlan(tasks=tuple(TASKS), lengths=(400, 640), depths=(0.0, 0.5, 1.0), samples=2, documents=1, buckets=4)


def test_a_model_that_copies_the_answer_scores_everything(codec, tokenizer, rng):
    plan = dataclasses.replace(PLAN, seed=_seed(rng), greedy_check=1)
    results = evaluate(
        plan, CopyingModel(plan, codec, 512, _seed(rng)), codec, tokenizer[2], HeldOut(), log=lambda _: None
    )
    accuracy = results["accuracy"]
    assert accuracy["average"] == 1.0
    assert all(v == 1.0 for by_length in accuracy["by_task"].values() for v in by_length.values())
    assert all(v == 1.0 for row in accuracy["needle_by_length_depth"].values() for v in row.values())
    assert len(results["samples"]) == len(plan.items()) == 2 * (2 * 3 + 3) * 2
    check = results["greedy_check"]
    assert check["samples"] == 2 * (2 * 3 + 3) and check["agree"] == check["samples"]
    assert all(r["greedy_ids"] == r["answer_ids"] for r in results["samples"] if "greedy_ids" in r)


def test_a_random_model_scores_near_chance(codec, tokenizer, rng):
    results = evaluate(
        dataclasses.replace(PLAN, seed=_seed(rng)),
        lambda tokens, labels: (torch.zeros(tokens.shape), torch.randint(512, tokens.shape, generator=rng)),
        codec,
        tokenizer[2],
        HeldOut(),
        log=lambda _: None,
    )
    # Chance is below 512 ** -5 per sample (every answer has five tokens or more).
    assert min(len(r["answer_ids"]) for r in results["samples"]) >= 5
    assert results["accuracy"]["average"] <= 0.02


def test_one_wrong_answer_token_fails_the_sample(codec, tokenizer, rng):
    """Each answer token is right with probability 0.8: a sample of k tokens scores 0.8 ** k."""
    plan = dataclasses.replace(PLAN, seed=_seed(rng), samples=6, lengths=(400,))
    model = CopyingModel(plan, codec, 512, _seed(rng), wrong=0.2)
    records = evaluate(plan, model, codec, tokenizer[2], HeldOut(), log=lambda _: None)["samples"]
    expected = [0.8 ** len(r["answer_ids"]) for r in records]
    sigma = math.sqrt(sum(p * (1 - p) for p in expected))
    assert abs(sum(r["correct"] for r in records) - sum(expected)) <= 4 * sigma + 1e-9, (records, expected)


class CausalLM(torch.nn.Module):
    """A small random causal model: each position's logits from the running mean of the
    embeddings up to it."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.out = torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab)

    @torch.no_grad()
    def forward(self, tokens, labels):
        hidden = self.embed(tokens).cumsum(0) / torch.arange(1, len(tokens) + 1).unsqueeze(1)
        logits = self.out(torch.tanh(3 * hidden)).double()
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def test_teacher_forcing_equals_greedy_decoding_of_a_causal_model(codec, tokenizer, rng):
    seed = _seed(rng)
    model, pad = CausalLM(512, seed), tokenizer[2]
    for task in TASKS:
        sample = make_sample(task, 400, 0.5, seed, 0, codec)
        greedy = greedy_answer(sample, model, pad)
        scored = score_sample(sample, model, codec)
        predicted, answer = scored["predicted_ids"], list(sample.answer_ids)
        first_error = next(
            (j for j, (p, a) in enumerate(zip(predicted, answer, strict=True)) if p != a), len(answer) - 1
        )
        assert greedy[: first_error + 1] == predicted[: first_error + 1]
        assert scored["correct"] == (greedy == answer)
        # With its own greedy answer appended, a sample is scored correct.
        own = dataclasses.replace(sample, answer_ids=tuple(greedy))
        assert score_sample(own, model, codec)["correct"]
        # ... and its loss is the mean of the answer tokens' losses at their positions.
        losses, _ = model(*teacher_forced(own.ids()))
        start = len(sample.context) - 1
        assert score_sample(own, model, codec)["answer_loss"] == pytest.approx(
            float(losses[start : start + len(greedy)].mean()), rel=1e-12
        )


def test_loss_by_position_buckets():
    def position_as_loss(tokens, labels):
        return torch.arange(len(tokens), dtype=torch.float32), torch.zeros(len(tokens), dtype=torch.long)

    sums, counts = position_losses(list(range(13)), position_as_loss, 4)
    assert counts == [3, 3, 3, 3]
    assert sums == [0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9 + 10 + 11]
    plan = EvalPlan(tasks=("niah_single",), lengths=(12,), samples=1, documents=1, buckets=4)
    summary = evaluate_summary(plan, [{"length": 12, "index": 0, "loss_sums": sums, "tokens": counts}])
    assert summary["loss"] == pytest.approx(66 / 12)
    assert summary["perplexity"] == pytest.approx(math.exp(66 / 12))
    spans = [(b["start"], b["end"], b["loss"]) for b in summary["buckets"]]
    assert spans == [(0, 3, 1), (3, 6, 4), (6, 9, 7), (9, 12, 10)]


def evaluate_summary(plan, positions):
    from megatron_mtraining.evaluation.harness import summarize

    return summarize(plan, [], positions, "test")["perplexity"]["12"]


def test_held_out_windows(tmp_path, codec, rng):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "held_out"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    gen = np.random.default_rng(_seed(rng))
    docs = [gen.integers(0, 500, n, dtype=np.int32) for n in (10, 50, 30, 70, 41)]
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    held_out = HeldOut(str(prefix))
    assert [held_out.window(40, i, codec) for i in range(3)] == [d[:41].tolist() for d in (docs[1], docs[3], docs[4])]
    held_out.check([40], 3)
    too_few = r"documents of at least 51 tokens \(length 50\): 1, --ppl-docs asks 3; the longest holds 70"
    with pytest.raises(ValueError, match=r"--ppl-data=.*: " + too_few):
        held_out.check([40, 50], 3)
    with pytest.raises(ValueError, match=r"--ppl-data='nowhere': nowhere.bin / nowhere.idx do not exist"):
        HeldOut("nowhere")
    synthetic = HeldOut(seed=3)
    windows = [synthetic.window(300, i, codec) for i in range(3)]
    assert all(len(w) == 301 for w in windows) and len({tuple(w) for w in windows}) == 3
    assert synthetic.window(300, 1, codec) == windows[1]
    assert HeldOut(seed=4).window(300, 1, codec) != windows[1]


class Recorder:
    """Stands for Megatron's writers: records the calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args))


def test_report_files_tables_and_writers(tmp_path, codec, tokenizer, rng):
    plan = dataclasses.replace(PLAN, seed=_seed(rng), lengths=(400,))
    results = evaluate(plan, CopyingModel(plan, codec, 512, 0), codec, tokenizer[2], HeldOut(), log=lambda _: None)
    written = report.write_report(results, tmp_path / "out")
    assert [p.name for p in written] == ["results.json", "results.md", report.HEATMAP, report.LOSS_PLOT]
    assert json.loads(written[0].read_text()) == json.loads(json.dumps(results))
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written[2:])
    table = written[1].read_text()
    assert "| niah_single | 100.0 | 100.0 |" in table and "| 400 | 100.0 | 100.0 | 100.0 |" in table
    assert report.write_report(results, tmp_path / "again") and (tmp_path / "again" / report.HEATMAP).is_file()
    tensorboard, wandb = Recorder(), Recorder()
    wandb.Image = lambda fig: ("image", fig)
    report.log_to_writers(results, 7, tensorboard, wandb)
    scalars = {args[0]: args[1] for name, args in tensorboard.calls if name == "add_scalar"}
    assert scalars["eval/accuracy/average"] == 1.0 and scalars["eval/accuracy/common_words/400"] == 1.0
    assert {args[0] for name, args in tensorboard.calls if name == "add_figure"} == {
        "eval/accuracy_heatmap",
        "eval/loss_by_position",
    }
    ((logged, step),) = [args for name, args in wandb.calls if name == "log"]
    assert step == 7 and logged["eval/perplexity/400"] == results["perplexity"]["400"]["perplexity"]
    assert logged["eval/accuracy_heatmap"][0] == "image"


def test_command_line_checks(tmp_path, tokenizer, monkeypatch):
    """Bad arguments stop the command before any model is built, naming the flag or key."""
    from megatron_mtraining import evaluate as cli

    def never(*args):
        raise AssertionError("the checks let the evaluation start")

    monkeypatch.setattr(cli, "evaluate_checkpoint", never)

    def error(*argv):
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        return str(info.value)

    with pytest.raises(SystemExit):
        cli._parse_cli(["--config", str(CONFIG), "--depths", "1.5"])
    assert "NullTokenizer" in error("--config", str(CONFIG))
    hf = ["megatron.tokenizer_type=HuggingFaceTokenizer", f"megatron.tokenizer_model={tokenizer[0]}"]
    assert "no checkpoint" in error("--config", str(CONFIG), *hf)
    assert "bad value for --checkpoint: " in error("--config", str(CONFIG), *hf, "--checkpoint", str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    given = ["--config", str(CONFIG), *hf, "--checkpoint", str(tmp_path)]
    assert "--lengths: 512 (accepted: lengths up to megatron.seq_length=256" in error(*given, "--lengths", "512")
    stripes = "--lengths: 100 (MTrainingAttentionConfig.stripe=16 is not accepted"
    assert stripes in error(*given, "megatron.context_parallel_size=2", "--lengths", "100")
    assert "--buckets: 300" in error(*given, "--lengths", "256", "--buckets", "300")
    assert "--ppl-data='nowhere'" in error(*given, "--ppl-data", "nowhere")
    assert cli.default_lengths(3000) == [3000] and cli.default_lengths(16384) == [4096, 8192, 16384]
    assert cli.default_lengths(20000) == [4096, 8192, 16384, 20000]
