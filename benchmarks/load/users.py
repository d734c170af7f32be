"""Simulated users: each holds one conversation and sends its turns one after another (the next
question only after the previous answer arrived, its history growing by both); all users run
concurrently against one server."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import aiohttp

from benchmarks.load.conversations import Conversation
from benchmarks.load.metrics import RequestRecord, RunMetrics, hit_rate, summarize
from sgl_kvevict.measure.client import StatsPeaks, StatsSampler, get_json, stream_completion


class LoadError(ValueError):
    """An invalid load setting; the message names it."""


@dataclass(frozen=True)
class LoadSettings:
    """max_tokens: answer length cap (short answers keep the run prefill-bound, as chat history is).
    request_timeout: seconds before one request counts as failed.
    stats_interval: seconds between samples of /kvevict/stats."""

    max_tokens: int = 16
    request_timeout: float = 900.0
    stats_interval: float = 0.5

    def __post_init__(self):
        if self.max_tokens < 1:
            raise LoadError(f"max_tokens {self.max_tokens} must be >= 1")
        if self.request_timeout <= 0 or self.stats_interval <= 0:
            raise LoadError("request_timeout and stats_interval must be positive")


@dataclass(frozen=True)
class RunOutcome:
    records: list[RequestRecord]
    metrics: RunMetrics
    stats: StatsPeaks
    dense_slots: Optional[int]  # SGLang's max_total_num_tokens: the token slots of its KV pool


class _Progress:
    """Prints a line whenever every user has finished (or given up on) another turn."""

    def __init__(self, users: int, turns: int, started: float, log: Callable[[str], None]):
        self.users, self.turns, self.started, self.log = users, turns, started, log
        self.finished_per_turn = [0] * turns
        self.records: list[RequestRecord] = []
        self.next_turn_to_report = 0

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.finished_per_turn[record.turn] += 1

    def skip(self, from_turn: int) -> None:
        """A user stopped (failed request): its later turns will never come."""
        for turn in range(from_turn, self.turns):
            self.finished_per_turn[turn] += 1

    def report(self) -> None:
        while self.next_turn_to_report < self.turns and self.finished_per_turn[self.next_turn_to_report] == self.users:
            turn = self.next_turn_to_report
            done = [r for r in self.records if r.ok]
            scored = [r for r in done if r.expected is not None]
            rate = hit_rate([r for r in done if r.turn == turn])
            self.log(
                f"  [{time.perf_counter() - self.started:7.1f} s] turn {turn + 1}/{self.turns} done: "
                f"{len(done)} requests ok, {len(self.records) - len(done)} failed; "
                f"hit rate this turn {'-' if rate is None else f'{rate:.2f}'}; "
                f"facts {sum(1 for r in scored if r.correct)}/{len(scored)} correct"
            )
            self.next_turn_to_report += 1


async def _run_user(
    session: aiohttp.ClientSession,
    url: str,
    conversation: Conversation,
    settings: LoadSettings,
    started: float,
    progress: _Progress,
) -> None:
    messages = conversation.opening_messages()
    for turn_index, turn in enumerate(conversation.turns):
        messages.append({"role": "user", "content": conversation.user_message(turn_index)})
        sent = time.perf_counter() - started
        reply = await stream_completion(
            session,
            url,
            {"model": "default", "messages": messages, "max_tokens": settings.max_tokens, "temperature": 0},
        )
        expected = turn.fact.answer if turn.fact else None
        progress.add(
            RequestRecord(
                user=conversation.user,
                turn=turn_index,
                started=sent,
                ttft=reply.ttft,
                latency=reply.latency,
                prompt_tokens=reply.prompt_tokens or 0,
                cached_tokens=reply.cached_tokens or 0,
                completion_tokens=reply.completion_tokens or 0,
                reply=reply.text,
                finish_reason=reply.finish_reason,
                expected=expected,
                correct=turn.fact.is_answered_by(reply.text) if turn.fact and reply.error is None else None,
                error=reply.error,
                problems=tuple(reply.problems),
            )
        )
        if reply.error is not None:
            # The history cannot go on without this answer; the user leaves, as a real one would.
            progress.skip(turn_index + 1)
            progress.report()
            return
        progress.report()
        messages.append({"role": "assistant", "content": reply.text})


async def run_users(
    base_url: str,
    conversations: Sequence[Conversation],
    settings: LoadSettings,
    log: Callable[[str], None] = print,
) -> RunOutcome:
    """All conversations at once against ``base_url``; returns records, metrics and stats peaks."""
    turns = len(conversations[0].turns)
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout)
    # One connection per user: the pool must not serialise users behind each other.
    connector = aiohttp.TCPConnector(limit=len(conversations) + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        info = await get_json(session, base_url + "/server_info")
        sampler = StatsSampler(session, base_url, settings.stats_interval)
        await sampler.start()
        started = time.perf_counter()
        progress = _Progress(len(conversations), turns, started, log)
        url = base_url + "/v1/chat/completions"
        await asyncio.gather(*(_run_user(session, url, c, settings, started, progress) for c in conversations))
        wall = time.perf_counter() - started
        stats = await sampler.stop()
    records = sorted(progress.records, key=lambda r: (r.user, r.turn))
    dense_slots = info.get("max_total_num_tokens") if info else None
    return RunOutcome(records, summarize(records, wall, turns), stats, dense_slots)


def outcome_to_json(outcome: RunOutcome) -> dict:
    return {
        "metrics": asdict(outcome.metrics),
        "kvevict_stats": asdict(outcome.stats),
        "dense_slots": outcome.dense_slots,
        "records": [asdict(r) for r in outcome.records],
    }


def outcome_from_json(run: dict) -> RunOutcome:
    """The outcome ``outcome_to_json`` wrote (a checkpointed run being resumed)."""
    records = [RequestRecord(**{**r, "problems": tuple(r["problems"])}) for r in run["records"]]
    return RunOutcome(records, RunMetrics(**run["metrics"]), StatsPeaks(**run["kvevict_stats"]), run["dense_slots"])
