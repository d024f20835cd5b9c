"""The training program: ``python -m megatron_mtraining.pretrain`` on Megatron-LM's own
``pretrain``, built on the Megatron adapter (``megatron_mtraining.megatron``)."""
