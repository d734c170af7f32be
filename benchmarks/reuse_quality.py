"""Answers through the real server after prefix reuse: context-only quality where it matters.

    python -m benchmarks.reuse_quality --policies lava,snapkv --budget 0.25          # ~20 samples a server
    python -m benchmarks.reuse_quality --policies topk:kvzip,lava:learned --samples 40 --name reuse-kvzip
    python -m benchmarks.reuse_quality ... --resume                                   # after an interruption

Per sample, one conversation of two turns, sent one request at a time (deterministic batches):
turn 1 is a ~1.3K-token document from ``sgl_kvevict/measure/tasks.py`` followed by a question-agnostic
instruction ("Summarise the text above in one sentence."), so a policy server compresses the document
before it knows the question; turn 2 re-sends that history (turn 1 and its answer) plus the task's
question, with the task's answer prefix as the start of the assistant's reply
(``continue_final_message``), and its greedy answer is scored by exact match. Turn 2 must reuse turn 1:
``usage.prompt_tokens_details.cached_tokens`` of turn 2 must cover turn 1's whole prompt (the reuse
rate), and ``/kvevict/stats`` read before and after turn 2 shows what the engine did (its numeric
fields that changed). The cache is flushed before each sample.

Servers: stock SGLang (``--kv-evict-policy none``), then each policy ``name[:score]`` at ``--budget``,
started by the real launcher one at a time with the same ``--max-total-tokens`` (``--policy-pool-tokens``
gives the policy servers another, e.g. a pool smaller than the document). Reported per server:
accuracy with its 95% Wilson interval, the ratio to stock, the reuse rate, and the median TTFT of both
turns: turn 1 pays for the compression (first-turn TTFT ratio), turn 2 gains from the reuse; the net
cost per reuse is turn 1's extra TTFT minus turn 2's saving. Writes ``<name>.json`` (every sample) and
``<name>.md`` into ``--out`` after each server (``--resume`` keeps the finished servers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args
from benchmarks.cli import add_resume_arg
from benchmarks.cli import add_server_args
from benchmarks.cli import as_json
from benchmarks.cli import benchmark_parser
from benchmarks.cli import checkpoint
from benchmarks.cli import checkpoint_path
from benchmarks.cli import command_line
from benchmarks.cli import exits_on
from benchmarks.cli import log_folder
from benchmarks.cli import other_configuration
from benchmarks.cli import parse_command_line
from benchmarks.cli import progress
from benchmarks.cli import run_each
from benchmarks.load.report import heading
from sgl_kvevict.measure.chat import model_token_counter
from sgl_kvevict.measure.client import STATS_PATH, ask, get_json, numeric_fields, flush_when_idle
from sgl_kvevict.measure.intervals import Proportion, wilson
from sgl_kvevict.measure.results import write_result_files, environment
from sgl_kvevict.measure.servers import ServerError
from sgl_kvevict.measure.servers import ServerVariant
from sgl_kvevict.measure.servers import check_launcher_accepts
from sgl_kvevict.measure.servers import launched_server
from sgl_kvevict.measure.servers import server_variants
from sgl_kvevict.measure.tasks import TASK_KINDS, Task, task_suite

CHAT_PATH = "/v1/chat/completions"
SUMMARY_INSTRUCTION = "Summarise the text above in one sentence."


class ReuseError(ValueError):
    """A bad setting, or a checkpoint of another run; the message says which."""


@dataclass(frozen=True)
class ReuseConfig:
    model: str
    policies: tuple[str, ...]
    budget: str
    samples: int
    seed: int
    document_tokens: int
    kinds: tuple[str, ...]
    summary_tokens: int  # turn 1's answer cap
    answer_tokens: int  # turn 2's answer cap
    pool_tokens: int
    launcher_extra: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ("request",)
    block_size: Optional[int] = None
    policy_pool_tokens: Optional[int] = None  # the policy servers' pool, when not stock's
    stock_extra: tuple[str, ...] = ()  # launcher flags of the stock server only, after launcher_extra

    def __post_init__(self):
        if self.policy_pool_tokens is not None and self.policy_pool_tokens < 1:
            raise ReuseError("--policy-pool-tokens must be >= 1")
        if self.samples < 1 or self.summary_tokens < 1 or self.answer_tokens < 1:
            raise ReuseError("--samples, --summary-tokens and --answer-tokens must be >= 1")
        if self.document_tokens < 64:
            raise ReuseError(f"--document-tokens {self.document_tokens} must be >= 64")
        unknown = [k for k in self.kinds if k not in TASK_KINDS]
        if unknown:
            raise ReuseError(f"unknown task kinds {unknown}; valid: {', '.join(TASK_KINDS)}")

    def variants(self) -> tuple[ServerVariant, ...]:
        return server_variants(self.policies, (self.budget,), self.scopes, self.block_size)

    def pool_of(self, variant: ServerVariant) -> int:
        """``--max-total-tokens`` of ``variant``'s server."""
        return self.pool_tokens if variant.is_vanilla or self.policy_pool_tokens is None else self.policy_pool_tokens

    def extra_of(self, variant: ServerVariant) -> tuple[str, ...]:
        """The launcher flags ``variant``'s server gets besides its policy and pool."""
        return self.launcher_extra + (self.stock_extra if variant.is_vanilla else ())


@dataclass(frozen=True)
class SampleRecord:
    """One two-turn conversation. TTFTs in seconds; ``stats_change``: the numeric ``/kvevict/stats``
    fields that changed across turn 2 (after minus before)."""

    index: int
    kind: str
    answer: str
    turn1_prompt_tokens: int
    turn1_ttft: float
    summary: str
    turn2_prompt_tokens: int
    turn2_cached_tokens: int
    turn2_ttft: float
    output: str
    correct: bool
    reused: bool  # turn 2's cached tokens cover turn 1's whole prompt
    stats_change: dict[str, float]


def conversation(task: Task, summary: Optional[str] = None) -> list[dict]:
    """Turn 1's messages, or (with turn 1's ``summary``) turn 2's, ending in the answer prefix."""
    messages = [{"role": "user", "content": f"{task.context}\n\n{SUMMARY_INSTRUCTION}"}]
    if summary is None:
        return messages
    return messages + [
        {"role": "assistant", "content": summary},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": task.answer_prefix},
    ]


def _changed(before: Optional[dict], after: Optional[dict]) -> dict[str, float]:
    old, new = numeric_fields(before or {}), numeric_fields(after or {})
    return {name: value - old.get(name, 0) for name, value in new.items() if value != old.get(name, 0)}


async def run_samples(
    base_url: str, config: ReuseConfig, tasks: Sequence[Task], log: Callable[[str], None]
) -> list[SampleRecord]:
    records: list[SampleRecord] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for index, task in enumerate(tasks):
            if not await flush_when_idle(session, base_url, timeout=60):
                raise ServerError(f"{base_url} did not flush its cache")
            turn1 = await ask(session, base_url, conversation(task), config.summary_tokens)
            before = await get_json(session, base_url + STATS_PATH)
            turn2 = await ask(session, base_url, conversation(task, turn1.text), config.answer_tokens)
            after = await get_json(session, base_url + STATS_PATH)
            records.append(
                SampleRecord(
                    index=index, kind=task.kind, answer=task.answer,
                    turn1_prompt_tokens=turn1.prompt_tokens, turn1_ttft=turn1.ttft, summary=turn1.text,
                    turn2_prompt_tokens=turn2.prompt_tokens, turn2_cached_tokens=turn2.cached_tokens,
                    turn2_ttft=turn2.ttft, output=turn2.text, correct=task.is_correct(turn2.text),
                    reused=turn2.cached_tokens >= turn1.prompt_tokens, stats_change=_changed(before, after),
                )
            )  # fmt: skip
            elapsed = time.perf_counter() - started
            log(
                f"  sample {index + 1}/{len(tasks)} ({task.kind}): {'right' if records[-1].correct else 'wrong'}, "
                f"turn 2 cached {turn2.cached_tokens}/{turn2.prompt_tokens}, TTFT {turn1.ttft:.2f} / {turn2.ttft:.2f} s "
                f"(ETA {elapsed / (index + 1) * (len(tasks) - index - 1) / 60:.1f} min)"
            )
    return records


def summarize(records: Sequence[SampleRecord]) -> dict:
    accuracy = wilson(sum(r.correct for r in records), len(records))
    return {
        "accuracy": accuracy.as_json(),
        "reuse_rate": sum(r.reused for r in records) / len(records),
        "turn1_ttft_median": statistics.median(r.turn1_ttft for r in records),
        "turn2_ttft_median": statistics.median(r.turn2_ttft for r in records),
        "turn2_cached_fraction": sum(r.turn2_cached_tokens for r in records) / sum(r.turn2_prompt_tokens for r in records),
    }


def against_stock(summary: dict, stock: dict) -> dict:
    """Ratios to stock and the net TTFT cost of one reuse: turn 1's extra minus turn 2's saving."""
    extra = summary["turn1_ttft_median"] - stock["turn1_ttft_median"]
    saving = stock["turn2_ttft_median"] - summary["turn2_ttft_median"]
    stock_accuracy = stock["accuracy"]["value"]
    return {
        "accuracy_ratio": summary["accuracy"]["value"] / stock_accuracy if stock_accuracy else None,
        "turn1_ttft_ratio": summary["turn1_ttft_median"] / stock["turn1_ttft_median"],
        "turn2_ttft_ratio": summary["turn2_ttft_median"] / stock["turn2_ttft_median"],
        "turn1_extra_seconds": extra,
        "turn2_saving_seconds": saving,
        "net_cost_per_reuse_seconds": extra - saving,
    }


def run_server(
    config: ReuseConfig, variant: ServerVariant, tasks: Sequence[Task], log_dir: Path, log: Callable[[str], None]
) -> dict:
    load_average = os.getloadavg()
    pool = config.pool_of(variant)
    log(f"{variant.label}: starting the server (--max-total-tokens {pool}; load average {load_average[0]:.2f})")
    with launched_server(config.model, variant, pool, log_dir, config.extra_of(variant)) as server:
        records = asyncio.run(run_samples(server.base_url, config, tasks, log))
    summary = summarize(records)
    log(
        f"{variant.label}: accuracy {wilson(sum(r.correct for r in records), len(records)).percent()}, reuse rate "
        f"{summary['reuse_rate']:.2f}, TTFT turn 1 {summary['turn1_ttft_median']:.2f} s, turn 2 {summary['turn2_ttft_median']:.2f} s"
    )
    return {
        "label": variant.label,
        "variant": asdict(variant),
        "pool_tokens": pool,
        "load_average": load_average,
        "summary": summary,
        "samples": [asdict(r) for r in records],
    }


def table_cells(server: dict) -> dict[str, str]:
    """A server's cells in the tables of this benchmark's results (its report and the README's part)."""
    s, r = server["summary"], server.get("vs_stock") or {}
    accuracy = Proportion.from_json(s["accuracy"])
    return {
        "server": server["label"], "accuracy": accuracy.percent(), "n": str(accuracy.n),
        "vs stock": _fmt(r.get("accuracy_ratio")), "reuse": f"{s['reuse_rate']:.2f}",
        "cached": f"{s['turn2_cached_fraction']:.2f}" if "turn2_cached_fraction" in s else "-",
        "ttft1": f"{s['turn1_ttft_median']:.2f}", "ttft1 vs stock": _fmt(r.get("turn1_ttft_ratio")),
        "ttft2": f"{s['turn2_ttft_median']:.2f}", "ttft2 vs stock": _fmt(r.get("turn2_ttft_ratio")),
        "net": _fmt(r.get("net_cost_per_reuse_seconds")),
    }  # fmt: skip


def table_row(cells: dict[str, str], columns: Sequence[str]) -> str:
    return "| " + " | ".join(cells[column] for column in columns) + " |"


def markdown(payload: dict) -> str:
    meta, servers = payload["meta"], payload["servers"]
    env, config = payload["environment"], meta["config"]
    lines = [
        *heading("Answers through the server after prefix reuse (context-only quality)", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, no GPU (CPU development mode). SGLang {env['sglang']}, "
        f"sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, {env['date']}. "
        f"Model `{config['model']}`, " + pools_sentence(config) + ".",
        "",
        f"{config['samples']} samples (kinds {', '.join(config['kinds'])}, seed {config['seed']}), documents of "
        f"~{config['document_tokens']} tokens. Turn 1: document + \"{SUMMARY_INSTRUCTION}\" (up to "
        f"{config['summary_tokens']} tokens); turn 2: the history + the task's question, the reply started with its "
        f"answer prefix (up to {config['answer_tokens']} tokens), scored by exact match. Reused = turn 2's cached tokens "
        "cover turn 1's whole prompt. One request at a time, cache flushed before each sample.",
        "",
        "| server | accuracy [95% CI] | n | vs stock | reuse rate | turn-2 cached share | TTFT turn 1 (s) | vs stock "
        "| TTFT turn 2 (s) | vs stock | net cost per reuse (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    columns = ("server", "accuracy", "n", "vs stock", "reuse", "cached", "ttft1", "ttft1 vs stock", "ttft2", "ttft2 vs stock", "net")
    lines += [table_row(table_cells(server), columns) for server in servers]
    lines += [
        "",
        "Net cost per reuse = (turn-1 TTFT − stock's) − (stock's turn-2 TTFT − turn-2 TTFT), medians: what one reuse "
        "costs after its saving (negative: a gain). Engine counters that moved during turn 2 (`/kvevict/stats`, summed "
        "over the samples):",
        "",
    ]
    for server in servers:
        totals: dict[str, float] = {}
        for sample in server["samples"]:
            for name, change in sample["stats_change"].items():
                totals[name] = totals.get(name, 0) + change
        shown = ", ".join(f"{name} {value:+g}" for name, value in sorted(totals.items())) or "none reported"
        lines.append(f"* {server['label']}: {shown}")
    lines += [
        "",
        "Greedy bf16 answers through a compressed cache are not bit-identical across machines; compare the intervals.",
    ]
    return "\n".join(lines) + "\n"


def pools_sentence(config: dict) -> str:
    pool, policy_pool = config["pool_tokens"], config.get("policy_pool_tokens")
    if policy_pool is None or policy_pool == pool:
        return f"every server with `--max-total-tokens {pool}`"
    return f"stock with `--max-total-tokens {pool}`, the policy servers with {policy_pool}"


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_outputs(servers: list[dict], meta: dict, out: Path, name: str) -> list[Path]:
    stock = next((s["summary"] for s in servers if s["variant"]["policy"] == "none"), None)
    for server in servers:
        server["vs_stock"] = against_stock(server["summary"], stock) if stock and server["variant"]["policy"] != "none" else None
    payload = {"environment": environment(), "meta": meta, "servers": servers}
    return write_result_files(out, name, payload, markdown(payload))


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("reuse_quality", __doc__)
    add_server_args(parser, ("--policies", "lava", "comma-separated name[:score] besides stock"), "--kv-evict-budget of every policy server")
    parser.add_argument("--samples", type=int, default=20, help="conversations per server (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    parser.add_argument("--document-tokens", type=int, default=1300, help="document length in model tokens (default 1300)")
    parser.add_argument("--kinds", default="passkey,multikey,fact", help="task kinds (default passkey,multikey,fact)")
    parser.add_argument("--summary-tokens", type=int, default=48, help="turn 1's answer cap (default 48)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="turn 2's answer cap (default 8)")
    parser.add_argument("--scopes", default="request", help="comma-separated scopes of every policy: request, block (default request)")
    parser.add_argument("--block-size", type=int, help="--kv-evict-block-size in block scope (default: the launcher's)")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="--max-total-tokens of every server (default 16384)")
    parser.add_argument(
        "--policy-pool-tokens", type=int,
        help="--max-total-tokens of the policy servers instead, e.g. a pool smaller than the document (default: --pool-tokens)",
    )  # fmt: skip
    add_output_args(parser, "reuse_quality", server_arg_for="every server")
    parser.add_argument(
        "--stock-server-arg", action="append", default=[],
        help="extra launcher/SGLang flag for the stock server only, e.g. --stock-server-arg=--chunked-prefill-size=-1 "
        "(its answers do not need the policy servers' chunking; repeatable)",
    )  # fmt: skip
    add_resume_arg(parser)
    return parser


def _resumed(args: argparse.Namespace, config: ReuseConfig) -> list[dict]:
    previous = checkpoint(args, ReuseError)
    if previous is None:
        return []
    if previous["meta"]["config"] != as_json(asdict(config)):
        raise other_configuration(checkpoint_path(args), ReuseError)
    return previous["servers"]


@exits_on(ServerError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    try:
        config = ReuseConfig(
            model=args.model,
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            budget=args.budget,
            samples=args.samples,
            seed=args.seed,
            document_tokens=args.document_tokens,
            kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
            summary_tokens=args.summary_tokens,
            answer_tokens=args.answer_tokens,
            pool_tokens=args.pool_tokens,
            launcher_extra=tuple(args.server_arg),
            scopes=tuple(s.strip() for s in args.scopes.split(",") if s.strip()),
            block_size=args.block_size,
            policy_pool_tokens=args.policy_pool_tokens,
            stock_extra=tuple(args.stock_server_arg),
        )
        variants = config.variants()
        for variant in variants:  # the launcher's own refusal, before minutes of stock's samples
            check_launcher_accepts(config.model, variant, config.pool_of(variant), config.extra_of(variant))
        done = {server["label"]: server for server in _resumed(args, config)}
    except (ReuseError, ServerError) as error:
        parser.error(str(error))
    tasks = task_suite(config.seed, config.samples, config.document_tokens, model_token_counter(config.model), config.kinds)
    meta = {"command": command_line("reuse_quality", argv), "config": asdict(config)}
    log_dir = log_folder(args.log_dir, "reuse-quality")
    run_each(
        variants, lambda variant: variant.label, done,
        lambda variant: run_server(config, variant, tasks, log_dir, progress),
        lambda servers: write_outputs(servers, meta, args.out, args.name),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
