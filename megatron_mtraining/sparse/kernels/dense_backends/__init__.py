"""Whole causal attention on other libraries' kernels: flash-attn (``flash_attn``,
optional) and PyTorch's fused attention (``sdpa``)."""
