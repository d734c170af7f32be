"""The comparison driver: at each pool size, vanilla SGLang and every chosen policy variant get the
same conversations with the same ``--max-total-tokens`` (equal KV memory: a policy server keeps its
compressed cells in that same pool), one server at a time, each started fresh.

A plan is a list of pools (a name and a size in tokens). ``compare`` runs two: ``large`` holds every
history, ``tight`` only part of them, so vanilla's LRU must throw histories away and re-prefill
them. ``sweep`` runs several, from every history fitting down to a quarter of them. Every pool must
hold the longest request dense (its prompt and answer), for vanilla and policy servers alike: a
prompt is prefilled dense before it is compressed.

Each finished server run is handed to ``checkpoint``; a run given in ``done`` (same pool size and
variant, from an interrupted invocation) is not run again.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.load.conversations import Conversation, ConversationSpec
from benchmarks.load.users import LoadSettings, RunOutcome, run_users
from sgl_kvevict.measure.servers import ServerError
from sgl_kvevict.measure.servers import ServerVariant
from sgl_kvevict.measure.servers import check_launcher_accepts
from sgl_kvevict.measure.servers import check_lineup
from sgl_kvevict.measure.servers import launched_server

POOL_NAMES = ("large", "tight")
# Chat-template tokens around each message (role markers, newlines) on top of the text's own tokens;
# SmolLM2's template adds a system prompt of about 30 tokens once.
TEMPLATE_TOKENS_PER_MESSAGE = 5
TEMPLATE_TOKENS_PER_CONVERSATION = 40
DEFAULT_SWEEP_FRACTIONS = (1.0, 0.75, 0.5, 0.25)


class DriverError(ValueError):
    """An invalid comparison setting; the message names it."""


@dataclass(frozen=True)
class Pool:
    """One KV memory size every server of a row group gets (``--max-total-tokens``)."""

    name: str
    tokens: int


@dataclass(frozen=True)
class CompareConfig:
    """model: launcher --model (bundled name or folder).
    variants: vanilla first, then each policy variant.
    launcher_extra: flags every server gets (variants carry their own in ``ServerVariant.extra``).
    """

    model: str
    variants: tuple[ServerVariant, ...]
    launcher_extra: tuple[str, ...] = ()

    def __post_init__(self):
        check_lineup(
            [v.label for v in self.variants], bool(self.variants) and self.variants[0].is_vanilla, DriverError,
            "the first variant must be vanilla (--kv-evict-policy none): ratios are against it", "variants repeat",
        )  # fmt: skip


def history_tokens(conversation: Conversation, count_tokens: Callable[[str], int], max_tokens: int) -> int:
    """Upper estimate of a conversation's final history: every message, answers at full length."""
    turns = len(conversation.turns)
    text = sum(count_tokens(conversation.user_message(i)) for i in range(turns))
    system = count_tokens(conversation.system_prompt) + TEMPLATE_TOKENS_PER_MESSAGE if conversation.system_prompt else 0
    return text + system + turns * (max_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE) + TEMPLATE_TOKENS_PER_CONVERSATION


@dataclass(frozen=True)
class Workload:
    """The token sizes pools are chosen from (estimates: answers counted at ``max_tokens``)."""

    all_histories: int  # every final history together: stock's working set when all stay cached
    longest_history: int
    max_tokens: int

    @property
    def longest_request(self) -> int:
        """The most KV one request needs at once, dense: its whole prompt plus its answer."""
        return self.longest_history + self.max_tokens


def workload(histories: Sequence[int], max_tokens: int) -> Workload:
    return Workload(sum(histories), max(histories), max_tokens)


def _check_holds_longest(pool: Pool, load: Workload) -> None:
    if pool.tokens < load.longest_request:
        raise DriverError(
            f"{pool.name} pool {pool.tokens} tokens cannot hold the longest request dense ({load.longest_request} "
            "tokens with its answer); use shorter documents, fewer turns or a larger pool"
        )


def compare_pools(
    names: Sequence[str], load: Workload, large: int, tight: Optional[int], tight_fraction: float
) -> list[Pool]:
    """``large`` (every history fits) and ``tight`` (``tight_fraction`` of them unless given)."""
    unknown = [n for n in names if n not in POOL_NAMES]
    if unknown or not names:
        raise DriverError(f"pools {list(names)}: choose from {', '.join(POOL_NAMES)}")
    if not 0 < tight_fraction < 1:
        raise DriverError(f"tight fraction {tight_fraction} must be in (0, 1)")
    sizes = {"large": large, "tight": tight or math.ceil(tight_fraction * load.all_histories)}
    pools = [Pool(name, sizes[name]) for name in names]
    for pool in pools:
        _check_holds_longest(pool, load)
    if "large" in names and large < load.all_histories:
        raise DriverError(f"large pool {large} tokens does not hold every history ({load.all_histories} tokens)")
    if "tight" in names and sizes["tight"] >= load.all_histories:
        raise DriverError(f"tight pool {sizes['tight']} tokens holds every history ({load.all_histories}): nothing is evicted")
    return pools


def sweep_pools(load: Workload, fractions: Sequence[float] = (), sizes: Sequence[int] = ()) -> list[Pool]:
    """Pools from every history fitting down to a fraction of them: ``sizes`` in tokens when given,
    else ``fractions`` (default 1, 0.75, 0.5, 0.25) of the working set. Largest first."""
    if sizes:
        pools = [Pool(f"{size / load.all_histories:.2f}", size) for size in sorted(sizes, reverse=True)]
    else:
        chosen = sorted(fractions or DEFAULT_SWEEP_FRACTIONS, reverse=True)
        if any(not 0 < f <= 4 for f in chosen):
            raise DriverError(f"pool fractions {chosen} must be in (0, 4]")
        pools = [Pool(f"{f:.2f}", math.ceil(f * load.all_histories)) for f in chosen]
    if len({p.tokens for p in pools}) != len(pools):
        raise DriverError(f"pool sizes repeat: {[p.tokens for p in pools]}")
    for pool in pools:
        _check_holds_longest(pool, load)
    return pools


@dataclass(frozen=True)
class RunResult:
    pool: str
    pool_tokens: int
    variant: ServerVariant
    outcome: Optional[RunOutcome]
    error: Optional[str]
    startup_seconds: float
    load_average: tuple[float, float, float]  # 1/5/15-minute load before the run: these machines are shared

    @property
    def key(self) -> tuple[int, str]:
        return self.pool_tokens, self.variant.label


@dataclass
class _Eta:
    total: int
    started: float = field(default_factory=time.perf_counter)
    finished: int = 0

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        if not self.finished:
            return f"elapsed {elapsed / 60:.0f} min"
        return f"elapsed {elapsed / 60:.0f} min, ETA {elapsed / self.finished * (self.total - self.finished) / 60:.0f} min"


def run_plan(
    config: CompareConfig,
    pools: Sequence[Pool],
    spec: ConversationSpec,
    conversations: Sequence[Conversation],
    settings: LoadSettings,
    log_dir: Path,
    log: Callable[[str], None] = print,
    done: Sequence[RunResult] = (),
    checkpoint: Optional[Callable[[list[RunResult]], None]] = None,
) -> list[RunResult]:
    """Every (pool, variant), vanilla first in each pool. A run that fails is recorded with its error
    and the plan goes on; leftover processes after a stop abort everything (the next run would
    measure a machine that is still busy). Runs in ``done`` without an error are kept, not rerun."""
    for variant in config.variants:  # refuse before spending minutes on the first servers
        check_launcher_accepts(config.model, variant, pools[0].tokens, config.launcher_extra)
    previous = {r.key: r for r in done if r.error is None}
    plan = [(pool, variant) for pool in pools for variant in config.variants]
    eta = _Eta(sum(1 for pool, variant in plan if (pool.tokens, variant.label) not in previous))
    results: list[RunResult] = []
    for index, (pool, variant) in enumerate(plan, 1):
        kept = previous.get((pool.tokens, variant.label))
        if kept is not None:
            log(f"[{index}/{len(plan)}] {variant.label} on the {pool.name} pool ({pool.tokens} tokens): done before, kept")
            results.append(kept)
            continue
        results.append(_run_one(config, pool, variant, spec, conversations, settings, log_dir, log, f"[{index}/{len(plan)}]"))
        eta.finished += 1
        log(f"  {eta.line()}")
        if checkpoint is not None:
            checkpoint(results)
    return results


def _run_one(
    config: CompareConfig,
    pool: Pool,
    variant: ServerVariant,
    spec: ConversationSpec,
    conversations: Sequence[Conversation],
    settings: LoadSettings,
    log_dir: Path,
    log: Callable[[str], None],
    prefix: str,
) -> RunResult:
    load_average = os.getloadavg()
    log(
        f"{prefix} {variant.label} on the {pool.name} pool ({pool.tokens} tokens); load average {load_average[0]:.2f}; "
        "starting the server"
    )
    started = time.perf_counter()
    outcome, error, startup = None, None, 0.0
    try:
        with launched_server(config.model, variant, pool.tokens, log_dir, config.launcher_extra) as server:
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
    return RunResult(pool.name, pool.tokens, variant, outcome, error, round(startup, 1), load_average)
