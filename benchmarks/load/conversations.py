"""Deterministic multi-turn conversations over long documents, generated from a seed.

Each simulated user reads a document (natural-language filler from ``sgl_kvevict.measure.tasks``' grammar,
which holds no digits, with numeric facts embedded at spread-out depths) and then asks one question
per turn. Turn 1 carries the document; later turns are short follow-ups, so the chat history grows by
one question and one short answer per turn, as with a real client. Every ``fact_every``-th turn asks
for one of the embedded facts and is scored by exact match of its number; the others ask open
questions that keep the conversation going and are not scored.

With ``shared_document`` every user gets the same document (one long shared prefix in the radix
tree) and asks its facts in a user-specific order. With ``system_prompt_tokens`` every conversation
starts with the same system message of about that many tokens (an instruction, then filler) before
the user's own document: the shared prefix of block scope, as a deployment's system prompt is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

from sgl_kvevict.measure.tasks import FACT_KINDS, Needle, build_context, states_number

DOCUMENT_INTRO = "Read the following document carefully. I will ask you several questions about it.\n\n"
SYSTEM_INTRO = (
    "You are the archive assistant of a small coastal town. Answer questions about the documents users "
    "share with you briefly and exactly. Background notes on the town follow.\n\n"
)
NUMBER_ONLY = " Answer with the number only."

# Subjects are never reused inside a document, so the smallest slot list bounds each kind.
MAX_FACTS_PER_DOCUMENT = len(FACT_KINDS) * min(len(values) for kind in FACT_KINDS for values in kind.slots.values())

OPEN_QUESTIONS = (
    "In one short sentence, what is the document about?",
    "Give the document a short title.",
    "Name one place that the document mentions.",
    "Which person in the document seems the most interesting to you, and why? Be brief.",
    "Describe the mood of the document in a few words.",
    "Name one season or time of day that the document mentions.",
)


class ConversationError(ValueError):
    """An invalid conversation spec; the message names the field."""


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    answer: str

    def is_answered_by(self, output: str) -> bool:
        return states_number(output, self.answer)


@dataclass(frozen=True)
class Turn:
    question: str
    fact: Optional[Fact]  # the fact asked, for scored turns


@dataclass(frozen=True)
class Conversation:
    user: int
    document: str
    facts: tuple[Fact, ...]
    turns: tuple[Turn, ...]
    system_prompt: Optional[str] = None  # the same for every user of a workload

    def opening_messages(self) -> list[dict]:
        """The messages before the first user message (the system prompt, if any)."""
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def user_message(self, turn_index: int) -> str:
        """The user's message at ``turn_index`` (0-based): the document travels with the first one."""
        question = self.turns[turn_index].question
        return DOCUMENT_INTRO + self.document + "\n\n" + question if turn_index == 0 else question


@dataclass(frozen=True)
class ConversationSpec:
    """users: concurrent simulated users, one conversation each.
    turns: user messages per conversation.
    document_tokens: target document length in tokens of the served model's tokenizer.
    fact_every: every ``fact_every``-th turn (1-based) asks a fact and is scored.
    shared_document: one document for all users instead of one per user.
    system_prompt_tokens: 0, or the length of one system prompt every conversation starts with.
    """

    users: int
    turns: int
    document_tokens: int
    fact_every: int
    shared_document: bool
    seed: int
    system_prompt_tokens: int = 0

    def __post_init__(self):
        if self.users < 1 or self.turns < 1:
            raise ConversationError(f"users ({self.users}) and turns ({self.turns}) must be >= 1")
        if self.document_tokens < 64:
            raise ConversationError(f"document_tokens {self.document_tokens} must be >= 64")
        if self.system_prompt_tokens and self.system_prompt_tokens < 64:
            raise ConversationError(f"system_prompt_tokens {self.system_prompt_tokens} must be 0 or >= 64")
        if self.fact_every < 1:
            raise ConversationError(f"fact_every {self.fact_every} must be >= 1")
        if self.fact_turns > MAX_FACTS_PER_DOCUMENT:
            raise ConversationError(
                f"{self.fact_turns} fact turns per conversation; a document holds at most {MAX_FACTS_PER_DOCUMENT} facts"
            )

    @property
    def fact_turns(self) -> int:
        return self.turns // self.fact_every

    def is_fact_turn(self, turn_index: int) -> bool:
        return (turn_index + 1) % self.fact_every == 0


def _make_facts(rng: random.Random, count: int) -> list[Fact]:
    """``count`` facts with distinct subjects and distinct answers, kinds cycling in a random order."""
    kinds = rng.sample(FACT_KINDS, len(FACT_KINDS))
    unused = [{slot: rng.sample(values, len(values)) for slot, values in kind.slots.items()} for kind in kinds]
    facts: list[Fact] = []
    answers: set[str] = set()
    for index in range(count):
        kind, kind_unused = kinds[index % len(kinds)], unused[index % len(kinds)]
        values = {slot: pool.pop() for slot, pool in kind_unused.items()}
        number = str(rng.randrange(10 ** (kind.digits - 1), 10**kind.digits))
        while number in answers:
            number = str(rng.randrange(10 ** (kind.digits - 1), 10**kind.digits))
        answers.add(number)
        facts.append(
            Fact(kind.statement.format(number=number, **values), kind.question.format(**values) + NUMBER_ONLY, number)
        )
    return facts


def _make_document(rng: random.Random, facts: list[Fact], target_tokens: int, count_tokens) -> str:
    # Facts spread evenly over the document, in a random order of depths.
    depths = [(i + 0.5) / len(facts) for i in range(len(facts))]
    rng.shuffle(depths)
    document, _ = build_context(
        rng, [Needle(fact.statement, depth) for fact, depth in zip(facts, depths)], target_tokens, count_tokens
    )
    return document


def system_prompt(spec: ConversationSpec, count_tokens: Callable[[str], int]) -> Optional[str]:
    """The workload's shared system prompt of about ``spec.system_prompt_tokens`` tokens, or None."""
    if not spec.system_prompt_tokens:
        return None
    rng = random.Random(f"multiturn-system:{spec.seed}")
    notes, _ = build_context(rng, [], spec.system_prompt_tokens - count_tokens(SYSTEM_INTRO), count_tokens)
    return SYSTEM_INTRO + notes


def build_conversations(spec: ConversationSpec, count_tokens: Callable[[str], int]) -> list[Conversation]:
    """One conversation per user; the same spec and tokenizer always give the same conversations."""
    system = system_prompt(spec, count_tokens)
    facts_per_document = max(spec.fact_turns, 1)
    shared: Optional[tuple[str, list[Fact]]] = None
    if spec.shared_document:
        rng = random.Random(f"multiturn-shared:{spec.seed}")
        # A shared document holds enough facts for users to ask different ones.
        facts = _make_facts(rng, min(facts_per_document * 2, MAX_FACTS_PER_DOCUMENT))
        shared = (_make_document(rng, facts, spec.document_tokens, count_tokens), facts)
    conversations = []
    for user in range(spec.users):
        rng = random.Random(f"multiturn:{spec.seed}:{user}")
        if shared is None:
            facts = _make_facts(rng, facts_per_document)
            document = _make_document(rng, facts, spec.document_tokens, count_tokens)
        else:
            document, facts = shared[0], rng.sample(shared[1], len(shared[1]))
        asked = iter(facts)
        open_questions = rng.sample(OPEN_QUESTIONS, len(OPEN_QUESTIONS))
        turns = []
        for index in range(spec.turns):
            if spec.is_fact_turn(index):
                fact = next(asked)
                turns.append(Turn(fact.question, fact))
            else:
                turns.append(Turn(open_questions[index % len(open_questions)], None))
        conversations.append(Conversation(user, document, tuple(facts), tuple(turns), system))
    return conversations


