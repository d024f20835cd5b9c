"""GPU kernels behind ``sparse_attention``, one sub-package per family: ``block_bar``
(query-major tile + bar attention and its tile tables), ``kv_outer`` (KV-outer attention
over top-k selections), ``index_build`` (the index builders' kernels), ``shared`` (what both
attention families use) and ``dense_backends`` (whole causal attention on other libraries'
kernels). Modules that import Triton are imported lazily: the package works without
Triton, on the reference path."""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
