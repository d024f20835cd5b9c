"""Real text that ships with every Python: the standard library's sources, the help topics of
``pydoc`` and the license, as documents for machines that reach no dataset hub.

* ``stdlib:<name>``: a top-level module's source, or a package's modules concatenated in path
  order, each after a ``# file: <path>`` line, as code datasets concatenate a repository's
  files into one long document (ProLong). Code, docstrings and comments: the longest
  documents, with references that reach back across files.
* ``pydoc:<topic>``: one help topic of ``pydoc_data.topics`` (English prose about the language).
* ``license``: the interpreter's ``LICENSE.txt``, where the installation has one.

Test suites, the codec tables of ``encodings`` (generated character maps, not text) and
``pydoc_data`` itself (its topics come as prose) are left out. The documents depend only on
the interpreter's installation: the same Python release gives the same text.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders of the standard library that hold no text to learn from (tests, generated tables,
# third-party installs, byte code) or that come in another form (pydoc_data's topics).
SKIPPED = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)


@dataclass(frozen=True)
class LocalDocument:
    name: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sources(folder: Path) -> list[Path]:
    """The ``.py`` files under ``folder``, in path order, outside the skipped folders."""
    return sorted(
        path
        for path in folder.rglob("*.py")
        if not SKIPPED.intersection(path.relative_to(folder).parts[:-1]) and path.is_file()
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_documents(root: Path | None = None) -> list[LocalDocument]:
    """One document per top-level module or package of the standard library at ``root``
    (default: this interpreter's), in name order."""
    root = root or stdlib_root()
    documents = []
    for entry in sorted(root.iterdir()):
        if entry.name in SKIPPED or entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            parts = [
                f"# file: {path.relative_to(root).as_posix()}\n{text}"
                for path in _sources(entry)
                if (text := _read(path))
            ]
            text = "\n".join(parts)
        elif entry.suffix == ".py" and entry.is_file():
            text = _read(entry) or ""
        else:
            continue
        if text.strip():
            documents.append(LocalDocument(f"stdlib:{entry.name.removesuffix('.py')}", text))
    return documents


def pydoc_documents() -> list[LocalDocument]:
    """The help topics of ``pydoc``, one document each, in topic order."""
    from pydoc_data.topics import topics

    return [LocalDocument(f"pydoc:{name}", topics[name]) for name in sorted(topics) if topics[name].strip()]


def license_documents(root: Path | None = None) -> list[LocalDocument]:
    path = (root or stdlib_root()) / "LICENSE.txt"
    text = _read(path) if path.is_file() else None
    return [LocalDocument("license", text)] if text else []


def python_documents(root: Path | None = None) -> list[LocalDocument]:
    """Every document above, sorted by name."""
    return sorted([*stdlib_documents(root), *pydoc_documents(), *license_documents(root)], key=lambda doc: doc.name)
