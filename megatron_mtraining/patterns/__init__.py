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

from ..sparse.validation import fail
from .base import Pattern

_REGISTRY: dict[str, type[Pattern]] = {}
# Dense first in messages, then the sparse patterns by name.
_FIRST = ("dense",)


def register(cls: type[Pattern]) -> type[Pattern]:
    """Class decorator: makes ``cls`` the pattern of ``attention.type == cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Pattern)):
        fail("pattern class", cls, "a subclass of megatron_mtraining.patterns.base.Pattern")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        fail("pattern name", cls.name, f"a name not taken (by {_REGISTRY[cls.name].__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """Every registered ``attention.type``."""
    return tuple(sorted(_REGISTRY, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n)))


def get(name: str) -> type[Pattern]:
    """The pattern class of ``attention.type == name``."""
    if name not in _REGISTRY:
        fail("attention.type", name, f"one of {', '.join(names())}")
    return _REGISTRY[name]


def with_settings() -> tuple[type[Pattern], ...]:
    """The patterns that have a settings section (``attention.<name>``), in :func:`names` order."""
    return tuple(cls for cls in map(get, names()) if cls.settings is not None)


for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Pattern", "get", "names", "register", "with_settings"]
