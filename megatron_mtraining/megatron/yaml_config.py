"""The training entry point's YAML config: Megatron arguments plus the plugin's attention.

A config file has two sections::

    megatron:            # Megatron-LM arguments by their argparse dest (num_layers, lr, save, ...)
      num_layers: 2
      mock_data: true
    attention:           # MTrainingAttentionConfig fields
      type: mtraining
      mtraining: {vertical_topp: 0.9}

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

SECTIONS = ("megatron", "attention")


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
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the config ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with the sections {', '.join(SECTIONS)}")
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{section}' (accepted: {', '.join(SECTIONS)})")
    sections = {}
    for section in SECTIONS:
        value = data.get(section) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping, not {type(value).__name__}")
        sections[section] = dict(value)
    sources = {f"{s}.{k}": str(path) for s in SECTIONS for k in sections[s]}
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] == "megatron" and len(keys) != 2:
            raise ConfigError(f"override {text!r}: Megatron arguments are flat (megatron.<dest>=value)")
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
    try:
        attention = MTrainingAttentionConfig.from_dict(sections["attention"], where="attention")
    except (ValueError, TypeError) as err:
        culprits = sorted({sources[k] for k in sources if k.startswith("attention.")} or {str(path)})
        raise ConfigError(f"{' / '.join(culprits)}: {err}") from None
    return RunConfig(sections["megatron"], attention, path, sources)
