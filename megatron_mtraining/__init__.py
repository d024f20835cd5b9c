"""megatron-mtraining: dynamic sparse attention with context parallelism for Megatron-Core."""

__version__ = "0.1.0"

# The Megatron layer imports megatron.core (seconds); load it on first use so that the
# sparse and context-parallel layers stay light.
_MEGATRON_EXPORTS = ("MTrainingAttentionConfig", "get_gpt_decoder_block_spec", "get_gpt_layer_spec")


def __getattr__(name):
    if name in _MEGATRON_EXPORTS:
        from . import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
