"""Shared by the evaluation tests: a tiny byte-level BPE whose merges cover the task texts, so
every task fits in a few hundred tokens."""

from __future__ import annotations

from pathlib import Path

from megatron_mtraining.data import generate_documents, load_tokenizer, train_tiny_tokenizer
from megatron_mtraining.evaluation.tasks import TASKS, Codec, make_sample

# Bytes as tokens, to write task texts before any tokenizer exists.
BYTES = Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode())


def train_task_tokenizer(out_dir: Path) -> Path:
    texts = [doc.text for doc in generate_documents(12, 3000, seed=0)]
    texts += [BYTES.decode(make_sample(task, 1500, 0.5, 99, i, BYTES).ids()) for task in TASKS for i in range(3)]
    return train_tiny_tokenizer(texts, out_dir)


def codec_of(path: Path) -> tuple[Codec, int]:
    """The tokenizer at ``path`` as a codec (no special tokens, as Megatron's tokenize), and its EOD id."""
    tokenizer = load_tokenizer(path)
    codec = Codec(
        lambda text: tokenizer.encode(text, add_special_tokens=False), lambda ids: tokenizer.decode(list(ids))
    )
    return codec, tokenizer.eos_token_id
