"""megatron-mtraining: dynamic sparse attention with context parallelism for Megatron-Core."""

__version__ = "0.1.0"
