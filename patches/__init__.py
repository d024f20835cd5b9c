"""Changes megatron-mtraining makes to Megatron-Core, one module per patched function.

Installed as ``megatron_mtraining.patches``. Each patch is applied explicitly by one
call, is guarded by the megatron-core version it was written for, and has a test that
fails loudly if the patched upstream function changed. The Megatron integration
(context-parallel batch split and RoPE positions for the striped layout) adds them.
"""
