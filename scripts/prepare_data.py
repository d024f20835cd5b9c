#!/usr/bin/env python
"""jsonl / parquet text -> Megatron indexed dataset (.bin/.idx) for `--data-path`.

  python scripts/prepare_data.py --config configs/data/synthetic_mix.yaml
  python scripts/prepare_data.py --input a.jsonl --input b.parquet --tokenizer DIR \\
      --output-prefix data/mix --seq-length 4096 [--min-tokens N] [--max-tokens N]

With --config, the flags given override the config's top-level fields. Without it, the inputs
form one source. See megatron_mtraining/data/config.py for the config's fields. The outputs
appear only when the whole run succeeds: a failed run leaves no partial file, and the output
of an earlier run over the same prefix as it was.
"""

from __future__ import annotations

import argparse
import sys

from megatron_mtraining.data.config import MixConfig
from megatron_mtraining.data.indexed import prepare


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="data-mix YAML")
    parser.add_argument("--input", action="append", help="jsonl / parquet file or glob (repeatable; without --config)")
    parser.add_argument("--text-key", default="text", help="field holding the text (without --config)")
    parser.add_argument("--tokenizer", help="local Hugging Face tokenizer directory")
    parser.add_argument("--output-prefix", help="writes PREFIX.bin/.idx, PREFIX.sources/, PREFIX.summary.json")
    parser.add_argument("--seq-length", type=int, help="training sequence length")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--min-tokens", type=int, help="drop shorter documents (tokens, EOD excluded); for sources that set none"
    )
    parser.add_argument("--max-tokens", type=int, help="drop longer documents; for sources that set none")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    overrides = {
        "tokenizer": args.tokenizer,
        "output_prefix": args.output_prefix,
        "seq_length": args.seq_length,
        "seed": args.seed,
        "min_tokens": args.min_tokens,
        "max_tokens": args.max_tokens,
    }
    try:
        if args.config:
            if args.input:
                parser.error("--input and --config exclude each other: list the inputs as sources in the config")
            config = MixConfig.from_yaml(args.config, **overrides)
        else:
            if not args.input:
                parser.error("give --config or at least one --input")
            raw = {k: v for k, v in overrides.items() if v is not None}
            config = MixConfig.from_dict(
                raw | {"sources": [{"name": "input", "paths": args.input, "text_key": args.text_key}]}
            )
        summary = prepare(config, progress=not args.no_progress)
    except (ValueError, OSError) as err:  # OSError: an unreadable input, an unwritable output
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(summary.format())


if __name__ == "__main__":
    main()
