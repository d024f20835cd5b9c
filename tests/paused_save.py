"""The training entry point with a checkpoint save that stops half-way: run as
``python tests/paused_save.py ITERATION --config ...`` (the entry point's arguments).

The save of iteration ``ITERATION`` writes its shards, then, where Megatron would write the
directory's ``metadata.json`` and then the tracker file, prints ``SAVE PAUSED <dir>`` and
sleeps, so that the test can kill the process with a half-written checkpoint on disk.
"""

from __future__ import annotations

import sys
import time

import megatron.core.dist_checkpointing.serialization as serialization

from megatron_mtraining.pretrain import main

if __name__ == "__main__":
    pause_at = f"iter_{int(sys.argv[1]):07d}"
    original = serialization.save_config

    def save_config(config, checkpoint_dir):
        if str(checkpoint_dir).rstrip("/").endswith(pause_at):
            print(f"SAVE PAUSED {checkpoint_dir}", flush=True)
            while True:
                time.sleep(60)
        return original(config, checkpoint_dir)

    serialization.save_config = save_config
    main(sys.argv[2:])
