"""jsonl / parquet text -> a Megatron indexed dataset (``.bin`` / ``.idx``) for a data mix.

:func:`prepare` runs a :class:`~.config.MixConfig` in two passes:

1. **Tokenise** each source into ``<prefix>.sources/<name>.bin/.idx``: every record's text with
   the local Hugging Face tokenizer, EOD (the tokenizer's EOS) appended, documents outside the
   source's ``[min_tokens, max_tokens]`` (EOD excluded) dropped. Memory stays at one batch.
   With ``valid_fraction`` the documents a seeded hash of their text holds out go to
   ``<prefix>.sources/<name>_valid.bin/.idx`` instead. Sources that read the same texts (the
   same files in the same order, the same ``text_key``: length buckets of one input) share one
   tokenization, each batch going through all of their filters; each still writes its own files.
2. **Mix**: each source's documents are repeated by its factor (``repeat``, or solved from the
   ``weight`` token shares), the document order is shuffled with the seed, and the documents
   are copied from the per-source files into ``<prefix>.bin/.idx``; the held-out documents,
   once each in a seeded order, into ``<prefix>_valid.bin/.idx``. A summary is printed and
   written to ``<prefix>.summary.json``.

Packing is left to Megatron's ``GPTDataset``, which concatenates the (shuffled) documents and
cuts them into ``seq_length + 1``-token samples at load time, so the file holds one document
per entry rather than pre-cut samples. Reasons: one tokenised mix serves every stage of a
32K -> 512K curriculum (only ``--seq-length`` changes); Megatron's train / valid / test split
is by documents, so documents must stay whole; and ``reset_position_ids`` /
``reset_attention_mask`` / ``eod_mask_loss`` find the document boundaries from the EOD
tokens written here. The shuffle in pass 2 matters because that split takes contiguous
document ranges: unshuffled, the validation set would be the last source. That split holds
out documents of the mix, which repeats the documents of an upsampled source anywhere in it,
so the held-out set of ``valid_fraction`` is chosen before any repetition.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from .config import MixConfig, SourceConfig
from .readers import read_texts
from .tokenizer import load_tokenizer


@dataclass
class SourceStats:
    """What happened to one source: documents read and kept, tokens (EOD included), mix counts."""

    name: str
    read: int = 0
    kept: int = 0
    too_short: int = 0
    too_long: int = 0
    tokens: int = 0
    factor: float = 1.0
    mix_docs: int = 0
    mix_tokens: int = 0
    held_out: int = 0  # documents written to the validation set instead (valid_fraction)
    held_out_tokens: int = 0


@dataclass
class PrepareSummary:
    """The written mix: per-source statistics and the training-length view of the whole."""

    prefix: str
    seq_length: int
    eod: int
    dtype: str
    sources: list[SourceStats]
    long_doc_tokens: int

    @property
    def documents(self) -> int:
        return sum(s.mix_docs for s in self.sources)

    @property
    def tokens(self) -> int:
        return sum(s.mix_tokens for s in self.sources)

    @property
    def valid_documents(self) -> int:
        return sum(s.held_out for s in self.sources)

    @property
    def valid_tokens(self) -> int:
        return sum(s.held_out_tokens for s in self.sources)

    @property
    def samples(self) -> int:
        """``seq_length + 1``-token samples that one epoch gives GPTDataset (consecutive samples share a token)."""
        return max(0, (self.tokens - 1) // self.seq_length)

    def to_dict(self) -> dict:
        return asdict(self) | {
            "documents": self.documents,
            "tokens": self.tokens,
            "samples": self.samples,
            "valid_documents": self.valid_documents,
            "valid_tokens": self.valid_tokens,
        }

    def format(self) -> str:
        header = f"{'source':<20} {'read':>8} {'kept':>8} {'short':>7} {'long':>7} {'tokens':>12} {'factor':>7} {'mix docs':>9} {'mix tokens':>12} {'share':>7}"
        lines = [f"mix written to {self.prefix}.bin/.idx ({self.dtype}, EOD id {self.eod})", header]
        for s in self.sources:
            share = s.mix_tokens / self.tokens if self.tokens else 0.0
            lines.append(
                f"{s.name:<20} {s.read:>8} {s.kept:>8} {s.too_short:>7} {s.too_long:>7} {s.tokens:>12} "
                f"{s.factor:>7.3f} {s.mix_docs:>9} {s.mix_tokens:>12} {share:>7.1%}"
            )
        long_share = self.long_doc_tokens / self.tokens if self.tokens else 0.0
        lines.append(
            f"total: {self.documents} documents, {self.tokens} tokens; {self.samples} samples of "
            f"{self.seq_length}+1 tokens per epoch; {long_share:.1%} of tokens in documents >= {self.seq_length} tokens"
        )
        if self.valid_documents:
            held = ", ".join(f"{s.name} {s.held_out}" for s in self.sources)
            lines.append(
                f"held out for validation: {self.valid_documents} documents ({held}), {self.valid_tokens} tokens, "
                f"in {self.prefix}_valid.bin/.idx"
            )
        return "\n".join(lines)


def _progress(iterable=None, **kwargs):
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)


def _input_key(source: SourceConfig) -> tuple:
    """Everything of a source that decides its token ids (the tokenizer and ``add_special_tokens``
    are the mix's): sources with equal keys read the same texts, so they share a tokenization.
    Resolved, so that two spellings of a file count as one."""
    return tuple(p.resolve() for p in source.paths), source.text_key


def _source_texts(source: SourceConfig) -> Iterator[str]:
    for path in source.paths:
        yield from read_texts(path, source.text_key)


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def held_out(text: str, config: MixConfig) -> bool:
    """Whether ``valid_fraction`` holds the document out: its text's hash, keyed by the seed,
    read as a number in [0, 1), is below the fraction."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=config.seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") < config.valid_fraction * 2**64


class _SourceWriter:
    """One source's side of a tokenization pass: its length filter, its files and its stats."""

    def __init__(self, source: SourceConfig, dtype: type, prefix: Path):
        self.source, self.prefix = source, prefix
        self.stats = SourceStats(source.name)
        self.builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
        self.valid = IndexedDatasetBuilder(str(prefix) + "_valid.bin", dtype=dtype)

    def keeps(self, length: int) -> bool:
        """Counts a read document of ``length`` tokens (EOD excluded); whether the filter keeps it."""
        self.stats.read += 1
        if length < self.source.min_tokens:
            self.stats.too_short += 1
            return False
        if self.source.max_tokens is not None and length > self.source.max_tokens:
            self.stats.too_long += 1
            return False
        return True

    def add(self, doc: np.ndarray, held: bool) -> None:
        if held:
            self.valid.add_document(doc, [doc.size])
            self.stats.held_out += 1
            self.stats.held_out_tokens += doc.size
            return
        self.builder.add_document(doc, [doc.size])
        self.stats.kept += 1
        self.stats.tokens += doc.size

    def finalize(self) -> None:
        self.builder.finalize(str(self.prefix) + ".idx")
        self.valid.finalize(str(self.prefix) + "_valid.idx")

    def check(self, config: MixConfig) -> None:
        stats, source = self.stats, self.source
        if stats.kept == 0:
            held = (
                f", and {stats.held_out} held out by valid_fraction={config.valid_fraction}" if stats.held_out else ""
            )
            raise ValueError(
                f"sources[{source.name}]: none of its {stats.read} documents is within min_tokens={source.min_tokens}, "
                f"max_tokens={source.max_tokens}{held} (files: {', '.join(map(str, source.paths))})"
            )


def tokenize_sources(
    sources: list[SourceConfig],
    tokenizer,
    eod: int,
    dtype: type,
    source_dir: Path,
    config: MixConfig,
    progress: bool = True,
) -> list[SourceStats]:
    """Pass 1 for sources that read the same texts (one :func:`_input_key`): each text is
    tokenised once and goes, length-filtered and EOD-terminated, to every source that keeps it,
    at ``source_dir / name`` (the held-out ones at ``<name>_valid``)."""
    if len({_input_key(s) for s in sources}) != 1:
        raise ValueError(f"tokenize_sources: {', '.join(s.name for s in sources)} do not read the same texts")
    writers = [_SourceWriter(s, dtype, source_dir / s.name) for s in sources]
    bar = _progress(desc=f"tokenize {', '.join(s.name for s in sources)}", unit="doc", disable=not progress)
    # Batches stream through every source of the input at once, so memory stays at one batch
    # however many sources (length buckets) read it.
    for batch in _batches(_source_texts(sources[0]), config.batch_size):
        # A fast tokenizer encodes a batch on all cores (Rust threads), hence batches, not workers.
        encoded = tokenizer(
            batch,
            add_special_tokens=config.add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        for text, ids in zip(batch, encoded, strict=True):
            keeping = [w for w in writers if w.keeps(len(ids))]
            if not keeping:
                continue
            doc = np.asarray([*ids, eod], dtype=dtype)
            held = bool(config.valid_fraction) and held_out(text, config)
            for writer in keeping:
                writer.add(doc, held)
        bar.update(len(batch))
    bar.close()
    for writer in writers:
        writer.finalize()
    for writer in writers:
        writer.check(config)
    return [w.stats for w in writers]


def mix_factors(config: MixConfig, stats: list[SourceStats]) -> list[float]:
    """Per-source repeat factors. With weights, the factors give each source ``weight`` of the
    tokens: scaled to ``total_tokens`` when set, else so that no source is subsampled (the
    source with the fewest tokens per unit of weight is used exactly once)."""
    if not config.weighted:
        return [1.0 if s.repeat is None else s.repeat for s in config.sources]
    weights = [s.weight / sum(src.weight for src in config.sources) for s in config.sources]
    scale = config.total_tokens or max(st.tokens / w for st, w in zip(stats, weights, strict=True))
    return [w * scale / st.tokens for st, w in zip(stats, weights, strict=True)]


def mix_order(doc_counts: list[int], factors: list[float], seed: int) -> np.ndarray:
    """``[N, 2]`` (source, document) pairs: ``floor(f)`` copies of every document of a source and
    a seeded sample (without replacement) of ``round(frac(f) * n)`` more, in a seeded random order."""
    rng = np.random.default_rng(seed)
    parts = []
    for source, (n, factor) in enumerate(zip(doc_counts, factors, strict=True)):
        whole = math.floor(factor)
        extra = rng.choice(n, size=round((factor - whole) * n), replace=False)
        docs = np.concatenate([np.tile(np.arange(n), whole), np.sort(extra)])
        parts.append(np.stack([np.full(docs.size, source), docs], axis=1))
    order = np.concatenate(parts)
    return order[rng.permutation(len(order))]


def prepare(config: MixConfig, progress: bool = True) -> PrepareSummary:
    """Runs both passes of ``config`` and returns (and writes next to the output) the summary.

    Every file is written under a temporary directory beside the output and renamed into place
    once the whole run has succeeded: a failed run leaves no partial file and leaves the output
    of an earlier run as it was."""
    tokenizer = load_tokenizer(config.tokenizer)
    # Long-context documents exceed every tokenizer's model_max_length; the length checks here are ours.
    tokenizer.model_max_length = sys.maxsize
    eod = tokenizer.eos_token_id
    if eod is None:
        raise ValueError(f"tokenizer={str(config.tokenizer)!r} has no eos_token; it is needed as the EOD token")
    prefix = config.output_prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # In the output's directory, so that the renames stay on one file system (atomic).
    stage = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.", suffix=".partial", dir=prefix.parent))
    try:
        summary = _prepare_into(config, tokenizer, eod, stage, progress)
        _commit(stage, prefix, config)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return summary


def _prepare_into(config: MixConfig, tokenizer, eod: int, stage: Path, progress: bool) -> PrepareSummary:
    """Both passes, written under ``stage`` as ``mix.bin/.idx``, ``sources/<name>.bin/.idx`` and
    ``summary.json`` (see :func:`_commit`)."""
    source_dir = stage / "sources"
    source_dir.mkdir()
    dtype = DType.optimal_dtype(len(tokenizer))

    groups: dict[tuple, list[SourceConfig]] = {}
    for source in config.sources:
        groups.setdefault(_input_key(source), []).append(source)
    by_name = {}
    for group in groups.values():
        by_name |= {st.name: st for st in tokenize_sources(group, tokenizer, eod, dtype, source_dir, config, progress)}
    stats = [by_name[s.name] for s in config.sources]
    datasets = [IndexedDataset(str(source_dir / s.name)) for s in config.sources]
    factors = mix_factors(config, stats)
    order = mix_order([len(d) for d in datasets], factors, config.seed)

    builder = IndexedDatasetBuilder(str(stage / "mix.bin"), dtype=dtype)
    long_doc_tokens = 0
    for st, factor in zip(stats, factors, strict=True):
        st.factor = factor
    for source, doc in _progress(order, desc="write mix", unit="doc", disable=not progress):
        tokens = datasets[source][doc]
        builder.add_document(tokens, [tokens.size])
        stats[source].mix_docs += 1
        stats[source].mix_tokens += tokens.size
        if tokens.size >= config.seq_length:
            long_doc_tokens += tokens.size
    builder.finalize(str(stage / "mix.idx"))
    if config.valid_fraction:
        _write_validation(config, stats, source_dir, dtype, stage / "mix_valid")

    summary = PrepareSummary(
        str(config.output_prefix), config.seq_length, eod, np.dtype(dtype).name, stats, long_doc_tokens
    )
    record = summary.to_dict() | {
        "tokenizer": str(config.tokenizer),
        "seed": config.seed,
        "sources_config": [asdict(s) | {"paths": [str(p) for p in s.paths]} for s in config.sources],
    }
    (stage / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    return summary


def _write_validation(config: MixConfig, stats: list[SourceStats], source_dir: Path, dtype, out: Path) -> None:
    """The held-out documents of every source, once each, in a seeded order, at ``out``."""
    if not any(st.held_out for st in stats):
        read = sum(st.read for st in stats)
        raise ValueError(
            f"valid_fraction={config.valid_fraction} held out none of the {read} documents read: raise it (or set 0 "
            "for no validation set)"
        )
    datasets = [IndexedDataset(str(source_dir / f"{s.name}_valid")) for s in config.sources]
    order = mix_order([len(d) for d in datasets], [1.0] * len(datasets), config.seed)
    builder = IndexedDatasetBuilder(str(out) + ".bin", dtype=dtype)
    for source, doc in order:
        tokens = datasets[source][doc]
        builder.add_document(tokens, [tokens.size])
    builder.finalize(str(out) + ".idx")


def _commit(stage: Path, prefix: Path, config: MixConfig) -> None:
    """Renames the staged files to ``prefix.sources/<name>.bin/.idx``, ``prefix.bin/.idx`` and
    ``prefix.summary.json`` (with ``valid_fraction`` also ``<name>_valid`` and
    ``prefix_valid.bin/.idx``; without, it removes an earlier run's). Readers take a dataset's ``.idx`` as the sign that it is complete
    (Megatron opens it first; the quickstart skips a finished stage by the mix's), so the old
    ones go before anything is replaced and the new ones come last, the mix's at the very end:
    an interruption between renames leaves datasets missing, never a ``.bin`` of one run beside
    the ``.idx`` of another."""
    source_dir = Path(str(prefix) + ".sources")
    source_dir.mkdir(exist_ok=True)
    names = [s.name for s in config.sources]
    if config.valid_fraction:
        names += [f"{s.name}_valid" for s in config.sources]
    datasets = [(stage / "sources" / name, source_dir / name) for name in names]
    if config.valid_fraction:
        datasets.append((stage / "mix_valid", config.valid_prefix))
    else:  # an earlier run's held-out set is not this mix's
        for stale in (config.valid_prefix, *(source_dir / f"{s.name}_valid" for s in config.sources)):
            for ext in (".idx", ".bin"):
                Path(str(stale) + ext).unlink(missing_ok=True)
    datasets.append((stage / "mix", prefix))
    for _, final in datasets:
        Path(str(final) + ".idx").unlink(missing_ok=True)
    for staged, final in datasets:
        os.replace(str(staged) + ".bin", str(final) + ".bin")
    os.replace(stage / "summary.json", str(prefix) + ".summary.json")
    for staged, final in datasets:
        os.replace(str(staged) + ".idx", str(final) + ".idx")
