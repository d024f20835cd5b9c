"""The registry of attention patterns: ``attention.type`` name -> pattern class."""

from __future__ import annotations

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
