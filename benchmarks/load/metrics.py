"""Per-request records of a multi-turn run and the numbers computed from them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """One chat request of the benchmark. Timings in seconds; ``started`` is relative to the run start.
    expected: the fact's answer on scored turns; correct: whether the reply contains it exactly."""

    user: int
    turn: int  # 0-based
    started: float
    ttft: Optional[float]
    latency: Optional[float]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reply: str
    finish_reason: Optional[str]
    expected: Optional[str]
    correct: Optional[bool]
    error: Optional[str]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def hit_rate(records: Sequence[RequestRecord]) -> Optional[float]:
    """Prompt tokens served from the prefix cache over all prompt tokens (token-weighted)."""
    prompt = sum(r.prompt_tokens for r in records if r.ok)
    return sum(r.cached_tokens for r in records if r.ok) / prompt if prompt else None


@dataclass(frozen=True)
class RunMetrics:
    requests: int
    failed_requests: int
    malformed_replies: int
    wall_seconds: float
    requests_per_second: float
    output_tokens_per_second: float
    ttft: dict[str, Optional[float]]  # "p50", "p90", "p99"
    latency: dict[str, Optional[float]]
    fact_questions: int
    fact_correct: int
    accuracy: Optional[float]
    prompt_tokens: int
    cached_tokens: int
    prompt_tokens_recomputed: int
    hit_rate: Optional[float]
    hit_rate_by_turn: list[Optional[float]]


def _percentiles(values: Sequence[float]) -> dict[str, Optional[float]]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


def summarize(records: Sequence[RequestRecord], wall_seconds: float, turns: int) -> RunMetrics:
    """Throughput counts completed requests only; failed ones are reported, never averaged in."""
    if wall_seconds <= 0:
        raise ValueError(f"wall_seconds {wall_seconds} must be positive")
    done = [r for r in records if r.ok]
    scored = [r for r in done if r.expected is not None]
    correct = sum(1 for r in scored if r.correct)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    return RunMetrics(
        requests=len(done),
        failed_requests=len(records) - len(done),
        malformed_replies=sum(1 for r in done if r.problems),
        wall_seconds=wall_seconds,
        requests_per_second=len(done) / wall_seconds,
        output_tokens_per_second=sum(r.completion_tokens for r in done) / wall_seconds,
        ttft=_percentiles([r.ttft for r in done if r.ttft is not None]),
        latency=_percentiles([r.latency for r in done if r.latency is not None]),
        fact_questions=len(scored),
        fact_correct=correct,
        accuracy=correct / len(scored) if scored else None,
        prompt_tokens=prompt,
        cached_tokens=cached,
        prompt_tokens_recomputed=prompt - cached,
        hit_rate=hit_rate(done),
        hit_rate_by_turn=[hit_rate([r for r in done if r.turn == t]) for t in range(turns)],
    )
