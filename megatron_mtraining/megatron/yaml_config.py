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
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import MTrainingAttentionConfig

SECTIONS = ("megatron", "attention", "cluster")
# The ``cluster:`` section: the world size of a dry run, the hierarchy check and the GPU whose
# memory the estimate is compared with. A launcher's actual world size wins in a real run.
CLUSTER_KEYS = {"nodes": int, "gpus_per_node": int, "gpu": str}


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and its source."""


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
        _megatron_parser().parse_args(argv)
    except (ConfigError, argparse.ArgumentError) as err:
        raise ConfigError(f"{where}: bad value for 'megatron.{key}': {value!r} ({err})") from None
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
        value = yaml.safe_load(raw) if raw else None
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
    for key, value in sections["megatron"].items():
        _key_argv(str(key), value, sources[f"megatron.{key}"])
    _check_cluster(sections["cluster"], sources)
    try:
        attention = MTrainingAttentionConfig.from_dict(sections["attention"], where="attention")
    except (ValueError, TypeError) as err:
        culprits = sorted({sources[k] for k in sources if k.startswith("attention.")} or {str(path)})
        raise ConfigError(f"{' / '.join(culprits)}: {err}") from None
    return RunConfig(sections["megatron"], attention, path, sources, sections["cluster"])


def _read_sections(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    """The sections of ``path`` over those of its ``base:`` file (a path relative to it), and
    the file that set each top-level key. Attention sections merge one level deep, so a stage
    file can change ``attention.msa.topk`` and keep the base's other MSA fields."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: 'base' includes form a cycle ({cycle})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        where = f"{chain[-1]}: base file" if chain else str(path)
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
