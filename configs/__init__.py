"""The run configs of ``python -m megatron_mtraining.pretrain``, shipped with the package.

This is the top-level ``configs/`` folder of the source tree, installed as
``megatron_mtraining.configs`` (``pyproject.toml`` maps it, as it maps ``patches/``), so an
installed package holds the same files. ``--config`` takes a path; where none exists,
:func:`find` takes it as the name of a packaged recipe (``qwen2.5-3b/512k.yaml``). A recipe
names its ``base:`` file relative to itself, and that file is packaged beside it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Data mixes for scripts/prepare_data.py, not run configs.
_DATA_MIXES = "data"


def packaged(name: str) -> Path:
    """The packaged file ``name``, a path relative to this folder (``data/synthetic_mix.yaml``)."""
    # Packages are installed as directories, so these are plain files: the training processes
    # read them by path, and a recipe's base: file resolves beside it.
    return Path(str(resources.files(__name__))) / name


def recipes() -> list[str]:
    """The names of the packaged run configs."""
    root = packaged("")
    names = (path.relative_to(root) for path in root.rglob("*.yaml"))
    return sorted(name.as_posix() for name in names if name.parts[0] != _DATA_MIXES)


def find(path: str | Path, field: str = "--config") -> Path:
    """``path`` where it exists, else the packaged recipe of that name; raises
    ``FileNotFoundError`` naming ``field``, the value and what is accepted."""
    given = Path(path)
    if given.exists():
        return given
    if not given.is_absolute() and ".." not in given.parts and packaged(given.as_posix()).is_file():
        return packaged(given.as_posix())
    raise FileNotFoundError(
        f"{field}={str(path)!r}: no such file, and no recipe of that name is packaged with megatron_mtraining "
        f"(accepted: the path of a YAML run config, or a packaged recipe: {', '.join(recipes())})"
    )
