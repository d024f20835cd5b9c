#!/usr/bin/env python
"""Megatron checkpoint (torch_dist save directory) -> Hugging Face safetensors + config.json.

  python scripts/convert_megatron_to_hf.py MEGATRON_DIR OUT_DIR [--dtype bfloat16]
      [--model-type qwen2|llama --vocab-size N]

A checkpoint written by convert_hf_to_megatron.py carries its Hugging Face config. For one
written by training, the architecture comes from its Megatron arguments: --model-type names the
Hugging Face class (qwen2 needs add_qkv_bias, llama none) and --vocab-size the unpadded
vocabulary (default the padded one). YaRN settings become `rope_scaling`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_mtraining.convert import (
    ConversionError,
    checkpoint_folder,
    checkpoint_spec,
    export_hf,
    load_megatron_checkpoint,
)
from megatron_mtraining.convert.hf_import import single_process_megatron


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("megatron_dir", help="Megatron save directory (with latest_checkpointed_iteration.txt)")
    parser.add_argument("out_dir", help="Hugging Face directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the source config's")
    parser.add_argument("--model-type", choices=["qwen2", "llama"], help="for checkpoints written by training")
    parser.add_argument("--vocab-size", type=int, help="unpadded vocabulary, for checkpoints written by training")
    args = parser.parse_args(argv)
    try:
        with single_process_megatron():
            spec = checkpoint_spec(checkpoint_folder(args.megatron_dir), args.model_type, args.vocab_size)
            model, spec = load_megatron_checkpoint(args.megatron_dir, spec=spec)
            out = export_hf(model, spec, args.out_dir, getattr(torch, args.dtype) if args.dtype else None)
    except (ConversionError, ValueError) as error:
        sys.exit(f"conversion error: {error}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
