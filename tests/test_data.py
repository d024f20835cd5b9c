"""Data pipeline: synthetic documents, jsonl / parquet -> indexed dataset round trip, filtering,
mixing, GPTDataset packing of the output, and config errors. CPU only, a tokenizer trained here."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.datasets.utils import Split  # noqa: E402
from megatron.core.tokenizers import MegatronTokenizer  # noqa: E402

from megatron_mtraining.data import (  # noqa: E402
    MixConfig,
    find_copy_span,
    find_passkey,
    generate_documents,
    load_tokenizer,
    make_document,
    prepare,
    train_tiny_tokenizer,
    write_jsonl,
)
from megatron_mtraining.data.indexed import mix_order  # noqa: E402
from megatron_mtraining.data.local_text import find_package, installed_packages, package_documents  # noqa: E402
from megatron_mtraining.training.documents import check_document_options, document_bounds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Long passkey / copy documents and short filler ones (jsonl), and a BPE trained on them."""
    root = tmp_path_factory.mktemp("data")
    write_jsonl(generate_documents(12, 6000, seed=0, kinds=("passkey", "copy")), root / "long.jsonl")
    write_jsonl(generate_documents(30, 300, seed=1, kinds=("filler", "passkey")), root / "short.jsonl")
    texts = [json.loads(line)["text"] for f in ("long.jsonl", "short.jsonl") for line in (root / f).open()]
    train_tiny_tokenizer(texts, root / "tokenizer", vocab_size=400)
    return root


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.open()]


def _encode(corpus: Path, texts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(corpus / "tokenizer")
    return [[*tok(t)["input_ids"], tok.eos_token_id] for t in texts]


def _config(corpus: Path, out: str, sources: list[dict], **top) -> MixConfig:
    raw = {"tokenizer": str(corpus / "tokenizer"), "output_prefix": str(corpus / out), "seq_length": 256}
    return MixConfig.from_dict(raw | top | {"sources": sources})


def _docs(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_round_trip_tokens_in_equal_tokens_out(corpus):
    paths = [str(corpus / "long.jsonl"), str(corpus / "short.jsonl")]
    config = _config(corpus, "rt", [{"name": "all", "paths": paths}], seed=7)
    summary = prepare(config, progress=False)
    expected = _encode(corpus, _texts(corpus / "long.jsonl") + _texts(corpus / "short.jsonl"))
    # The per-source file keeps the input order; the mix is the seeded shuffle of it.
    assert _docs(str(corpus / "rt.sources" / "all")) == expected
    order = mix_order([len(expected)], [1.0], seed=7)
    assert _docs(str(corpus / "rt")) == [expected[d] for _, d in order]
    # Byte-level BPE is lossless, so the text comes back too, passkeys included.
    tok = load_tokenizer(corpus / "tokenizer")
    texts = _texts(corpus / "long.jsonl") + _texts(corpus / "short.jsonl")
    for (_, d), ids in zip(order, _docs(str(corpus / "rt")), strict=True):
        assert tok.decode(ids[:-1]) == texts[d] and find_passkey(tok.decode(ids)) == find_passkey(texts[d])
    assert summary.documents == len(expected) and summary.tokens == sum(map(len, expected))
    recorded = json.loads((corpus / "rt.summary.json").read_text())
    assert recorded["tokens"] == summary.tokens and recorded["sources"][0]["kept"] == len(expected)


def test_parquet_input_matches_jsonl(corpus):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = _texts(corpus / "short.jsonl")
    pq.write_table(pa.table({"body": texts, "id": list(range(len(texts)))}), corpus / "short.parquet")
    prepare(
        _config(corpus, "pq", [{"name": "pq", "paths": [str(corpus / "short.parquet")], "text_key": "body"}]), False
    )
    assert _docs(str(corpus / "pq.sources" / "pq")) == _encode(corpus, texts)


def test_length_filter_counts(corpus):
    texts = _texts(corpus / "long.jsonl") + _texts(corpus / "short.jsonl")
    lengths = np.array([len(ids) - 1 for ids in _encode(corpus, texts)])  # EOD excluded
    lo, hi = int(np.percentile(lengths, 30)), int(np.percentile(lengths, 80))
    paths = [str(corpus / "long.jsonl"), str(corpus / "short.jsonl")]
    summary = prepare(_config(corpus, "flt", [{"name": "f", "paths": paths}], min_tokens=lo, max_tokens=hi), False)
    stats = summary.sources[0]
    assert (stats.read, stats.too_short, stats.too_long) == (len(texts), (lengths < lo).sum(), (lengths > hi).sum())
    kept = [len(d) - 1 for d in _docs(str(corpus / "flt"))]
    assert len(kept) == stats.kept == ((lengths >= lo) & (lengths <= hi)).sum()
    assert min(kept) >= lo and max(kept) <= hi


def test_repeat_and_weights(corpus):
    long, short = str(corpus / "long.jsonl"), str(corpus / "short.jsonl")
    summary = prepare(
        _config(corpus, "rep", [{"name": "long", "paths": [long]}, {"name": "short", "paths": [short], "repeat": 2.5}]),
        False,
    )
    long_stats, short_stats = summary.sources
    assert long_stats.mix_docs == 12 and short_stats.mix_docs == 2 * 30 + 15
    # Every short document is there twice or three times, never dropped.
    source = _docs(str(corpus / "rep.sources" / "short"))
    counts = [sum(doc == s for doc in _docs(str(corpus / "rep"))) for s in source]
    assert sorted(set(counts)) == [2, 3] and sum(counts) == 75

    weighted = prepare(
        _config(
            corpus,
            "w",
            [{"name": "long", "paths": [long], "weight": 1}, {"name": "short", "paths": [short], "weight": 1}],
        ),
        False,
    )
    # The short source is upsampled to half the tokens (to within one document); the long one is used once.
    long_stats, short_stats = weighted.sources
    assert long_stats.factor == 1.0 and short_stats.factor > 1.0
    longest_short = max(map(len, _docs(str(corpus / "w.sources" / "short"))))
    assert abs(short_stats.mix_tokens - long_stats.mix_tokens) <= longest_short

    # total_tokens sizes the mix: the long source is subsampled, the short one upsampled.
    sized = prepare(
        _config(
            corpus,
            "sized",
            [{"name": "long", "paths": [long], "weight": 3}, {"name": "short", "paths": [short], "weight": 1}],
            total_tokens=30000,
        ),
        False,
    )
    long_stats, short_stats = sized.sources
    assert long_stats.factor < 1.0 < short_stats.factor and long_stats.mix_docs < 12
    assert abs(long_stats.mix_tokens - 22500) < 3500 and abs(short_stats.mix_tokens - 7500) < 300


def test_valid_fraction_holds_documents_out_of_the_mix(corpus):
    """Documents whose seeded text hash falls under the fraction (an independent blake2b of
    the rule) go once each to ``<prefix>_valid`` and never into the mix, though the mix
    upsamples their source; a rerun holds out the same ones; a run without the fraction
    removes them."""
    import hashlib

    long, short = str(corpus / "long.jsonl"), str(corpus / "short.jsonl")
    sources = [{"name": "long", "paths": [long]}, {"name": "short", "paths": [short], "repeat": 2.5}]
    config = _config(corpus, "held", sources, seed=11, valid_fraction=0.3)
    summary = prepare(config, False)
    texts = _texts(corpus / "long.jsonl") + _texts(corpus / "short.jsonl")

    def hashed(text: str) -> float:
        digest = hashlib.blake2b(text.encode(), digest_size=8, key=(11).to_bytes(8, "little")).digest()
        return int.from_bytes(digest, "little") / 2**64

    want = sorted(ids for text, ids in zip(texts, _encode(corpus, texts), strict=True) if hashed(text) < 0.3)
    valid, mix = _docs(str(corpus / "held_valid")), _docs(str(corpus / "held"))
    assert 0 < len(want) < len(texts) and sorted(valid) == want
    assert not any(doc in want for doc in mix)
    assert len(mix) == (12 - summary.sources[0].held_out) + summary.sources[1].mix_docs
    assert summary.valid_documents == len(want) and summary.valid_tokens == sum(map(len, want))
    assert "held out for validation" in summary.format()
    assert prepare(config, False).valid_documents == len(want) and _docs(str(corpus / "held_valid")) == valid
    prepare(dataclasses.replace(config, valid_fraction=0.0), False)
    assert not list(corpus.glob("held_valid.*")) and not list((corpus / "held.sources").glob("*_valid.*"))


class _CountingTokenizer:
    """The real tokenizer, counting its calls and the texts it encodes."""

    def __init__(self, tok):
        self.tok, self.calls, self.texts = tok, 0, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def __call__(self, texts, **kwargs):
        self.calls += 1
        self.texts += len(texts)
        return self.tok(texts, **kwargs)


@pytest.fixture
def counting(monkeypatch):
    """Makes ``prepare`` load a :class:`_CountingTokenizer`; returns the list it appends them to."""
    from megatron_mtraining.data import indexed

    made = []

    def load(path):
        made.append(_CountingTokenizer(load_tokenizer(path)))
        return made[-1]

    monkeypatch.setattr(indexed, "load_tokenizer", load)
    return made


def _prepare_tree(config: MixConfig) -> dict[str, bytes]:
    prepare(config, False)
    return {p.name: p.read_bytes() for p in config.output_prefix.parent.rglob("*") if p.is_file()}


def _source_files(tree: dict[str, bytes], name: str) -> dict[str, bytes]:
    return {k: v for k, v in tree.items() if k.startswith((f"{name}.", f"{name}_valid."))}


def test_length_buckets_of_one_input_share_a_tokenization(corpus, tmp_path, monkeypatch, counting):
    """Two sources over the same files with complementary length filters: the texts are
    tokenised once (one tokenizer call a batch), and every file written (sources, mix, held-out
    set, summary) is byte for byte what tokenising each source on its own writes."""
    from megatron_mtraining.data import indexed

    paths = [str(corpus / "long.jsonl"), str(corpus / "short.jsonl")]
    texts = _texts(corpus / "long.jsonl") + _texts(corpus / "short.jsonl")
    cut = int(np.median([len(ids) - 1 for ids in _encode(corpus, texts)]))
    sources = [
        {"name": "long", "paths": paths, "min_tokens": cut, "weight": 3},
        {"name": "short", "paths": paths, "max_tokens": cut - 1, "weight": 1},
    ]
    top = {"output_prefix": str(tmp_path / "out" / "mix"), "batch_size": 8, "seed": 5, "valid_fraction": 0.2}
    config = _config(corpus, "unused", sources, **top)

    shared = _prepare_tree(config)
    assert counting[-1].calls == -(-len(texts) // 8) and counting[-1].texts == len(texts)

    # The reference: each source tokenised on its own, as when no two sources read the same texts.
    with monkeypatch.context() as patch:
        patch.setattr(indexed, "_input_key", lambda source: source.name)
        alone = _prepare_tree(config)
    assert counting[-1].calls == 2 * -(-len(texts) // 8)
    assert any(k.endswith("_valid.bin") for k in shared) and "mix.summary.json" in shared
    assert shared == alone

    # And each source's files are those of a mix of that source alone.
    for source in sources:
        single = _prepare_tree(
            _config(corpus, "unused", [source], **top | {"output_prefix": str(tmp_path / source["name"] / "mix")})
        )
        assert _source_files(shared, source["name"]) == _source_files(single, source["name"]) != {}
    summary = json.loads(shared["mix.summary.json"])
    long_stats, short_stats = summary["sources"]
    assert long_stats["read"] == short_stats["read"] == len(texts)
    assert long_stats["too_short"] == short_stats["kept"] + short_stats["held_out"]
    assert short_stats["too_long"] == long_stats["kept"] + long_stats["held_out"]


def test_sources_over_different_inputs_are_tokenized_apart(corpus, tmp_path, counting):
    """Different files, the same files in another order, or another ``text_key`` of the same
    file: each source tokenised on its own, its files those of a mix of it alone."""
    long, short = str(corpus / "long.jsonl"), str(corpus / "short.jsonl")
    texts = _texts(corpus / "short.jsonl")
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps({"text": t, "body": t[::-1]}) + "\n" for t in texts))
    sources = [
        {"name": "long", "paths": [long]},
        {"name": "short", "paths": [short], "repeat": 2.0},
        {"name": "long_short", "paths": [long, short]},
        {"name": "short_long", "paths": [short, long]},
        {"name": "text", "paths": [str(both)]},
        {"name": "body", "paths": [str(both)], "text_key": "body"},
    ]
    top = {"batch_size": 8, "valid_fraction": 0.2}
    tree = _prepare_tree(_config(corpus, "unused", sources, output_prefix=str(tmp_path / "all" / "mix"), **top))
    batches = {"long": 2, "short": 4, "long_short": 6, "short_long": 6, "text": 4, "body": 4}
    assert counting[-1].calls == sum(batches.values())
    for source in sources:
        out = str(tmp_path / source["name"] / "mix")
        single = _prepare_tree(_config(corpus, "unused", [source], output_prefix=out, **top))
        assert counting[-1].calls == batches[source["name"]]
        assert _source_files(tree, source["name"]) == _source_files(single, source["name"]) != {}
    text, body = (
        _docs(str(tmp_path / "all" / "mix.sources" / "text")),
        _docs(str(tmp_path / "all" / "mix.sources" / "body")),
    )
    assert sorted(text + _docs(str(tmp_path / "all" / "mix.sources" / "text_valid"))) == sorted(_encode(corpus, texts))
    assert sorted(body + _docs(str(tmp_path / "all" / "mix.sources" / "body_valid"))) == sorted(
        _encode(corpus, [t[::-1] for t in texts])
    )


def test_a_shared_input_keeps_each_sources_empty_error(corpus, tmp_path):
    short = str(corpus / "short.jsonl")
    # The same file spelled through a link: one input, one tokenization, still two sources.
    link = tmp_path / "link.jsonl"
    link.symlink_to(short)
    sources = [{"name": "a", "paths": [short]}, {"name": "b", "paths": [str(link)], "min_tokens": 10**6}]
    with pytest.raises(ValueError, match=r"sources\[b\]: none of its 30 documents is within min_tokens=1000000"):
        prepare(_config(corpus, "unused", sources, output_prefix=str(tmp_path / "mix")), False)
    assert not list(tmp_path.glob("mix*"))


def _gpt_dataset(corpus, out: str, seq: int, **flags):
    paths = [str(corpus / "long.jsonl"), str(corpus / "short.jsonl")]
    summary = prepare(_config(corpus, out, [{"name": "all", "paths": paths}], seq_length=seq), False)
    indexed = IndexedDataset(str(corpus / out))
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=seq,
        # The tokenizer as the trainer loads it (--tokenizer-type HuggingFaceTokenizer), so EOD ids must agree.
        tokenizer=MegatronTokenizer.from_pretrained(
            str(corpus / "tokenizer"), metadata_path={"library": "huggingface"}
        ),
        reset_position_ids=flags.get("reset", False),
        reset_attention_mask=flags.get("reset", False),
        create_attention_mask=flags.get("reset", False),
        eod_mask_loss=False,
        split="100,0,0",
    )
    dataset = GPTDataset(indexed, str(corpus / out), np.arange(len(indexed), dtype=np.int32), None, Split.train, config)
    return summary, indexed, config, dataset


def test_gpt_dataset_packs_the_output(corpus):
    seq = 128
    summary, indexed, config, dataset = _gpt_dataset(corpus, "pack", seq)
    assert config.tokenizer.eod == summary.eod and len(dataset) == summary.samples
    # In storage order, samples cut the EOD-joined document stream into seq + 1 windows that share one token.
    stream = np.concatenate([indexed[int(d)] for d in dataset.document_index])
    eod_positions = set(np.flatnonzero(stream == summary.eod))
    ends = set(np.cumsum([indexed.sequence_lengths[int(d)] for d in dataset.document_index]) - 1)
    assert eod_positions == ends
    for i in range(len(dataset)):
        sample = dataset[int(np.flatnonzero(dataset.shuffle_index == i)[0])]
        assert sample["tokens"].shape == (seq,) and sample["labels"].shape == (seq,)
        window = np.append(sample["tokens"].numpy(), sample["labels"][-1].item())
        assert np.array_equal(window, stream[i * seq : i * seq + seq + 1])


def test_document_bounds_follow_megatron_reset_mask_and_positions(corpus):
    """The packed path's cu_seqlens give exactly Megatron's reset_attention_mask (block-diagonal
    causal, the EOD closing its document) and its reset_position_ids (offsets in the document)."""
    seq = 128
    summary, _, _, dataset = _gpt_dataset(corpus, "pack_reset", seq, reset=True)
    seen_inner = False
    for i in range(len(dataset)):
        sample = dataset[i]
        tokens = sample["tokens"].view(1, seq).long()
        cu = document_bounds(tokens, summary.eod)
        seen_inner |= len(cu) > 2
        starts = cu.long()[torch.searchsorted(cu.long(), torch.arange(seq), right=True) - 1]
        key = torch.arange(seq)
        allowed = (key.view(1, -1) >= starts.view(-1, 1)) & (key.view(1, -1) <= key.view(-1, 1))
        assert torch.equal(~sample["attention_mask"][0], allowed), i  # Megatron: True = masked
        assert torch.equal(sample["position_ids"], key - starts), i
    assert seen_inner  # some sample holds a boundary


def test_packed_options_are_checked():
    args = SimpleNamespace(
        reset_attention_mask=True, reset_position_ids=True, micro_batch_size=2, pipeline_model_parallel_size=1
    )
    with pytest.raises(ValueError, match=r"megatron\.micro_batch_size=2 is not accepted.*one sequence per"):
        check_document_options(args)
    args.micro_batch_size, args.pipeline_model_parallel_size = 1, 2
    with pytest.raises(ValueError, match=r"megatron\.pipeline_model_parallel_size=2"):
        check_document_options(args)
    args.pipeline_model_parallel_size, args.reset_attention_mask = 1, False
    with pytest.raises(ValueError, match=r"megatron\.reset_position_ids=True.*reset_attention_mask=true"):
        check_document_options(args)
    args.reset_position_ids = False
    check_document_options(args)


def test_synthetic_documents_are_deterministic_and_retrievable(corpus):
    first = [d.text for d in generate_documents(6, 2000, seed=3)]
    assert first == [d.text for d in generate_documents(6, 2000, seed=3)]
    assert first[:4] == [d.text for d in generate_documents(4, 2000, seed=3)]
    assert first != [d.text for d in generate_documents(6, 2000, seed=4)]
    depths = []
    for i in range(24):
        doc = make_document("passkey", 3000, seed=5, index=i)
        assert find_passkey(doc.text) == doc.answer and doc.text.count(doc.answer) == 2
        assert doc.text.endswith(f"What is the pass key? The pass key is {doc.answer}.")
        needle = doc.text.index(f"The pass key is {doc.answer}. Remember it.")
        assert abs(needle / len(doc.text) - doc.depth) < 0.05
        depths.append(doc.depth)
        assert abs(len(doc.text) - 3000) < 200
    assert min(depths) < 0.25 and max(depths) > 0.75  # needles land at every depth
    copy = make_document("copy", 3000, seed=5, index=1)
    assert find_copy_span(copy.text) == copy.answer and copy.text.endswith(copy.answer)
    tok = load_tokenizer(corpus / "tokenizer")
    count = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    doc = make_document("passkey", 1500, seed=0, count_tokens=count)
    assert 1500 <= count(doc.text) <= 1500 + 60


def test_make_synthetic_docs_cli(tmp_path, capsys):
    main = _script("make_synthetic_docs").main
    main(
        ["--out", str(tmp_path / "d.jsonl"), "--num-docs", "3", "--length", "500", "--kinds", "passkey", "--seed", "2"]
    )
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").open()]
    assert [r["kind"] for r in records] == ["passkey"] * 3 and all(
        find_passkey(r["text"]) == r["answer"] for r in records
    )


def test_prepare_data_cli_flags(corpus, capsys):
    _script("prepare_data").main(
        ["--input", str(corpus / "short.jsonl"), "--tokenizer", str(corpus / "tokenizer"),
         "--output-prefix", str(corpus / "cli"), "--seq-length", "64", "--no-progress"]
    )  # fmt: skip
    assert "total: 30 documents" in capsys.readouterr().out
    assert _docs(str(corpus / "cli.sources" / "input")) == _encode(corpus, _texts(corpus / "short.jsonl"))


def test_example_config_validates(corpus, tmp_path, monkeypatch):
    # The example's inputs are made by its own commands; here stand-ins in a scratch working directory.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "synthetic").mkdir(parents=True)
    for name in ("long", "short"):
        (tmp_path / "data" / "synthetic" / f"{name}.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "data" / "synthetic" / "tokenizer").mkdir()
    config = MixConfig.from_yaml(ROOT / "configs" / "data" / "synthetic_mix.yaml")
    assert [s.name for s in config.sources] == ["long", "short"] and config.weighted
    assert len(config.sources[0].paths) == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_length": None}, "seq_length=None"),
        ({"seq_length": 0}, "seq_length=0"),
        ({"colour": 1}, "unknown field(s) colour"),
        ({"tokenizer": "/nonexistent/tok"}, "tokenizer='/nonexistent/tok'"),
        ({"sources": []}, "sources=[]"),
        ({"sources": [{"name": "a", "paths": ["/nonexistent.jsonl"]}]}, "sources[a].paths='/nonexistent.jsonl'"),
        (
            {"sources": [{"name": "a", "paths": ["{long}"], "min_tokens": 10, "max_tokens": 5}]},
            "sources[a].max_tokens=5",
        ),
        ({"sources": [{"name": "a", "paths": ["{long}"], "weight": -1}]}, "sources[a].weight=-1"),
        ({"sources": [{"name": "a", "paths": ["{long}"], "weight": 1, "repeat": 2}]}, "sources[a].repeat=2"),
        (
            {"sources": [{"name": "a", "paths": ["{long}"], "weight": 1}, {"name": "b", "paths": ["{long}"]}]},
            "sources[b].weight is missing",
        ),
        ({"sources": [{"name": "a", "paths": ["{long}"]}, {"name": "a", "paths": ["{long}"]}]}, "sources[].name='a'"),
        ({"sources": [{"name": "a", "paths": ["{long}"], "text_key": ""}]}, "sources[a].text_key=''"),
        ({"total_tokens": 100}, "total_tokens=100"),
        ({"valid_fraction": 1}, "valid_fraction=1"),
        ({"valid_fraction": "5%"}, "valid_fraction='5%'"),
    ],
)
def test_bad_config_names_the_field(corpus, change, message):
    raw = {
        "tokenizer": str(corpus / "tokenizer"),
        "output_prefix": str(corpus / "bad"),
        "seq_length": 64,
        "sources": [{"name": "a", "paths": [str(corpus / "long.jsonl")]}],
    }
    raw |= json.loads(json.dumps(change).replace("{long}", str(corpus / "long.jsonl")))
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError) as err:
        MixConfig.from_dict(raw)
    assert message in str(err.value)


def test_bad_input_records_name_file_and_line(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no field text_key='text'"):
        prepare(_config(corpus, "badrec", [{"name": "a", "paths": [str(bad)]}]), False)
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        prepare(_config(corpus, "badrec", [{"name": "a", "paths": [str(bad)]}]), False)
    with pytest.raises(ValueError, match=r"sources\[a\]: none of its 30 documents"):
        prepare(
            _config(corpus, "badrec", [{"name": "a", "paths": [str(corpus / "short.jsonl")]}], min_tokens=10**6), False
        )


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_arguments_are_checked_up_front():
    with pytest.raises(ValueError, match=r"kinds=\('passkey', 'bogus'\)"):
        generate_documents(2, 100, seed=0, kinds=("passkey", "bogus"))
    with pytest.raises(ValueError, match="length=0"):
        make_document("filler", 0, seed=0)


def _tree(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes); directories count as files of ``b""``."""
    return {str(p.relative_to(directory)): b"" if p.is_dir() else p.read_bytes() for p in directory.rglob("*")}


def test_failed_run_keeps_the_finished_output(corpus, tmp_path):
    long, short = str(corpus / "long.jsonl"), str(corpus / "short.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    finished = {"tokenizer": str(corpus / "tokenizer"), "output_prefix": str(out / "mix"), "seq_length": 64}
    prepare(
        MixConfig.from_dict(finished | {"sources": [{"name": "a", "paths": [long]}, {"name": "b", "paths": [short]}]}),
        False,
    )
    before = _tree(out)
    assert set(before) == {
        "mix.bin",
        "mix.idx",
        "mix.summary.json",
        "mix.sources",
        *(f"mix.sources/{s}.{e}" for s in "ab" for e in ("bin", "idx")),
    }
    # A re-run whose source a differs (its shard would change) and whose source b fails midway.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 100 + "not json\n")
    rerun = MixConfig.from_dict(
        finished | {"batch_size": 8, "sources": [{"name": "a", "paths": [short]}, {"name": "b", "paths": [str(bad)]}]}
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:101: not valid JSON"):
        prepare(rerun, False)
    assert _tree(out) == before
    # A good re-run replaces the shards and the mix, and leaves nothing else.
    prepare(dataclasses.replace(rerun, sources=rerun.sources[:1]), False)
    assert set(_tree(out)) == set(before)
    assert _docs(str(out / "mix.sources" / "a")) == _encode(corpus, _texts(corpus / "short.jsonl"))
    assert sorted(_docs(str(out / "mix"))) == sorted(_docs(str(out / "mix.sources" / "a")))


def test_failed_first_run_leaves_nothing(corpus, tmp_path, monkeypatch):
    from megatron_mtraining.data import indexed

    class FailingTokenizer(_CountingTokenizer):
        """The real tokenizer until its third batch, which raises."""

        def __call__(self, texts, **kwargs):
            if self.calls == 2:
                raise RuntimeError("tokenizer failed")
            return super().__call__(texts, **kwargs)

    monkeypatch.setattr(indexed, "load_tokenizer", lambda path: FailingTokenizer(load_tokenizer(path)))
    sources = [{"name": "s", "paths": [str(corpus / "short.jsonl")]}]
    config = _config(corpus, "unused", sources, output_prefix=str(tmp_path / "new" / "mix"), batch_size=8)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        prepare(config, False)
    assert _tree(tmp_path) == {"new": b""}


# ---- local real text -------------------------------------------------------------------------
@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """``fakepkg`` 1.2.3 installed with its metadata in a folder on ``sys.path``: a module, a
    sub-package, tests, byte code, a generated file, a table of numbers and a non-UTF-8 file."""
    site = tmp_path / "site"
    files = {
        "fakepkg/__init__.py": "from . import core\n",
        "fakepkg/core.py": "def add(a, b):\n    return a + b\n",
        "fakepkg/sub/__init__.py": '"""A sub-package."""\n',
        "fakepkg/sub/b.py": "B = 2\n",
        "fakepkg/sub/a.py": "A = 1\n",
        "fakepkg/sub/tests/test_a.py": "def test_a():\n    pass\n",
        "fakepkg/tests/__init__.py": "",
        "fakepkg/tests/test_core.py": "def test_add():\n    pass\n",
        "fakepkg/__pycache__/core.py": "stale = True\n",
        "fakepkg/sub/patterns.py": "# This is an auto-generated file. Please do not modify it by hand.\nP = 0\n",
        "fakepkg/sub/table.py": "T = [" + ", ".join(str(10**6 + i) for i in range(200)) + "]\n",
    }
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    (site / "fakepkg/sub/latin.py").write_bytes("N = 'caf\xe9'\n".encode("latin-1"))
    info = site / "fakepkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.2.3\n")
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in [*files, "fakepkg/sub/latin.py"]))
    # Sources without metadata: importable, but no distribution gives them a version.
    (site / "loose").mkdir()
    (site / "loose/__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("fakepkg", "fakepkg.core", "fakepkg.sub", "loose"):
        sys.modules.pop(name, None)


def test_package_documents_name_their_files_and_skip_tests_and_generated(fake_site):
    package = find_package("fakepkg")
    assert package.record() == {"name": "fakepkg", "distribution": "fakepkg", "version": "1.2.3"}
    assert package.path == fake_site / "fakepkg"
    docs = package_documents(package)
    assert {d.name: d.text for d in docs} == {
        "package:fakepkg/fakepkg": "from . import core\n",
        "package:fakepkg/fakepkg.core": "def add(a, b):\n    return a + b\n",
        # Path order; the tests, the generated file, the table and the latin-1 file are left out.
        "package:fakepkg/fakepkg.sub": '# file: fakepkg/sub/__init__.py\n"""A sub-package."""\n\n'
        "# file: fakepkg/sub/a.py\nA = 1\n\n# file: fakepkg/sub/b.py\nB = 2\n",
    }
    assert package_documents(find_package("fakepkg")) == docs
    # A sub-package by its dotted name: its modules are the documents, paths from the site.
    sub = find_package("fakepkg.sub")
    assert (sub.name, sub.version) == ("fakepkg.sub", "1.2.3")
    assert [(d.name, d.text) for d in package_documents(sub)] == [
        ("package:fakepkg/fakepkg.sub", '"""A sub-package."""\n'),
        ("package:fakepkg/fakepkg.sub.a", "A = 1\n"),
        ("package:fakepkg/fakepkg.sub.b", "B = 2\n"),
    ]
    assert find_package("fakepkg_missing") is None and find_package("loose") is None
    assert "fakepkg" in installed_packages() and "loose" not in installed_packages()


def test_installed_package_documents_are_deterministic():
    package = find_package("jinja2")
    assert package.version == importlib.metadata.version("jinja2")
    docs = package_documents(package)
    assert docs == package_documents(find_package("jinja2"))
    names = [d.name for d in docs]
    assert names == sorted(names) and "package:Jinja2/jinja2.compiler" in names
    assert docs[names.index("package:Jinja2/jinja2.compiler")].text == (package.path / "compiler.py").read_text()
