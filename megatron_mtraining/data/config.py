"""The data-mix config (YAML), validated on load with errors that name the field and the value.

```yaml
tokenizer: path/to/local/hf_tokenizer     # AutoTokenizer.from_pretrained(path)
output_prefix: data/mix                   # writes data/mix.bin/.idx (+ data/mix.sources/, data/mix.summary.json)
seq_length: 4096                          # training length (for the summary; GPTDataset packs, see indexed.py)
seed: 1234
total_tokens: null                        # with weights: the mix's size (sources sub- or upsampled to it)
valid_fraction: 0.0                       # share of documents held out as data/mix_valid (never trained on)
min_tokens: 0                             # default length filter of every source (tokens, EOD excluded)
max_tokens: null
sources:
  - name: books_long                      # a source = files + a length bucket + a weight or repeat
    paths: [data/books/*.jsonl]           # jsonl (one JSON object a line) or parquet; globs allowed
    text_key: text
    min_tokens: 65536
    weight: 0.6                           # share of the mix's tokens (all sources or none)
  - name: short
    paths: [data/short.parquet]
    max_tokens: 8192
    weight: 0.4
```

``valid_fraction`` holds out a share of the documents, chosen by a seeded hash of each
document's text (so a text is held out in every source that reads it, and in every run
with the same seed), and writes them once each, in a seeded order, as
``<output_prefix>_valid.bin/.idx``: train on the mix with ``megatron.train_data_path`` and
evaluate on it with ``megatron.valid_data_path``. Megatron's ``split`` would instead hold out
whole documents of the mix, copies of which the mix repeats elsewhere for any source it
upsamples.

Instead of weights, a source may give ``repeat`` (an upsampling factor, 2.5 = every document
twice and a seeded half of them a third time). Two sources over the same files with different
``min_tokens`` / ``max_tokens`` are length buckets (ProLong's long / short split). Relative paths
are relative to the working directory, as the CLI's flags are.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import yaml

INPUT_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def _fail(field_name: str, value, accepted: str) -> ValueError:
    return ValueError(f"{field_name}={value!r} is invalid; {accepted}")


def _int(raw: dict, key: str, where: str, default, minimum: int):
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(f"{where}{key}", value, f"expected an integer >= {minimum}")
    return value


def _number(raw: dict, key: str, where: str, minimum_exclusive: float = 0.0):
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > minimum_exclusive:
        raise _fail(f"{where}{key}", value, f"expected a number > {minimum_exclusive:g}")
    return float(value)


def _check_keys(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{where}unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class SourceConfig:
    """One source of the mix: its files, text field, length bucket and weight or repeat factor."""

    name: str
    paths: tuple[Path, ...]
    text_key: str = "text"
    min_tokens: int = 0
    max_tokens: int | None = None
    weight: float | None = None
    repeat: float | None = None


@dataclass(frozen=True)
class MixConfig:
    """The whole data-preparation job; :meth:`from_dict` validates every field."""

    tokenizer: Path
    output_prefix: Path
    sources: tuple[SourceConfig, ...]
    seq_length: int
    seed: int = 1234
    total_tokens: int | None = None
    add_special_tokens: bool = True
    batch_size: int = 64
    valid_fraction: float = 0.0

    _FIELDS = {
        "tokenizer",
        "output_prefix",
        "sources",
        "seq_length",
        "seed",
        "total_tokens",
        "min_tokens",
        "max_tokens",
        "add_special_tokens",
        "batch_size",
        "valid_fraction",
    }
    _SOURCE_FIELDS = {"name", "paths", "text_key", "min_tokens", "max_tokens", "weight", "repeat"}

    @property
    def weighted(self) -> bool:
        return self.sources[0].weight is not None

    @property
    def valid_prefix(self) -> Path:
        """Where the held-out documents go (with ``valid_fraction``)."""
        return self.output_prefix.with_name(self.output_prefix.name + "_valid")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> MixConfig:
        """Loads ``path``; ``overrides`` (e.g. from CLI flags) replace top-level fields when not None."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config={str(path)!r} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config={str(path)!r}: expected a mapping of fields at the top level")
        raw |= {k: v for k, v in overrides.items() if v is not None}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> MixConfig:
        _check_keys(raw, cls._FIELDS, "")
        for key in ("tokenizer", "output_prefix"):
            if not isinstance(raw.get(key), str | Path) or not str(raw[key]):
                raise _fail(key, raw.get(key), "expected a path")
        if not (Path(raw["tokenizer"]).is_dir()):
            raise _fail("tokenizer", str(raw["tokenizer"]), "expected a local Hugging Face tokenizer directory")
        seq_length = _int(raw, "seq_length", "", None, 1)
        if seq_length is None:
            raise _fail("seq_length", None, "expected the training sequence length (an integer >= 1)")
        min_tokens = _int(raw, "min_tokens", "", 0, 0)
        max_tokens = _int(raw, "max_tokens", "", None, 1)
        if not isinstance(raw.get("add_special_tokens", True), bool):
            raise _fail("add_special_tokens", raw["add_special_tokens"], "expected true or false")

        sources_raw = raw.get("sources")
        if not isinstance(sources_raw, list) or not sources_raw:
            raise _fail("sources", sources_raw, "expected a non-empty list of sources")
        sources = tuple(cls._source(s, i, min_tokens, max_tokens) for i, s in enumerate(sources_raw))
        names = [s.name for s in sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise _fail("sources[].name", dup[0], "source names must be unique")
        weighted = [s.weight is not None for s in sources]
        if any(weighted) and not all(weighted):
            missing = names[weighted.index(False)]
            raise ValueError(f"sources[{missing}].weight is missing; give every source a weight, or none (repeat)")
        total_tokens = _int(raw, "total_tokens", "", None, 1)
        if total_tokens is not None and not all(weighted):
            raise _fail("total_tokens", total_tokens, "needs a weight on every source (it sizes the weighted mix)")
        valid_fraction = raw.get("valid_fraction", 0.0)
        if (
            isinstance(valid_fraction, bool)
            or not isinstance(valid_fraction, int | float)
            or not 0 <= valid_fraction < 1
        ):
            raise _fail(
                "valid_fraction", valid_fraction, "expected a number in [0, 1): the share of documents held out"
            )
        return cls(
            tokenizer=Path(raw["tokenizer"]),
            output_prefix=Path(raw["output_prefix"]),
            sources=sources,
            seq_length=seq_length,
            seed=_int(raw, "seed", "", 1234, 0),
            total_tokens=total_tokens,
            add_special_tokens=raw.get("add_special_tokens", True),
            batch_size=_int(raw, "batch_size", "", 64, 1),
            valid_fraction=float(valid_fraction),
        )

    @classmethod
    def _source(cls, raw, i: int, min_tokens: int, max_tokens: int | None) -> SourceConfig:
        if not isinstance(raw, dict):
            raise _fail(f"sources[{i}]", raw, "expected a mapping with name and paths")
        name = raw.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise _fail(f"sources[{i}].name", name, "expected a non-empty name without '/'")
        where = f"sources[{name}]."
        _check_keys(raw, cls._SOURCE_FIELDS, where)
        patterns = raw.get("paths")
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise _fail(f"{where}paths", patterns, "expected a path or a list of paths (globs allowed)")
        paths = []
        for pattern in patterns:
            matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            if not matched or not Path(matched[0]).is_file():
                raise _fail(f"{where}paths", pattern, "no such file")
            for p in map(Path, matched):
                if p.suffix not in INPUT_SUFFIXES:
                    raise _fail(f"{where}paths", str(p), f"accepted suffixes: {', '.join(INPUT_SUFFIXES)}")
                paths.append(p)
        text_key = raw.get("text_key", "text")
        if not isinstance(text_key, str) or not text_key:
            raise _fail(f"{where}text_key", text_key, "expected a field name")
        lo = _int(raw, "min_tokens", where, min_tokens, 0)
        hi = _int(raw, "max_tokens", where, max_tokens, 1)
        if hi is not None and hi < lo:
            raise _fail(f"{where}max_tokens", hi, f"must be >= min_tokens ({lo})")
        weight, repeat = _number(raw, "weight", where), _number(raw, "repeat", where)
        if weight is not None and repeat is not None:
            raise _fail(f"{where}repeat", repeat, "give weight or repeat, not both")
        return SourceConfig(name, tuple(paths), text_key, lo, hi, weight, repeat)
