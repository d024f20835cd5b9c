#!/usr/bin/env python
"""Writes seeded synthetic long documents (passkey / copy / filler) as jsonl, and optionally a
tiny byte-level BPE tokenizer trained on them (for machines without a model hub).

  python scripts/make_synthetic_docs.py --out data/synthetic/passkey.jsonl --num-docs 64 \\
      --length 16000 --kinds passkey,copy --seed 0 [--train-tokenizer data/synthetic/tokenizer]
  python scripts/make_synthetic_docs.py --out data/x.jsonl --length 4096 --unit tokens --tokenizer DIR
"""

from __future__ import annotations

import argparse

from megatron_mtraining.data.synthetic_docs import KINDS, UNITS, generate_documents, write_jsonl
from megatron_mtraining.data.tokenizer import load_tokenizer, train_tiny_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output .jsonl path")
    parser.add_argument("--num-docs", type=int, default=32)
    parser.add_argument("--length", type=int, default=16000, help="target length of each document, in --unit")
    parser.add_argument("--unit", choices=UNITS, default="chars")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, taken in turn; of {', '.join(KINDS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="local HF tokenizer directory; required with --unit tokens")
    parser.add_argument(
        "--train-tokenizer", metavar="DIR", help="also train a tiny BPE on the documents and save it to DIR"
    )
    parser.add_argument("--vocab-size", type=int, default=512, help="vocabulary of --train-tokenizer")
    args = parser.parse_args(argv)

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    count_tokens = None
    if args.unit == "tokens":
        if not args.tokenizer:
            parser.error("--unit tokens needs --tokenizer DIR (a local Hugging Face tokenizer)")
        tok = load_tokenizer(args.tokenizer)
        count_tokens = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    try:
        count = write_jsonl(generate_documents(args.num_docs, args.length, args.seed, kinds, count_tokens), args.out)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {count} documents to {args.out}")
    if args.train_tokenizer:
        texts = (doc.text for doc in generate_documents(args.num_docs, args.length, args.seed, kinds, count_tokens))
        print(f"tokenizer saved to {train_tiny_tokenizer(texts, args.train_tokenizer, args.vocab_size)}")


if __name__ == "__main__":
    main()
