"""Data preparation: synthetic long documents, and jsonl / parquet text -> Megatron indexed datasets.

| module | one job |
|---|---|
| `synthetic_docs.py` | seeded passkey / copy / filler long documents, written as jsonl |
| `tokenizer.py` | Hugging Face tokenizers from a local directory; a tiny BPE trained on the fly |
| `config.py` | the data-mix YAML (`MixConfig`), validated with errors naming the field |
| `readers.py` | streamed text records from jsonl and parquet |
| `indexed.py` | tokenise, filter, mix (weights / repeat), shuffle and write `.bin/.idx`; the summary |
"""

from .config import MixConfig, SourceConfig
from .indexed import PrepareSummary, SourceStats, prepare
from .synthetic_docs import SyntheticDoc, find_copy_span, find_passkey, generate_documents, make_document, write_jsonl
from .tokenizer import load_tokenizer, train_tiny_tokenizer

__all__ = [
    "MixConfig",
    "PrepareSummary",
    "SourceConfig",
    "SourceStats",
    "SyntheticDoc",
    "find_copy_span",
    "find_passkey",
    "generate_documents",
    "load_tokenizer",
    "make_document",
    "prepare",
    "train_tiny_tokenizer",
    "write_jsonl",
]
