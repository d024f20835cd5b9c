"""The small-scale study, ``python -m megatron_mtraining.examples.study``: its data recipe,
the real text and generated documents, the archives that carry a stage between machines,
the time limit, the report from fixture results (numbers worked out by hand), and every
stage end to end at a tiny size on CPU (gloo): data, pretraining, continued pretraining
from that checkpoint with MSA (the switch, the iteration reset, the indexer warmup) and its
evaluation, export and import, report."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers")

from eval_fixtures import run_command  # noqa: E402

from megatron_mtraining.evaluation.harness import EvalPlan, summarize  # noqa: E402
from megatron_mtraining.evaluation.report import has_matplotlib  # noqa: E402
from megatron_mtraining.evaluation.tasks import TASKS, make_sample  # noqa: E402
from megatron_mtraining.examples.quickstart import StageError, run_logged  # noqa: E402
from megatron_mtraining.examples.study import report, runs, schedule, transfer  # noqa: E402
from megatron_mtraining.examples.study.cli import main  # noqa: E402
from megatron_mtraining.examples.study.data import (  # noqa: E402
    BYTES,
    STREAM_BASE,
    DataStage,
    Source,
    StudyData,
    find_packages,
    generated_documents,
    split_real_text,
)
from megatron_mtraining.examples.study.runs import Deadline, Study  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "configs" / "study"


def tiny_data(**changes) -> dict:
    data = {
        "seed": 7,
        "tokenizer": {"vocab_size": 512, "sample_docs": 30},
        "real_text": {"heldout_docs": 2, "heldout_min_chars": 8000, "max_chars": 60000},
        "splits": {
            "pretrain": {
                "seq_length": 256,
                "sources": [
                    {"name": "text", "kind": "text", "weight": 0.3},
                    {"name": "tasks", "kind": "tasks", "docs": 40, "chars": [700, 1500], "weight": 0.5},
                    {"name": "synthetic", "kind": "synthetic", "docs": 12, "chars": [700, 1500], "weight": 0.2},
                ],
            },
            "continue": {
                "seq_length": 512,
                "sources": [
                    {"name": "text", "kind": "text", "weight": 0.3},
                    {"name": "tasks", "kind": "tasks", "docs": 20, "chars": [1500, 3000], "weight": 0.5},
                    {"name": "synthetic", "kind": "synthetic", "docs": 6, "chars": [1500, 3000], "weight": 0.2},
                ],
            },
        },
    }
    return data | changes


# ---- the data recipe -----------------------------------------------------------------------
def test_the_packaged_recipe_loads():
    config = StudyData.from_yaml(ROOT / "configs" / "data" / "study.yaml")
    assert config.vocab_size == 8192 and config.splits["continue"].seq_length == 16384
    assert config.packages == ("torch", "sympy", "networkx", "numpy", "megatron.core")
    assert [s.kind for s in config.splits["pretrain"].sources] == ["text", "tasks", "synthetic"]
    # Every source draws from its own stream, none of them an evaluation seed.
    streams = [config.stream(split, s.name) for split in ("pretrain", "continue") for s in config.splits[split].sources]
    assert len(set(streams)) == len(streams) and min(streams) >= STREAM_BASE


@pytest.mark.parametrize(
    "change, message",
    [
        ({"splits": {"pretrain": {}}}, "splits=['pretrain'] is invalid; accepted: pretrain and continue"),
        ({"tokenizer": {"vocab_size": 100}}, "tokenizer.vocab_size=100 is invalid; accepted: an integer >= 257"),
        ({"colour": 1}, "colour=1 is invalid; accepted: one of the fields seed, tokenizer, real_text, splits"),
        (
            {"real_text": {"heldout_docs": 0}},
            "real_text.heldout_docs=0 is invalid; accepted: an integer >= 1",
        ),
        (
            {"real_text": {"packages": "torch"}},
            "real_text.packages='torch' is invalid; accepted: a list of import names of installed packages",
        ),
        # A sub-package of a listed package would train twice.
        (
            {"real_text": {"packages": ["torch", "megatron.core", "torch.nn"]}},
            "real_text.packages='torch.nn' is invalid; accepted: a list of import names",
        ),
        ({"real_text": {"packages": ["jinja2", "jinja2"]}}, "real_text.packages='jinja2' is invalid"),
    ],
)
def test_recipe_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=f"^{message.replace('[', r'\[').replace(']', r'\]')}"):
        StudyData.from_dict(tiny_data(**change))


@pytest.mark.parametrize(
    "source, message",
    [
        (
            {"name": "t", "kind": "book", "weight": 1},
            "sources[t].kind='book' is invalid; accepted: text | tasks | synthetic",
        ),
        ({"name": "t", "kind": "tasks", "weight": 1, "chars": [10, 20]}, "sources[t].docs=None is invalid"),
        (
            {"name": "t", "kind": "tasks", "weight": 1, "docs": 2, "chars": [30, 20]},
            "sources[t].chars=[30, 20] is invalid",
        ),
        # Too short for the common-word list: named with the task's own reason.
        (
            {"name": "t", "kind": "tasks", "weight": 1, "docs": 2, "chars": [100, 200]},
            "a shortest length that holds every task",
        ),
        ({"name": "t", "kind": "text", "weight": 0}, "sources[t].weight=0 is invalid; accepted: a number > 0"),
        (
            {"name": "t", "kind": "text", "weight": 1, "docs": 3},
            "sources[t].docs=3 is invalid; accepted: nothing for kind 'text'",
        ),
    ],
)
def test_source_errors_name_the_field(source, message):
    data = tiny_data()
    data["splits"]["pretrain"]["sources"] = [source]
    with pytest.raises(ValueError) as err:
        StudyData.from_dict(data)
    assert f"splits.pretrain.{message}" in str(err.value) or message in str(err.value), str(err.value)
    assert "splits.pretrain.sources" in str(err.value)


# ---- documents -----------------------------------------------------------------------------
def test_generated_task_documents_are_the_evaluations_tasks_on_other_streams():
    source = Source("tasks", "tasks", 1.0, docs=10, chars=(1500, 4000))
    docs = list(generated_documents(source, STREAM_BASE + 5))
    assert docs == list(generated_documents(source, STREAM_BASE + 5))
    assert docs != list(generated_documents(source, STREAM_BASE + 6))
    assert [d["kind"] for d in docs] == [*TASKS, *TASKS]
    assert all(1500 <= len(d["text"]) <= 4000 for d in docs)
    for doc in docs:
        # Each document ends with its answer, which the task's solver finds in the text before it.
        solved = TASKS[doc["kind"]].solve(doc["text"])
        assert solved is not None and doc["text"].endswith(" " + solved), doc["kind"]
    # The evaluation's samples (seed 0) hold other needles.
    evaluation = BYTES.decode(make_sample("niah_single", len(docs[0]["text"]), 0.5, 0, 0, BYTES).context)
    assert TASKS["niah_single"].solve(docs[0]["text"]) != TASKS["niah_single"].solve(evaluation + " ")


def test_generated_synthetic_documents_take_the_kinds_in_turn():
    source = Source("synthetic", "synthetic", 1.0, docs=6, chars=(900, 1100))
    docs = list(generated_documents(source, STREAM_BASE))
    assert [d["kind"] for d in docs] == ["passkey", "copy", "filler"] * 2
    assert all(900 <= len(d["text"]) <= 1300 for d in docs)


def test_real_text_split_is_seeded_disjoint_and_capped():
    config = StudyData.from_dict(tiny_data())
    train, heldout = split_real_text(config, [])
    again = split_real_text(config, [])
    assert [d.name for d in train] == [d.name for d in again[0]] and heldout == again[1]
    assert len(heldout) == 2 and all(len(d.text) >= 8000 for d in heldout)
    assert not {d.name for d in train} & {d.name for d in heldout}
    assert 0 < sum(len(d.text) for d in train) <= 60000
    other = split_real_text(StudyData.from_dict(tiny_data(seed=8)), [])
    assert [d.name for d in other[1]] != [d.name for d in heldout]
    with pytest.raises(ValueError, match=r"real_text.heldout_docs=10000 is invalid; accepted: at most \d+"):
        split_real_text(StudyData.from_dict(tiny_data(real_text={"heldout_docs": 10000})), [])


def with_packages(*packages: str, **real_text) -> StudyData:
    text = {"heldout_docs": 2, "heldout_min_chars": 8000, "max_chars": None, "packages": list(packages)}
    return StudyData.from_dict(tiny_data(real_text=text | real_text))


def test_packages_train_and_the_held_out_text_stays_the_standard_librarys():
    config = with_packages("jinja2")
    packages = find_packages(config)
    assert [p.record() for p in packages] == [
        {"name": "jinja2", "distribution": "Jinja2", "version": importlib.metadata.version("jinja2")}
    ]
    train, heldout = split_real_text(config, packages)
    stdlib_train, stdlib_heldout = split_real_text(config, [])
    # The held-out documents do not depend on the packages, and never train.
    assert heldout == stdlib_heldout and all(d.name.startswith("stdlib:") for d in heldout)
    assert not {d.name for d in train} & {d.name for d in heldout}
    assert not {d.text for d in train} & {d.text for d in heldout}
    jinja = [d for d in train if d.name.startswith("package:Jinja2/jinja2")]
    assert len(jinja) == len(train) - len(stdlib_train) > 10
    assert {d.name for d in stdlib_train} < {d.name for d in train}


def test_a_package_not_installed_is_an_error_naming_the_field():
    with pytest.raises(ValueError) as err:
        find_packages(with_packages("jinja2", "no_such_package_here"))
    message = str(err.value)
    assert message.startswith("real_text.packages='no_such_package_here' is invalid; accepted: packages"), message
    # What is accepted: the installed top-level packages.
    assert ", jinja2, " in message and "torch" in message
    # The standard library has no distribution (and no version to record).
    with pytest.raises(ValueError, match="real_text.packages='json' is invalid"):
        find_packages(with_packages("json"))


def test_data_json_records_the_packages_and_rebuilds_on_another_version(tmp_path):
    config = with_packages("jinja2", max_chars=150000)
    logs = []
    stage = DataStage(config, tmp_path, log=logs.append)
    manifest = stage.build(("pretrain", "heldout"))
    train, heldout = split_real_text(config, find_packages(config))
    jinja = [d for d in train if d.name.startswith("package:Jinja2/")]
    version = importlib.metadata.version("jinja2")
    pretrain = manifest["splits"]["pretrain"]
    real = pretrain["real_text"]
    assert real["packages"] == [
        {
            "name": "jinja2",
            "distribution": "Jinja2",
            "version": version,
            "documents": len(jinja),
            "characters": sum(len(d.text) for d in jinja),
        }
    ]
    assert real["packages"][0]["documents"] > 0
    assert real["training"]["characters"] == sum(len(d.text) for d in train) <= 150000
    assert real["python"]["characters"] + real["packages"][0]["characters"] == real["training"]["characters"]
    # Its tokens are those of the split's text source before the mix repeats them.
    text = pretrain["sources"]["text"]
    assert real["training"]["tokens"] == text["source_tokens"] > 0
    assert text["tokens"] == pytest.approx(text["factor"] * text["source_tokens"], rel=0.1)
    assert manifest["splits"]["heldout"]["real_text"]["names"] == [d.name for d in heldout]
    assert pretrain["recipe"]["real_text"]["packages"][0]["version"] == version
    # Another version of a package is another training text: the split is built again.
    pretrain["recipe"]["real_text"]["packages"][0]["version"] = "0.0"
    stage.write_manifest()
    logs.clear()
    DataStage(config, tmp_path, log=logs.append).build(("pretrain", "heldout"))
    assert [line.split(":")[0] for line in logs if line.startswith("  split")] == [
        "  split pretrain",
        "  split heldout",
    ]
    assert "reused" not in logs[-2] and "reused" in logs[-1]


# ---- moving stages between machines --------------------------------------------------------
@pytest.mark.parametrize("devices", [["0", "1", "2", "3"], ["0", "1", "0", "1"]], ids=["one-a-gpu", "two-a-gpu"])
def test_jobs_share_the_devices_and_a_seed_only_once_its_cache_exists(devices, tmp_path, capsys):
    """``study all``'s scheduler on real processes: one job per slot at a time (a device listed
    twice holds two); a job of a seed starts beside another of that seed only after that one
    logged a training iteration (its dataset cache is built); jobs side by side where they may,
    every job run once, a failure reported without stopping the rest."""
    record = tmp_path / "spans.txt"
    code = (
        "import sys, time; a = time.time(); time.sleep(0.1); name = sys.argv[1]; m = 'none'\n"
        "if name.startswith('train'):\n"
        "    m = str(time.time()); print('  iteration  10/300 | lm_loss 4.5', flush=True)\n"
        "time.sleep(0.3)\n"
        f"open({str(record)!r}, 'a').write(' '.join([*sys.argv[1:], str(a), m, str(time.time())]) + '\\n')\n"
        "sys.exit(3 if name.startswith('bad') else 0)"
    )

    def start(job, device, threads, log):
        with log.open("w") as out:
            return schedule.subprocess.Popen(
                [sys.executable, "-c", code, job.name, str(job.seed), device], stdout=out, stderr=out
            )

    # "train" jobs log an iteration (their seed's cache then exists), "eval" and "bad" ones never do.
    jobs = [schedule.Job(f"{kind}-{seed}", (), seed) for kind in ("train", "eval", "bad") for seed in (1, 2, 3)]
    failed = schedule.run_jobs(jobs, devices, tmp_path, start=start, poll_seconds=0.02)
    assert failed == ["bad-1", "bad-2", "bad-3"]
    spans = sorted((line.split() for line in record.read_text().splitlines()), key=lambda s: float(s[3]))
    assert sorted(name for name, *_ in spans) == sorted(j.name for j in jobs)
    # When each seed's cache first existed: a job of it logged an iteration or ended well.
    ready = {}
    for name, seed, _, _, marked, end in spans:
        done = float(marked) if marked != "none" else float(end) if not name.startswith("bad") else float("inf")
        ready[seed] = min(ready.get(seed, float("inf")), done)
    for _, _, device, b0, _, _ in spans:  # never more runs on a device than its slots
        at_once = sum(d == device and float(a0) <= float(b0) < float(a1) for _, _, d, a0, _, a1 in spans)
        assert at_once <= devices.count(device), spans
    together = same_seed = same_device = 0
    for i, (_, seed_a, dev_a, _, _, a1) in enumerate(spans):
        for _, seed_b, dev_b, b0, _, _ in spans[i + 1 :]:
            if float(b0) < float(a1):  # b started while a ran
                together += 1
                same_device += dev_a == dev_b
                if seed_a == seed_b:
                    same_seed += 1
                    assert float(b0) >= ready[seed_a], spans
    assert together >= 6 and same_seed >= 1, spans  # the devices were used at once, seeds shared
    assert (same_device > 0) == (len(set(devices)) < len(devices)), spans
    assert "bad-2: FAILED (exit 3)" in capsys.readouterr().out


def test_all_runs_every_stage_it_has_not_run(tmp_path, monkeypatch, capsys):
    """``study all``: the data, then the pretraining alone, then the continued runs it has
    not finished, with the evaluation's and export's flags and the overrides, then the report."""
    from megatron_mtraining.examples.study import cli

    ran = []
    monkeypatch.setattr(cli, "_data", lambda cli_, workdir, splits: ran.append(("data", splits)))
    monkeypatch.setattr(schedule, "run_jobs", lambda jobs, devices, logs: ran.append((list(jobs), devices)) or [])
    run = "continue/dense-seed2"
    write_run(tmp_path, run, stage_record(run, "dense", 2), {"dense": fixture_results("dense", 2)})
    trained = "continue/msa-seed1"  # trained, not evaluated
    write_run(tmp_path, trained, stage_record(trained, "msa", 1), {})
    main(["all", "--workdir", str(tmp_path), "--gpus", "0", "1", "--no-cross", "--samples", "2",
          "--export", "out", "megatron.lr=1e-4"])  # fmt: skip
    assert ran[0] == ("data", ("pretrain", "continue", "heldout"))
    (pretrain,), devices = ran[1]
    assert pretrain.name == "pretrain" and devices == ["0"] and "megatron.lr=1e-4" in pretrain.args
    jobs, devices = ran[2]
    assert devices == ["0", "1"]
    assert [j.name for j in jobs] == ["continue-dense-seed1", "continue-mtraining-seed1", "continue-mtraining-seed2",
                                      "continue-msa-seed1-eval", "continue-msa-seed2"]  # fmt: skip
    evaluate = jobs[3].args
    assert evaluate[:4] == ("eval", "continue/msa-seed1", "--as", "msa") and "megatron.lr=1e-4" not in evaluate
    args = jobs[0].args
    for flag in (["--attention", "dense"], ["--seed", "1"], ["--samples", "2"], ["--export", "out"],
                 ["--time-limit", "0"]):  # fmt: skip
        assert any(list(args[i : i + 2]) == flag for i in range(len(args))), (flag, args)
    assert "--no-cross" in args and "--eval" in args and args[-1] == "megatron.lr=1e-4" and jobs[0].seed == 1
    assert "[study] report: " in capsys.readouterr().out  # of the one finished run
    assert (tmp_path / "report" / "study.md").is_file()


def test_all_runs_a_variant_with_its_overrides_on_the_continued_runs_only(tmp_path, monkeypatch):
    from megatron_mtraining.examples.study import cli

    ran = []
    monkeypatch.setattr(cli, "_data", lambda cli_, workdir, splits: None)
    monkeypatch.setattr(schedule, "run_jobs", lambda jobs, devices, logs: ran.append(list(jobs)) or [])
    main(["all", "--workdir", str(tmp_path), "--attention", "mtraining", "--seeds", "1", "--variant", "p95",
          "attention.mtraining.vertical_topp=0.95"])  # fmt: skip
    (pretrain,), (continued,) = ran
    assert "attention.mtraining.vertical_topp=0.95" not in pretrain.args
    assert continued.name == "continue-mtraining-p95-seed1"
    args = continued.args
    assert any(list(args[i : i + 2]) == ["--variant", "p95"] for i in range(len(args)))
    assert args[-1] == "attention.mtraining.vertical_topp=0.95"
    with pytest.raises(SystemExit, match="--variant='P95' is invalid"):
        main(["all", "--workdir", str(tmp_path), "--variant", "P95"])


def test_all_puts_runs_per_gpu_runs_on_each_gpu(tmp_path, monkeypatch):
    """``--runs-per-gpu 2``: every GPU once, then every GPU again, as the continued runs' slots;
    0 is refused naming the flag."""
    from megatron_mtraining.examples.study import cli

    ran = []
    monkeypatch.setattr(cli, "_data", lambda cli_, workdir, splits: None)
    monkeypatch.setattr(schedule, "run_jobs", lambda jobs, devices, logs: ran.append(devices) or [])
    main(["all", "--workdir", str(tmp_path), "--gpus", "0", "1", "--runs-per-gpu", "2", "--seeds", "1"])
    assert ran == [["0"], ["0", "1", "0", "1"]]
    with pytest.raises(SystemExit, match="--runs-per-gpu=0 is invalid; accepted: an integer >= 1"):
        main(["all", "--workdir", str(tmp_path), "--runs-per-gpu", "0"])


def test_archives_in_parts_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "PART_BYTES", 5000)
    src = tmp_path / "src"
    (src / "run/checkpoints").mkdir(parents=True)
    (src / "run/stage.json").write_text("{}")
    (src / "run/eval").mkdir()
    (src / "run/eval/big.bin").write_bytes(os.urandom(12000))
    (src / "run/checkpoints/weights").write_bytes(b"w" * 100)
    parts = transfer.export(src, [Path("run"), Path("absent")], tmp_path / "out", "study-x", [Path("run/checkpoints")])
    assert [p.name for p in parts] == [f"study-x.tar.{i:03d}" for i in range(len(parts))] and len(parts) >= 3
    assert all(p.stat().st_size <= 5000 for p in parts)
    names = transfer.import_archives([tmp_path / "out"], tmp_path / "dst")
    assert names == ["study-x.tar"]
    assert (tmp_path / "dst/run/eval/big.bin").read_bytes() == (src / "run/eval/big.bin").read_bytes()
    assert not (tmp_path / "dst/run/checkpoints").exists()
    parts[1].unlink()
    with pytest.raises(ValueError, match=r"archive study-x.tar: parts \[0, 2"):
        transfer.import_archives([tmp_path / "out"], tmp_path / "dst2")


# ---- the time limit ------------------------------------------------------------------------
def test_a_deadline_sends_sigterm_and_a_short_limit_is_refused(tmp_path):
    program = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('exiting program after receiving SIGTERM.'), sys.exit(0)))\n"
        "print('started', flush=True)\n"
        "time.sleep(30)\n"
    )
    start = time.monotonic()
    output = run_logged([sys.executable, "-c", program], tmp_path, tmp_path / "log", 1, 1, "x", start + 1.5)
    assert "exiting program after receiving SIGTERM." in output and time.monotonic() - start < 15
    assert Deadline(0).training_end(5, "x") is None
    with pytest.raises(StageError, match=r"--time-limit=2.4: 2.4 minutes are left, and evaluation keeps 0.5 back"):
        Deadline(2.4).training_end(0.5, "evaluation")
    assert Deadline(3).training_end(0.5, "evaluation") - time.monotonic() == pytest.approx(150, abs=1)


def test_the_study_sets_its_own_arguments(tmp_path):
    with pytest.raises(StageError, match=r"override 'megatron.seed=3': the study sets megatron.seed itself"):
        Study(tmp_path, {}, ["megatron.seed=3"])


# ---- the report, from fixture results --------------------------------------------------------
PLAN = EvalPlan(tasks=("niah_single", "common_words"), lengths=(4096, 8192), depths=(0.0, 1.0), samples=10)
# Correct samples: dense all the needles and common_words' first 8 (seed 1) or 6 (seed 2)
# indexes; mtraining misses the needles' index 0 everywhere; msa gets one more common word.
# Held-out loss per token: dense 2.0, mtraining 2.02, msa 2.004.
LOSS = {"dense": 2.0, "mtraining": 2.02, "msa": 2.004}


def _correct(attention: str, seed: int, task: str, index: int) -> bool:
    if task == "niah_single":
        return not (attention == "mtraining" and index == 0)
    return index < (8 if seed == 1 else 6) + (attention == "msa")


def fixture_results(attention: str, seed: int, plan: EvalPlan = PLAN, loss: float | None = None) -> dict:
    records = [
        {
            "task": task,
            "length": n,
            "depth": depth,
            "index": i,
            "correct": _correct(attention, seed, task, i),
            "answer_loss": 1.0,
        }
        for task, n, depth, i in plan.items()
    ]
    loss = LOSS[attention] if loss is None else loss
    positions = [
        {"length": n, "index": 0, "loss_sums": [loss * n / 4] * 4, "tokens": [n // 4] * 4} for n in plan.lengths
    ]
    plan_4 = EvalPlan(**{**plan.__dict__, "buckets": 4, "documents": 1})
    return summarize(plan_4, records, positions, "indexed dataset data/heldout")


def stage_record(run: str, attention: str, seed: int, sha: str = "aaaa", seq: int = 16384) -> dict:
    return {
        "stage": "pretrain" if run == "pretrain" else "continue",
        "run": run,
        "attention": attention,
        "seed": seed,
        "seq_length": seq,
        "train_iters": 500,
        "iterations": 500,
        "documents_masked": True,
        "tokens": 500 * 8 * seq,
        "stopped_by_time_limit": False,
        "s_per_iteration": 0.5,
        "lm_loss": {"first": 4.0, "last": 2.5},
        "attended_fraction": {"dense": 1.0, "mtraining": 0.2, "msa": 0.1}[attention],
        "msa_block_recall": 0.8 if attention == "msa" else None,
        "validation": {"iteration": 500, "lm_loss": 2.1},
        "index_recall": {"dense": 1.0, "mtraining": 0.95, "msa": 0.9}[attention],
        "index_recall_heldout": {"dense": 1.0, "mtraining": 0.85, "msa": 0.7}[attention],
        "data": {"split": "continue", "sha256": sha, "tokenizer": "tttt", "python": "3.12.3"},
        "device": "NVIDIA H200",
        "date": "2026-11-26T10:00:00+00:00",
        "commit": "abc1234",
    }


def write_run(workdir: Path, run: str, record: dict, evals: dict[str, dict]) -> None:
    (workdir / run).mkdir(parents=True)
    (workdir / run / "stage.json").write_text(json.dumps(record))
    for attention, results in evals.items():
        (workdir / run / "eval" / attention).mkdir(parents=True)
        (workdir / run / "eval" / attention / "results.json").write_text(json.dumps(results))


@pytest.fixture
def fixture_workdir(tmp_path):
    for seed in (1, 2):
        for attention in ("dense", "mtraining", "msa"):
            run = f"continue/{attention}-seed{seed}"
            sha = "bbbb" if (attention, seed) == ("msa", 2) else "aaaa"
            evals = {attention: fixture_results(attention, seed)}
            if attention == "dense":
                evals["mtraining"] = fixture_results("mtraining", seed, loss=2.1)
            record = stage_record(run, attention, seed, sha)
            if (attention, seed) == ("msa", 2):  # a record from before the field existed
                del record["documents_masked"]
            write_run(tmp_path, run, record, evals)
    pre_plan = EvalPlan(tasks=PLAN.tasks, lengths=(2048,), depths=(0.0, 1.0), samples=10)
    write_run(
        tmp_path,
        "pretrain",
        stage_record("pretrain", "dense", 1234, seq=2048),
        {"dense": fixture_results("dense", 1, pre_plan)},
    )
    return tmp_path


def test_report_tables_from_fixture_results(fixture_workdir):
    summary = report.summarize(fixture_workdir)
    dense, mtraining, msa = (summary["per_type"][t] for t in ("dense", "mtraining", "msa"))
    # common_words: 16 of 20 (seed 1), 12 of 20 (seed 2).
    assert dense["tasks"]["common_words"] == pytest.approx((0.7, math.sqrt(0.02)))
    assert dense["tasks"]["niah_single"] == pytest.approx((1.0, 0.0))
    assert mtraining["tasks"]["niah_single"] == pytest.approx((0.9, 0.0))
    assert dense["average"] == pytest.approx((0.85, math.sqrt(0.005)))
    assert dense["perplexity"][0] == pytest.approx(math.exp(2.0))
    against = summary["against_dense"]
    # mtraining: 8 of 80 paired needle samples worse by one: -10 points, standard error
    # sqrt((8 * 0.81 + 72 * 0.01) / 79 / 80) = 3.38 points.
    delta, se, n = against["mtraining"]["tasks"]["niah_single"]
    assert (delta, n) == (pytest.approx(-10.0), 80) and se == pytest.approx(100 * math.sqrt(7.2 / 79 / 80))
    assert against["mtraining"]["tasks"]["common_words"][:2] == pytest.approx((0.0, 0.0))
    assert against["mtraining"]["average"][0] == pytest.approx(-5.0)
    assert against["mtraining"]["perplexity_ratio"] == pytest.approx(math.exp(0.02) - 1)
    assert against["mtraining"]["misses"] == ["niah_single -10.0 points", "perplexity +2.02%"]
    # msa: 4 more common words of 40 paired (+10 points, standard error sqrt(3.6 / 39 / 40)),
    # perplexity +0.40%: the target is met.
    delta, se, _ = against["msa"]["tasks"]["common_words"]
    assert (delta, se) == (pytest.approx(10.0), pytest.approx(100 * math.sqrt(3.6 / 39 / 40))) and against["msa"]["met"]
    text = report.markdown(summary)
    assert "| dense | 1 | 500 | 1.000 | 100.0 | 80.0 | 90.0 | 7.389 |" in text
    assert "| **dense** | mean |  | 1.000 ± 0.000 | 100.0 ± 0.0 | 70.0 ± 14.1 | 85.0 ± 7.1 | 7.389 ± 0.000 |" in text
    assert "| mtraining | 1, 2 | -10.0 (3.4) | +0.0 (0.0) | -5.0 (1.8) | +2.02% | not met |" in text
    assert "| msa | 1, 2 | +0.0 (0.0) | +10.0 (4.8) | +5.0 (2.4) | +0.40% | met |" in text
    assert "**Target: met by msa; not met by mtraining (niah_single -10.0 points; perplexity +2.02%).**" in text
    # The dense model evaluated with MTraining at inference only.
    assert "| dense | mtraining | 1 | 85.0 | -5.0 | 8.166 | +10.52% |" in text
    assert "seed 1: the same data and iterations (" in text
    assert "seed 2: different data, documents masked in some runs only" in text
    assert (
        "| continue/msa-seed1 | NVIDIA H200 | 2026-11-26 | abc1234 | 500 of 500 | masked | 0.500 | 4.000 -> 2.500 | 2.100 | 0.900 | 0.700 | 0.800 |"
        in text
    )
    assert "| continue/msa-seed2 | NVIDIA H200 | 2026-11-26 | abc1234 | 500 of 500 | not recorded |" in text
    assert "### The pretrained model (dense, 2048 tokens)" in text and "| 100.0 | 80.0 | 90.0 | 7.389 |" in text
    # The loss by position: every bucket holds the fixture's loss, so the differences are LOSS's.
    position = summary["loss_by_position"]
    assert position["buckets"] == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]
    assert position["per_type"]["msa"] == pytest.approx([LOSS["msa"]] * 4)
    assert "| attention | 0-2048 | 2048-4096 | 4096-6144 | 6144-8192 |" in text
    assert "| dense | 2.000 | 2.000 | 2.000 | 2.000 |" in text and "| mtraining | +0.020 | +0.020 |" in text


def test_a_variant_reports_as_its_own_row_against_dense(fixture_workdir):
    """A run of ``continue --variant p95`` reports as ``mtraining p95``, paired with the dense run
    of its seed, and leaves the plain ``mtraining`` rows as they were."""
    plain = report.summarize(fixture_workdir)
    run = "continue/mtraining-p95-seed1"
    record = stage_record(run, "mtraining", 1) | {"variant": "p95"}
    write_run(fixture_workdir, run, record, {"mtraining": fixture_results("msa", 1, loss=2.001)})
    summary = report.summarize(fixture_workdir)
    assert list(summary["per_type"]) == ["dense", "mtraining", "mtraining p95", "msa"]
    assert summary["per_type"]["mtraining"] == plain["per_type"]["mtraining"]
    variant = summary["against_dense"]["mtraining p95"]
    assert variant["seeds"] == [1] and variant["perplexity_ratio"] == pytest.approx(math.exp(0.001) - 1)
    assert variant["average"][0] == pytest.approx(100 * (summary["per_type"]["mtraining p95"]["average"][0] - 0.9))
    text = report.markdown(summary)
    assert "| mtraining p95 | 1 | 500 | 0.200 |" in text and "| mtraining p95 | 1 | " in text.split("Against dense")[1]


def test_a_run_evaluated_at_fewer_lengths_is_named_and_paired_where_both_scored(fixture_workdir):
    """A run whose evaluation left a length out (MSA at a top-k taking every block there) is
    named under the table, and differs from dense over the samples both scored only."""
    run = "continue/msa-k64-seed1"
    record = stage_record(run, "msa", 1) | {"variant": "k64"}
    short = EvalPlan(**{**PLAN.__dict__, "lengths": (8192,)})
    write_run(fixture_workdir, run, record, {"msa": fixture_results("msa", 1, short)})
    summary = report.summarize(fixture_workdir)
    assert summary["plan"]["lengths"] == [4096, 8192]
    # niah_single: 2 depths x 10 samples at 8192 (40 with both lengths); msa misses none of them.
    assert summary["against_dense"]["msa k64"]["tasks"]["niah_single"] == pytest.approx((0.0, 0.0, 20))
    text = report.markdown(summary)
    assert "Evaluated at fewer lengths" in text and "continue/msa-k64-seed1 at 8192." in text
    assert "continue/msa-seed1 at" not in text


def test_variant_names_make_run_directories_or_are_refused():
    assert runs.continue_run("msa", 2) == Path("continue/msa-seed2")
    assert runs.continue_run("msa", 2, "k32") == Path("continue/msa-k32-seed2")
    for bad in ("K32", "p-95", "", "p95/x", ".p"):
        with pytest.raises(StageError, match=r"--variant=.* is invalid; accepted: lower-case letters"):
            runs.continue_run("msa", 1, bad)


def test_report_files_and_the_empty_case(fixture_workdir, tmp_path):
    text, written = report.write_report(fixture_workdir)
    names = {p.name for p in written}
    assert {"study.md", "study.json"} <= names and (fixture_workdir / "report/study.md").read_text() == text
    if has_matplotlib():
        assert set(report.PLOTS) <= names
    with pytest.raises(ValueError, match="no evaluated run under"):
        report.summarize(tmp_path / "empty")


# ---- every stage, tiny, on CPU -------------------------------------------------------------
SHAPE = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "padded_vocab_size": 512,
    "bf16": False,
    "lr_warmup_iters": 1,
    "log_interval": 1,
}


def study(workdir: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "megatron_mtraining.examples.study", *args]
    return run_command(cmd, workdir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with the tiny data recipe and stage configs (on the packaged ones), and the
    options that select them."""
    root = tmp_path_factory.mktemp("study")
    (root / "data.yaml").write_text(yaml.safe_dump(tiny_data()))
    (root / "configs").mkdir()
    stages = {
        "pretrain": {
            "seq_length": 256,
            "max_position_embeddings": 256,
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "train_iters": 2,
        },
        "continue": {
            "seq_length": 512,
            "max_position_embeddings": 512,
            "micro_batch_size": 1,
            "global_batch_size": 2,
            "train_iters": 3,
        },
    }
    attention = {
        "mtraining": {"last_q": 32, "vertical_cap": 64, "slash_cap": 64, "block_size": 16},
        "msa": {"block_size": 16, "topk": 4, "index_head_dim": 16, "warmup_steps": 1},
    }
    for stage, settings in stages.items():
        config = {"base": str(STUDY / f"{stage}.yaml"), "megatron": {**SHAPE, **settings}, "attention": attention}
        (root / "configs" / f"{stage}.yaml").write_text(yaml.safe_dump(config))
    options = ["--workdir", "w", "--data-config", "data.yaml", "--configs", "configs"]
    evaluation = ["--lengths", "512", "--samples", "1", "--ppl-docs", "1"]
    return root, options, evaluation


@pytest.fixture(scope="module")
def pretrained(tiny):
    root, options, _ = tiny
    output = study(root, "pretrain", *options, "--export", "out")
    return root, output


def test_data_and_pretraining(pretrained):
    root, output = pretrained
    work = root / "w"
    manifest = json.loads((work / "data/data.json").read_text())
    assert set(manifest["splits"]) == {"pretrain", "heldout"} and manifest["tokenizer"]["sha256"]
    for split in ("pretrain", "heldout"):
        assert (work / f"data/{split}.idx").is_file() and manifest["splits"][split]["tokens"] > 10000
    record = json.loads((work / "pretrain/stage.json").read_text())
    assert (record["iterations"], record["tokens"], record["attention"]) == (2, 2 * 2 * 256, "dense")
    assert record["documents_masked"] is False
    assert not record["stopped_by_time_limit"] and (work / record["checkpoint"]).is_dir()
    assert record["data"]["sha256"] == manifest["splits"]["pretrain"]["sha256"]
    assert math.isfinite(record["lm_loss"]["last"])
    # Megatron validates on the held-out text at the end.
    assert record["validation"]["iteration"] == 2 and math.isfinite(record["validation"]["lm_loss"])
    assert [p.name for p in (root / "out").iterdir()] == ["study-pretrain.tar.000"]


def test_continued_msa_from_the_pretrained_model_elsewhere(pretrained, tiny, capsys):
    """Continued in a fresh workdir from the pretraining's archive (as on another machine), as a
    named variant, evaluated with MSA and dense, exported without its checkpoint and reported."""
    root, options, evaluation = tiny
    fresh = ["--workdir", "w2", *options[2:]]
    output = study(
        root,
        "continue",
        "--attention",
        "msa",
        "--seed",
        "3",
        *fresh,
        "--import",
        "out",
        "--eval",
        *evaluation,
        "--export",
        "out2",
        "--variant",
        "kl.5",
        "attention.msa.kl_coeff=0.5",
    )
    work = root / "w2"
    assert "imported study-pretrain.tar" in output and "split heldout: reused" in output
    log = (work / "continue/msa-kl.5-seed3/train.log").read_text()
    # The switch from the pretrained dense model, which restarts at iteration 0 with a fresh
    # optimizer; the index branch warms up for one iteration (dense) and then selects.
    assert "attention switch on load from pretrain/checkpoints (iteration 2): 'dense' -> 'msa'" in log
    from megatron_mtraining.training.metrics_line import parse_metrics

    metrics = parse_metrics(log)
    assert sorted(metrics) == [1, 2, 3]
    assert float(metrics[1]["attended_fraction"]) == 1.0 and float(metrics[3]["attended_fraction"]) < 0.5
    record = json.loads((work / "continue/msa-kl.5-seed3/stage.json").read_text())
    assert record["started_from"] == {"checkpoint": "pretrain/checkpoints", "iteration": 2}
    assert (record["loaded_iteration"], record["iterations"], record["seed"]) == (0, 3, 3)
    # The continued stage masks packed documents (the indexes are built per document).
    assert record["documents_masked"] is True
    assert record["variant"] == "kl.5" and "attention.msa.kl_coeff=0.5" in record["overrides"]
    assert record["validation"]["iteration"] == 3 and record["data"]["split"] == "continue"
    for attention in ("msa", "dense"):
        results = json.loads((work / f"continue/msa-kl.5-seed3/eval/{attention}/results.json").read_text())
        assert results["meta"]["attention"]["type"] == attention and results["meta"]["iteration"] == 3
        assert results["plan"]["lengths"] == [512] and results["plan"]["held_out"] == "indexed dataset data/heldout"
        assert math.isfinite(results["perplexity"]["512"]["perplexity"])
    # The export holds the results, not the checkpoint; the report reads them anywhere.
    main(["import", str(root / "out2"), "--workdir", str(root / "w3")])
    assert (root / "w3/continue/msa-kl.5-seed3/eval/msa/results.json").is_file()
    assert not (root / "w3/continue/msa-kl.5-seed3/checkpoints").exists()
    main(["report", "--workdir", str(root / "w3")])
    text = capsys.readouterr().out
    assert "| msa kl.5 | 3 | 3 | " in text and "| msa kl.5 | dense | 3 |" in text


def test_a_config_megatron_rejects_stops_before_the_data(tiny, tmp_path):
    root, options, _ = tiny
    args = ["pretrain", "--workdir", str(tmp_path / "w"), "--data-config", str(root / "data.yaml")]
    args += ["--configs", str(root / "configs"), "megatron.micro_batch_size=3"]
    with pytest.raises(
        SystemExit, match=r"config error: .*pretrain.yaml: Megatron rejected the arguments: .*micro_batch_size \(3\)"
    ):
        main(args)
    assert not (tmp_path / "w/data").exists()


@pytest.mark.slow
def test_three_types_one_seed_evaluated_and_reported(pretrained, tiny, capsys):
    """Dense and MTraining continued beside MSA in one workdir: the same data and iterations,
    the eval stage on its own, and the report against dense."""
    root, options, evaluation = tiny
    for attention in ("dense", "mtraining", "msa"):
        study(root, "continue", "--attention", attention, "--seed", "1", *options, "--eval", *evaluation)
    output = study(root, "eval", "continue/dense-seed1", "--as", "msa", *options, *evaluation, "--export", "out4")
    # The dense model through MSA's index branch, which it never trained: the projections start fresh.
    assert (
        "attention switch on load from continue/dense-seed1/checkpoints (iteration 3): 'dense' -> 'msa'"
        in (root / "w/continue/dense-seed1/eval/msa/evaluate.log").read_text()
    )
    assert "study-eval-continue-dense-seed1.tar.000" in output
    main(["report", "--workdir", str(root / "w")])
    text = capsys.readouterr().out
    assert (
        "seed 1: the same data and iterations (continue/dense-seed1, continue/mtraining-seed1, continue/msa-seed1)"
        in text
    )
    assert "| mtraining | 1 | " in text and "| msa | 1 | " in text and "**Target: " in text
    summary = json.loads((root / "w/report/study.json").read_text())
    assert set(summary["against_dense"]) == {"mtraining", "msa"}
    assert {(c["trained"], c["evaluated"]) for c in summary["cross"]} == {
        ("dense", "mtraining"),
        ("dense", "msa"),
        ("mtraining", "dense"),
        ("msa", "dense"),
    }


@pytest.mark.slow
@pytest.mark.slow
def test_all_end_to_end(pretrained, tiny, tmp_path):
    """``study all`` on the tiny recipe: the pretraining reused from its archive, two types of
    one seed continued and evaluated, the report written; a second call has nothing to run."""
    root, options, evaluation = tiny
    fresh = ["--workdir", str(tmp_path / "w"), *options[2:]]
    output = study(root, "all", *fresh, "--import", "out", "--seeds", "5", "--attention", "dense", "msa",
                   *evaluation, "--no-cross", "megatron.lr=2e-4")  # fmt: skip
    assert "continue-dense-seed5: done" in output and "continue-msa-seed5: done" in output
    assert "pretrain: started" not in output and (tmp_path / "w/report/study.md").is_file()
    record = json.loads((tmp_path / "w/continue/msa-seed5/stage.json").read_text())
    assert "megatron.lr=2e-4" in record["overrides"] and record["documents_masked"]
    again = study(root, "all", *fresh, "--seeds", "5", "--attention", "dense", "msa", *evaluation, "--no-cross")
    assert "started" not in again


def test_the_time_limit_stops_training_with_a_checkpoint(pretrained, tiny, monkeypatch):
    """Megatron's own SIGTERM path: the run saves where it is, exits cleanly, and says so."""
    from megatron_mtraining.examples.study import runs

    root, _, _ = tiny
    monkeypatch.setattr(runs, "MIN_TRAINING_MINUTES", 0.1)
    configs = {stage: root / "configs" / f"{stage}.yaml" for stage in ("pretrain", "continue")}
    deadline = Deadline(0.5)
    record = Study(root / "w", configs, []).train("pretrain", Path("stopped"), [], 100000, deadline, 0.0)
    assert record["stopped_by_time_limit"] and 0 < record["iterations"] < 100000
    assert record["saved_iterations"] == [record["iterations"]]
    assert (root / "w" / record["checkpoint"]).is_dir()
