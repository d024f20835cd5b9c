#!/usr/bin/env python
"""Hugging Face Qwen2 / Llama checkpoint (local directory, safetensors) -> Megatron checkpoint.

  python scripts/convert_hf_to_megatron.py HF_DIR OUT_DIR [--padded-vocab-size N] \\
      [--attention '{type: msa, msa: {index_head_dim: 64}}'] [--yaml OUT.yaml]

OUT_DIR is a Megatron save directory (release/ in torch_dist format and
latest_checkpointed_iteration.txt) for `megatron.load=OUT_DIR`. The Megatron arguments that
reproduce the architecture are printed as the YAML `megatron:` section (and written with
--yaml); the run's padded vocabulary must equal the checkpoint's (--padded-vocab-size, default
the Hugging Face vocab_size). One CPU process; no GPU needed.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from megatron_mtraining.convert import ConversionError, import_hf, save_megatron_checkpoint
from megatron_mtraining.convert.hf_import import single_process_megatron
from megatron_mtraining.megatron import MTrainingAttentionConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    parser.add_argument("out_dir", help="Megatron save directory to write")
    parser.add_argument("--padded-vocab-size", type=int, help="embedding rows in Megatron (extra rows are zero)")
    parser.add_argument(
        "--attention",
        help="the plugin's attention section as YAML/JSON (default dense; MSA's index branch starts fresh)",
    )
    parser.add_argument("--yaml", help="also write the Megatron arguments to this YAML file")
    args = parser.parse_args(argv)
    attention = yaml.safe_load(args.attention) if args.attention else None
    try:
        with single_process_megatron():
            config = MTrainingAttentionConfig.from_dict(attention) if attention else None
            model, spec = import_hf(args.hf_dir, attention=config, padded_vocab_size=args.padded_vocab_size)
            folder = save_megatron_checkpoint(model, spec, args.out_dir, args.padded_vocab_size, attention)
    except (ConversionError, ValueError) as error:
        sys.exit(f"conversion error: {error}")
    section = {"megatron": spec.megatron_args()}
    text = yaml.safe_dump(section, sort_keys=False)
    if args.yaml:
        with open(args.yaml, "w") as f:
            f.write(text)
    padded = args.padded_vocab_size or spec.vocab_size
    print(
        f"wrote {folder}\n# Megatron arguments for this model (the run's padded vocabulary must be {padded}):\n{text}"
    )


if __name__ == "__main__":
    main()
