"""Soak: bounded minutes of concurrent load with injected faults, then proof that nothing leaked.

Each request is one kind, drawn at random after a first round that injects every kind once:

* ``chat``: a normal streamed chat request over a random slice of one of a few documents (so
  prefixes are shared and the radix tree fills up), random answer length; must be well-formed.
* ``abort_prefill``: a long fresh prompt; the client closes the connection before the first token.
* ``abort_decode``: the client closes the connection after a few streamed tokens.
* ``short_prompt``: a raw completion whose prompt is shorter than 32 tokens (below an eviction window).
* ``invalid_json``, ``negative_max_tokens``, ``wrong_field_type``: must be refused with a 4xx.
* ``unknown_field``: an extra field the API does not define; SGLang ignores such fields, so any
  non-5xx answer is accepted and a 200 must be well-formed.

With ``long_prompt_tokens`` (prompts longer than a prefill chunk), three more kinds:

* ``long_prompt``: a fresh prompt of that many tokens, prefilled in chunks; must be well-formed.
* ``abort_between_chunks``: the same, but the client gives up after 1-8 s, mostly while its chunks
  are being prefilled (the engine's ``chunked_prefills_aborted`` counts the aborts that landed
  between chunks; the report quotes it).
* ``beyond_pool`` (with ``beyond_pool_tokens``, a prompt longer than the KV pool): served
  well-formed where the server compresses while prefilling (block scope), else refused with SGLang's
  length message, as stock SGLang refuses it (a 4xx, or for a streamed chat an error chunk after its
  200 headers); a 5xx, a hang, a broken stream or another error is a violation.
* ``near_limit`` (with ``near_limit_tokens``, a prompt just under the model's context length): the same
  rule; it exercises scoring at the last positions (KVzip's passes run after the segment, so near the
  limit they shrink or the segment stays dense: ``scoring.kvzip``).

Afterwards: wait for the server to go idle, ``POST /flush_cache``, and check that the server is
healthy and answers, that ``/kvevict/stats`` (when it exists) shows every ``*_used`` counter at 0
and every ``*_free`` equal to its ``*_total`` (``arena_cells_used``, ``kv_slots_free``...), and (when
we started the server) that SGLang's idle self-check logged no leak.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp

from sgl_kvevict.measure.client import STATS_PATH
from sgl_kvevict.measure.client import check_reply
from sgl_kvevict.measure.client import flush_when_idle
from sgl_kvevict.measure.client import get_json
from sgl_kvevict.measure.client import numeric_fields
from sgl_kvevict.measure.client import stream_completion
from sgl_kvevict.measure.tasks import filler_sentence

FAULT_KINDS = (
    "chat", "abort_prefill", "abort_decode", "short_prompt",
    "invalid_json", "negative_max_tokens", "wrong_field_type", "unknown_field",
)  # fmt: skip
LONG_KINDS = ("long_prompt", "abort_between_chunks", "beyond_pool", "near_limit")
MUST_BE_REFUSED = ("invalid_json", "negative_max_tokens", "wrong_field_type")
SHORT_PROMPT_LIMIT = 32
# Requests of each kind per normal chat request after the first round (chat takes the rest).
DEFAULT_FAULT_SHARE = {
    "abort_prefill": 0.08, "abort_decode": 0.08, "short_prompt": 0.08,
    "invalid_json": 0.03, "negative_max_tokens": 0.03, "wrong_field_type": 0.03, "unknown_field": 0.03,
}  # fmt: skip
# Long prompts cost a CPU server seconds each: a few per hundred requests.
LONG_FAULT_SHARE = {"long_prompt": 0.02, "abort_between_chunks": 0.02, "beyond_pool": 0.01, "near_limit": 0.01}
ABORT_BETWEEN_CHUNKS_SECONDS = (1.0, 8.0)
# SGLang's refusal of a prompt longer than the server accepts (its tokenizer's length check).
LENGTH_REFUSAL = "exceeds the maximum allowed length"
MAX_SOAK_SECONDS = 3600
MAX_SOAK_REQUESTS = 100_000


class SoakError(ValueError):
    """An invalid soak setting; the message names it."""


@dataclass(frozen=True)
class SoakConfig:
    """seconds / max_requests: the soak stops at whichever comes first (both bounded).
    concurrency: requests in flight at once.
    prompt_tokens: range of tokens of a chat prompt's document slice; the top also sizes the prompts
        that get aborted mid-prefill (keep it under the server's pool and context).
    max_tokens: range of answer lengths.
    long_prompt_tokens: length of the long kinds' prompts (None: no long kinds).
    beyond_pool_tokens: length of the ``beyond_pool`` prompt (None: not sent; needs long kinds).
    near_limit_tokens: length of the ``near_limit`` prompt (None: not sent; needs long kinds)."""

    seconds: float
    max_requests: int
    concurrency: int
    prompt_tokens: tuple[int, int] = (40, 1200)
    max_tokens: tuple[int, int] = (1, 32)
    seed: int = 0
    long_prompt_tokens: Optional[int] = None
    beyond_pool_tokens: Optional[int] = None
    near_limit_tokens: Optional[int] = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The request kinds this soak sends."""
        if self.long_prompt_tokens is None:
            return FAULT_KINDS
        sized = {"beyond_pool": self.beyond_pool_tokens, "near_limit": self.near_limit_tokens}
        return FAULT_KINDS + tuple(kind for kind in LONG_KINDS if sized.get(kind, True))

    def fault_share(self) -> dict[str, float]:
        """Requests of each fault kind per request after the first round (chat takes the rest)."""
        return {**DEFAULT_FAULT_SHARE, **{kind: LONG_FAULT_SHARE[kind] for kind in self.kinds if kind in LONG_FAULT_SHARE}}

    def __post_init__(self):
        if not 0 < self.seconds <= MAX_SOAK_SECONDS:
            raise SoakError(f"seconds {self.seconds} must be in (0, {MAX_SOAK_SECONDS}]")
        if not len(self.kinds) <= self.max_requests <= MAX_SOAK_REQUESTS:
            raise SoakError(f"max_requests {self.max_requests} must be in [{len(self.kinds)}, {MAX_SOAK_REQUESTS}]")
        if not 1 <= self.concurrency <= 64:
            raise SoakError(f"concurrency {self.concurrency} must be in [1, 64]")
        for name, (low, high) in (("prompt_tokens", self.prompt_tokens), ("max_tokens", self.max_tokens)):
            if not 1 <= low <= high:
                raise SoakError(f"{name} range ({low}, {high}) must satisfy 1 <= low <= high")
        if self.long_prompt_tokens is not None and self.long_prompt_tokens < 1:
            raise SoakError(f"long_prompt_tokens {self.long_prompt_tokens} must be at least 1")
        for name in ("beyond_pool_tokens", "near_limit_tokens"):
            if getattr(self, name) is not None and self.long_prompt_tokens is None:
                raise SoakError(f"{name} sizes one of the long kinds: give long_prompt_tokens too")


@dataclass
class SoakReport:
    injected: Counter = field(default_factory=Counter)  # requests sent, per kind
    outcomes: Counter = field(default_factory=Counter)  # "<kind>: <what happened>"
    status_codes: Counter = field(default_factory=Counter)  # "<kind>: <HTTP status>"
    malformed: list[str] = field(default_factory=list)  # completed replies that are not well-formed
    violations: list[str] = field(default_factory=list)  # answers a kind must never get (5xx, 2xx to invalid)
    seconds: float = 0.0
    flush_ok: Optional[bool] = None
    healthy_after: Optional[bool] = None
    final_reply_ok: Optional[bool] = None
    stats_after_flush: Optional[dict] = None
    stats_leaks: list[str] = field(default_factory=list)
    log_leak_warnings: list[str] = field(default_factory=list)
    server_alive: Optional[bool] = None

    @property
    def leaks(self) -> int:
        return len(self.stats_leaks) + len(self.log_leak_warnings)

    @property
    def passed(self) -> bool:
        return (
            not self.malformed
            and not self.violations
            and self.leaks == 0
            and bool(self.flush_ok and self.healthy_after and self.final_reply_ok)
            and self.server_alive is not False
        )

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "requests": sum(self.injected.values()),
            "seconds": round(self.seconds, 1),
            "injected": dict(sorted(self.injected.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "status_codes": dict(sorted(self.status_codes.items())),
            "malformed": self.malformed,
            "violations": self.violations,
            "leaks": self.leaks,
            "stats_leaks": self.stats_leaks,
            "log_leak_warnings": self.log_leak_warnings,
            "flush_ok": self.flush_ok,
            "healthy_after": self.healthy_after,
            "final_reply_ok": self.final_reply_ok,
            "server_alive": self.server_alive,
            "stats_after_flush": self.stats_after_flush,
        }


class _Requests:
    """Builds and sends one request of a kind, recording what happened in the report."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        config: SoakConfig,
        report: SoakReport,
        count_tokens: Callable[[str], int],
    ):
        self.session, self.base_url, self.config, self.report = session, base_url, config, report
        self.count_tokens = count_tokens
        # A few documents, so chat prompts share prefixes of different lengths.
        rng = random.Random(f"soak-documents:{config.seed}")
        self.documents = [self._sentences(rng, config.prompt_tokens[1]) for _ in range(4)]

    def _sentences(self, rng: random.Random, max_tokens: int) -> list[str]:
        """Filler sentences totalling at most ``max_tokens`` tokens."""
        sentences, total = [], 0
        while True:
            sentence = filler_sentence(rng)
            total += self.count_tokens(" " + sentence)
            if total > max_tokens:
                return sentences
            sentences.append(sentence)

    def _chat_payload(self, text: str, max_tokens: int) -> dict:
        return {
            "model": "default",
            "messages": [{"role": "user", "content": text + "\n\nSummarise this in one sentence."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }

    def _document_slice(self, rng: random.Random) -> str:
        """A prefix of one of the documents, of a random length within ``prompt_tokens``."""
        document = rng.choice(self.documents)
        low, high = self.config.prompt_tokens
        fraction = rng.uniform(low, high) / high
        return " ".join(document[: max(1, round(fraction * len(document)))])

    def _note(self, kind: str, outcome: str) -> None:
        self.report.outcomes[f"{kind}: {outcome}"] += 1

    async def send(self, kind: str, rng: random.Random) -> None:
        report, config = self.report, self.config
        report.injected[kind] += 1
        max_tokens = rng.randint(*config.max_tokens)
        chat_url = self.base_url + "/v1/chat/completions"
        if kind == "chat":
            reply = await stream_completion(self.session, chat_url, self._chat_payload(self._document_slice(rng), max_tokens))
            self._record_stream(kind, reply)
        elif kind == "abort_prefill":
            # A fresh long prompt (no cached prefix), so prefill takes long enough to be interrupted.
            payload = self._chat_payload(" ".join(self._sentences(rng, self.config.prompt_tokens[1])), 16)
            reply = await stream_completion(self.session, chat_url, payload, abort_after_seconds=rng.uniform(0.05, 0.5))
            self._record_stream(kind, reply)
        elif kind == "abort_decode":
            payload = self._chat_payload(self._document_slice(rng), 64)
            reply = await stream_completion(self.session, chat_url, payload, abort_after_chunks=rng.randint(1, 5))
            self._record_stream(kind, reply)
        elif kind in ("long_prompt", "abort_between_chunks"):
            payload = self._chat_payload(" ".join(self._sentences(rng, self.config.long_prompt_tokens)), max_tokens)
            abort_after = rng.uniform(*ABORT_BETWEEN_CHUNKS_SECONDS) if kind == "abort_between_chunks" else None
            self._record_stream(kind, await stream_completion(self.session, chat_url, payload, abort_after_seconds=abort_after))
        elif kind in ("beyond_pool", "near_limit"):
            tokens = self.config.beyond_pool_tokens if kind == "beyond_pool" else self.config.near_limit_tokens
            payload = self._chat_payload(" ".join(self._sentences(rng, tokens)), max_tokens)
            reply = await stream_completion(self.session, chat_url, payload)
            if reply.error is not None and LENGTH_REFUSAL in reply.error:
                # Stock's refusal; a streamed chat's can come after its 200 headers, as an error chunk.
                self.report.status_codes[f"{kind}: {reply.status}"] += 1
                self._note(kind, "refused as too long" + (" (4xx)" if reply.status != 200 else " (error in stream)"))
            else:
                if reply.status is not None and 400 <= reply.status < 500:
                    self.report.violations.append(f"{kind}: refused, not for its length: {reply.error}")
                self._record_stream(kind, reply)
        elif kind == "short_prompt":
            words = " ".join(self.documents[0][0].split()[: rng.randint(1, 3)])
            payload = {"model": "default", "prompt": words, "max_tokens": max_tokens, "temperature": 0}
            reply = await stream_completion(self.session, self.base_url + "/v1/completions", payload)
            self._record_stream(kind, reply)
            if reply.prompt_tokens is not None and reply.prompt_tokens >= SHORT_PROMPT_LIMIT:
                report.violations.append(f"short_prompt had {reply.prompt_tokens} prompt tokens")
        else:
            await self._send_invalid(kind, max_tokens)

    def _record_stream(self, kind: str, reply) -> None:
        if reply.status is not None:
            self.report.status_codes[f"{kind}: {reply.status}"] += 1
        if reply.status is not None and reply.status >= 500:
            self.report.violations.append(f"{kind}: HTTP {reply.status}: {reply.error}")
        if reply.error is None:
            self._note(kind, "completed")
            if reply.problems:
                self.report.malformed.append(f"{kind}: {'; '.join(reply.problems)}")
        elif reply.error.startswith("aborted"):
            self._note(kind, "aborted before the first token" if "before" in reply.error else "aborted mid-decode")
        else:
            self._note(kind, "failed")
            self.report.violations.append(f"{kind}: {reply.error}")

    async def _send_invalid(self, kind: str, max_tokens: int) -> None:
        messages = [{"role": "user", "content": "Say hello."}]
        body: object
        if kind == "invalid_json":
            body = '{"model": "default", "messages": [{"role": "user", "content": "Say hel'
        elif kind == "negative_max_tokens":
            body = {"model": "default", "messages": messages, "max_tokens": -max_tokens}
        elif kind == "wrong_field_type":
            body = {"model": "default", "messages": "Say hello.", "max_tokens": "many"}
        else:  # unknown_field
            body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "kv_evict_magic": {"x": 1}}
        url = self.base_url + "/v1/chat/completions"
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
        try:
            async with self.session.post(url, **kwargs) as response:
                status, answer = response.status, await response.read()
        except aiohttp.ClientError as error:
            self._note(kind, "failed")
            self.report.violations.append(f"{kind}: {type(error).__name__}: {error}")
            return
        self.report.status_codes[f"{kind}: {status}"] += 1
        refused = 400 <= status < 500
        self._note(kind, "refused (4xx)" if refused else "accepted (2xx)" if status < 300 else f"HTTP {status}")
        if status >= 500 or (kind in MUST_BE_REFUSED and not refused):
            self.report.violations.append(f"{kind}: HTTP {status}: {answer[:200]!r}")
        if kind == "unknown_field" and status == 200 and b'"choices"' not in answer:
            self.report.malformed.append(f"unknown_field: 200 without choices: {answer[:200]!r}")


def _kinds(config: SoakConfig, rng: random.Random, share: dict[str, float]):
    """Every kind once (shuffled), then random kinds by ``share`` until ``max_requests``."""
    first = list(config.kinds)
    rng.shuffle(first)
    yield from first
    names, weights = zip(*share.items())
    for _ in range(config.max_requests - len(first)):
        yield "chat" if rng.random() >= sum(weights) else rng.choices(names, weights)[0]


def stats_leaks(stats: dict) -> list[str]:
    """Why ``/kvevict/stats`` read after a flush shows a leak (empty when everything is back): by the
    engine's naming convention, every ``<thing>_used`` count must be 0 and every ``<thing>_free`` must
    equal its ``<thing>_total``, whatever things (cells, slots) the engine accounts for."""
    numbers, leaks = numeric_fields(stats), []
    for name, value in numbers.items():
        if name.endswith("_used") and value != 0:
            leaks.append(f"{name} {value:g} after flush")
        total = name.removesuffix("_free") + "_total"
        if name.endswith("_free") and total in numbers and value != numbers[total]:
            leaks.append(f"{name} {value:g} != {total} {numbers[total]:g}")
    return leaks


async def run_soak(
    base_url: str,
    config: SoakConfig,
    count_tokens: Callable[[str], int],
    log: Callable[[str], None] = print,
) -> SoakReport:
    """The load, then the after-checks (not the server-log check: see ``check_server_after``)."""
    report = SoakReport()
    rng = random.Random(f"soak:{config.seed}")
    kinds = _kinds(config, rng, config.fault_share())
    timeout = aiohttp.ClientTimeout(total=600)
    # One connection per request: aborted requests close theirs mid-way, and a pooled keep-alive
    # connection the server has just closed fails the next request that reuses it ("Can not write
    # request body", seen after ~1300 s of a soak; no request had reached the server).
    connector = aiohttp.TCPConnector(limit=config.concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        requests = _Requests(session, base_url, config, report, count_tokens)
        started = time.monotonic()
        deadline = started + config.seconds
        next_progress = started + 10

        async def worker(worker_id: int) -> None:
            nonlocal next_progress
            worker_rng = random.Random(f"soak:{config.seed}:{worker_id}")
            for kind in kinds:  # the generator is shared: workers take turns drawing from it
                if time.monotonic() >= deadline:
                    return
                await requests.send(kind, worker_rng)
                if time.monotonic() >= next_progress:
                    next_progress = time.monotonic() + 10
                    log(
                        f"  [{time.monotonic() - started:6.1f} s] {sum(report.injected.values())} requests, "
                        f"{sum(n for k, n in report.outcomes.items() if 'aborted' in k)} aborted, "
                        f"{len(report.violations)} violations, {len(report.malformed)} malformed"
                    )

        await asyncio.gather(*(worker(i) for i in range(config.concurrency)))
        report.seconds = time.monotonic() - started
        log(f"  load done: {sum(report.injected.values())} requests in {report.seconds:.0f} s; flushing the cache")
        report.flush_ok = await flush_when_idle(session, base_url)
        report.stats_after_flush = await get_json(session, base_url + STATS_PATH)
        if report.stats_after_flush is not None:
            report.stats_leaks = stats_leaks(report.stats_after_flush)
        try:
            async with session.get(base_url + "/health") as response:
                report.healthy_after = response.status == 200
        except aiohttp.ClientError:
            report.healthy_after = False
        final = await stream_completion(
            session,
            base_url + "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0},
        )
        report.final_reply_ok = final.error is None and not check_reply(final, 8)
    return report


def combined_summary(reports: list[SoakReport]) -> dict:
    """One summary over several servers' soaks: counts added, every problem listed, passed if all passed."""
    merged = SoakReport()
    for report in reports:
        for name in ("injected", "outcomes", "status_codes"):
            getattr(merged, name).update(getattr(report, name))
        for name in ("malformed", "violations", "stats_leaks", "log_leak_warnings"):
            getattr(merged, name).extend(getattr(report, name))
        merged.seconds += report.seconds
    summary = merged.to_json()
    summary["passed"] = all(report.passed for report in reports)
    for name in ("flush_ok", "healthy_after", "final_reply_ok"):
        summary[name] = all(getattr(report, name) for report in reports)
    summary["server_alive"] = all(report.server_alive is not False for report in reports)
    del summary["stats_after_flush"]  # per server, in its own run
    return summary
