"""Send the documents to one server and record every answer, its timing and the KV the server holds.

Per document, after a cache flush:

1. turn 1: the document and "Summarise the text above in one sentence." (the server compresses the
   document without knowing any question); then ``/kvevict/stats``: the KV slots the conversation
   holds, over the tokens stock holds dense for it (prompt + summary), is the document's kept share;
2. **multi-request** (SCBench's multi-request mode): each question in a new one-turn request, the
   document followed by the question, reusing the document's cached prefix;
3. **multi-turn** (SCBench's multi-turn mode): the questions in turn, as later turns of turn 1's
   conversation, each after the summary and the earlier questions and answers (the server's own).

One request at a time, greedy (temperature 0), streamed: TTFT, inter-token latencies and cached
tokens come from the stream.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import aiohttp

from sgl_kvevict.evaluate.inputs import Document, Question
from sgl_kvevict.measure.chat import slots_held
from sgl_kvevict.measure.client import StreamedReply, ask, flush_when_idle
from sgl_kvevict.measure.servers import ServerError

SUMMARY_INSTRUCTION = "Summarise the text above in one sentence."


@dataclass(frozen=True)
class Answer:
    document: str
    form: str  # multi-request, multi-turn
    index: int  # the question's index in its document
    kind: str
    text: str  # what the server generated after the answer prefix (what fidelity compares: the prefix is ours)
    correct: Optional[bool]  # against the reference, where one is given
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft: Optional[float]  # None: the server ended the answer without a token
    latency: float
    itl: list[float]  # seconds between consecutive content chunks


@dataclass(frozen=True)
class DocumentRun:
    document: str
    prompt_tokens: int
    summary_tokens: int
    ttft: float
    slots_held: Optional[int]  # None: stock, which holds the conversation dense

    @property
    def kept_share(self) -> Optional[float]:
        return None if self.slots_held is None else self.slots_held / (self.prompt_tokens + self.summary_tokens)


def itl_of(reply: StreamedReply) -> list[float]:
    times = reply.token_times
    return [round(b - a, 6) for a, b in zip(times, times[1:])]


def _answer(document: Document, form: str, index: int, question: Question, reply: StreamedReply) -> Answer:
    if document.checks:
        correct: Optional[bool] = document.checks[index](reply.text)
    elif question.reference is not None:
        from sgl_kvevict.evaluate.fidelity import contains_reference

        correct = contains_reference(question.answer_prefix + reply.text, question.reference)
    else:
        correct = None
    return Answer(document.name, form, index, question.kind, reply.text, correct, reply.prompt_tokens or 0, reply.cached_tokens or 0,
                  reply.completion_tokens or 0, reply.ttft, reply.latency or 0.0, itl_of(reply))  # fmt: skip


def _asking(question: Question) -> list[dict]:
    """The question's messages: the user's question, and the reply's prefix where it has one."""
    asked = [{"role": "user", "content": question.text}]
    return asked + ([{"role": "assistant", "content": question.answer_prefix}] if question.answer_prefix else [])


async def run_document(
    session: aiohttp.ClientSession, base_url: str, document: Document, summary_tokens: int, answer_tokens: int
) -> tuple[DocumentRun, list[Answer]]:
    if not await flush_when_idle(session, base_url, timeout=60):
        raise ServerError(f"{base_url} did not flush its cache (POST /flush_cache)")
    turn_one = [{"role": "user", "content": f"{document.text}\n\n{SUMMARY_INSTRUCTION}"}]
    first = await ask(session, base_url, turn_one, summary_tokens)
    record = DocumentRun(document.name, first.prompt_tokens or 0, first.completion_tokens or 0, first.ttft or 0.0,
                         await slots_held(session, base_url))  # fmt: skip
    answers = []
    for index, question in enumerate(document.questions):
        messages = _asking(question)
        messages[0] = {"role": "user", "content": f"{document.text}\n\n{question.text}"}
        reply = await ask(session, base_url, messages, answer_tokens, empty_ok=True)
        answers.append(_answer(document, "multi-request", index, question, reply))
    history = turn_one + [{"role": "assistant", "content": first.text}]
    for index, question in enumerate(document.questions):
        reply = await ask(session, base_url, history + _asking(question), answer_tokens, empty_ok=True)
        answers.append(_answer(document, "multi-turn", index, question, reply))
        history += [{"role": "user", "content": question.text},
                    {"role": "assistant", "content": question.answer_prefix + reply.text}]  # fmt: skip
    return record, answers


async def run_documents(
    base_url: str, documents: Sequence[Document], summary_tokens: int, answer_tokens: int, log: Callable[[str], None],
    api_key: Optional[str] = None,
) -> dict:  # fmt: skip
    """Every document on the server at ``base_url``: its records as JSON (``documents``, ``answers``)."""
    runs, answers, started = [], [], time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), headers=headers) as session:
        for done, document in enumerate(documents, 1):
            record, asked = await run_document(session, base_url, document, summary_tokens, answer_tokens)
            runs.append(record)
            answers += asked
            elapsed = time.perf_counter() - started
            share = "-" if record.kept_share is None else f"{record.kept_share:.2f}"
            log(f"  [{done}/{len(documents)}] {document.name}: {record.prompt_tokens} tokens, kept share {share}, "
                f"turn 1 TTFT {record.ttft:.1f} s, {len(asked)} answers (ETA {elapsed / done * (len(documents) - done) / 60:.1f} min)")  # fmt: skip
    return {"documents": [asdict(r) | {"kept_share": r.kept_share} for r in runs], "answers": [asdict(a) for a in answers]}


def speed(answers: Sequence[dict]) -> dict:
    """Over the answers: output tokens per second of decode, mean and median inter-token latency, median
    TTFT and the hit rate (cached over prompt tokens)."""
    itl = [gap for answer in answers for gap in answer["itl"]]
    decode_time = sum(sum(answer["itl"]) for answer in answers)
    prompt = sum(answer["prompt_tokens"] for answer in answers)
    return {
        "output_tokens_per_second": (len(itl) / decode_time) if decode_time else None,
        "itl_mean": statistics.mean(itl) if itl else None,
        "itl_median": statistics.median(itl) if itl else None,
        "ttft_median": statistics.median(ttfts) if (ttfts := [a["ttft"] for a in answers if a["ttft"] is not None]) else None,
        "hit_rate": sum(a["cached_tokens"] for a in answers) / prompt if prompt else None,
    }
