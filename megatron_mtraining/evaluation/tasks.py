"""RULER-style synthetic long-context tasks, generated from a seed, each with an exact solver.

A sample is token ids of the run's tokenizer: a haystack of filler sentences (the words of
``data.synthetic_docs``) holding the task's inserts (needles, variable assignments, a word
list) at their depths, then a question, then the answer. It is exactly ``length + 1`` ids, so
the model runs at ``length`` tokens with the answer as the last labels (teacher forcing).

Every piece (each insert, the question, the answer, each filler sentence) is tokenised on its
own with a leading space, so a piece's tokens do not depend on its neighbours; the filler is
a stream of sentence tokens cut to exactly the room the other pieces leave, at token
granularity. An insert at depth ``d`` starts after ``round(d * F)`` of the ``F`` filler tokens
(inserts sorted by depth, ties in the order the generator lists them).

The tasks (``TASKS``), after RULER (Hsieh et al., 2024):

* ``niah_single``: one needle "One of the special magic numbers for KEY is: VALUE." at the
  sample's depth; the question asks for KEY's number.
* ``niah_multikey``: the same needle among three with other keys at random depths.
* ``niah_multivalue``: four needles of one key at random depths; the answer lists the four
  numbers in the order they appear.
* ``variable_tracking``: two chains of assignments ("VAR ABCDE = 12345.", then
  "VAR FGHIJ = VAR ABCDE." ...) at random depths, each chain in order; the answer lists the
  variables that hold the asked value, in order of assignment.
* ``common_words``: a numbered word list in which a few words recur three times as often as
  any other; the answer lists those words in order of first appearance.

Each task's ``solve`` computes the answer from the text alone (the decoded context), so the
tests check generator against solver.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..data.synthetic_docs import WORDS, sentence


@dataclass(frozen=True)
class Codec:
    """The run's tokenizer as two functions: text to ids (no special tokens) and back."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]

    def piece(self, text: str) -> list[int]:
        """The ids of ``text`` as a piece of a sample: after a space, so that the tokens at its
        start are those it has inside running text."""
        return self.encode(" " + text)


@dataclass(frozen=True)
class TaskText:
    """What a generator writes: ``inserts`` (depth in [0, 1], text) to place in the filler,
    the question, the answer, and ``target``, the insert whose depth is the sample's."""

    inserts: list[tuple[float, str]]
    question: str
    answer: str
    target: int | None = None


@dataclass(frozen=True)
class Sample:
    """One task instance: ``context`` (haystack and question) followed by ``answer_ids`` are
    ``length + 1`` ids. ``position`` is where the target insert starts (depth tasks)."""

    task: str
    length: int
    depth: float | None
    index: int
    context: tuple[int, ...]
    answer: str
    answer_ids: tuple[int, ...]
    position: int | None

    def ids(self) -> list[int]:
        return [*self.context, *self.answer_ids]


# A generator gets its RNG, the depth (None for tasks without one), the sample's ids
# (length + 1) and a function giving a piece's token count; it raises ValueError when the
# task does not fit.
Generator = Callable[[random.Random, float | None, int, Callable[[str], int]], TaskText]


@dataclass(frozen=True)
class Task:
    name: str
    has_depth: bool  # the sample's depth places the target needle (the heatmap's tasks)
    generate: Generator
    solve: Callable[[str], str | None]  # the answer from the context's text, None if it has none


# ---- needles -----------------------------------------------------------------------------
_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
_ASK_ONE = (
    "What is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
_ASK_ONE_RE = re.compile(r"What is the special magic number for (\S+) mentioned in the provided text\?")
_ASK_ALL = (
    "What are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are"
)
_ASK_ALL_RE = re.compile(r"What are all the special magic numbers for (\S+) mentioned in the provided text\?")
_DISTRACTORS = 3
_VALUES = 4


def _keys(rng: random.Random, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, count: int) -> list[str]:
    return [str(n) for n in rng.sample(range(1_000_000, 10_000_000), count)]


def _needle_values(text: str, key: str) -> list[str]:
    return [value for k, value in _NEEDLE_RE.findall(text) if k == key]


def _asked_key(pattern: re.Pattern, text: str) -> str | None:
    asked = pattern.findall(text)
    return asked[-1] if asked else None


def _niah_single(rng, depth, _length, _measure) -> TaskText:
    (key,), (value,) = _keys(rng, 1), _numbers(rng, 1)
    return TaskText([(depth, _NEEDLE.format(key=key, value=value))], _ASK_ONE.format(key=key), value, target=0)


def _niah_multikey(rng, depth, _length, _measure) -> TaskText:
    keys, values = _keys(rng, 1 + _DISTRACTORS), _numbers(rng, 1 + _DISTRACTORS)
    inserts = [
        (depth if i == 0 else rng.random(), _NEEDLE.format(key=k, value=v))
        for i, (k, v) in enumerate(zip(keys, values, strict=True))
    ]
    return TaskText(inserts, _ASK_ONE.format(key=keys[0]), values[0], target=0)


def _solve_one(text: str) -> str | None:
    key = _asked_key(_ASK_ONE_RE, text)
    values = _needle_values(text, key) if key else []
    return values[0] if len(values) == 1 else None


def _niah_multivalue(rng, _depth, _length, _measure) -> TaskText:
    (key,), values = _keys(rng, 1), _numbers(rng, _VALUES)
    depths = sorted(rng.random() for _ in values)
    inserts = [(d, _NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values, strict=True)]
    return TaskText(inserts, _ASK_ALL.format(key=key), ", ".join(values))


def _solve_all(text: str) -> str | None:
    key = _asked_key(_ASK_ALL_RE, text)
    values = _needle_values(text, key) if key else []
    return ", ".join(values) if values else None


# ---- variable tracking -------------------------------------------------------------------
_HOPS = 4
_ASSIGN_RE = re.compile(r"VAR ([A-Z]+) = (?:(\d+)|VAR ([A-Z]+))\.")
_ASK_VARS = (
    "Find all variables that are assigned the value {value} in the text above. "
    "Answer: the variables assigned the value {value}, in order of assignment, are"
)
_ASK_VARS_RE = re.compile(r"Find all variables that are assigned the value (\d+) in the text above\.")


def _variable_tracking(rng, _depth, _length, _measure) -> TaskText:
    names: list[str] = []
    while len(names) < 2 * _HOPS:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    values = _numbers(rng, 2)
    depths = [rng.random() for _ in names]
    inserts = []
    for chain, value in enumerate(values):
        chain_names = names[chain * _HOPS : (chain + 1) * _HOPS]
        chain_depths = sorted(depths[chain * _HOPS : (chain + 1) * _HOPS])
        sources = [value, *(f"VAR {name}" for name in chain_names[:-1])]
        inserts += [(d, f"VAR {n} = {s}.") for d, n, s in zip(chain_depths, chain_names, sources, strict=True)]
    return TaskText(inserts, _ASK_VARS.format(value=values[0]), " ".join(names[:_HOPS]))


def _solve_variables(text: str) -> str | None:
    asked = _ASK_VARS_RE.findall(text)
    if not asked:
        return None
    values: dict[str, str | None] = {}
    holding = []
    for name, number, source in _ASSIGN_RE.findall(text):
        values[name] = number or values.get(source)
        if values[name] == asked[-1]:
            holding.append(name)
    return " ".join(holding) or None


# ---- common-word extraction --------------------------------------------------------------
_COMMON = 5
# Common words recur this many times as often as the others.
_COMMON_RATIO = 3
_LIST_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_ASK_COMMON = (
    "What are the {count} most common words in the list above? "
    "Answer: the {count} most common words, in order of first appearance, are"
)
_ASK_COMMON_RE = re.compile(r"What are the (\d+) most common words in the list above\?")
_ENTRY_RE = re.compile(r"(\d+)\. ([a-z]+)")


def _word_list(entries: int, commons: list[str], pool: list[str], rng: random.Random) -> list[str]:
    """``entries`` words, shuffled: each common word ``_COMMON_RATIO`` times as often as any
    other word appears (at most once more than the others' base count)."""
    other = max(1, math.ceil(entries / (len(pool) + _COMMON_RATIO * len(commons))))
    rest = entries - len(commons) * _COMMON_RATIO * other
    distinct, extra = divmod(rest, other)
    words = commons * (_COMMON_RATIO * other) + pool[:distinct] * other + pool[:extra]
    rng.shuffle(words)
    return words


def _common_words(rng, _depth, budget, measure) -> TaskText:
    commons = rng.sample(WORDS, _COMMON)
    pool = [w for w in WORDS if w not in commons]
    rng.shuffle(pool)
    question = _ASK_COMMON.format(count=_COMMON)
    list_seed = rng.random()
    # The list fills what the question and answer leave: from a count no list of that room can
    # exceed (two tokens per entry at least), shrunk in proportion until it fits.
    room = budget - measure(question) - measure(" ".join(commons))
    entries = room // 2
    while entries > _COMMON * _COMMON_RATIO:
        words = _word_list(entries, commons, pool, random.Random(list_seed))
        text = _LIST_HEAD + " " + " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
        used = measure(text)
        if used <= room:
            first = {w: words.index(w) for w in commons}
            return TaskText([(1.0, text)], question, " ".join(sorted(commons, key=first.__getitem__)))
        entries = min(entries - 1, entries * room // used)
    raise ValueError(f"{budget - 1} tokens do not hold a word list of the common_words task")


def _solve_common(text: str) -> str | None:
    asked, start = _ASK_COMMON_RE.findall(text), text.rfind(_LIST_HEAD)
    if not asked or start < 0:
        return None
    count = int(asked[-1])
    words = [w for _, w in _ENTRY_RE.findall(text[start + len(_LIST_HEAD) : text.rfind("What are the")])]
    ranked = Counter(words).most_common()
    if len(ranked) < count or (len(ranked) > count and ranked[count - 1][1] == ranked[count][1]):
        return None  # no unique set of most common words
    top = {w for w, _ in ranked[:count]}
    return " ".join(sorted(top, key=words.index))


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("niah_single", True, _niah_single, _solve_one),
        Task("niah_multikey", True, _niah_multikey, _solve_one),
        Task("niah_multivalue", False, _niah_multivalue, _solve_all),
        Task("variable_tracking", False, _variable_tracking, _solve_variables),
        Task("common_words", False, _common_words, _solve_common),
    )
}


def make_sample(task: str, length: int, depth: float | None, seed: int, index: int, codec: Codec) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens (and ``depth`` for the needle tasks;
    ignored by the others) from ``seed``: the same arguments always give the same ids.
    Raises ``ValueError`` naming the length when the task's pieces do not fit in it."""
    spec = TASKS[task]
    depth = depth if spec.has_depth else None
    rng = random.Random(f"{seed}:{task}:{length}:{depth}:{index}")

    def measure(text: str) -> int:
        return len(codec.piece(text))

    try:
        text = spec.generate(rng, depth, length + 1, measure)
    except ValueError as err:
        raise ValueError(f"length={length}: too short for the {task} task with this tokenizer ({err})") from None
    question, answer = codec.piece(text.question), codec.piece(text.answer)
    inserts = [(d, codec.piece(t)) for d, t in text.inserts]
    room = length + 1 - len(question) - len(answer) - sum(len(ids) for _, ids in inserts)
    if room < 0:
        raise ValueError(
            f"length={length}: too short for the {task} task with this tokenizer (accepted: a length of at least "
            f"{length - room}, which holds its pieces)"
        )
    filler: list[int] = []
    while len(filler) < room:
        filler += codec.piece(sentence(rng))
    ids: list[int] = []
    placed, position = 0, None
    for i in sorted(range(len(inserts)), key=lambda i: inserts[i][0]):
        cut = round(inserts[i][0] * room)
        ids += filler[placed:cut]
        placed = cut
        if i == text.target:
            position = len(ids)
        ids += inserts[i][1]
    ids += filler[placed:room] + question
    return Sample(task, length, depth, index, tuple(ids), text.answer, tuple(answer), position)
