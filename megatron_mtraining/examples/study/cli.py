"""The study's command line: ``python -m megatron_mtraining.examples.study <stage> [options]``."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from ... import configs
from ..quickstart import StageError
from .runs import (
    ATTENTION_TYPES,
    CONTINUE,
    CROSS,
    PRETRAIN,
    STAGE_FILE,
    Deadline,
    EvalSettings,
    Study,
    check_variant,
    continue_run,
)

DATA_CONFIG = "data/study.yaml"
CONFIGS = "study"
STAGE_CONFIGS = ("pretrain", "continue")
# A GPU machine of the project runs one command for at most 10 minutes.
DEFAULT_TIME_LIMIT = 9.5
EXPORT_MINUTES = 0.5


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--workdir", default="runs/study", help="where every stage reads and writes (default: %(default)s)"
    )
    common.add_argument(
        "--data-config", default=DATA_CONFIG, help="the data recipe: a path or a packaged name (default: %(default)s)"
    )
    common.add_argument(
        "--configs",
        default=CONFIGS,
        help="the folder of the stage configs pretrain.yaml and continue.yaml: a path or a packaged name (default: %(default)s)",
    )
    common.add_argument(
        "--import",
        dest="imports",
        nargs="+",
        metavar="PATH",
        help="unpack these archives (parts or folders of parts) into the workdir first",
    )
    train = argparse.ArgumentParser(add_help=False)
    train.add_argument("--steps", type=int, help="training iterations (default: the config's train_iters)")
    train.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        metavar="MIN",
        help="minutes the whole command may take; training stops with a checkpoint when only the evaluation's and "
        "the export's time is left (default: %(default)s, one command of the project's GPU machines; 0: no limit)",
    )
    train.add_argument("--eval", action="store_true", help="evaluate the checkpoint after training (as the eval stage)")
    train.add_argument(
        "--export", metavar="DIR", help="pack the stage's outputs into DIR as <name>.tar.NNN parts of at most 15 MiB"
    )
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for training and evaluation")
    evaluation = argparse.ArgumentParser(add_help=False)
    evaluation.add_argument(
        "--samples",
        type=int,
        default=EvalSettings.samples,
        help="samples per task, length and depth (default: %(default)s)",
    )
    evaluation.add_argument(
        "--eval-seed", type=int, default=EvalSettings.seed, help="seed of the evaluation's tasks (default: %(default)s)"
    )
    evaluation.add_argument(
        "--ppl-docs",
        type=int,
        default=EvalSettings.ppl_docs,
        help="held-out documents per length (default: %(default)s)",
    )
    evaluation.add_argument(
        "--lengths", type=int, nargs="+", help="evaluation lengths (default: 4096 doubling up to the run's length)"
    )
    evaluation.add_argument(
        "--eval-minutes",
        type=float,
        default=1.5,
        help="minutes kept back per evaluation under --time-limit (default: %(default)s)",
    )

    parser = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.examples.study",
        description="The small-scale study of sparse against dense training (docs/accuracy.md), one command per stage.",
    )
    stages = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    data = stages.add_parser("data", parents=[common], help="build the tokenizer and the indexed datasets")
    data.add_argument(
        "--splits", nargs="+", default=["pretrain", "continue", "heldout"], help="splits to build (default: all)"
    )
    data.add_argument("--fresh", action="store_true", help="build everything again (the tokenizer too)")
    stages.add_parser("pretrain", parents=[common, train, evaluation], help="dense pretraining at the short length")
    cont = stages.add_parser(
        "continue", parents=[common, train, evaluation], help="continued pretraining with one attention type"
    )
    cont.add_argument("--attention", required=True, choices=ATTENTION_TYPES)
    cont.add_argument("--seed", type=int, required=True, help="seed of the run (data order, new parameters)")
    cont.add_argument("--export-checkpoint", action="store_true", help="with --export: the checkpoint too")
    cont.add_argument(
        "--variant",
        metavar="NAME",
        help="name a run whose overrides change the type's settings (a budget sweep): it trains as "
        "continue/<type>-NAME-seed<N> and reports as its own row against dense",
    )
    cont.add_argument(
        "--cross",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --eval: also evaluate with the other attention types where cheap (the dense model with "
        "mtraining, a sparse model dense; default: %(default)s)",
    )
    ev = stages.add_parser("eval", parents=[common, evaluation], help="evaluate runs of the workdir")
    ev.add_argument(
        "runs", nargs="+", metavar="RUN", help="run folders of the workdir: pretrain, continue/<type>-seed<N>"
    )
    ev.add_argument(
        "--as",
        dest="attention",
        nargs="+",
        choices=ATTENTION_TYPES,
        help="attention types (default: the run's own, and the cross types of a continued run)",
    )
    ev.add_argument("--export", metavar="DIR", help="pack the evaluations into DIR")
    every = stages.add_parser(
        "all",
        parents=[common, evaluation],
        help="data, pretraining and every continued run (side by side on the GPUs), evaluated, then the report",
    )
    every.add_argument(
        "--gpus", nargs="+", metavar="N", help="CUDA devices to spread the continued runs over (default: every GPU)"
    )
    every.add_argument(
        "--runs-per-gpu",
        type=int,
        default=1,
        metavar="N",
        help="continued runs side by side on each GPU (default: 1); the study's small models leave a GPU "
        "mostly idle, so 2-3 shorten the wall time",
    )
    every.add_argument(
        "--seeds", nargs="+", type=int, default=[1, 2], help="seeds of the continued runs (default: 1 2)"
    )
    every.add_argument(
        "--attention",
        nargs="+",
        choices=ATTENTION_TYPES,
        default=list(ATTENTION_TYPES),
        help="attention types of the continued runs (default: all)",
    )
    every.add_argument(
        "--cross", action=argparse.BooleanOptionalAction, default=True, help="as the continue stage's --cross"
    )
    every.add_argument(
        "--variant",
        metavar="NAME",
        help="the continued runs as a named variant (as the continue stage's --variant), the overrides its settings",
    )
    every.add_argument("--export", metavar="DIR", help="each stage packs its outputs into DIR, as with the stages")
    every.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every stage")
    rep = stages.add_parser("report", parents=[common], help="the markdown tables and plots of every evaluated run")
    rep.add_argument("--output", help="folder of the report (default: WORKDIR/report)")
    imp = stages.add_parser("import", help="unpack archives of another machine's stages into the workdir")
    imp.add_argument("paths", nargs="+", metavar="PATH", help="archive parts, or folders holding them")
    imp.add_argument("--workdir", default="runs/study")
    return parser


def _check(parser: argparse.ArgumentParser, cli: argparse.Namespace) -> None:
    checks = [
        ("--steps", getattr(cli, "steps", None), lambda v: v is None or v >= 1, "a positive integer"),
        ("--time-limit", getattr(cli, "time_limit", 0), lambda v: v >= 0, "minutes >= 0 (0: no limit)"),
        ("--samples", getattr(cli, "samples", 1), lambda v: v >= 1, "a positive integer"),
        ("--ppl-docs", getattr(cli, "ppl_docs", 0), lambda v: v >= 0, "an integer >= 0"),
        ("--eval-minutes", getattr(cli, "eval_minutes", 0), lambda v: v >= 0, "minutes >= 0"),
        ("--seed", getattr(cli, "seed", 0), lambda v: v >= 0, "an integer >= 0"),
        (
            "--seeds",
            getattr(cli, "seeds", [0]),
            lambda v: min(v) >= 0 and len(set(v)) == len(v),
            "distinct integers >= 0",
        ),
    ]
    for flag, value, test, accepted in checks:
        if not test(value):
            parser.error(f"bad value for {flag}: {value} (accepted: {accepted})")
    if getattr(cli, "export_checkpoint", False) and not cli.export:
        parser.error("--export-checkpoint is for --export DIR")


def _eval_settings(cli) -> EvalSettings:
    return EvalSettings(cli.samples, cli.eval_seed, cli.ppl_docs, tuple(cli.lengths) if cli.lengths else None)


def _configs(cli) -> dict[str, Path]:
    folder = Path(cli.configs) if Path(cli.configs).is_dir() else configs.packaged(cli.configs)
    found = {stage: folder / f"{stage}.yaml" for stage in STAGE_CONFIGS}
    missing = [str(p) for p in found.values() if not p.is_file()]
    if missing:
        raise StageError(
            f"--configs={cli.configs!r}: no {', '.join(missing)} (accepted: a folder holding pretrain.yaml and continue.yaml)"
        )
    return found


def _data(cli, workdir: Path, splits: tuple[str, ...]) -> None:
    from .data import DataStage, StudyData

    try:
        config = StudyData.from_yaml(configs.find(cli.data_config, "--data-config"))
        print(f"[study] data ({', '.join(splits)}) under {workdir / 'data'}")
        DataStage(config, workdir).build(splits)
    except (ValueError, FileNotFoundError) as err:
        raise StageError(f"data: {err}") from None


def _import(paths, workdir: Path) -> None:
    from .transfer import import_archives

    try:
        names = import_archives([Path(p) for p in paths], workdir)
    except ValueError as err:
        raise StageError(f"--import: {err}") from None
    print(f"[study] imported {', '.join(names)} into {workdir}")


def _export(workdir: Path, out: str, name: str, paths, exclude=()) -> None:
    from .transfer import export

    parts = export(workdir, paths, Path(out), name, exclude)
    size = sum(p.stat().st_size for p in parts)
    print(f"[study] exported {size / 2**20:.1f} MiB as {len(parts)} part(s): {', '.join(str(p) for p in parts)}")


def _train_stage(
    cli, study: Study, stage: str, run: Path, overrides: list[str], cross: tuple[str, ...], deadline: Deadline, export
) -> None:
    """Trains ``run``; with ``--eval`` evaluates it with its attention and ``cross``; with
    ``--export`` calls ``export`` after training (so that a command stopped during the
    evaluation still leaves the run) and again after the evaluations, finished or failed."""
    passes = 1 + len(cross) if cli.eval else 0
    reserve = passes * cli.eval_minutes + (EXPORT_MINUTES if cli.export else 0)
    record = study.train(stage, run, overrides, cli.steps, deadline, reserve, getattr(cli, "variant", None))
    if cli.export:
        export()
    if cli.eval:
        try:
            study.evaluate(run, (record["attention"], *cross), _eval_settings(cli), deadline.before(EXPORT_MINUTES))
        finally:
            if cli.export:
                export()


def run(cli) -> None:
    workdir = Path(cli.workdir)
    deadline = Deadline(getattr(cli, "time_limit", 0))
    if cli.stage == "import":
        _import(cli.paths, workdir)
        return
    if cli.imports:
        _import(cli.imports, workdir)
    if cli.stage == "data":
        if cli.fresh:
            shutil.rmtree(workdir / "data", ignore_errors=True)
        _data(cli, workdir, tuple(cli.splits))
        return
    if cli.stage == "all":
        _all(cli, workdir)
        return
    if cli.stage == "report":
        from .report import write_report

        try:
            text, written = write_report(workdir, cli.output)
        except ValueError as err:
            raise StageError(f"report: {err}") from None
        print(text)
        print(f"[study] wrote {', '.join(map(str, written))}")
        return
    study = Study(workdir, _configs(cli), getattr(cli, "overrides", []))
    if cli.stage == "pretrain":
        study.plan("pretrain", PRETRAIN, [], cli.steps)
        _data(cli, workdir, ("pretrain", "heldout"))
        outputs = ["data/tokenizer", "data/data.json", "data/heldout.bin", "data/heldout.idx", PRETRAIN]
        _train_stage(
            cli,
            study,
            "pretrain",
            PRETRAIN,
            [],
            (),
            deadline,
            lambda: _export(workdir, cli.export, "study-pretrain", outputs),
        )
    elif cli.stage == "continue":
        if not (workdir / PRETRAIN / STAGE_FILE).is_file():
            raise StageError(
                f"no pretrained model in {workdir / PRETRAIN}: run the pretrain stage there first, or --import its "
                "archive (study-pretrain.tar.NNN)"
            )
        run_dir = continue_run(cli.attention, cli.seed, cli.variant)
        overrides = [f"attention.type={cli.attention}", f"megatron.seed={cli.seed}"]
        study.plan("continue", run_dir, overrides, cli.steps)
        _data(cli, workdir, ("continue", "heldout"))
        exclude = [] if cli.export_checkpoint else [run_dir / "checkpoints"]
        name = f"study-{'-'.join(run_dir.parts)}"
        _train_stage(
            cli,
            study,
            "continue",
            run_dir,
            overrides,
            CROSS[cli.attention] if cli.cross else (),
            deadline,
            lambda: _export(workdir, cli.export, name, [run_dir], exclude),
        )
    elif cli.stage == "eval":
        for name in cli.runs:
            run_dir = Path(name)
            if run_dir.parts[:1] not in ((PRETRAIN.name,), (CONTINUE.name,)):
                raise StageError(f"bad run {name!r} (accepted: pretrain, or continue/<type>[-<variant>]-seed<N>)")
            types = cli.attention or _default_types(workdir, run_dir)
            study.evaluate(run_dir, tuple(types), _eval_settings(cli))
            if cli.export:
                _export(
                    workdir, cli.export, f"study-eval-{'-'.join(run_dir.parts)}", [run_dir], [run_dir / "checkpoints"]
                )


def _all(cli, workdir: Path) -> None:
    """Every stage in order (``study all``): the data here, then the pretraining and the
    continued runs as their own stage commands (``schedule``): a run with no stage record
    trains and is evaluated, one with a record but no evaluation of its own attention is
    evaluated, the rest are skipped; then the report. ``--lengths`` is the continued runs'
    (the pretraining is evaluated at its own length)."""
    from .report import write_report
    from .schedule import Job, check_finished, run_jobs, visible_devices

    if cli.runs_per_gpu < 1:
        raise SystemExit(f"--runs-per-gpu={cli.runs_per_gpu} is invalid; accepted: an integer >= 1")
    check_variant(cli.variant)
    devices = visible_devices(cli.gpus)
    _data(cli, workdir, ("pretrain", "continue", "heldout"))
    shared = ["--workdir", str(workdir), "--data-config", cli.data_config, "--configs", cli.configs]
    shared += ["--samples", str(cli.samples), "--eval-seed", str(cli.eval_seed), "--ppl-docs", str(cli.ppl_docs)]
    shared += ["--export", cli.export] if cli.export else []
    # --lengths (several values) first: a one-value flag after it ends its list before the overrides.
    lengths = ["--lengths", *map(str, cli.lengths)] if cli.lengths else []
    logs = workdir / "logs"

    def job(
        run: Path, attention: str, train: tuple[str, ...], types: tuple[str, ...], seed=None, more=(), overrides=()
    ):
        name = "-".join(run.parts)
        if not (workdir / run / STAGE_FILE).is_file():
            return Job(name, (*train, *more, "--eval", "--time-limit", "0", *shared, *overrides), seed)
        if not (workdir / run / "eval" / attention / "results.json").is_file():
            return Job(f"{name}-eval", ("eval", run.as_posix(), "--as", *types, *more, *shared), seed)
        return None

    # A variant's overrides are its continued runs' settings, not the pretraining's.
    pretrain = job(PRETRAIN, "dense", ("pretrain",), ("dense",), overrides=() if cli.variant else cli.overrides)
    if pretrain is not None:
        check_finished(run_jobs([pretrain], devices[:1], logs))
    jobs = [
        job(
            continue_run(attention, seed, cli.variant),
            attention,
            (
                "continue",
                *("--attention", attention, "--seed", str(seed)),
                *(["--variant", cli.variant] if cli.variant else []),
                *([] if cli.cross else ["--no-cross"]),
            ),
            (attention, *(CROSS[attention] if cli.cross else ())),
            seed,
            lengths,
            cli.overrides,
        )
        for attention in cli.attention
        for seed in cli.seeds
    ]
    # Every device once before any twice: the first runs spread over the GPUs.
    slots = [device for _ in range(cli.runs_per_gpu) for device in devices]
    failed = run_jobs([j for j in jobs if j is not None], slots, logs)
    try:
        _, written = write_report(workdir, None)
        print(f"[study] report: {', '.join(map(str, written))}")
    except ValueError as err:
        print(f"[study] no report: {err}")
    check_finished(failed)


def _default_types(workdir: Path, run: Path) -> tuple[str, ...]:
    import json

    record = workdir / run / STAGE_FILE
    if not record.is_file():
        raise StageError(f"no finished run at {workdir / run} (no {STAGE_FILE})")
    attention = json.loads(record.read_text())["attention"]
    return (attention, *(CROSS[attention] if run.parts[0] == CONTINUE.name else ()))


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    cli = parser.parse_args(sys.argv[1:] if argv is None else argv)
    _check(parser, cli)
    if hasattr(sys.stdout, "reconfigure"):
        # Stage lines in order with the training output they summarise, also through a pipe.
        sys.stdout.reconfigure(line_buffering=True)
    start = time.monotonic()
    try:
        run(cli)
    except StageError as err:
        sys.exit(f"error: {err}")
    print(f"[study] {cli.stage} done in {(time.monotonic() - start) / 60:.1f} minutes")
