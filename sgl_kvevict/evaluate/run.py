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
from typing import Callable, Optional, Sequence, Union

import aiohttp

from sgl_kvevict.evaluate.fidelity import contains_reference, follows_document
from sgl_kvevict.evaluate.inputs import Document, Question
from sgl_kvevict.measure.chat import ChatTokens, kv_held
from sgl_kvevict.measure.client import StreamedReply, ask, complete, flush_when_idle
from sgl_kvevict.measure.servers import ServerError

SUMMARY_INSTRUCTION = "Summarise the text above in one sentence."
# Turn 1 for a base model, which continues text rather than following an instruction.
BASE_SUMMARY_CUE = "In one sentence, the text above says that"


@dataclass(frozen=True)
class Answer:
    document: str
    form: str  # multi-request, multi-turn
    index: int  # the question's index in its document
    kind: str
    text: str  # what the server generated after the answer prefix (what fidelity compares: the prefix is ours)
    correct: Optional[bool]  # against the reference (the document's words for a probe), where there is one
    document_f1: Optional[float]  # a probe's token F1 against the document's words
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
    kept_share_global_layers: Optional[float] = None  # a model with local layers: what its global layers keep

    @property
    def kept_share(self) -> Optional[float]:
        return None if self.slots_held is None else self.slots_held / (self.prompt_tokens + self.summary_tokens)


def itl_of(reply: StreamedReply) -> list[float]:
    times = reply.token_times
    return [round(b - a, 6) for a, b in zip(times, times[1:])]


def judged(document: Document, index: int, question: Question, reply: StreamedReply, answer_tokens: int) -> tuple[Optional[bool], Optional[float]]:
    """The answer against its reference: (right, token F1 against the document's words for a probe)."""
    if document.checks:
        return document.checks[index](reply.text), None
    if question.reference is None:
        return None, None
    if question.judged_by_document:
        return follows_document(reply.text, question.reference, cut=(reply.completion_tokens or 0) >= answer_tokens)
    return contains_reference(question.answer_prefix + reply.text, question.reference), None


def _answer(document: Document, form: str, index: int, question: Question, reply: StreamedReply, answer_tokens: int) -> Answer:
    correct, f1 = judged(document, index, question, reply, answer_tokens)
    return Answer(document.name, form, index, question.kind, reply.text, correct, f1, reply.prompt_tokens or 0, reply.cached_tokens or 0,
                  reply.completion_tokens or 0, reply.ttft, reply.latency or 0.0, itl_of(reply))  # fmt: skip


class ChatPrompts:
    """A chat model's conversations: messages through its template, sent to the chat API."""

    def __init__(self, chat: ChatTokens):
        self.chat = chat

    def first(self, document: Document) -> list[dict]:
        return [{"role": "user", "content": f"{document.text}\n\n{SUMMARY_INSTRUCTION}"}]

    def new_request(self, document: Document, question: Question) -> list[dict]:
        return [{"role": "user", "content": f"{document.text}\n\n{question.text}"}, *self._reply_start(question)]

    def later(self, history: list[dict], question: Question) -> list[dict]:
        return [*history, {"role": "user", "content": question.text}, *self._reply_start(question)]

    def answered(self, prompt: list[dict], question: Optional[Question], reply: str) -> list[dict]:
        """``prompt`` (``later``'s, or turn 1's with no question) with the reply as the assistant's turn."""
        if question is not None and question.answer_prefix:
            return [*prompt[:-1], {"role": "assistant", "content": question.answer_prefix + reply}]
        return [*prompt, {"role": "assistant", "content": reply}]

    def tokens(self, prompt: list[dict]) -> int:
        return len(self.chat.ids(prompt))

    async def send(self, session: aiohttp.ClientSession, base_url: str, prompt: list[dict], max_tokens: int, empty_ok: bool) -> StreamedReply:
        return await ask(session, base_url, prompt, max_tokens, empty_ok=empty_ok)

    @staticmethod
    def _reply_start(question: Question) -> list[dict]:
        return [{"role": "assistant", "content": question.answer_prefix}] if question.answer_prefix else []


class CompletionPrompts:
    """A base model's conversations (no chat template): token ids, the model's BOS first, sent to the
    completions API; the document, then turn 1's cue or a question's ``completion``, each later
    question after the answers before it. Pieces are tokenised apart so that every prompt of a
    document starts with the same ids and reuses its cached prefix."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, document: Document) -> list[int]:
        return [*self.bos, *self._ids(document.text), *self._ids(f"\n\n{BASE_SUMMARY_CUE}")]

    def new_request(self, document: Document, question: Question) -> list[int]:
        return [*self.bos, *self._ids(document.text), *self._ids(f"\n\n{question.completion}")]

    def later(self, history: list[int], question: Question) -> list[int]:
        return [*history, *self._ids(f"\n\n{question.completion}")]

    def answered(self, prompt: list[int], question: Optional[Question], reply: str) -> list[int]:
        return [*prompt, *self._ids(reply)]

    def tokens(self, prompt: list[int]) -> int:
        return len(prompt)

    async def send(self, session: aiohttp.ClientSession, base_url: str, prompt: list[int], max_tokens: int, empty_ok: bool) -> StreamedReply:
        return await complete(session, base_url, prompt, max_tokens, empty_ok=empty_ok)


Prompts = Union[ChatPrompts, CompletionPrompts]


def prompts_for(model: str) -> Prompts:
    """Chat prompts where the model's tokenizer has a chat template, else completion prompts."""
    chat = ChatTokens.for_model(model)
    return ChatPrompts(chat) if getattr(chat.tokenizer, "chat_template", None) else CompletionPrompts(chat.tokenizer)


async def run_document(
    session: aiohttp.ClientSession, base_url: str, prompts: Prompts, document: Document, summary_tokens: int, answer_tokens: int
) -> tuple[DocumentRun, list[Answer]]:
    if not await flush_when_idle(session, base_url, timeout=60):
        raise ServerError(f"{base_url} did not flush its cache (POST /flush_cache)")
    turn_one = prompts.first(document)
    first = await prompts.send(session, base_url, turn_one, summary_tokens, False)
    held = await kv_held(session, base_url)
    record = DocumentRun(document.name, first.prompt_tokens or 0, first.completion_tokens or 0, first.ttft or 0.0,
                         held.slots, held.global_layers_share)  # fmt: skip
    answers = []
    for index, question in enumerate(document.questions):
        reply = await prompts.send(session, base_url, prompts.new_request(document, question), answer_tokens, True)
        answers.append(_answer(document, "multi-request", index, question, reply, answer_tokens))
    history = prompts.answered(turn_one, None, first.text)
    for index, question in enumerate(document.questions):
        prompt = prompts.later(history, question)
        reply = await prompts.send(session, base_url, prompt, answer_tokens, True)
        answers.append(_answer(document, "multi-turn", index, question, reply, answer_tokens))
        history = prompts.answered(prompt, question, reply.text)
    return record, answers


async def run_documents(
    base_url: str, prompts: Prompts, documents: Sequence[Document], summary_tokens: int, answer_tokens: int, log: Callable[[str], None],
    api_key: Optional[str] = None,
) -> dict:  # fmt: skip
    """Every document on the server at ``base_url``: its records as JSON (``documents``, ``answers``)."""
    runs, answers, started = [], [], time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), headers=headers) as session:
        for done, document in enumerate(documents, 1):
            record, asked = await run_document(session, base_url, prompts, document, summary_tokens, answer_tokens)
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
