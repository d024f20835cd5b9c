"""Moving a stage's outputs between machines in files of bounded size.

A stage on one machine may need an earlier stage's outputs from another (the project's GPU
machines start empty and return at most a few files of 16 MiB each). :func:`export` packs
workdir paths into one tar archive written as parts ``<name>.tar.000``, ``.001``, ... of at
most :data:`PART_BYTES`; :func:`import_archives` finds the parts of every archive in the
given files and folders and unpacks them into a workdir (members outside it are refused, as
tarfile's ``data`` filter refuses them).
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

PART_BYTES = 15 * 2**20
PART = re.compile(r"(.+\.tar)\.(\d{3})$")


class _PartWriter:
    """A write-only file object that cuts what it is given into numbered parts."""

    def __init__(self, out_dir: Path, name: str):
        self.out_dir, self.name = out_dir, name
        self.parts: list[Path] = []
        self.file = None
        self.room = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self.room == 0:
                self._next()
            taken = view[: self.room]
            self.file.write(taken)
            self.room -= len(taken)
            view = view[len(taken) :]
        return len(data)

    def _next(self) -> None:
        if self.file is not None:
            self.file.close()
        self.parts.append(self.out_dir / f"{self.name}.tar.{len(self.parts):03d}")
        self.file = self.parts[-1].open("wb")
        self.room = PART_BYTES

    def close(self) -> None:
        if self.file is None:
            self._next()
        self.file.close()


class _JoinedReader:
    """A read-only file object over parts read one after another."""

    def __init__(self, parts: list[Path]):
        self.parts = list(parts)
        self.file = None

    def read(self, size: int = -1) -> bytes:
        chunks = []
        while size != 0:
            if self.file is None:
                if not self.parts:
                    break
                self.file = self.parts.pop(0).open("rb")
            chunk = self.file.read(size)
            if not chunk:
                self.file.close()
                self.file = None
                continue
            chunks.append(chunk)
            if size > 0:
                size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def export(workdir: Path, paths: Iterable[Path], out_dir: Path, name: str, exclude: Iterable[Path] = ()) -> list[Path]:
    """Packs the workdir-relative ``paths`` (files or folders, those that exist), less the
    ``exclude``d ones, into ``out_dir/<name>.tar.NNN``; returns the parts."""
    workdir, out_dir = Path(workdir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{name}.tar.[0-9][0-9][0-9]"):
        old.unlink()
    excluded = {Path(p) for p in exclude}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if Path(info.name) in excluded else info

    writer = _PartWriter(out_dir, name)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        for path in paths:
            if (workdir / path).exists():
                tar.add(workdir / path, arcname=Path(path).as_posix(), filter=keep)
    writer.close()
    return writer.parts


def find_archives(sources: Iterable[Path]) -> dict[str, list[Path]]:
    """Archive name -> its parts in order, from the given part files and folders."""
    archives: dict[str, list[Path]] = {}
    for source in map(Path, sources):
        files = sorted(source.iterdir()) if source.is_dir() else [source]
        for path in files:
            if match := PART.match(path.name):
                archives.setdefault(match.group(1), []).append(path)
    for name, parts in archives.items():
        parts.sort(key=lambda p: p.name)
        numbers = [int(PART.match(p.name).group(2)) for p in parts]
        if numbers != list(range(len(parts))):
            raise ValueError(f"archive {name}: parts {numbers} found (accepted: every part from 000 on, once)")
    return archives


def import_archives(sources: Iterable[Path], workdir: Path) -> list[str]:
    """Unpacks every archive found in ``sources`` into ``workdir``; returns their names."""
    sources = list(sources)
    archives = find_archives(sources)
    if not archives:
        raise ValueError(f"no archive parts (NAME.tar.000, ...) in {', '.join(map(str, sources))}")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    for parts in archives.values():
        reader = _JoinedReader(parts)
        try:
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                tar.extractall(workdir, filter="data")
        finally:
            reader.close()
    return sorted(archives)
