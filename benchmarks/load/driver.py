"""The comparison driver: at each pool size, vanilla SGLang and every chosen policy variant get the
same conversations with the same ``--max-total-tokens`` (equal KV memory: a policy server carves its
compressed-cell arena out of that same pool), one server at a time, each started fresh.

Two pools: ``large`` holds every history (the prefix cache keeps all of them), ``tight`` holds only
part of them, so vanilla's LRU must throw histories away and re-prefill them on the next turn.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.load.conversations import Conversation, ConversationSpec
from benchmarks.load.servers import ServerError, ServerVariant, check_launcher_accepts, dense_slots, launched_server
from benchmarks.load.users import LoadSettings, RunOutcome, run_users

POOL_NAMES = ("large", "tight")
# Chat-template tokens around each message (role markers, newlines) on top of the text's own tokens;
# SmolLM2's template adds a system prompt of about 30 tokens once.
TEMPLATE_TOKENS_PER_MESSAGE = 5
TEMPLATE_TOKENS_PER_CONVERSATION = 40


class DriverError(ValueError):
    """An invalid comparison setting; the message names it."""


@dataclass(frozen=True)
class CompareConfig:
    """model: launcher --model (bundled name or folder).
    variants: vanilla first, then each policy@budget.
    pools: names to run, in order, from POOL_NAMES.
    large_pool / tight_pool: --max-total-tokens of each (tight None = tight_fraction of all histories).
    """

    model: str
    variants: tuple[ServerVariant, ...]
    pools: tuple[str, ...]
    large_pool: int
    tight_pool: Optional[int]
    tight_fraction: float
    launcher_extra: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.variants or not self.variants[0].is_vanilla:
            raise DriverError("the first variant must be vanilla (--kv-evict-policy none): ratios are against it")
        unknown = [p for p in self.pools if p not in POOL_NAMES]
        if unknown or not self.pools:
            raise DriverError(f"pools {list(self.pools)}: choose from {', '.join(POOL_NAMES)}")
        if self.large_pool < 256 or (self.tight_pool is not None and self.tight_pool < 256):
            raise DriverError("pool sizes must be at least 256 tokens")
        if not 0 < self.tight_fraction < 1:
            raise DriverError(f"tight fraction {self.tight_fraction} must be in (0, 1)")


def history_tokens(conversation: Conversation, count_tokens: Callable[[str], int], max_tokens: int) -> int:
    """Upper estimate of a conversation's final history: every message, answers at full length."""
    turns = len(conversation.turns)
    text = sum(count_tokens(conversation.user_message(i)) for i in range(turns))
    return text + turns * (max_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE) + TEMPLATE_TOKENS_PER_CONVERSATION


@dataclass(frozen=True)
class PoolSizes:
    large: int
    tight: int
    all_histories: int  # estimated tokens of every final history together
    longest_history: int
    # The tight pool was raised above --tight-fraction so that a policy server's dense share (the pool
    # minus its arena) still holds the longest conversation: every prompt is prefilled dense.
    tight_raised_for_dense: bool = False

    def of(self, name: str) -> int:
        return self.large if name == "large" else self.tight


def pool_sizes(
    config: CompareConfig, histories: Sequence[int], max_tokens: int, dense_slots_of: Callable[[int], int] = lambda n: n
) -> PoolSizes:
    """The two pools; refuses sizes that make the comparison meaningless. ``dense_slots_of(pool)``:
    the fewest dense slots any variant gets from a pool of that size (a policy server gives part of
    it to its arena)."""
    total, longest = sum(histories), max(histories)
    # One request needs its whole prompt plus its answer in the dense slots at once.
    needed = longest + max_tokens
    tight, raised = config.tight_pool or math.ceil(config.tight_fraction * total), False
    while config.tight_pool is None and dense_slots_of(tight) < needed:
        # Dense slots grow no faster than the pool, so stepping by the shortfall never overshoots.
        tight, raised = tight + needed - dense_slots_of(tight), True
    for name in config.pools:
        pool = config.large_pool if name == "large" else tight
        if dense_slots_of(pool) < needed:
            raise DriverError(
                f"{name} pool {pool} tokens leaves {dense_slots_of(pool)} dense slots, too few for the longest "
                f"conversation ({needed} tokens with its answer); use more users, shorter documents, or a larger pool"
            )
    if "large" in config.pools and config.large_pool < total:
        raise DriverError(f"large pool {config.large_pool} tokens does not hold every history ({total} tokens)")
    if "tight" in config.pools and tight >= total:
        raise DriverError(f"tight pool {tight} tokens holds every history ({total} tokens): nothing would be evicted")
    return PoolSizes(config.large_pool, tight, total, longest, raised)


def fewest_dense_slots(config: CompareConfig) -> Callable[[int], int]:
    """``dense_slots_of`` for ``pool_sizes``: the launcher's own split, over every variant."""
    return lambda pool: min(dense_slots(config.model, v, pool, config.launcher_extra) for v in config.variants)


@dataclass(frozen=True)
class RunResult:
    pool: str
    pool_tokens: int
    variant: ServerVariant
    outcome: Optional[RunOutcome]
    error: Optional[str]
    startup_seconds: float
    load_average: tuple[float, float, float]  # 1/5/15-minute load before the run: these machines are shared


def compare(
    config: CompareConfig,
    spec: ConversationSpec,
    conversations: Sequence[Conversation],
    settings: LoadSettings,
    sizes: PoolSizes,
    log_dir: Path,
    log: Callable[[str], None] = print,
) -> list[RunResult]:
    """Every (pool, variant), vanilla first in each pool. A run that fails is recorded with its error
    and the comparison goes on; leftover processes after a stop abort everything (the next run would
    measure a machine that is still busy)."""
    for variant in config.variants:  # refuse before spending minutes on the first servers
        check_launcher_accepts(config.model, variant, sizes.large, config.launcher_extra)
    plan = [(pool, variant) for pool in config.pools for variant in config.variants]
    results = []
    for index, (pool, variant) in enumerate(plan, 1):
        pool_tokens = sizes.of(pool)
        load_average = os.getloadavg()
        log(
            f"[{index}/{len(plan)}] {variant.label} on the {pool} pool ({pool_tokens} tokens); "
            f"load average {load_average[0]:.2f}; starting the server"
        )
        started = time.perf_counter()
        outcome, error, startup = None, None, 0.0
        try:
            with launched_server(config.model, variant, pool_tokens, log_dir, config.launcher_extra) as server:
                startup = time.perf_counter() - started
                log(f"  serving after {startup:.0f} s at {server.base_url}; {spec.users} users x {spec.turns} turns")
                outcome = asyncio.run(run_users(server.base_url, conversations, settings, log))
                m = outcome.metrics
                log(
                    f"  done in {m.wall_seconds:.0f} s: {m.requests_per_second:.3f} req/s, "
                    f"{m.output_tokens_per_second:.2f} output tok/s, hit rate {m.hit_rate or 0:.2f}, "
                    f"TTFT p50 {m.ttft['p50'] or 0:.2f} s, facts {m.fact_correct}/{m.fact_questions}; stopping"
                )
        except ServerError as failure:
            if outcome is not None:  # the run finished but the server did not stop cleanly
                raise
            error = str(failure)
            log(f"  failed: {error}")
        results.append(RunResult(pool, pool_tokens, variant, outcome, error, round(startup, 1), load_average))
    return results
