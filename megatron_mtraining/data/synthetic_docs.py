"""Long synthetic documents for tests, the embedded default and retrieval checks.

Three kinds, each over natural-ish filler (sentences drawn from a fixed word list):

* ``passkey``: a needle ("The pass key is 48213. Remember it.") at a random depth, and the
  question with its answer at the end, so a model trained on it learns to look back;
* ``copy``: a random span marked near the start and repeated at the end;
* ``filler``: filler only.

Every document is generated from its own ``random.Random(f"{seed}:{index}")``, so the first
``n`` documents do not depend on how many are asked for, and a seed always gives the same
text. Lengths are in characters, or in tokens when a ``count_tokens`` callable is given; a
document reaches its target and overshoots it by less than about one sentence.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

KINDS = ("passkey", "copy", "filler")
UNITS = ("chars", "tokens")

# Common words of several parts of speech, so the filler reads like text to a tokenizer (BPE
# merges, word-frequency skew) without carrying anything a model could retrieve.
_WORD_LIST = """
the of and to in is was for on that with as by at from his her they this had not are but which
have one were all their there been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such
like our over man me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take
three river garden window table letter morning evening winter summer mountain valley village
city market road bridge harbor island forest field stone water light paper music story teacher
doctor farmer sailor painter student friend mother father brother sister child family quiet
bright heavy gentle careful sudden distant narrow ancient simple warm cold green blue walked
carried opened watched followed remembered answered noticed wondered gathered
"""
WORDS = tuple(_WORD_LIST.split())

PASSKEY_RE = re.compile(r"The pass key is (\d+)\. Remember it\.")
_COPY_OPEN, _COPY_CLOSE = "<copy>", "</copy>"


@dataclass(frozen=True)
class SyntheticDoc:
    """One document: its text, its kind, and for the tasks the answer and where it was placed."""

    text: str
    kind: str
    answer: str | None = None
    depth: float | None = None

    def to_record(self) -> dict:
        record = {"text": self.text, "kind": self.kind}
        if self.answer is not None:
            record |= {"answer": self.answer, "depth": round(self.depth, 4)}
        return record


def sentence(rng: random.Random) -> str:
    """One filler sentence of random :data:`WORDS`, capitalised, with a full stop."""
    words = rng.choices(WORDS, k=rng.randint(6, 16))
    return " ".join(words).capitalize() + "."


def _filler(rng: random.Random, budget: int, measure: Callable[[str], int]) -> list[str]:
    """Sentences whose measured length first reaches ``budget`` (at least one sentence)."""
    sentences, used = [], 0
    while not sentences or used < budget:
        sentences.append(sentence(rng))
        used += measure(sentences[-1] + " ")
    return sentences


def make_document(
    kind: str,
    length: int,
    seed: int,
    index: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    copy_words: int = 32,
) -> SyntheticDoc:
    """Document ``index`` of the stream ``seed``: about ``length`` characters (or tokens with
    ``count_tokens``) of filler, with a needle (``passkey``) or a repeated span (``copy``)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a synthetic document kind; accepted: {', '.join(KINDS)}")
    if length < 1:
        raise ValueError(f"length={length} must be a positive number of characters or tokens")
    rng = random.Random(f"{seed}:{index}")
    measure = count_tokens or len
    if kind == "filler":
        sentences = _filler(rng, length, measure)
        while (missing := length - measure(" ".join(sentences))) > 0:
            sentences += _filler(rng, missing, measure)
        return SyntheticDoc(" ".join(sentences), kind)
    if kind == "passkey":
        key = str(rng.randint(10_000, 99_999))
        head, tail = f"The pass key is {key}. Remember it.", f"What is the pass key? The pass key is {key}."
    else:
        key = " ".join(rng.choices(WORDS, k=copy_words))
        head = f"Remember the marked passage. {_COPY_OPEN} {key} {_COPY_CLOSE}"
        tail = f"Repeat the marked passage: {key}"
    # Copy spans sit in the first tenth so the distance to the repeat is most of the document;
    # needles go anywhere, as in the passkey evaluations.
    depth = rng.random() * (0.1 if kind == "copy" else 1.0)
    sentences = _filler(rng, max(1, length - measure(head + " ") - measure(tail + " ")), measure)
    while True:
        at = round(depth * len(sentences))
        text = " ".join([*sentences[:at], head, *sentences[at:], tail])
        # Token counts of pieces do not add up exactly to the whole's, so top up until it is long enough.
        missing = length - measure(text)
        if missing <= 0:
            break
        sentences += _filler(rng, missing, measure)
    return SyntheticDoc(text, kind, answer=key, depth=at / len(sentences))


def generate_documents(
    num_docs: int,
    length: int,
    seed: int,
    kinds: tuple[str, ...] = KINDS,
    count_tokens: Callable[[str], int] | None = None,
) -> Iterator[SyntheticDoc]:
    """``num_docs`` documents, the kinds taken in turn (document ``i`` is ``kinds[i % len]``).
    Arguments are checked here, before the first document, so no output file is half written."""
    if num_docs < 0:
        raise ValueError(f"num_docs={num_docs} must be >= 0")
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ValueError(f"kinds={kinds!r} is invalid; accepted: a non-empty subset of {', '.join(KINDS)}")
    if length < 1:
        raise ValueError(f"length={length} must be a positive number of characters or tokens")
    return (make_document(kinds[i % len(kinds)], length, seed, i, count_tokens) for i in range(num_docs))


def write_jsonl(docs: Iterator[SyntheticDoc], path: str | Path) -> int:
    """Writes one ``{"text": ..., "kind": ..., ["answer", "depth"]}`` record per line; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc.to_record(), ensure_ascii=False) + "\n")
            count += 1
    return count


def find_passkey(text: str) -> str | None:
    """The pass key stated by the needle of a ``passkey`` document (None if there is none)."""
    match = PASSKEY_RE.search(text)
    return match.group(1) if match else None


def find_copy_span(text: str) -> str | None:
    """The marked span of a ``copy`` document (None if there is none)."""
    start = text.find(_COPY_OPEN)
    end = text.find(_COPY_CLOSE, start)
    return text[start + len(_COPY_OPEN) : end].strip() if start >= 0 and end > start else None
