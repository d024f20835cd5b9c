"""The study's training and evaluation stages over one workdir.

A run is a directory of the workdir: ``pretrain`` (dense, short length) or
``continue/<type>-seed<N>`` (one attention type and seed, from the pretrained model;
``continue/<type>-<variant>-seed<N>`` for a named variant of the type's settings). Each
holds ``checkpoints/``, ``train.log``, ``tensorboard/``, ``stage.json`` (what ran and what it
measured) and ``eval/<type>/`` (the evaluation's ``results.json``, tables and plots, one
folder per attention type the checkpoint was evaluated with).

Training goes through ``python -m megatron_mtraining.pretrain`` on one process (one GPU, or
the CPU over gloo) with the stage's config; evaluation through ``python -m
megatron_mtraining.evaluate``. A stage command may be given a time limit: the training run
gets SIGTERM when only the time kept back for what follows it (evaluation, export) is left,
and saves a checkpoint and stops there (``megatron.exit_signal_handler``); ``stage.json`` then
records ``stopped_by_time_limit``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ...training.metrics_line import parse_metrics, parse_validation
from ..quickstart import LOADED, SAVED, StageError, module_command, pretrain_command, run_logged
from .data import DATA, HELDOUT, MANIFEST

ATTENTION_TYPES = ("dense", "mtraining", "msa")
# The other attention types a continued checkpoint is evaluated with: the dense model sparse
# at inference only (MTraining needs no trained part), and the sparse models dense. A dense
# model evaluated with MSA would select blocks with an untrained index branch: not measured.
CROSS = {"dense": ("mtraining",), "mtraining": ("dense",), "msa": ("dense",)}
PRETRAIN = Path("pretrain")
CONTINUE = Path("continue")
STAGE_FILE = "stage.json"
TRAIN_LOG = "train.log"
CHECKPOINTS = "checkpoints"
EVAL = "eval"
SIGTERM_EXIT = "exiting program after receiving SIGTERM"
# Below this, a run under a time limit would be stopped before its first steps.
MIN_TRAINING_MINUTES = 2
SWITCH = re.compile(r"\[mtraining\] attention switch on load from (\S+) \(iteration (\d+)\).*")
# Megatron arguments a stage sets itself.
RESERVED = ("train_iters", "save", "load", "save_interval", "seed", "tensorboard_dir", "exit_signal_handler")


# A variant's name is part of a directory and an archive name, and is told from the seed by "-seed".
VARIANT = re.compile(r"[a-z0-9][a-z0-9.]*")


def check_variant(variant: str | None) -> None:
    if variant is not None and not VARIANT.fullmatch(variant):
        raise StageError(
            f"--variant={variant!r} is invalid; accepted: lower-case letters, digits and dots, starting with a "
            "letter or digit (e.g. p95, k32)"
        )


def continue_run(attention: str, seed: int, variant: str | None = None) -> Path:
    check_variant(variant)
    return CONTINUE / (f"{attention}-seed{seed}" if variant is None else f"{attention}-{variant}-seed{seed}")


@dataclass(frozen=True)
class EvalSettings:
    """The harness's plan for every checkpoint of the study (``python -m
    megatron_mtraining.evaluate``'s flags): samples per task, length and depth, the task
    seed, the held-out documents per length, and the lengths (default: the evaluation's,
    4096 doubling up to the run's length, or the length itself when shorter)."""

    samples: int = 16
    seed: int = 0
    ppl_docs: int = 8
    lengths: tuple[int, ...] | None = None

    def flags(self) -> list[str]:
        flags = ["--samples", str(self.samples), "--seed", str(self.seed), "--ppl-docs", str(self.ppl_docs)]
        return flags + (["--lengths", *map(str, self.lengths)] if self.lengths else [])


class Deadline:
    """The end of a stage command's time limit (None: no limit), as ``time.monotonic()``."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.end = None if not minutes else time.monotonic() + 60 * minutes

    def before(self, reserve_minutes: float) -> float | None:
        """``reserve_minutes`` before the end."""
        return None if self.end is None else self.end - 60 * reserve_minutes

    def training_end(self, reserve_minutes: float, what: str) -> float | None:
        """When training must stop to leave ``reserve_minutes``; raises when that leaves
        less than :data:`MIN_TRAINING_MINUTES` from now (the start-up alone takes most of it)."""
        end = self.before(reserve_minutes)
        if end is not None and end - time.monotonic() < 60 * MIN_TRAINING_MINUTES:
            raise StageError(
                f"--time-limit={self.minutes}: {(self.end - time.monotonic()) / 60:.1f} minutes are left, and "
                f"{what} keeps {reserve_minutes:.1f} back: less than {MIN_TRAINING_MINUTES} minutes to start and train "
                "(accepted: a longer --time-limit, or 0 for none)"
            )
        return end


def _gpu_name() -> str:
    """The GPU's name from nvidia-smi, without a CUDA context in this process (the
    training process needs the device), else "cpu"."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return names.stdout.strip().splitlines()[0] if names.returncode == 0 and names.stdout.strip() else "cpu"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def training_summary(output: str, run_config, warmup: int) -> dict:
    """What a training log says: iterations, loss, speed, the attention's figures (after
    ``warmup`` iterations for MSA's), the checkpoint loaded and saved, and how it stopped."""
    metrics = parse_metrics(output)
    validation = parse_validation(output)
    iterations = sorted(metrics)
    gbs, seq = run_config.value("global_batch_size"), run_config.value("seq_length")
    # The first interval holds the warm-up (compilation, allocator growth): not the speed.
    speeds = [float(metrics[i]["tokens/s"]) for i in iterations[1:] if "tokens/s" in metrics[i]]
    speed = _mean(speeds)

    def mean_of(name: str) -> float | None:
        return _mean([float(metrics[i][name]) for i in iterations if i > warmup and name in metrics[i]])

    saved = [int(i) for i in SAVED.findall(output)]
    trained = max(saved, default=iterations[-1] if iterations else 0)
    switch = SWITCH.search(output)
    return {
        "iterations": trained,
        "tokens": trained * gbs * seq,
        "stopped_by_time_limit": SIGTERM_EXIT in output,
        # Megatron's own line: 0 where the run started over from a checkpoint (finetune).
        "loaded_iteration": int(m.group(1)) if (m := LOADED.search(output)) else None,
        "started_from": {"checkpoint": switch.group(1), "iteration": int(switch.group(2))} if switch else None,
        "attention_switch": switch.group(0) if switch else None,
        "saved_iterations": saved,
        "lm_loss": {
            "first": float(metrics[iterations[0]]["lm_loss"]) if iterations else None,
            "last": float(metrics[iterations[-1]]["lm_loss"]) if iterations else None,
        },
        # Megatron's last evaluation on the validation data (the held-out text).
        "validation": {"iteration": validation[-1][0], "lm_loss": float(validation[-1][1]["lm_loss"])}
        if validation
        else None,
        "tokens_per_s": speed,
        "s_per_iteration": gbs * seq / speed if speed else None,
        "attended_fraction": mean_of("attended_fraction"),
        "index_recall": mean_of("index_recall"),
        "index_recall_heldout": mean_of("index_recall_heldout"),
        "msa_kl_loss": mean_of("msa_kl_loss"),
        "msa_block_recall": mean_of("msa_block_recall"),
    }


class Study:
    """The stages over ``workdir``; ``configs`` names each stage's config (``pretrain``,
    ``continue``), ``overrides`` apply to every training and evaluation run."""

    def __init__(self, workdir: Path, configs: dict[str, Path], overrides: list[str], log=print):
        self.workdir, self.configs, self.overrides, self.log = Path(workdir), configs, list(overrides), log
        for override in overrides:
            section, _, key = override.partition("=")[0].partition(".")
            if section == "megatron" and key in RESERVED:
                raise StageError(
                    f"override {override!r}: the study sets megatron.{key} itself (accepted: --steps for the "
                    "iterations, --seed for the seed, or another key)"
                )

    def path(self, relative: Path | str) -> Path:
        return self.workdir / relative

    def run_config(self, stage: str, overrides: list[str]):
        from ...training.yaml_config import ConfigError, load_config

        try:
            return load_config(self.configs[stage], [*self.overrides, *overrides])
        except ConfigError as err:
            raise StageError(f"config error: {err}") from None

    # ---- training --------------------------------------------------------------------------
    def plan(self, stage: str, run: Path, overrides: list[str], steps: int | None) -> tuple:
        """(config, overrides, steps) of a training run, validated as Megatron validates it
        (before a stage spends time on its data)."""
        from ...training.dry_run import resolve
        from ...training.yaml_config import ConfigError

        steps = steps or self.run_config(stage, overrides).value("train_iters")
        run_overrides = [
            *overrides,
            f"megatron.train_iters={steps}",
            f"megatron.save={run / CHECKPOINTS}",
            f"megatron.save_interval={steps}",
            f"megatron.tensorboard_dir={run / 'tensorboard'}",
            "megatron.exit_signal_handler=true",
        ]
        run_config = self.run_config(stage, run_overrides)
        try:
            # Megatron prints the arguments it validates.
            with contextlib.redirect_stdout(io.StringIO()):
                resolve(run_config, world_size=1)
        except ConfigError as err:
            raise StageError(f"config error: {err}") from None
        return run_config, run_overrides, steps

    def train(
        self,
        stage: str,
        run: Path,
        overrides: list[str],
        steps: int | None,
        deadline: Deadline,
        reserve_minutes: float,
        variant: str | None = None,
    ) -> dict:
        """Trains ``run`` with the ``stage`` config; returns (and writes) its ``stage.json``."""
        run_config, run_overrides, steps = self.plan(stage, run, overrides, steps)
        with contextlib.chdir(self.workdir):
            missing = run_config.missing_paths()
        if missing:
            raise StageError("\n".join(missing))
        # A run starts over: an earlier run's checkpoints would be resumed, its events mixed in.
        for output in (CHECKPOINTS, "tensorboard", EVAL):
            shutil.rmtree(self.path(run / output), ignore_errors=True)
        end = deadline.training_end(reserve_minutes, "what follows training (evaluation, export)")
        attention = run_config.attention
        self.log(
            f"  {stage}: {attention.type} attention, {run_config.value('seq_length')}-token samples, {steps} "
            f"iterations of {run_config.value('global_batch_size')} samples"
            + (
                f"; the time limit stops it with a checkpoint in {(end - time.monotonic()) / 60:.1f} minutes"
                if end
                else ""
            )
        )
        command = pretrain_command(1, self.configs[stage].resolve(), [*self.overrides, *run_overrides])
        start = time.monotonic()
        output = run_logged(command, self.workdir, self.path(run / TRAIN_LOG), steps, 1, f"{stage} training", end)
        seconds = time.monotonic() - start
        warmup = attention.msa.warmup_steps if attention.type == "msa" else 0
        summary = training_summary(output, run_config, warmup)
        checkpoint = run / CHECKPOINTS / f"iter_{summary['iterations']:07d}"
        if not summary["saved_iterations"] or not self.path(checkpoint).is_dir():
            raise StageError(
                f"{stage} training saved no checkpoint under {self.path(run / CHECKPOINTS)} (log: {self.path(run / TRAIN_LOG)})"
            )
        manifest = json.loads(self.path(MANIFEST).read_text())
        split = Path((run_config.value("train_data_path") or run_config.value("data_path"))[-1]).name
        record = {
            "stage": stage,
            "run": run.as_posix(),
            "attention": attention.type,
            "variant": variant,
            "seed": run_config.value("seed"),
            "config": str(self.configs[stage].resolve()),
            "overrides": [*self.overrides, *run_overrides],
            "attention_settings": run_config.attention_dict(),
            "seq_length": run_config.value("seq_length"),
            "global_batch_size": run_config.value("global_batch_size"),
            # Whether packed documents attended only within themselves (and the sparse indexes
            # were built per document): runs that differ here are not comparable.
            "documents_masked": bool(run_config.value("reset_attention_mask")),
            "train_iters": steps,
            **summary,
            "checkpoint": checkpoint.as_posix(),
            "seconds": round(seconds, 1),
            "data": {
                "split": split,
                "sha256": manifest.get("splits", {}).get(split, {}).get("sha256"),
                "tokenizer": manifest["tokenizer"]["sha256"],
                "python": manifest["python"],
            },
            "device": _gpu_name(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": _commit(),
        }
        self.path(run / STAGE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        stop = " (stopped by the time limit)" if summary["stopped_by_time_limit"] else ""
        self.log(
            f"  trained {summary['iterations']} of {steps} iterations{stop} in {seconds / 60:.1f} min, "
            f"{_fmt(summary['s_per_iteration'], '.3f')} s/iteration; lm_loss {_fmt(summary['lm_loss']['first'], '.3f')} -> "
            f"{_fmt(summary['lm_loss']['last'], '.3f')}; checkpoint {self.path(checkpoint)}"
        )
        return record

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(
        self, run: Path, attention_types: tuple[str, ...], settings: EvalSettings, deadline: float | None = None
    ) -> list[Path]:
        """Evaluates the latest checkpoint of ``run`` with each attention type, with the
        config and overrides it trained with; returns the results files. An evaluation
        still running at ``deadline`` (a ``time.monotonic()`` value) is stopped, and fails."""
        record_path = self.path(run / STAGE_FILE)
        if not record_path.is_file():
            raise StageError(f"no finished run at {self.path(run)} (no {STAGE_FILE}): train it first")
        record = json.loads(record_path.read_text())
        heldout = DATA / HELDOUT
        if not Path(f"{self.path(heldout)}.idx").is_file():
            raise StageError(f"no held-out split at {self.path(heldout)}: run the data stage (or import it) first")
        results = []
        for attention in attention_types:
            out = run / EVAL / attention
            shutil.rmtree(self.path(out), ignore_errors=True)
            overrides = [
                *record["overrides"],
                f"attention.type={attention}",
                # The checkpoint's own iteration, not a fresh start from it.
                "megatron.finetune=false",
            ]
            config = self.configs[record["stage"]].resolve()
            args = ["--config", str(config), *overrides, "--checkpoint", str(run / CHECKPOINTS)]
            args += ["--output", str(out), "--ppl-data", str(heldout), *settings.flags()]
            self.log(f"  evaluating {run} ({record['attention']}) with {attention} attention -> {self.path(out)}")
            start = time.monotonic()
            command = module_command(1, "megatron_mtraining.evaluate", args)
            log = self.path(out / "evaluate.log")
            run_logged(command, self.workdir, log, 0, 1, f"evaluation of {run} with {attention}", deadline)
            summary = json.loads(self.path(out / "results.json").read_text())
            longest = str(max(summary["plan"]["lengths"]))
            self.log(
                f"  task average {100 * summary['accuracy']['average']:.1f}%, held-out perplexity at {longest} "
                f"{summary['perplexity'][longest]['perplexity']:.3f} ({time.monotonic() - start:.0f} s)"
            )
            results.append(self.path(out / "results.json"))
        return results


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _commit() -> str | None:
    from ...evaluate import source_commit

    return source_commit()
