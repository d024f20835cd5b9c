"""The embedded default: ``python -m megatron_mtraining.examples.quickstart [--workdir DIR] [--steps N] [--fresh]``.

A tiny continued-pretraining run with sparse attention, end to end, in six stages:

1. synthetic long documents (passkey / copy) and short ones (filler / passkey), as jsonl;
2. a tiny byte-level BPE tokenizer trained on them;
3. the Megatron indexed dataset of ``configs/data/synthetic_mix.yaml`` (long and short buckets),
   and the documents it holds out for validation;
4. training phase 1 on ``configs/quickstart.yaml`` (a tiny Qwen2-architecture model, random
   init, ``mtraining`` attention): the first half of the steps, then a checkpoint;
5. phase 2: resumed from that checkpoint to the last step, checked to have resumed there,
   with the held-out loss every ``eval_interval`` steps and at the end;
6. a summary: the loss at the start and the end, the last held-out loss, and where the logs,
   checkpoints, TensorBoard events and offline W&B runs are, with the commands to rerun,
   resume and view.

Everything lives under the workdir, which is the training processes' working directory, so
the config's relative paths (data, tokenizer, checkpoints, TensorBoard, W&B) point there.
Training runs as two gloo processes on the CPU with context parallelism 2 (striped ring), as
two NCCL processes where there are two or more GPUs, and as one process with CP 1 on a single
GPU. Each phase's output goes to ``logs/phase<N>.log``; the console shows one line per
iteration and per evaluation. Finished stages (recorded in ``quickstart.json``) are reused unless ``--fresh``;
the training stages only while the steps, config, overrides and launch are the recorded ones.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from .. import configs

DEFAULT_CONFIG = configs.packaged("quickstart.yaml")
MIX_CONFIG = configs.packaged("data/synthetic_mix.yaml")
# Relative to the workdir, where the mix config and configs/quickstart.yaml look for them.
DOCS = Path("data/synthetic")
TOKENIZER = DOCS / "tokenizer"
CHECKPOINTS, TENSORBOARD, WANDB, LOGS = Path("checkpoints"), Path("tensorboard"), Path("wandb"), Path("logs")
# The documents that configs/data/synthetic_mix.yaml's header describes: long ones (about 9K
# tokens of the tiny BPE) for its long bucket, short ones for the other.
DOCUMENT_SETS = {
    "long": {"num_docs": 48, "length": 24000, "seed": 0, "kinds": ("passkey", "copy")},
    "short": {"num_docs": 192, "length": 1500, "seed": 1, "kinds": ("filler", "passkey")},
}
STATE = "quickstart.json"
STAGES = 6
# Megatron arguments the phases set from --steps.
RESERVED = ("train_iters", "save", "load", "ckpt_step", "save_interval", "exit_interval")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
SAVED = re.compile(r"successfully saved checkpoint from iteration +(\d+)")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the training processes run on this machine."""

    processes: int
    device: str  # "cpu" (gloo) or "cuda" (NCCL)
    note: str = ""  # why the run differs from two processes with CP 2

    def overrides(self) -> list[str]:
        return [] if self.processes > 1 else ["megatron.context_parallel_size=1"]


def plan_launch(gpus: int) -> Launch:
    """Two processes with CP 2, on two GPUs or on the CPU; a single GPU runs one process with CP 1."""
    if gpus == 1:
        return Launch(
            1,
            "cuda",
            "one GPU found: training runs as one process on it with context parallelism 1 (CP 2 needs two "
            "GPUs, and two CPU processes would be slower than the GPU)",
        )
    return Launch(2, "cuda" if gpus >= 2 else "cpu")


def module_command(processes: int, module: str, args: list[str]) -> list[str]:
    """``python -m module args`` on ``processes`` local processes (through torchrun for more than one)."""
    launcher = [sys.executable, "-m"]
    if processes > 1:
        launcher += ["torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m"]
    return [*launcher, module, *args]


def pretrain_command(processes: int, config: Path | str, overrides: list[str]) -> list[str]:
    """The training entry point on ``processes`` local processes."""
    return module_command(processes, "megatron_mtraining.pretrain", ["--config", str(config), *overrides])


class StageError(RuntimeError):
    """A stage failed; the message says which and where its log is."""


def run_logged(
    command: list[str], cwd: Path, log_path: Path, steps: int, processes: int, what: str, deadline: float | None = None
) -> str:
    """Runs ``command`` in ``cwd``, its output to ``log_path`` and its progress to the
    console (one line per iteration of ``steps``, checkpoint saves and loads); returns the
    output. At ``deadline`` (a ``time.monotonic()`` value) the command gets SIGTERM, on which
    a training run with ``megatron.exit_signal_handler`` saves a checkpoint and stops. A
    failure raises :class:`StageError` with the end of the log, naming ``what``."""
    # Lines reach the display as they are printed, not when a pipe buffer fills.
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    # torchrun's default is one thread per process, which leaves cores idle on bigger machines.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    progress = _Progress(steps)
    lines = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        log.write(f"# cwd: {Path(cwd).resolve()}\n# command: {shlex.join(command)}\n")
        with subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            timer = None
            if deadline is not None:
                timer = threading.Timer(max(0.0, deadline - time.monotonic()), proc.send_signal, (signal.SIGTERM,))
                timer.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    lines.append(line)
                    progress.show(line)
            finally:
                if timer is not None:
                    timer.cancel()
    if proc.returncode != 0:
        # torchrun's own report (which rank failed, how) closes the log; the cause is above it.
        end = next((i for i, line in enumerate(lines) if "torch/distributed/elastic/" in line), len(lines))
        raise StageError(
            f"{what} failed (exit code {proc.returncode}); the end of its log:\n"
            f"{''.join(lines[max(0, end - 40) : end])}\nfull log: {log_path}"
        )
    return "".join(lines)


class Quickstart:
    """The six stages over one workdir; ``run`` runs or reuses each in turn."""

    def __init__(self, args: argparse.Namespace, launch: Launch, run_config):
        self.args = args
        self.workdir = Path(args.workdir)
        self.steps, self.half = args.steps, args.steps // 2
        self.config = Path(args.config).resolve()
        self.launch = launch
        # W&B is an optional extra (setup.sh installs it); without it Megatron's writer fails to import.
        self.wandb = importlib.util.find_spec("wandb") is not None
        self.overrides = [*args.overrides, *launch.overrides(), *([] if self.wandb else ["megatron.wandb_project=''"])]
        self.seq_length = run_config.megatron["seq_length"]
        self.context_parallel = 1 if launch.processes == 1 else run_config.megatron.get("context_parallel_size", 1)
        self.attention = run_config.attention
        self.settings = {
            "config": str(self.config),
            "steps": self.steps,
            "overrides": self.overrides,
            "processes": launch.processes,
            "device": launch.device,
        }
        state = self.workdir / STATE
        self.state = {} if args.fresh or not state.is_file() else json.loads(state.read_text())
        self.state.setdefault("done", [])

    def path(self, relative: Path | str) -> Path:
        """A workdir path as reached from where the quickstart was started."""
        return self.workdir / relative

    def checkpoint(self, iteration: int) -> Path:
        return CHECKPOINTS / f"iter_{iteration:07d}"

    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        recorded = self.state.get("settings", {})
        if recorded != self.settings:
            # The training stages ran with other settings (or never): their outputs do not apply.
            if "phase1" in self.state["done"]:
                changed = "; ".join(
                    f"{key}: {recorded.get(key)!r} -> {value!r}"
                    for key, value in self.settings.items()
                    if recorded.get(key) != value
                )
                print(f"the training settings differ from the recorded run's ({changed}): training again")
            self.state["done"] = [s for s in self.state["done"] if not s.startswith("phase")]
            self.state["settings"] = self.settings
        stages = [
            ("docs", "Synthetic long documents", [DOCS / f"{name}.jsonl" for name in DOCUMENT_SETS], self.make_documents),
            ("tokenizer", "Tiny byte-level BPE tokenizer", [TOKENIZER / "tokenizer.json"], self.make_tokenizer),
            ("mix", "Megatron indexed dataset", [DOCS / "mix.idx", DOCS / "mix_valid.idx"], self.make_mix),
            ("phase1", f"Training phase 1: iterations 1-{self.half} of {self.steps}, then a checkpoint",
             [self.checkpoint(self.half), LOGS / "phase1.log"], self.phase1),
            ("phase2", f"Training phase 2: resume from the checkpoint of iteration {self.half}, train to {self.steps}",
             [self.checkpoint(self.steps), LOGS / "phase2.log"], self.phase2),
        ]  # fmt: skip
        redo = False
        for number, (stage, title, outputs, action) in enumerate(stages, 1):
            reuse = not redo and stage in self.state["done"] and all(self.path(p).exists() for p in outputs)
            print(f"\n[{number}/{STAGES}] {title}" + (" (reused: done before; --fresh redoes it)" if reuse else ""))
            if reuse:
                continue
            # Every later stage read what this one writes.
            redo = True
            self.record(stage, done=False)
            start = time.monotonic()
            action()
            self.record(stage, done=True)
            print(f"  done in {_clock(time.monotonic() - start)}")
        print(f"\n[{STAGES}/{STAGES}] Summary")
        self.summary()

    def record(self, stage: str, done: bool) -> None:
        self.state["done"] = [s for s in self.state["done"] if s != stage] + ([stage] if done else [])
        self.path(STATE).write_text(json.dumps(self.state, indent=2) + "\n")

    # ---- data stages ------------------------------------------------------------------------
    def make_documents(self) -> None:
        from ..data import generate_documents, write_jsonl

        for name, spec in DOCUMENT_SETS.items():
            path = self.path(DOCS / f"{name}.jsonl")
            count = write_jsonl(generate_documents(spec["num_docs"], spec["length"], spec["seed"], spec["kinds"]), path)
            print(f"  {count} {' / '.join(spec['kinds'])} documents of ~{spec['length']} characters -> {path}")

    def make_tokenizer(self) -> None:
        from ..data import train_tiny_tokenizer
        from ..data.readers import read_texts

        texts = (text for name in DOCUMENT_SETS for text in read_texts(self.path(DOCS / f"{name}.jsonl"), "text"))
        print(f"  trained on the documents, saved to {train_tiny_tokenizer(texts, self.path(TOKENIZER))}")

    def make_mix(self) -> None:
        from ..data import MixConfig, prepare

        # The mix config's paths are relative to the working directory: here, the workdir.
        with contextlib.chdir(self.workdir):
            summary = prepare(MixConfig.from_yaml(MIX_CONFIG, seq_length=self.seq_length))
        print("  " + summary.format().replace("\n", "\n  ") + f"\n  (written under {self.path(DOCS)})")

    # ---- training stages -------------------------------------------------------------------
    def phase1_overrides(self) -> list[str]:
        return [
            f"megatron.save={CHECKPOINTS}",
            f"megatron.save_interval={self.half}",
            f"megatron.exit_interval={self.half}",
        ]

    def phase2_overrides(self) -> list[str]:
        return [
            f"megatron.load={CHECKPOINTS}",
            f"megatron.ckpt_step={self.half}",
            f"megatron.save={CHECKPOINTS}",
            f"megatron.save_interval={self.half}",
        ]

    def command(self, phase_overrides: list[str]) -> list[str]:
        overrides = [*self.overrides, f"megatron.train_iters={self.steps}", *phase_overrides]
        return pretrain_command(self.launch.processes, self.config, overrides)

    def evaluate_command(self) -> list[str]:
        """``megatron_mtraining.evaluate`` on the run's last checkpoint, in the workdir: the run's
        config and overrides, none of a phase's (phase 2's ``ckpt_step`` would load the half)."""
        args = ["--config", str(self.config), *self.overrides, "--checkpoint", str(CHECKPOINTS)]
        return module_command(self.launch.processes, "megatron_mtraining.evaluate", args)

    def phase1(self) -> None:
        from ..training.metrics_line import parse_metrics

        # Phase 1 starts the run over: earlier checkpoints, events and W&B runs would mix in.
        for output in (CHECKPOINTS, TENSORBOARD, WANDB, LOGS):
            shutil.rmtree(self.path(output), ignore_errors=True)
        iterations = sorted(parse_metrics(self.train("phase1", self.phase1_overrides())))
        if iterations != list(range(1, self.half + 1)) or not self.path(self.checkpoint(self.half)).is_dir():
            raise StageError(
                f"phase 1 should train iterations 1-{self.half} and save {self.path(self.checkpoint(self.half))}; "
                f"it logged iterations {_span(iterations)} (log: {self.path(LOGS / 'phase1.log')})"
            )

    def phase2(self) -> None:
        from ..training.metrics_line import parse_metrics

        output = self.train("phase2", self.phase2_overrides())
        loaded = [int(i) for i in LOADED.findall(output)]
        iterations = sorted(parse_metrics(output))
        if loaded != [self.half] or iterations != list(range(self.half + 1, self.steps + 1)):
            raise StageError(
                f"phase 2 did not resume where phase 1 saved: expected to load iteration {self.half} and train "
                f"{self.half + 1}-{self.steps}; Megatron loaded {loaded or 'no checkpoint'} and logged iterations "
                f"{_span(iterations)} (log: {self.path(LOGS / 'phase2.log')})"
            )
        print(f"  resumed at iteration {self.half}, as saved, and trained to {self.steps}")

    def train(self, phase: str, phase_overrides: list[str]) -> str:
        """Runs one phase in the workdir, its output to ``logs/<phase>.log`` and the progress to
        the console; returns the output."""
        command = self.command(phase_overrides)
        log_path = self.path(LOGS / f"{phase}.log")
        count = self.launch.processes
        processes = f"{count} process{'es' if count > 1 else ''}"
        where = (
            "on the CPU (gloo)" if self.launch.device == "cpu" else f"on {count} GPU{'s' if count > 1 else ''} (NCCL)"
        )
        ring = f"context parallelism {self.context_parallel} ({self.attention.layout} ring)"
        print(f"  {processes} {where}, {ring}, {self.attention.type} attention, {self.seq_length}-token samples")
        print(f"  log: {log_path}")
        return run_logged(command, self.workdir, log_path, self.steps, count, f"training {phase}")

    # ---- summary ---------------------------------------------------------------------------
    def summary(self) -> None:
        from ..training.metrics_line import parse_metrics, parse_validation

        first = parse_metrics(self.path(LOGS / "phase1.log").read_text())
        phase2 = self.path(LOGS / "phase2.log").read_text()
        last = parse_metrics(phase2)
        start, end = first[min(first)], last[max(last)]
        validated = parse_validation(phase2)
        events = sorted(self.path(TENSORBOARD).glob("events.out.tfevents.*"))
        runs = sorted(self.path(WANDB).glob("wandb/offline-run-*"))
        rerun = [
            sys.executable,
            "-m",
            "megatron_mtraining.examples.quickstart",
            *(a for a in self.args.argv if a != "--fresh"),
        ]
        resume = f"cd {shlex.quote(str(self.workdir.resolve()))} && WANDB_MODE=offline "
        rows = [
            ("loss", f"{float(start['lm_loss']):.4f} at iteration {min(first)} -> {float(end['lm_loss']):.4f} at iteration {max(last)}"),
            ("validation", f"{float(validated[-1][1]['lm_loss']):.4f} held-out loss at iteration {validated[-1][0]}" if validated else "not run (megatron.eval_iters=0)"),
            ("attended", f"{end.get('attended_fraction', 'not logged')} of the causal area at iteration {max(last)} ({self.attention.type})"),
            ("speed", f"{sum(float(m['tokens/s']) for m in last.values()) / len(last):.0f} tokens/s (phase 2 mean)"),
            ("logs", f"{self.path(LOGS / 'phase1.log')}, {self.path(LOGS / 'phase2.log')}"),
            ("checkpoints", f"{self.path(self.checkpoint(self.half))} (phase 1), {self.path(self.checkpoint(self.steps))} (final)"),
            ("tensorboard", f"{self.path(TENSORBOARD)}: {', '.join(p.name for p in events) or 'no event file'}"),
            ("wandb", f"{', '.join(map(str, runs))} (offline)" if self.wandb else "not installed (pip install wandb), no run written"),
            ("view", f"tensorboard --logdir {self.path(TENSORBOARD)}" + (f"  |  upload to W&B: wandb sync {self.path(WANDB / 'wandb')}/offline-run-*" if self.wandb else "")),
            ("rerun", f"{shlex.join(rerun)} [--fresh]  (without --fresh, finished stages are reused)"),
            ("resume", f"{resume}{shlex.join(self.command(self.phase2_overrides()))}  (phase 2 by hand, from iteration {self.half})"),
            ("evaluate", f"{resume}{shlex.join(self.evaluate_command())}  (the last checkpoint, iteration {self.steps}; attention.type=... evaluates it as another type)"),
        ]  # fmt: skip
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"  {name:<{width}}  {value}")


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def _span(iterations: list[int]) -> str:
    return f"{iterations[0]}-{iterations[-1]} ({len(iterations)} lines)" if iterations else "none"


class _Progress:
    """The console's view of a training phase: one line per iteration, checkpoint saves and
    loads (and an evaluation's progress lines)."""

    def __init__(self, total: int):
        self.total = total
        self.start = time.monotonic()

    def show(self, line: str) -> None:
        from ..training.metrics_line import VALIDATION_LINE, parse_metrics_line

        parsed = parse_metrics_line(line)
        validation = parse_metrics_line(line, VALIDATION_LINE)
        if validation is not None:
            iteration, values = validation
            print(f"  validation at iteration {iteration} | held-out lm_loss {float(values['lm_loss']):.4f}")
        elif parsed is not None:
            iteration, values = parsed
            text = f"  iteration {iteration:>{len(str(self.total))}}/{self.total}"
            if "lm_loss" in values:
                text += f" | lm_loss {float(values['lm_loss']):.4f}"
            if "tokens/s" in values:
                text += f" | {float(values['tokens/s']):6.0f} tokens/s"
            if "attended_fraction" in values:
                text += f" | attended {values['attended_fraction']}"
            if "index_recall" in values:
                text += f" | recall {values['index_recall']}"
            print(f"{text} | {_clock(time.monotonic() - self.start)}")
        elif match := LOADED.search(line):
            print(f"  loaded the checkpoint of iteration {match.group(1)}")
        elif match := SAVED.search(line):
            print(f"  saved the checkpoint of iteration {match.group(1)}")
        elif line.startswith("[eval] "):
            print(f"  {line.rstrip()}")


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.examples.quickstart",
        description="The embedded default: synthetic long documents -> tokenizer -> indexed dataset -> "
        "sparse-attention continued pretraining of a tiny model in two phases (save, resume) -> summary.",
        epilog="Overrides go to both training phases (megatron.<dest>=value, attention.<field>=value), except "
        f"{', '.join('megatron.' + k for k in RESERVED)}, which the phases set from --steps.",
    )
    parser.add_argument("--workdir", default="runs/quickstart", help="where everything goes (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, help="training iterations in all, half per phase (default: the config's train_iters)"
    )
    parser.add_argument(
        "--config",
        default=str(DEFAULT_CONFIG),
        help="training config: a path, or the name of a packaged recipe (default: the packaged quickstart.yaml)",
    )
    parser.add_argument("--fresh", action="store_true", help="redo every stage, even those done before")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides")
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        args.config = str(configs.find(args.config))
    except FileNotFoundError as err:
        parser.error(str(err))
    for override in args.overrides:
        section, _, key = override.partition("=")[0].partition(".")
        if section == "megatron" and key in RESERVED:
            parser.error(
                f"override {override!r}: the quickstart sets megatron.{key} itself; use --steps for the length"
            )
    if args.steps is not None and args.steps < 2:
        parser.error(
            f"--steps={args.steps} is too few: accepted an integer >= 2 (phase 1 trains half, phase 2 the rest)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_cli(sys.argv[1:] if argv is None else argv)
    # The data stages' progress bars go to stderr: line buffering keeps both streams in order.
    sys.stdout.reconfigure(line_buffering=True)
    # Importing Megatron (for the config check and the data stages) warns about fused kernels and
    # CUDA that the data stages never use, and megatron.training sets the root logger to INFO,
    # which would print every index read; the training processes keep all of it in their logs.
    warnings.filterwarnings("ignore", module=r"megatron\b")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    import torch

    from ..training.yaml_config import ConfigError, load_config

    try:
        run_config = load_config(args.config, args.overrides)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    if args.steps is None:
        args.steps = run_config.megatron.get("train_iters")
        if not isinstance(args.steps, int) or args.steps < 2:
            sys.exit(
                f"error: {args.config}: megatron.train_iters={args.steps!r}; the quickstart needs >= 2 (or --steps)"
            )
    launch = plan_launch(torch.cuda.device_count())
    if launch.note:
        print(launch.note)
    try:
        Quickstart(args, launch, run_config).run()
    except StageError as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted: the finished stages are kept; the same command continues from them")


if __name__ == "__main__":
    main()
