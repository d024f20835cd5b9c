"""Hugging Face tokenizers from a local directory, and a tiny one trained on the fly.

Training machines here reach no model hub, so a tokenizer is always a local directory
(``AutoTokenizer.from_pretrained(path)``: a downloaded Qwen2.5 / Llama tokenizer, or the tiny
byte-level BPE that :func:`train_tiny_tokenizer` writes for tests and the embedded default).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOD_TOKEN = "<|endoftext|>"


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained`` on a local directory, with errors that name the path."""
    path = Path(path)
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"tokenizer={str(path)!r}: no tokenizer.json or tokenizer_config.json there; "
            "expected a local Hugging Face tokenizer directory (save_pretrained output)"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def train_tiny_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Trains a byte-level BPE on ``texts`` and saves it as a ``PreTrainedTokenizerFast``
    directory with ``<|endoftext|>`` as its EOS; byte-level, so every text encodes losslessly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN, pad_token=EOD_TOKEN).save_pretrained(
        str(out_dir)
    )
    return out_dir
