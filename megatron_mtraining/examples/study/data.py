"""The study's data stage: real text that ships with the machine and generated long documents,
a byte-level BPE, and Megatron indexed datasets for each training stage and the held-out loss.

The recipe is a YAML (``configs/data/study.yaml``, fields in :class:`StudyData`). Everything
is deterministic from its ``seed``, the interpreter's standard library and the versions of
the installed packages it names:

* **real text** (``data.local_text``): the held-out documents are ``real_text.heldout_docs``
  documents of the standard library (and ``pydoc``) of at least ``heldout_min_chars``
  characters, drawn with the seed; the other standard-library documents and those of the
  installed ``real_text.packages`` (up to ``max_chars`` of them, in a seeded order) are the
  training text;
* **generated sources**, per split: ``tasks`` documents are the evaluation's task samples
  (``evaluation.tasks``: needles, multi-key, multi-value, variable tracking, common words,
  in turn) written with bytes as tokens and decoded, so their length is in characters and
  their generator streams (seeds from 10^9 up) are never the evaluation's; ``synthetic``
  documents are ``data.synthetic_docs``' passkey, copy and filler documents. Lengths are
  log-uniform in the source's ``chars`` range, needle depths uniform;
* the **tokenizer** is trained once on the training text and the first ``sample_docs``
  documents of every generated source of every split, so it is the same whichever splits a
  call builds (a later stage reuses the one it finds);
* each **split** is a ``data.prepare`` mix (``MixConfig``: sources weighted by tokens, length
  buckets, shuffled) at ``data/<split>``; ``heldout`` holds the held-out real text, once each.

``data/data.json`` records the recipe, the interpreter, the real text (each package's
distribution and version, documents, characters, tokens), and each split's documents, tokens,
per-source repeat factors and content hash. A split whose recipe (package versions included)
and tokenizer are the recorded ones and whose files exist is reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from ...data.local_text import Package, find_package, installed_packages, package_documents, python_documents
from ...data.synthetic_docs import KINDS, make_document
from ...evaluation.tasks import TASKS, Codec, make_sample

DATA = Path("data")
SOURCES = DATA / "sources"
TOKENIZER = DATA / "tokenizer"
MANIFEST = DATA / "data.json"
HELDOUT = "heldout"
TRAIN_SPLITS = ("pretrain", "continue")
SOURCE_KINDS = ("text", "tasks", "synthetic")
# Generated documents draw from streams at and above this seed; the evaluation's tasks use
# the --seed of the evaluation (0 by default), so no training document is an evaluation sample.
STREAM_BASE = 10**9
# Bytes as tokens: task samples written before (and independently of) the tokenizer.
BYTES = Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode())


def _fail(name: str, value, accepted: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")


def _int(raw: dict, key: str, where: str, default, minimum: int) -> int | None:
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(f"{where}{key}", value, f"an integer >= {minimum}")
    return value


def _keys(raw, allowed: tuple[str, ...], where: str) -> dict:
    if not isinstance(raw, dict):
        raise _fail(where.rstrip("."), raw, f"a mapping with the fields {', '.join(allowed)}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise _fail(f"{where}{unknown[0]}", raw[unknown[0]], f"one of the fields {', '.join(allowed)}")
    return raw


@dataclass(frozen=True)
class Source:
    """One source of a split's mix: ``text`` (the training text, in a token-length bucket) or
    ``docs`` generated ``tasks`` / ``synthetic`` documents of ``chars`` characters."""

    name: str
    kind: str
    weight: float
    docs: int = 0
    chars: tuple[int, int] = (0, 0)
    min_tokens: int = 0
    max_tokens: int | None = None

    FIELDS = ("name", "kind", "weight", "docs", "chars", "min_tokens", "max_tokens")

    @classmethod
    def from_dict(cls, raw, where: str) -> Source:
        raw = _keys(raw, cls.FIELDS, where)
        name = raw.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            raise _fail(f"{where}name", name, "a name of letters, digits and underscores")
        where = f"{where[: where.rindex('[')]}[{name}]."
        kind = raw.get("kind")
        if kind not in SOURCE_KINDS:
            raise _fail(f"{where}kind", kind, " | ".join(SOURCE_KINDS))
        weight = raw.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise _fail(f"{where}weight", weight, "a number > 0 (the source's share of the split's tokens)")
        min_tokens = _int(raw, "min_tokens", where, 0, 0)
        max_tokens = _int(raw, "max_tokens", where, None, 1)
        if max_tokens is not None and max_tokens < min_tokens:
            raise _fail(f"{where}max_tokens", max_tokens, f"an integer >= min_tokens ({min_tokens})")
        if kind == "text":
            for key in ("docs", "chars"):
                if key in raw:
                    raise _fail(f"{where}{key}", raw[key], "nothing for kind 'text' (it is the training text)")
            return cls(name, kind, float(weight), min_tokens=min_tokens, max_tokens=max_tokens)
        docs = _int(raw, "docs", where, None, 1)
        if docs is None:
            raise _fail(f"{where}docs", None, f"the number of {kind} documents to generate (an integer >= 1)")
        chars = raw.get("chars")
        if (
            not isinstance(chars, list | tuple)
            or len(chars) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in chars)
            or not 1 <= chars[0] <= chars[1]
        ):
            raise _fail(f"{where}chars", chars, "[shortest, longest] in characters, 1 <= shortest <= longest")
        source = cls(name, kind, float(weight), docs, (chars[0], chars[1]), min_tokens, max_tokens)
        if kind == "tasks":
            for task in TASKS:
                try:
                    make_sample(task, chars[0], 0.5, STREAM_BASE, 0, BYTES)
                except ValueError as err:
                    raise _fail(f"{where}chars", chars, f"a shortest length that holds every task ({err})") from None
        return source


@dataclass(frozen=True)
class Split:
    name: str
    seq_length: int
    sources: tuple[Source, ...]

    @classmethod
    def from_dict(cls, name: str, raw) -> Split:
        where = f"splits.{name}."
        raw = _keys(raw, ("seq_length", "sources"), where)
        seq_length = _int(raw, "seq_length", where, None, 1)
        if seq_length is None:
            raise _fail(f"{where}seq_length", None, "the stage's training length in tokens")
        listed = raw.get("sources")
        if not isinstance(listed, list) or not listed:
            raise _fail(f"{where}sources", listed, "a non-empty list of sources")
        sources = tuple(Source.from_dict(s, f"{where}sources[{i}].") for i, s in enumerate(listed))
        names = [s.name for s in sources]
        for n in names:
            if names.count(n) > 1:
                raise _fail(f"{where}sources[].name", n, "names unique within the split")
        return cls(name, seq_length, sources)


def _packages(raw, where: str) -> tuple[str, ...]:
    """Import names, unique, none inside another (its documents would train twice)."""
    accepted = "a list of import names of installed packages (torch, megatron.core), none inside another"
    if not isinstance(raw, list) or not all(
        isinstance(n, str) and all(map(str.isidentifier, n.split("."))) for n in raw
    ):
        raise _fail(where, raw, accepted)
    for name in raw:
        if sum(name == other or name.startswith(other + ".") for other in raw) > 1:
            raise _fail(where, name, accepted)
    return tuple(raw)


@dataclass(frozen=True)
class StudyData:
    """The data recipe: ``seed``; ``tokenizer`` (``vocab_size``, ``sample_docs``);
    ``real_text`` (``packages``, ``heldout_docs``, ``heldout_min_chars``, ``max_chars``);
    ``splits`` (one per training stage, each a ``seq_length`` and its ``sources``)."""

    seed: int
    vocab_size: int
    sample_docs: int
    heldout_docs: int
    heldout_min_chars: int
    max_chars: int | None
    packages: tuple[str, ...] = ()
    splits: dict[str, Split] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path) -> StudyData:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data-config={str(path)!r} does not exist")
        try:
            return cls.from_dict(yaml.safe_load(path.read_text()) or {})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_dict(cls, raw) -> StudyData:
        raw = _keys(raw, ("seed", "tokenizer", "real_text", "splits"), "")
        tokenizer = _keys(raw.get("tokenizer") or {}, ("vocab_size", "sample_docs"), "tokenizer.")
        text = _keys(
            raw.get("real_text") or {}, ("packages", "heldout_docs", "heldout_min_chars", "max_chars"), "real_text."
        )
        splits = raw.get("splits")
        if not isinstance(splits, dict) or sorted(splits) != sorted(TRAIN_SPLITS):
            raise _fail(
                "splits", sorted(splits) if isinstance(splits, dict) else splits, f"{' and '.join(TRAIN_SPLITS)}"
            )
        return cls(
            seed=_int(raw, "seed", "", 1234, 0),
            vocab_size=_int(tokenizer, "vocab_size", "tokenizer.", 8192, 257),
            sample_docs=_int(tokenizer, "sample_docs", "tokenizer.", 200, 0),
            heldout_docs=_int(text, "heldout_docs", "real_text.", 8, 1),
            heldout_min_chars=_int(text, "heldout_min_chars", "real_text.", 80000, 1),
            max_chars=_int(text, "max_chars", "real_text.", None, 1),
            packages=_packages(text.get("packages", []), "real_text.packages"),
            splits={name: Split.from_dict(name, splits[name]) for name in TRAIN_SPLITS},
        )

    def stream(self, split: str, source: str) -> int:
        """The generator seed of a split's source: distinct per source, never an evaluation seed."""
        return STREAM_BASE + zlib.crc32(f"{self.seed}:{split}:{source}".encode())

    def real_text_recipe(self) -> dict:
        """What the held-out documents depend on (beside the standard library); the training
        text also depends on the packages' versions (:meth:`DataStage.recipe`)."""
        return {
            "seed": self.seed,
            "heldout_docs": self.heldout_docs,
            "heldout_min_chars": self.heldout_min_chars,
            "max_chars": self.max_chars,
        }


# ---- documents ---------------------------------------------------------------------------
def _length(rng: random.Random, chars: tuple[int, int]) -> int:
    low, high = chars
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def generated_documents(source: Source, stream: int, count: int | None = None) -> Iterator[dict]:
    """The first ``count`` (default all) documents of a generated source, as jsonl records."""
    for index in range(source.docs if count is None else min(count, source.docs)):
        rng = random.Random(f"{stream}:{index}")
        length = _length(rng, source.chars)
        if source.kind == "tasks":
            task = tuple(TASKS)[index % len(TASKS)]
            sample = make_sample(task, length, rng.random(), stream, index, BYTES)
            yield {"text": BYTES.decode(sample.ids()), "kind": task}
        else:
            doc = make_document(KINDS[index % len(KINDS)], length, stream, index)
            yield {"text": doc.text, "kind": doc.kind}


def find_packages(config: StudyData) -> list[Package]:
    """The installed ``real_text.packages``, in the recipe's order."""
    packages = []
    for name in config.packages:
        package = find_package(name)
        if package is None:
            raise _fail(
                "real_text.packages",
                name,
                "packages (or their sub-packages) installed by a distribution, importable by this Python; "
                f"installed here: {', '.join(installed_packages())}",
            )
        packages.append(package)
    return packages


def split_real_text(config: StudyData, packages: list[Package]) -> tuple[list, list]:
    """(training, held-out) documents of the real text: the held-out ones from the standard
    library only, so that they are the same whichever packages train and at whichever
    versions (the held-out perplexity stays comparable between recipes and with runs before
    the packages); the training text is the rest of it and every document of ``packages``."""
    documents = python_documents()
    rng = random.Random(f"{config.seed}:real_text")
    candidates = [d for d in documents if len(d.text) >= config.heldout_min_chars]
    if len(candidates) < config.heldout_docs:
        raise _fail(
            "real_text.heldout_docs",
            config.heldout_docs,
            f"at most {len(candidates)}: the documents of at least heldout_min_chars={config.heldout_min_chars} "
            "characters in this Python's standard library (or a smaller heldout_min_chars)",
        )
    heldout = sorted(rng.sample(candidates, config.heldout_docs), key=lambda d: d.name)
    names = {d.name for d in heldout}
    rest = [d for d in documents if d.name not in names]
    rest += [doc for package in packages for doc in package_documents(package)]
    rng.shuffle(rest)
    training, used = [], 0
    for doc in rest:
        if config.max_chars is not None and used + len(doc.text) > config.max_chars:
            continue
        training.append(doc)
        used += len(doc.text)
    return sorted(training, key=lambda d: d.name), heldout


def _write_jsonl(records, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    count = 0
    with partial.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    partial.replace(path)
    return count


def _digest(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def tokenizer_digest(workdir: Path) -> str:
    return _digest(workdir / TOKENIZER / "tokenizer.json")


# ---- the stage ---------------------------------------------------------------------------
class DataStage:
    """Builds (or reuses) the tokenizer and the named splits under ``workdir / data``."""

    def __init__(self, config: StudyData, workdir: Path, log=print):
        self.config, self.workdir, self.log = config, Path(workdir), log
        path = self.workdir / MANIFEST
        self.manifest = json.loads(path.read_text()) if path.is_file() else {}
        self._packages: list[Package] | None = None
        self._real: tuple[list, list] | None = None
        self._train_text: Path | None = None

    def path(self, relative: Path | str) -> Path:
        return self.workdir / relative

    def packages(self) -> list[Package]:
        if self._packages is None:
            self._packages = find_packages(self.config)
        return self._packages

    def real_text(self) -> tuple[list, list]:
        if self._real is None:
            start = time.monotonic()
            self._real = split_real_text(self.config, self.packages())
            train, heldout = self._real
            self.log(
                f"  real text: {len(train)} training documents ({sum(len(d.text) for d in train) / 1e6:.1f} M "
                f"characters; packages {', '.join(f'{p.distribution} {p.version}' for p in self.packages()) or 'none'}),"
                f" {len(heldout)} held out ({', '.join(d.name for d in heldout)}) in {time.monotonic() - start:.1f} s"
            )
        return self._real

    def real_text_record(self, split: str, summary) -> dict:
        """The real text of a split as data.json records it. Held out: the documents. Training:
        the interpreter's documents (standard library, pydoc topics, license) and each
        package's (its distribution and version), and their total; its tokens (EOD included)
        where a ``text`` source without length bounds holds all of it."""
        train, heldout = self.real_text()

        def totals(docs: list) -> dict:
            return {"documents": len(docs), "characters": sum(len(d.text) for d in docs)}

        if split == HELDOUT:
            return totals(heldout) | {"names": [d.name for d in heldout], "tokens": summary.tokens}

        def of(package: Package) -> list:
            name = f"package:{package.distribution}/{package.name}"
            return [d for d in train if d.name == name or d.name.startswith(name + ".")]

        record = {
            "python": {"version": sys.version.split()[0]}
            | totals([d for d in train if not d.name.startswith("package:")]),
            "packages": [p.record() | totals(of(p)) for p in self.packages()],
            "training": totals(train),
        }
        whole = {
            s.name
            for s in self.config.splits[split].sources
            if s.kind == "text" and not s.min_tokens and s.max_tokens is None
        }
        for source in summary.sources:
            if source.name in whole:
                record["training"]["tokens"] = source.tokens
        return record

    def build(self, splits: tuple[str, ...]) -> dict:
        """The tokenizer (unless one is there) and ``splits`` (of ``pretrain``, ``continue``,
        ``heldout``); returns the manifest."""
        unknown = [s for s in splits if s not in (*TRAIN_SPLITS, HELDOUT)]
        if unknown:
            raise _fail("split", unknown[0], " | ".join((*TRAIN_SPLITS, HELDOUT)))
        if not self.path(TOKENIZER / "tokenizer.json").is_file():
            self.train_tokenizer()
        self.manifest["tokenizer"] = {"path": str(TOKENIZER), "sha256": tokenizer_digest(self.workdir)}
        for split in splits:
            recipe = self.recipe(split)
            recorded = self.manifest.get("splits", {}).get(split, {})
            prefix = self.path(DATA / split)
            files = [Path(f"{prefix}.bin"), Path(f"{prefix}.idx")]
            if recorded.get("recipe") == recipe and all(f.is_file() for f in files):
                self.log(f"  split {split}: reused ({recorded['tokens']} tokens, {recorded['documents']} documents)")
                continue
            start = time.monotonic()
            summary = self.build_split(split)
            self.manifest.setdefault("splits", {})[split] = {
                "recipe": recipe,
                "prefix": str(DATA / split),
                "documents": summary.documents,
                "tokens": summary.tokens,
                # A source's own documents and tokens (EOD included), then the mix's: factor
                # times the source's.
                "sources": {
                    s.name: {
                        "source_documents": s.kept,
                        "source_tokens": s.tokens,
                        "documents": s.mix_docs,
                        "tokens": s.mix_tokens,
                        "factor": round(s.factor, 3),
                    }
                    for s in summary.sources
                },
                "real_text": self.real_text_record(split, summary),
                "sha256": _digest(*files),
                "seconds": round(time.monotonic() - start, 1),
            }
            self.log(
                f"  split {split}: {summary.documents} documents, {summary.tokens} tokens in {time.monotonic() - start:.1f} s"
            )
        self.manifest["python"] = sys.version.split()[0]
        self.write_manifest()
        return self.manifest

    def write_manifest(self) -> None:
        path = self.path(MANIFEST)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.manifest, indent=1) + "\n")

    def recipe(self, split: str) -> dict:
        """What a split's content depends on: the seed, the real-text split (for a training
        split, the packages' versions too), the tokenizer and the split's own sources."""
        recipe = {"real_text": self.config.real_text_recipe(), "tokenizer": tokenizer_digest(self.workdir)}
        if split != HELDOUT:
            recipe["real_text"]["packages"] = [p.record() for p in self.packages()]
            split_config = self.config.splits[split]
            recipe["split"] = {
                "seq_length": split_config.seq_length,
                "sources": [asdict(s) for s in split_config.sources],
            }
        # As the manifest holds it (tuples as lists), so that a recorded recipe compares equal.
        return json.loads(json.dumps(recipe))

    def train_text(self) -> Path:
        """The training text as jsonl, written once per build."""
        if self._train_text is None:
            train, _ = self.real_text()
            self._train_text = self.path(SOURCES / "train_text.jsonl")
            _write_jsonl(({"text": d.text, "name": d.name} for d in train), self._train_text)
        return self._train_text

    def train_tokenizer(self) -> None:
        from ...data import train_tiny_tokenizer

        start = time.monotonic()
        train, _ = self.real_text()
        texts = [d.text for d in train]
        for split in self.config.splits.values():
            for source in split.sources:
                if source.kind != "text":
                    stream = self.config.stream(split.name, source.name)
                    texts += [r["text"] for r in generated_documents(source, stream, self.config.sample_docs)]
        train_tiny_tokenizer(texts, self.path(TOKENIZER), vocab_size=self.config.vocab_size)
        self.log(
            f"  tokenizer: byte-level BPE of {self.config.vocab_size} tokens on {sum(map(len, texts)) / 1e6:.1f} M "
            f"characters in {time.monotonic() - start:.1f} s -> {self.path(TOKENIZER)}"
        )

    def build_split(self, split: str):
        from ...data import MixConfig, prepare

        if split == HELDOUT:
            _, heldout = self.real_text()
            path = self.path(SOURCES / "heldout_text.jsonl")
            _write_jsonl(({"text": d.text, "name": d.name} for d in heldout), path)
            sources = [{"name": "text", "paths": [str(path)], "repeat": 1.0}]
            seq_length = max(s.seq_length for s in self.config.splits.values())
        else:
            split_config = self.config.splits[split]
            seq_length, sources = split_config.seq_length, []
            for source in split_config.sources:
                if source.kind == "text":
                    path = self.train_text()
                else:
                    path = self.path(SOURCES / f"{split}_{source.name}.jsonl")
                    stream = self.config.stream(split, source.name)
                    _write_jsonl(generated_documents(source, stream), path)
                sources.append(
                    {
                        "name": source.name,
                        "paths": [str(path)],
                        "weight": source.weight,
                        "min_tokens": source.min_tokens,
                        "max_tokens": source.max_tokens,
                    }
                )
        mix = MixConfig.from_dict(
            {
                "tokenizer": str(self.path(TOKENIZER)),
                "output_prefix": str(self.path(DATA / split)),
                "seq_length": seq_length,
                "seed": self.config.seed,
                "sources": sources,
            }
        )
        return prepare(mix, progress=False)
