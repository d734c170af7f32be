"""What ``python -m sgl_kvevict.evaluate`` sends: the user's documents and questions, or probes made
from each document, or the bundled task set.

* a folder: every ``.txt`` / ``.md`` file in it (sorted by name), no questions: probes;
* a JSONL file: one ``{"document": ..., "questions": [...], "answers": [...]}`` per line (``questions``
  and ``answers`` optional; ``answers`` parallel to ``questions``, for accuracy);
* nothing: the bundled task set (``sgl_kvevict.measure.tasks``' ``facts``: filler with three numbered
  facts and their questions, at lengths spread over the context), with reference answers.

A probe is a question whose answer is in the document: ``continue`` quotes the first words of a
sentence of the document and asks for the rest of it; ``next`` quotes a sentence and asks for the one
after it. The document's words are its reference. Probes are drawn from the sentences spread over
the document (seeded), so both ends and the middle are asked about. Each probe starts the reply for
the model (``answer_prefix``: the quoted words, or an opening quote), so its first generated tokens
come from the document: left to themselves small models echo the question first ("The sentence that
starts ... is"), and a capped answer then compares mostly the echo, which reads the uncompressed
question, not the document's kept cache. A base model (no chat template) reads each question as a
text to continue (``Question.cue``): ``Quoted word for word from the text above: "<head>`` (the rest of
the sentence follows), or the same with a whole sentence quoted (the next sentence follows), which a
base model copies where it would not follow an instruction to name the next sentence.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

DOCUMENT_SUFFIXES = (".txt", ".md")
PROBE_KINDS = ("continue", "next")
# How a ``next`` probe's reply starts: the sentence itself follows.
NEXT_SENTENCE_PREFIX = 'The sentence after it is: "'
# The bundled task set's document lengths, in model tokens, cycled (the default run: 6 documents of 2-5K).
BUNDLED_LENGTHS = (2000, 3500, 5000)


class InputError(ValueError):
    """Input the command cannot use; the message is the one line it prints."""


@dataclass(frozen=True)
class Question:
    """``text``: what the user asks; ``reference``: the expected answer (the user's, or for a probe the
    document's own words); ``answer_prefix``: the start of the assistant's reply (the bundled tasks'
    RULER-style prefix, a probe's quoted head); ``kind``: ``user``, ``task`` or a probe kind;
    ``cue``: how a base model (no chat template) is asked, the text after the document up to where
    the answer starts (default: ``Question: ... Answer:`` and the answer's prefix)."""

    text: str
    kind: str = "user"
    reference: Optional[str] = None
    answer_prefix: str = ""
    cue: str = ""

    @property
    def completion(self) -> str:
        """The question as a base model reads it after the document, ending where its answer starts."""
        return self.cue or f"Question: {self.text}\nAnswer: {self.answer_prefix}".rstrip(" ")

    @property
    def judged_by_document(self) -> bool:
        """A probe: its reference is the document's text, matched as a prefix (``follows_document``)."""
        return self.kind in PROBE_KINDS


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    questions: tuple[Question, ...] = ()
    checks: tuple[Callable[[str], bool], ...] = field(default=(), compare=False, repr=False)  # bundled: exact checks


def read_documents(source: Optional[Path]) -> list[Document]:
    """The documents at ``source`` (a folder or a JSONL file); ``InputError`` in one line otherwise."""
    if source is None:
        return []
    if not source.exists():
        raise InputError(f"--documents {source}: no such file or folder")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in DOCUMENT_SUFFIXES)
        documents = [Document(p.name, p.read_text(errors="replace")) for p in files]
        documents = [d for d in documents if d.text.strip()]
        if not documents:
            raise InputError(f"--documents {source}: no non-empty {' or '.join(DOCUMENT_SUFFIXES)} file in this folder")
        return documents
    return _read_jsonl(source)


def _read_jsonl(path: Path) -> list[Document]:
    documents = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"--documents {path}, line {number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("document"), str) or not row["document"].strip():
            raise InputError(f'--documents {path}, line {number}: expected {{"document": "...", "questions": [...]}}')
        questions, answers = row.get("questions") or [], row.get("answers")
        if not isinstance(questions, list) or not all(isinstance(q, str) for q in questions):
            raise InputError(f"--documents {path}, line {number}: questions must be a list of strings")
        if answers is not None and (not isinstance(answers, list) or len(answers) != len(questions)):
            raise InputError(f"--documents {path}, line {number}: answers must be a list as long as questions")
        references = answers or [None] * len(questions)
        documents.append(Document(str(row.get("name") or f"line {number}"), row["document"],
                                  tuple(Question(q, "user", None if a is None else str(a)) for q, a in zip(questions, references))))  # fmt: skip
    if not documents:
        raise InputError(f"--documents {path}: no document in this file")
    return documents


def bundled_documents(count: int, count_tokens: Callable[[str], int], seed: int, lengths: Sequence[int] = BUNDLED_LENGTHS) -> list[Document]:
    """``count`` documents of the bundled ``facts`` task set, lengths cycled, with their questions and answers."""
    from sgl_kvevict.measure.tasks import make_task

    documents = []
    for index in range(count):
        length = lengths[index % len(lengths)]
        task = make_task("facts", seed * 100_003 + index, length, (index + 0.5) / count, count_tokens)
        questions = tuple(Question(q.question, "task", q.answer, q.answer_prefix) for q in task.questions)
        documents.append(Document(f"facts-{length}-{index}", task.context, questions, tuple(q.is_correct for q in task.questions)))
    return documents


# ---- probes ----------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'`(\[])|\n\s*\n")
_WORD = re.compile(r"\S+")


def _is_sentence(sentence: str) -> bool:
    """Prose a probe can quote: 8-40 words, not a code or table row, mostly letters."""
    if not 8 <= len(_WORD.findall(sentence)) <= 40 or sentence.startswith(("|", "```", "    ", ">>>", "$")):
        return False
    return sum(ch.isalpha() for ch in sentence) >= 0.6 * len(sentence)


def _segments(text: str) -> list[str]:
    return [" ".join(raw.split()) for raw in _SENTENCE_END.split(text)]


def sentences(text: str) -> list[str]:
    """The document's prose sentences that a probe can quote, said once."""
    found = [s for s in _segments(text) if _is_sentence(s)]
    counts = {s: found.count(s) for s in found}
    return [s for s in found if counts[s] == 1]


_PARAGRAPH_END = re.compile(r"\n\s*\n")


def _followers(text: str, said: Sequence[str]) -> dict[str, str]:
    """For each quotable sentence, the one right after it in the same paragraph where that is quotable
    too (across a heading or a code block, "the sentence after" is no longer the text's flow)."""
    quotable, found = set(said), {}
    for paragraph in _PARAGRAPH_END.split(text):
        segments = _segments(paragraph)
        found |= {a: b for a, b in zip(segments, segments[1:]) if a in quotable and _is_sentence(b)}
    return found


def probes(text: str, count: int, seed: int, kinds: Sequence[str] = PROBE_KINDS) -> tuple[Question, ...]:
    """``count`` probes of the document, kinds alternating, over sentences spread through it (seeded);
    each carries the document's words that answer it as its reference. A ``next`` probe quotes the
    first sentence from its slot on whose follower is prose too (none: a ``continue`` probe there)."""
    said = sentences(text)
    if len(said) < 2 or count < 1:
        return ()
    followers = _followers(text, said)
    rng = random.Random(seed)
    slots = [min(len(said) - 2, int((i + rng.random()) * (len(said) - 1) / count)) for i in range(count)]
    made = []
    for i, at in enumerate(slots):
        kind = kinds[i % len(kinds)]
        quoted = next((s for s in said[at:] if s in followers), None) if kind == "next" else None
        if quoted is None:
            words = said[at].split()
            head = " ".join(words[: max(4, len(words) // 2)])
            made.append(Question(f'In the document above, how does the sentence that starts "{head}" go on? '
                                 "Reply with that sentence, word for word.", "continue", " ".join(words[len(head.split()):]), head,
                                 f'Quoted word for word from the text above: "{head}'))  # fmt: skip
        else:
            made.append(Question(f'In the document above, which sentence comes right after "{quoted}"? '
                                 "Reply with that sentence only, word for word.", "next", followers[quoted], NEXT_SENTENCE_PREFIX,
                                 f'Quoted word for word from the text above: "{quoted}'))  # fmt: skip
    return tuple(made)


def with_questions(document: Document, count: int, seed: int) -> Document:
    """The document with its own questions, or ``count`` probes when it has none."""
    if document.questions:
        return document
    return Document(document.name, document.text, probes(document.text, count, seed), document.checks)
