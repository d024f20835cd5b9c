"""Held-out long documents for the loss by position: windows of ``length + 1`` token ids, from
a Megatron indexed dataset or from the synthetic long documents of ``data.synthetic_docs``.

From an indexed dataset (the ``.bin`` / ``.idx`` prefix that ``scripts/prepare_data.py``
writes, of documents the model did not train on), window ``i`` at a length is the start of
the ``i``-th document, in dataset order, that holds at least ``length + 1`` tokens. Without
one, window ``i`` is synthetic document ``i`` (passkey, copy and filler in turn) of the stream
``HELD_OUT_SEED + seed``, which the quickstart's training documents (streams 0 and 1) do not
use, written to at least ``length + 1`` tokens of the run's tokenizer.
"""

from __future__ import annotations

import functools
import os

from ..data.synthetic_docs import KINDS, make_document
from .tasks import Codec

HELD_OUT_SEED = 9973


class HeldOut:
    def __init__(self, path: str | None = None, seed: int = 0):
        self.path, self.seed = path, seed
        self._long: dict[int, list[int]] = {}  # length -> the documents longer than it
        if path is not None and not all(os.path.isfile(path + ext) for ext in (".bin", ".idx")):
            raise ValueError(
                f"--ppl-data={path!r}: {path}.bin / {path}.idx do not exist (accepted: the prefix of an indexed "
                "dataset, as scripts/prepare_data.py writes it, or no --ppl-data for synthetic documents)"
            )

    def describe(self) -> str:
        if self.path is None:
            return f"synthetic documents ({', '.join(KINDS)}), stream {HELD_OUT_SEED + self.seed}"
        return f"indexed dataset {self.path}"

    @functools.cached_property
    def _dataset(self):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        return IndexedDataset(self.path)

    def _long_documents(self, length: int) -> list[int]:
        if length not in self._long:
            self._long[length] = [i for i, n in enumerate(self._dataset.sequence_lengths) if n > length]
        return self._long[length]

    def check(self, lengths, count: int) -> None:
        """Raises ``ValueError`` unless an indexed dataset has ``count`` documents long
        enough for every length (synthetic documents always exist)."""
        if self.path is None:
            return
        for length in lengths:
            found = len(self._long_documents(length))
            if found < count:
                longest = int(self._dataset.sequence_lengths.max()) if len(self._dataset) else 0
                raise ValueError(
                    f"--ppl-data={self.path!r}: documents of at least {length + 1} tokens (length {length}): {found}, "
                    f"--ppl-docs asks {count}; the longest holds {longest} tokens (accepted: a dataset with {count} "
                    "such documents, or a smaller --ppl-docs or length)"
                )

    def window(self, length: int, index: int, codec: Codec) -> list[int]:
        """Window ``index`` at ``length``: ``length + 1`` ids (of ``codec`` for synthetic
        documents)."""
        if self.path is not None:
            return self._dataset[self._long_documents(length)[index]][: length + 1].tolist()
        doc = make_document(
            KINDS[index % len(KINDS)],
            length + 1,
            HELD_OUT_SEED + self.seed,
            index,
            count_tokens=lambda text: len(codec.encode(text)),
        )
        return codec.encode(doc.text)[: length + 1]
