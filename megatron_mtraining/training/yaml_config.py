"""The training entry point's YAML config: Megatron arguments plus the plugin's attention.

A config file has two sections and an optional third::

    megatron:            # Megatron-LM arguments by their argparse dest (num_layers, lr, save, ...)
      num_layers: 2
      mock_data: true
    attention:           # MTrainingAttentionConfig fields
      type: mtraining
      mtraining: {vertical_topp: 0.9}
    cluster:             # optional: the machines a recipe is written for
      nodes: 4
      gpus_per_node: 8
      gpu: A100-40GB

A file may start with ``base: other.yaml`` (relative to it): its sections go over the base's,
key by key (attention pattern sections one level deeper), so a model's recipes share one
base file. The optional ``cluster:`` section names the machines a recipe is written for;
``--dry-run`` validates for that world size and compares the memory estimate with that GPU.

Command-line overrides are ``section.key=value`` (``megatron.train_iters=5``,
``attention.mtraining.vertical_topp=0.9``); values are parsed as YAML scalars. Every Megatron
key is checked against Megatron's own argument parser (name, type, choices, number of values)
and every attention key against the dataclass, before anything starts; errors name the key
and the file (or the override). The Megatron section is turned into the argv that Megatron's
``parse_args`` reads, so Megatron's defaults and ``validate_args`` apply unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import linecache
import math
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..megatron.config import MTrainingAttentionConfig

SECTIONS = ("megatron", "attention", "cluster")
# The ``cluster:`` section: the world size of a dry run, the hierarchy check, the GPU whose
# memory the estimate is compared with, and the network across nodes that the capacity planner
# assumes (``python -m megatron_mtraining.plan``). A launcher's actual world size wins in a real run.
CLUSTER_KEYS = {"nodes": int, "gpus_per_node": int, "gpu": str, "network": str}
# Megatron arguments whose parser accepts any number but whose values out of range fail only
# later (a division in the model's init, a dropout or seed torch refuses, a loop that never
# runs, NaN from the first step) or in an assertion that names nothing: dest -> (test, what is
# accepted).
VALUE_RANGES = {
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "seq_length",
            "max_position_embeddings",
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "train_samples",
            "lr_decay_iters",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "save_interval",
            "log_interval",
            "eval_interval",
            "exit_interval",
            "rotary_base",
        ),
        (lambda v: v >= 1, "a positive integer"),
    ),
    **dict.fromkeys(("lr_warmup_iters", "eval_iters", "seed"), (lambda v: v >= 0, "an integer >= 0")),
    **dict.fromkeys(
        ("lr", "min_lr", "weight_decay", "clip_grad", "init_method_std"),
        (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ),
    **dict.fromkeys(("hidden_dropout", "attention_dropout"), (lambda v: 0 <= v <= 1, "a probability in [0, 1]")),
    "rotary_percent": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
}
# Megatron arguments naming indexed datasets: path prefixes of .bin / .idx pairs, optionally
# preceded by their blend weights.
DATA_PATHS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and its source."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key repeated in one mapping is an error: PyYAML keeps
    the last value, so the first would be dropped without a word."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str, name: str):
    # PyYAML's error marks name the stream.
    stream = io.StringIO(text)
    stream.name = name
    return yaml.load(stream, Loader=_UniqueKeyLoader)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


@functools.cache
def _megatron_parser() -> _RaisingParser:
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(_RaisingParser(allow_abbrev=False, exit_on_error=False, add_help=False))


@functools.cache
def _actions_by_dest() -> dict[str, list[argparse.Action]]:
    actions: dict[str, list[argparse.Action]] = {}
    for action in _megatron_parser()._actions:
        if action.option_strings:
            actions.setdefault(action.dest, []).append(action)
    return actions


def _takes_no_value(action: argparse.Action) -> bool:
    return action.nargs == 0


def _key_argv(key: str, value, where: str) -> list[str]:
    """The Megatron command-line tokens for one ``megatron:`` key, checked by Megatron's parser."""
    actions = _actions_by_dest().get(key)
    if actions is None:
        raise ConfigError(
            f"{where}: unknown Megatron argument 'megatron.{key}' (use the argparse dest, e.g. num_layers)"
        )
    flags = [a for a in actions if _takes_no_value(a)]
    valued = [a for a in actions if not _takes_no_value(a)]
    default = actions[0].default
    if value is None or (isinstance(value, bool) and flags):
        match = [a for a in flags if a.const == value]
        if match:
            return [match[0].option_strings[0]]
        if value == default:
            return []
        accepted = ", ".join(repr(a.const) for a in flags) or "a value"
        raise ConfigError(
            f"{where}: bad value for 'megatron.{key}': {value!r} (accepted: {accepted}; default {default!r})"
        )
    if not valued:
        raise ConfigError(f"{where}: 'megatron.{key}' is a flag: give true or false, not {value!r}")
    action = valued[0]
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs in (None, "?"):
        raise ConfigError(f"{where}: 'megatron.{key}' takes one value, not the list {value!r}")
    if isinstance(value, dict):
        raise ConfigError(f"{where}: 'megatron.{key}' takes a value, not the mapping {value!r}")
    argv = [action.option_strings[0], *(_scalar(v) for v in values)]
    try:
        parsed = getattr(_megatron_parser().parse_args(argv), key)
    except (ConfigError, argparse.ArgumentError) as err:
        raise ConfigError(f"{where}: bad value for 'megatron.{key}': {value!r} ({err})") from None
    test, accepted = VALUE_RANGES.get(key, (None, None))
    if test is not None and not test(parsed):
        raise ConfigError(f"{where}: bad value for 'megatron.{key}': {value!r} (accepted: {accepted})")
    return argv


def _scalar(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclass
class RunConfig:
    """A validated config: the Megatron arguments (dest -> value), the attention config, and
    where each key came from (the file, or the override that set it)."""

    megatron: dict
    attention: MTrainingAttentionConfig
    path: Path
    sources: dict[str, str]
    cluster: dict = dataclasses.field(default_factory=dict)

    def megatron_argv(self) -> list[str]:
        argv = []
        for key, value in self.megatron.items():
            argv += _key_argv(key, value, self.sources.get(f"megatron.{key}", str(self.path)))
        return argv

    def missing_paths(self) -> list[str]:
        """What the run would read from this machine's disk and cannot find: the indexed
        datasets (without ``mock_data``) and the checkpoint directory to load. A ``load``
        directory that does not exist yet is fine when it is also ``save``: a run that saves
        and resumes in one place starts from scratch the first time."""
        missing = []
        m = self.megatron
        if not _megatron_value(m, "mock_data"):
            for key in DATA_PATHS:
                for prefix in _megatron_value(m, key) or ():
                    if _is_number(prefix) or all(os.path.isfile(f"{prefix}{ext}") for ext in (".bin", ".idx")):
                        continue
                    missing.append(
                        f"{self._source(key)}: 'megatron.{key}' names {prefix!r}, but {prefix}.bin / {prefix}.idx "
                        "do not exist (accepted: the prefix of an indexed dataset, as scripts/prepare_data.py "
                        "writes it, or megatron.mock_data=true)"
                    )
        load, save = _megatron_value(m, "load"), _megatron_value(m, "save")
        if load and not os.path.exists(load) and not (save and Path(load).resolve() == Path(save).resolve()):
            missing.append(
                f"{self._source('load')}: 'megatron.load' names {load!r}, which does not exist (accepted: an existing "
                f"checkpoint directory; the directory of megatron.save (now {save!r}), which the first run of a "
                "job that saves and resumes there creates; or null to start from a random initialisation)"
            )
        return missing

    def value(self, key: str):
        """The ``megatron:`` argument ``key`` as Megatron parses it, or Megatron's default."""
        return _megatron_value(self.megatron, key)

    def empty_splits(self) -> list[str]:
        """The splits of ``data_path`` a run would read that get no document of a dataset on
        this machine (Megatron's dataset builder then never returns): the training split, and
        with ``eval_iters`` the validation and test splits."""
        from megatron.core.datasets.blended_megatron_dataset_config import (
            convert_split_vector_to_split_matrix,
            parse_and_normalize_split,
        )
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        m = self.megatron
        split, prefixes = _megatron_value(m, "split"), _megatron_value(m, "data_path")
        if _megatron_value(m, "mock_data") or not prefixes or split is None:
            return []
        evaluated = bool(_megatron_value(m, "eval_iters"))
        read = {"training": True, "validation": evaluated, "test": evaluated}
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        empty = []
        for prefix in prefixes:
            if _is_number(prefix) or not os.path.isfile(f"{prefix}.idx"):
                continue
            n = len(IndexedDataset(prefix, mmap=True).sequence_lengths)
            for (name, wanted), bounds in zip(read.items(), matrix, strict=True):
                # Megatron's builder rounds each split's bounds to documents so.
                if wanted and bounds is not None and round(bounds[0] * n) == round(bounds[1] * n):
                    empty.append(
                        f"{self._source('split')}: 'megatron.split' {split!r} gives the {name} split no document of "
                        f"{prefix!r} ({n} documents), and Megatron's dataset builder would never return (accepted: "
                        f"a {name} share of at least one document, or the held-out documents as "
                        "megatron.valid_data_path with split null)"
                    )
        return empty

    def _source(self, key: str) -> str:
        return self.sources.get(f"megatron.{key}", str(self.path))

    def attention_dict(self) -> dict:
        """The attention config as plain data (stored with Megatron's args in checkpoints)."""
        return dataclasses.asdict(self.attention)


def parse_override(text: str) -> tuple[list[str], object]:
    """``section.key[.sub]=value`` -> (key path, value parsed as a YAML scalar)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected section.key=value (e.g. megatron.train_iters=5)")
    path = key.split(".")
    if len(path) < 2 or path[0] not in SECTIONS or not all(path):
        raise ConfigError(f"override {text!r}: the key must start with one of the sections {', '.join(SECTIONS)}")
    try:
        value = _load_yaml(raw, f"override {text!r}") if raw else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({err})") from None
    return path, value


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Reads, overrides and validates a config; raises :class:`ConfigError` naming the key and its source."""
    sections, sources = _read_sections(Path(path), ())
    path = Path(path)
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] in ("megatron", "cluster") and len(keys) != 2:
            raise ConfigError(f"override {text!r}: the {keys[0]} section is flat ({keys[0]}.<key>=value)")
        node = sections[keys[0]]
        for key in keys[1:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{key}' is not a mapping")
            node = child
        node[keys[-1]] = value
        sources[".".join(keys[:2])] = f"override {text!r}"
    if not any(sections.values()):
        raise ConfigError(f"{path}: the config is empty (expected the sections {', '.join(SECTIONS)})")
    megatron = sections["megatron"]
    for key, value in megatron.items():
        _key_argv(str(key), value, sources[f"megatron.{key}"])
    _check_cluster(sections["cluster"], sources)
    attention_keys = [k for k in sources if k.startswith("attention.")]
    try:
        attention = MTrainingAttentionConfig.from_dict(sections["attention"], where="attention")
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{culprits(sources, attention_keys, path)}: {err}") from None
    _check_heads_and_data(megatron, sources, path)
    seq_length = _megatron_value(megatron, "seq_length")
    if seq_length is not None:
        try:
            attention.validate_for_sequence(seq_length, _megatron_value(megatron, "context_parallel_size"))
        except ValueError as err:
            keys = [*attention_keys, "megatron.seq_length", "megatron.context_parallel_size"]
            raise ConfigError(f"{culprits(sources, keys, path)}: {err}") from None
    return RunConfig(megatron, attention, path, sources, sections["cluster"])


def _check_heads_and_data(megatron: dict, sources: dict[str, str], path: Path) -> None:
    """What Megatron's validate_args lets through and the model or the data loader trips on."""
    value = functools.partial(_megatron_value, megatron)
    heads, groups = value("num_attention_heads"), value("num_query_groups")
    if value("group_query_attention") and heads and heads % groups:
        keys = ["megatron.num_attention_heads", "megatron.num_query_groups"]
        raise ConfigError(
            f"{culprits(sources, keys, path)}: bad value for 'megatron.num_query_groups': {groups} (accepted: a "
            f"divisor of megatron.num_attention_heads ({heads}): each K/V head serves as many query heads)"
        )
    if not value("mock_data") and not any(
        value(k) for k in (*DATA_PATHS, "data_args_path", "per_split_data_args_path")
    ):
        raise ConfigError(
            f"{culprits(sources, ['megatron.mock_data'], path)}: no training data: 'megatron.mock_data' is false and "
            "no data path is set (accepted: megatron.data_path=[prefix, ...] of indexed datasets, or mock_data: true)"
        )
    _check_validation_data(megatron, sources, path)


def _check_validation_data(megatron: dict, sources: dict[str, str], path: Path) -> None:
    """The held-out data an evaluation reads: Megatron splits ``data_path`` by ``split``,
    or takes ``valid_data_path`` whole, never both; with no validation data it evaluates
    anyway and the forward step finds no batch."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    value = functools.partial(_megatron_value, megatron)
    per_split = any(value(k) for k in ("train_data_path", "valid_data_path", "test_data_path"))
    if per_split and value("split") is not None:
        keys = ["megatron.split", "megatron.train_data_path", "megatron.valid_data_path", "megatron.test_data_path"]
        raise ConfigError(
            f"{culprits(sources, keys, path)}: bad value for 'megatron.split': {value('split')!r} (accepted: null "
            "with megatron.train_data_path / valid_data_path / test_data_path, which Megatron takes whole; split "
            "divides megatron.data_path)"
        )
    if value("mock_data") or not (value("eval_iters") and value("eval_interval")):
        return
    evaluate = ["megatron.eval_iters", "megatron.eval_interval"]
    if per_split and not value("valid_data_path"):
        raise ConfigError(
            f"{culprits(sources, [*evaluate, 'megatron.valid_data_path'], path)}: 'megatron.eval_iters' is "
            f"{value('eval_iters')} but 'megatron.valid_data_path' is not set (accepted: the held-out indexed "
            "datasets to evaluate on, e.g. the _valid output of scripts/prepare_data.py with valid_fraction, or "
            "megatron.eval_iters=0)"
        )
    split = value("split")
    if value("data_path") and split is not None and parse_and_normalize_split(split)[1] == 0:
        raise ConfigError(
            f"{culprits(sources, [*evaluate, 'megatron.split'], path)}: bad value for 'megatron.split': {split!r}: "
            f"'megatron.eval_iters' is {value('eval_iters')} and the split holds out no validation documents "
            "(accepted: a positive second weight, e.g. '998,2,0', or megatron.eval_iters=0)"
        )


def culprits(sources: dict[str, str], keys: list[str], path: Path) -> str:
    """The files and overrides that set ``keys``, for an error that involves them together."""
    return " / ".join(sorted({sources[k] for k in keys if k in sources} or {str(path)}))


def _megatron_value(megatron: dict, key: str):
    """A (validated) ``megatron:`` key as Megatron parses it, or Megatron's default."""
    argv = _key_argv(key, megatron[key], "") if key in megatron else []
    return getattr(_megatron_parser().parse_args(argv), key)


def _read_sections(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    """The sections of ``path`` over those of its ``base:`` file (a path relative to it), and
    the file that set each top-level key. Attention sections merge one level deep, so a stage
    file can change ``attention.msa.topk`` and keep the base's other MSA fields."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: 'base' includes form a cycle ({cycle})")
    where = f"{chain[-1]}: base file" if chain else str(path)
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{where}: cannot read the config {path}: byte {err.object[err.start]:#04x} at offset {err.start} is "
            "not UTF-8 (accepted: a UTF-8 text file)"
        ) from None
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{where}: cannot read the config {path} ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with the sections {', '.join(SECTIONS)}")
    for section in data:
        if section not in (*SECTIONS, "base"):
            raise ConfigError(f"{path}: unknown section '{section}' (accepted: base, {', '.join(SECTIONS)})")
    sections, sources = {s: {} for s in SECTIONS}, {}
    base = data.get("base")
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file path relative to this file, not {base!r}")
        sections, sources = _read_sections(path.parent / base, (*chain, path.resolve()))
    for section in SECTIONS:
        value = data.get(section) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping, not {type(value).__name__}")
        for key, item in value.items():
            inherited = sections[section].get(key)
            if section == "attention" and isinstance(item, dict) and isinstance(inherited, dict):
                item = {**inherited, **item}
            sections[section][key] = item
            sources[f"{section}.{key}"] = str(path)
    return sections, sources


def _check_cluster(cluster: dict, sources: dict[str, str]) -> None:
    from ..planning.hardware import network_names
    from .memory import GPU_MEMORY_GIB

    for key, value in cluster.items():
        where = sources[f"cluster.{key}"]
        kind = CLUSTER_KEYS.get(key)
        if kind is None:
            raise ConfigError(f"{where}: unknown key 'cluster.{key}' (accepted: {', '.join(CLUSTER_KEYS)})")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: bad value for 'cluster.{key}': {value!r} (a positive integer)")
        if key == "gpu" and value not in GPU_MEMORY_GIB:
            raise ConfigError(
                f"{where}: bad value for 'cluster.gpu': {value!r} (accepted: {', '.join(GPU_MEMORY_GIB)})"
            )
        if key == "network" and value not in network_names():
            raise ConfigError(
                f"{where}: bad value for 'cluster.network': {value!r} (accepted: {', '.join(network_names())})"
            )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def explain_rejection(err: ConfigError, run_config: RunConfig) -> ConfigError:
    """``err``, completed when it is a rejection by an ``assert`` in Megatron's
    ``validate_args``: the values of the arguments the assertion reads and where the config
    set them, and, for the many bare ones, the asserted condition."""
    cause = err.__cause__
    if not isinstance(cause, AssertionError):
        return err
    frame, lineno = list(traceback.walk_tb(cause.__traceback__))[-1]
    end = traceback.extract_tb(cause.__traceback__)[-1].end_lineno or lineno
    filename = frame.f_code.co_filename
    source = " ".join(linecache.getline(filename, n).strip() for n in range(lineno, end + 1))
    args = frame.f_locals.get("args")
    details = []
    for name in dict.fromkeys(re.findall(r"\bargs\.(\w+)", source)):
        origin = run_config.sources.get(f"megatron.{name}")
        details.append(f"megatron.{name}={getattr(args, name, None)!r}" + (f" from {origin}" if origin else ""))
    details.append(f"{Path(filename).name} line {lineno}")
    condition = "" if str(cause) else f"{source.removeprefix('assert').strip()} must hold "
    return ConfigError(f"{err}{condition}({'; '.join(details)})")
