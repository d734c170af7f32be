"""Deterministic synthetic long-context retrieval tasks (RULER-like), generated from a seed.

Four kinds, each a context (natural-language filler with needles) and a short question whose answer
is one string that must appear in the model's greedy output:

* ``passkey``: one 5-digit pass key at a given depth;
* ``multikey``: four "special magic number for <word>" needles; the question asks for one of them;
* ``vartrack``: a chain ``VAR A = 12345``, ``VAR B = A``, ... spread over the context; the question
  asks for the value of the last variable;
* ``fact``: three meetings with different people in different rooms; the question asks one room;
* ``facts``: three numbered facts of different kinds (a locker code, a meeting room, a train platform:
  ``FACT_KINDS`` but the shelter tag, which stock SmolLM2 answers "1" at 7K tokens), each stated once;
  each question's answer prefix is its statement up to the number, so the answer is a copy of what the
  document says, and the facts do not look alike (a small model confuses the near-identical needles of
  ``multikey`` and ``fact`` at length).

Each task also has an answer prefix (RULER's ``answer_prefix``) that starts the assistant turn, so a
few generated tokens hold the answer. ``Task.questions`` lists every question its context answers
(one per fact needle of ``multikey`` and ``fact``; the task's own question first), so one compressed
document can be asked several questions.

The filler is drawn sentence by sentence from a small grammar over word lists, so no sentence
repeats verbatim (a repeated sentence makes attention scores degenerate) and it never contains digits
or the needles' vocabulary. ``depth`` is the fraction of the context (in characters) before the
needle that holds the answer.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

# The RULER-like kinds the quality suites cycle through by default; every kind.
RULER_KINDS = ("passkey", "multikey", "vartrack", "fact")
TASK_KINDS = (*RULER_KINDS, "facts")
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

_SUBJECTS = (
    "the old gardener", "a quiet fisherman", "the young baker", "my neighbour", "the village teacher",
    "a tired traveller", "the painter", "an elderly poet", "the shopkeeper", "a curious child",
    "the ferry captain", "the librarian", "a wandering musician", "the carpenter", "the weaver",
)
_VERBS = (
    "watched", "admired", "described", "remembered", "followed", "sketched", "praised", "ignored",
    "visited", "photographed", "walked past", "talked about", "dreamed of", "returned to", "studied",
)
_ADJECTIVES = (
    "golden", "misty", "quiet", "crowded", "ancient", "narrow", "bright", "windy", "peaceful",
    "colourful", "shaded", "distant", "muddy", "frozen", "fragrant",
)
_OBJECTS = (
    "orchard", "harbour", "market square", "river bank", "hillside", "bridge", "meadow", "lighthouse",
    "vineyard", "forest path", "chapel", "boathouse", "wheat field", "stone wall", "windmill",
)
_TIMES = (
    "in the early morning", "at dusk", "after the rain", "during the long summer", "before the harvest",
    "on a cold evening", "at noon", "in late autumn", "when the snow melted", "on market day",
)
_FEELINGS = (
    "calm", "hopeful", "restless", "content", "nostalgic", "cheerful", "thoughtful", "weary",
    "grateful", "surprised",
)
_NATURE = (
    "the wind carried the smell of pine", "swallows circled above the roofs", "the river ran high and fast",
    "clouds drifted slowly over the hills", "the bells rang across the valley", "frogs sang in the reeds",
    "the fields turned from green to gold", "smoke rose from the chimneys", "the tide pulled back from the shore",
    "leaves gathered along the lane",
)
_TEMPLATES = (
    "{Subject} {verb} the {adj} {obj} {time}.",
    "{Time}, {nature}, and {subject} felt {feeling}.",
    "Nobody knew why {subject} {verb} the {obj} so often.",
    "The {obj} looked {adj} {time}, as {subject} later told everyone.",
    "{Subject} said that {nature}.",
    "It was {adj} near the {obj}, and {subject} felt {feeling}.",
    "Some say {subject} once {verb} every {obj} in the region.",
    "{Time}, {subject} {verb} the {obj} and then went home {feeling}.",
)
_KEY_WORDS = (
    "apple", "comet", "lantern", "violin", "pepper", "glacier", "falcon", "marble", "saffron",
    "harbor", "thistle", "cobalt", "nightingale", "quartz", "juniper", "tundra",
)
_NAMES = ("Dana", "Marcus", "Priya", "Tomas", "Ingrid", "Kenji", "Lucia", "Omar", "Sofia", "Wendell")
_COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown")
_PLACES = ("gym", "station", "museum", "school", "library", "harbour office", "town hall", "hospital")
_TOPICS = ("budget", "roof repair", "summer fair", "new bridge", "school trip", "water supply", "garden plan")
_CITIES = ("Lisbon", "Oslo", "Krakow", "Dublin", "Seville", "Tallinn", "Porto", "Ghent", "Bergen", "Turin")
_ANIMALS = ("grey cat", "old dog", "white rabbit", "brown horse", "small goat", "black parrot", "young fox")
_VARIABLE_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


@dataclass(frozen=True)
class Needle:
    """Text inserted into the filler at ``depth`` (fraction of the context's characters before it)."""

    text: str
    depth: float


@dataclass(frozen=True)
class FactKind:
    """A kind of numbered fact: the sentence stating it and the question asking it (``{number}`` and
    the slots' names as fields), the values each slot draws from, the digits of its number."""

    statement: str
    question: str
    slots: dict[str, tuple[str, ...]]
    digits: int

    def answer_prefix(self, **values: str) -> str:
        """The statement up to its number: the reply's start that the number completes."""
        return self.statement.split("{number}")[0].format(**values).rstrip()


FACT_KINDS = (
    FactKind(
        "The {colour} locker at the {place} opens with the code {number}.",
        "Which code opens the {colour} locker at the {place}?",
        {"colour": _COLOURS, "place": _PLACES},
        5,
    ),
    FactKind(
        "The meeting of {person} about the {topic} takes place in room {number}.",
        "In which room does the meeting of {person} about the {topic} take place?",
        {"person": _NAMES, "topic": _TOPICS},
        3,
    ),
    FactKind(
        "The night train to {city} always leaves from platform {number}.",
        "From which platform does the night train to {city} leave?",
        {"city": _CITIES},
        2,
    ),
    FactKind(
        "At the shelter, the {animal} wears tag number {number}.",
        "What tag number does the {animal} at the shelter wear?",
        {"animal": _ANIMALS},
        4,
    ),
)


def states_number(output: str, number: str) -> bool:
    """``number`` appears in ``output``, not as part of a longer number (an exact-match answer)."""
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", output) is not None


@dataclass(frozen=True)
class Question:
    """A question the context answers: ``answer`` is stated by needle ``needle`` of its task.

    answer_prefix: the start of the assistant's reply, fed with the question (never compressed).
    """

    question: str
    answer_prefix: str
    answer: str
    needle: int

    def is_correct(self, output: str) -> bool:
        return states_number(output, self.answer)


@dataclass(frozen=True)
class Task:
    """One sample: a context and the questions it answers, the task's own first (``question``,
    ``answer_prefix``, ``answer``: that one's). ``depth`` is the depth of its needle."""

    kind: str
    seed: int
    context: str
    needles: tuple[Needle, ...]
    questions: tuple[Question, ...]

    # The task's own question's fields (str, str, str, int).
    question = property(lambda self: self.questions[0].question)
    answer_prefix = property(lambda self: self.questions[0].answer_prefix)
    answer = property(lambda self: self.questions[0].answer)
    answer_needle = property(lambda self: self.questions[0].needle)

    @property
    def depth(self) -> float:
        return self.needles[self.answer_needle].depth

    def is_correct(self, output: str) -> bool:
        return self.questions[0].is_correct(output)


def filler_sentence(rng: random.Random) -> str:
    """One sentence of the filler grammar."""
    subject, time = rng.choice(_SUBJECTS), rng.choice(_TIMES)
    return rng.choice(_TEMPLATES).format(
        Subject=subject[0].upper() + subject[1:],
        subject=subject,
        verb=rng.choice(_VERBS),
        adj=rng.choice(_ADJECTIVES),
        obj=rng.choice(_OBJECTS),
        Time=time[0].upper() + time[1:],
        time=time,
        feeling=rng.choice(_FEELINGS),
        nature=rng.choice(_NATURE),
    )


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def build_context(
    rng: random.Random, needles: Sequence[Needle], target_tokens: int, count_tokens: Callable[[str], int]
) -> tuple[str, tuple[Needle, ...]]:
    """Filler of about ``target_tokens`` tokens (needles included) with each needle at its depth.

    Needles go between sentences, so the realised depth (returned in the needles) is within one
    sentence of the requested one. Needle texts must be distinct.
    """
    budget = target_tokens - sum(count_tokens(" " + needle.text) for needle in needles)
    sentences: list[str] = []
    seen: set[str] = set()
    while budget > 0:
        sentence = filler_sentence(rng)
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
            budget -= count_tokens(" " + sentence)
    sentence_ends = list(itertools.accumulate(len(s) + 1 for s in sentences))
    filler_chars = sentence_ends[-1] if sentences else 0
    # Each needle goes before the first sentence that ends past its share of the filler; ties keep
    # the needles' order (a variable chain stays in order).
    slots = sorted(
        (bisect.bisect_right(sentence_ends, needle.depth * filler_chars), order) for order, needle in enumerate(needles)
    )
    parts = list(sentences)
    for slot, order in reversed(slots):
        parts.insert(slot, needles[order].text)
    context = " ".join(parts)
    return context, tuple(Needle(n.text, context.index(n.text) / len(context)) for n in needles)


def make_task(kind: str, seed: int, target_tokens: int, depth: float, count_tokens: Callable[[str], int]) -> Task:
    """The task of ``kind`` for ``seed``; its answer needle at about ``depth`` of the context."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; valid: {', '.join(TASK_KINDS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be in [0, 1]")
    rng = random.Random(f"{kind}:{seed}")
    needles, questions = _NEEDLE_MAKERS[kind](rng, depth)
    context, realised = build_context(rng, needles, target_tokens, count_tokens)
    return Task(kind, seed, context, realised, questions)


def _passkey(rng: random.Random, depth: float):
    key = _number(rng, 5)
    needle = Needle(f"The pass key is {key}. Remember it. {key} is the pass key.", depth)
    return (needle,), (Question("What is the pass key?", "The pass key is:", key, 0),)


def _asked_first(questions: list[Question], asked: int) -> tuple[Question, ...]:
    return (questions[asked], *questions[:asked], *questions[asked + 1 :])


def _multikey(rng: random.Random, depth: float):
    words = rng.sample(_KEY_WORDS, 4)
    numbers = [_number(rng, 5) for _ in words]
    asked = rng.randrange(len(words))
    # The asked needle sits at `depth`; the distractors spread evenly around the rest of the context.
    others = iter((i + 0.5) / (len(words) - 1) for i in range(len(words) - 1))
    needles = tuple(
        Needle(f"One of the special magic numbers for {word} is: {number}.", depth if i == asked else next(others))
        for i, (word, number) in enumerate(zip(words, numbers))
    )
    questions = [
        Question(f"What is the special magic number for {word}?", f"The special magic number for {word} is:", number, i)
        for i, (word, number) in enumerate(zip(words, numbers))
    ]
    return needles, _asked_first(questions, asked)


def _vartrack(rng: random.Random, depth: float):
    names = ["".join(rng.sample(_VARIABLE_LETTERS, 3)) for _ in range(4)]
    value = _number(rng, 5)
    # The value statement at `depth`; each following link a quarter of the remaining context later.
    depths = [depth + (1.0 - depth) * i / 4 for i in range(4)]
    texts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
    needles = tuple(Needle(text, d) for text, d in zip(texts, depths))
    return needles, (Question(f"What is the value of VAR {names[-1]}?", f"The value of VAR {names[-1]} is:", value, 0),)


def _fact(rng: random.Random, depth: float):
    people = rng.sample(_NAMES, 3)
    rooms = rng.sample(range(100, 1000), 3)
    others = iter((0.25, 0.75))
    needles = tuple(
        Needle(f"The meeting with {person} is in Room {room}.", depth if i == 0 else next(others))
        for i, (person, room) in enumerate(zip(people, rooms))
    )
    questions = tuple(
        Question(f"In which room is the meeting with {person}?", f"The meeting with {person} is in Room", str(room), i)
        for i, (person, room) in enumerate(zip(people, rooms))
    )
    return needles, questions


def _facts(rng: random.Random, depth: float):
    kinds = rng.sample(FACT_KINDS[:3], 3)
    # The asked fact (the first kind drawn) at `depth`; the others spread evenly over the context.
    depths = [depth, *((i + 0.5) / (len(kinds) - 1) for i in range(len(kinds) - 1))]
    needles, questions = [], []
    for index, kind in enumerate(kinds):
        values = {slot: rng.choice(choices) for slot, choices in kind.slots.items()}
        number = _number(rng, kind.digits)
        needles.append(Needle(kind.statement.format(number=number, **values), depths[index]))
        questions.append(Question(kind.question.format(**values), kind.answer_prefix(**values), number, index))
    return tuple(needles), tuple(questions)


_NEEDLE_MAKERS = {"passkey": _passkey, "multikey": _multikey, "vartrack": _vartrack, "fact": _fact, "facts": _facts}


def task_suite(
    seed: int,
    samples: int,
    target_tokens: int,
    count_tokens: Callable[[str], int],
    kinds: Sequence[str] = RULER_KINDS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> list[Task]:
    """``samples`` tasks cycling through ``kinds`` and ``depths`` (coprime lengths mix them)."""
    return [
        make_task(kinds[i % len(kinds)], seed * 100_003 + i, target_tokens, depths[i % len(depths)], count_tokens)
        for i in range(samples)
    ]
