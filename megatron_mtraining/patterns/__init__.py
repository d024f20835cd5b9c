"""The attention patterns: one module per pattern, each registering one
:class:`~megatron_mtraining.patterns.base.Pattern` class under its ``attention.type`` name.

Every caller that depends on the pattern asks this registry (:func:`get`, :func:`names`)
rather than testing types: the plugin config (its sections and checks), the core attention
and the ring (index builders), the memory estimate and the metrics. A new pattern is one
new module here (discovered on import) plus its tests.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Pattern
from .registry import get, names, register, with_settings

# Every other module of this package is a pattern; importing it registers it.
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Pattern", "get", "names", "register", "with_settings"]
