"""GPU kernels behind ``sparse_attention`` (Triton). Imported lazily: the package works
without Triton, on the reference path."""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
