"""What compression costs and saves on a single stream: prefill overhead of scoring + compaction,
decode speed over compressed KV, turn-2 time to first token with a reused compressed prefix, and
memory per conversation.

    python -m benchmarks.engine_overhead                                   # SmolLM2, vanilla vs lava@0.25
    python -m benchmarks.engine_overhead --policy snapkv --budget 0.5 --prompts 7

Starts the real launcher (sgl_kvevict/measure/servers.py) for vanilla (``--kv-evict-policy none``), for
``full`` (the plugin's path with nothing evicted) and then for the policy, one server at a time, all
with the same ``--max-total-tokens``. Requests are
sent one at a time (nothing else in flight), greedy and streamed, so time to first token (TTFT) is
measured at the client. Each server answers, in this order:

* prefill: a fresh ~2K-token prompt (document + question) with ``max_tokens`` 1, after a flush, for
  several documents: TTFT is the prefill time, plus scoring and compaction with a policy;
* decode: a fresh prompt with ``--decode-tokens`` output tokens (``ignore_eos``): tokens/s after the
  first token, i.e. decode over the compressed prefix plus the dense window with a policy;
* turn 2: after a flush, turn 1 of a conversation (its prompt compressed with a policy), then turn 2
  (history + answer + a new question) with ``max_tokens`` 1: TTFT with the prefix reused; then a
  flush and the same turn 2 again: TTFT without reuse. ``/kvevict/stats`` after turn 1 gives the
  memory of one conversation: arena cells kept for the compressed segment against its dense
  equivalent (tokens x layers x KV heads), plus the dense slots the tree still holds (window, answer).

Medians over the samples, and ratios from the same run: policy / vanilla, policy / full (what eviction
buys) and full / vanilla (what the plugin's path costs); the machine is shared and noisy (absolute
numbers move by tens of percent between runs, ratios much less). Writes
``<name>.json`` (every sample) and ``<name>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args
from benchmarks.cli import add_server_args
from benchmarks.cli import benchmark_parser
from benchmarks.cli import command_line
from benchmarks.cli import exits_on
from benchmarks.cli import log_folder
from benchmarks.cli import parse_command_line
from benchmarks.cli import progress
from benchmarks.load.conversations import Conversation, ConversationSpec, build_conversations
from benchmarks.load.report import ATTRIBUTION, FULL_NOT_SERVED, ratio, ratios_of, write_report
from benchmarks.load.soak import stats_leaks
from sgl_kvevict.measure.chat import model_token_counter
from sgl_kvevict.measure.client import STATS_PATH, StreamedReply, get_json, stream_completion, flush_when_idle
from sgl_kvevict.measure.results import environment
from sgl_kvevict.measure.servers import FULL_POLICY, VANILLA_POLICY, ServerError, ServerVariant, launched_server

CHAT_PATH = "/v1/chat/completions"
# A short first request: the server skips SGLang's warm-up, so the first forward pays one-off costs.
WARM_UP_MESSAGE = "Say hello."


@dataclass(frozen=True)
class OverheadConfig:
    model: str
    policy: str
    budget: str
    pool_tokens: int
    prompt_tokens: int  # document length in model tokens; the chat prompt adds ~60 tokens around it
    prompts: int
    decode_tokens: int
    decode_runs: int
    turn2_runs: int
    answer_tokens: int
    seed: int
    launcher_extra: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("pool_tokens", "prompt_tokens", "prompts", "decode_tokens", "decode_runs", "turn2_runs", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.policy in (VANILLA_POLICY, FULL_POLICY):
            raise ValueError(f"--policy {self.policy}: every run serves it already; choose a policy that evicts")

    @property
    def documents(self) -> int:
        return max(self.prompts, self.decode_runs, self.turn2_runs)


@dataclass
class ServerSamples:
    """Every measurement of one server; ``memory`` only for a server that evicts."""

    label: str
    prefill: list[dict] = field(default_factory=list)  # ttft, prompt_tokens, cached_tokens
    decode: list[dict] = field(default_factory=list)  # tokens_per_second, completion_tokens, ttft
    turn2: list[dict] = field(default_factory=list)  # ttft_reuse, ttft_no_reuse, cached_* , prompt_tokens
    memory: list[dict] = field(default_factory=list)  # /kvevict/stats after turn 1, per conversation
    leaks_after_flush: list[str] = field(default_factory=list)


class MeasurementError(RuntimeError):
    """A request of the benchmark failed; the message has the server's answer."""


def chat_payload(messages: list[dict], max_tokens: int, ignore_eos: bool = False) -> dict:
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {**payload, "ignore_eos": True} if ignore_eos else payload


async def ask(session: aiohttp.ClientSession, base_url: str, payload: dict) -> StreamedReply:
    reply = await stream_completion(session, base_url + CHAT_PATH, payload)
    if reply.error or reply.problems or reply.ttft is None:
        raise MeasurementError(f"request failed: {reply.error or reply.problems or 'no token streamed'}")
    return reply


async def flush(session: aiohttp.ClientSession, base_url: str) -> None:
    if not await flush_when_idle(session, base_url, timeout=60):
        raise MeasurementError(f"{base_url} did not flush its cache")


async def _measure(
    base_url: str, config: OverheadConfig, conversations: Sequence[Conversation], label: str, log: Callable[[str], None]
) -> ServerSamples:
    samples = ServerSamples(label)
    first = lambda c: [{"role": "user", "content": c.user_message(0)}]  # noqa: E731
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await ask(session, base_url, chat_payload([{"role": "user", "content": WARM_UP_MESSAGE}], 4))

        for i in range(config.prompts):
            await flush(session, base_url)
            reply = await ask(session, base_url, chat_payload(first(conversations[i]), 1))
            samples.prefill.append({"ttft": reply.ttft, "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens})
            log(f"  prefill {i + 1}/{config.prompts}: {reply.prompt_tokens} tokens, TTFT {reply.ttft:.2f} s")

        for i in range(config.decode_runs):
            await flush(session, base_url)
            reply = await ask(session, base_url, chat_payload(first(conversations[i]), config.decode_tokens, ignore_eos=True))
            rate = (reply.completion_tokens - 1) / (reply.latency - reply.ttft)
            samples.decode.append({"tokens_per_second": rate, "completion_tokens": reply.completion_tokens, "ttft": reply.ttft})
            log(f"  decode {i + 1}/{config.decode_runs}: {reply.completion_tokens} tokens, {rate:.2f} tok/s after the first")

        for i in range(config.turn2_runs):
            conversation = conversations[i]
            await flush(session, base_url)
            turn1 = await ask(session, base_url, chat_payload(first(conversation), config.answer_tokens))
            stats = await get_json(session, base_url + STATS_PATH)
            if stats and stats.get("policy") not in (VANILLA_POLICY, FULL_POLICY):
                samples.memory.append({**stats, "turn1_prompt_tokens": turn1.prompt_tokens, "turn1_answer_tokens": turn1.completion_tokens})
            turn2 = first(conversation) + [
                {"role": "assistant", "content": turn1.text},
                {"role": "user", "content": conversation.user_message(1)},
            ]
            reused = await ask(session, base_url, chat_payload(turn2, 1))
            await flush(session, base_url)
            fresh = await ask(session, base_url, chat_payload(turn2, 1))
            samples.turn2.append(
                {
                    "prompt_tokens": reused.prompt_tokens,
                    "ttft_reuse": reused.ttft,
                    "cached_tokens_reuse": reused.cached_tokens,
                    "ttft_no_reuse": fresh.ttft,
                    "cached_tokens_no_reuse": fresh.cached_tokens,
                }
            )
            log(
                f"  turn 2 {i + 1}/{config.turn2_runs}: {reused.prompt_tokens} tokens, TTFT {reused.ttft:.2f} s with "
                f"{reused.cached_tokens} cached, {fresh.ttft:.2f} s after a flush ({fresh.cached_tokens} cached)"
            )

        await flush(session, base_url)
        stats = await get_json(session, base_url + STATS_PATH)
        samples.leaks_after_flush = stats_leaks(stats or {})
    return samples


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


# The /kvevict/stats fields the memory figure is computed from.
MEMORY_FIELDS = ("compressed_tokens", "kept_cells", "kv_slots_total", "kv_slots_free", "arena_slots_borrowed")


def memory_per_conversation(memory: dict, num_layers: int, num_kv_heads: int) -> dict:
    """One conversation after turn 1, from ``/kvevict/stats``: cells held vs its dense equivalent.
    One dense slot (a token) holds ``num_layers * num_kv_heads`` cells' worth of K and V."""
    missing = [name for name in MEMORY_FIELDS if name not in memory]
    if missing:
        raise MeasurementError(f"/kvevict/stats lacks {missing}: benchmarks/engine_overhead.py is behind the engine")
    if memory["compressed_tokens"] == 0:
        raise MeasurementError("turn 1 was not compressed")
    cells_per_token = num_layers * num_kv_heads
    # SGLang's pool lends slots to the arena of compressed cells; the rest in use hold dense tokens.
    dense_slots_held = memory["kv_slots_total"] - memory["kv_slots_free"] - memory["arena_slots_borrowed"]
    conversation_tokens = memory["turn1_prompt_tokens"] + memory["turn1_answer_tokens"]
    held = memory["kept_cells"] + dense_slots_held * cells_per_token
    return {
        "compressed_tokens": memory["compressed_tokens"],
        "kept_cells": memory["kept_cells"],
        "compressed_dense_equivalent_cells": memory["compressed_tokens"] * cells_per_token,
        "compressed_ratio": memory["kept_cells"] / (memory["compressed_tokens"] * cells_per_token),
        "dense_slots_held": dense_slots_held,
        "conversation_tokens": conversation_tokens,
        "conversation_cells_held": held,
        "conversation_dense_equivalent_cells": conversation_tokens * cells_per_token,
        "conversation_ratio": held / (conversation_tokens * cells_per_token),
    }


def summarize(samples: ServerSamples) -> dict:
    prefill_ttft = _median(samples.prefill, "ttft")
    return {
        "prefill_prompt_tokens": _median(samples.prefill, "prompt_tokens"),
        "prefill_ttft": prefill_ttft,
        "prefill_tokens_per_second": _median(samples.prefill, "prompt_tokens") / prefill_ttft,
        "decode_tokens_per_second": _median(samples.decode, "tokens_per_second"),
        "turn2_prompt_tokens": _median(samples.turn2, "prompt_tokens"),
        "turn2_ttft_reuse": _median(samples.turn2, "ttft_reuse"),
        "turn2_ttft_no_reuse": _median(samples.turn2, "ttft_no_reuse"),
        "turn2_cached_tokens_reuse": _median(samples.turn2, "cached_tokens_reuse"),
    }


# The servers of a run, in order: stock, the plugin's path with nothing evicted, the policy.
ROLES = ("vanilla", "full", "policy")
# The medians compared server / baseline.
RATIO_MEDIANS = ("prefill_ttft", "prefill_tokens_per_second", "decode_tokens_per_second", "turn2_ttft_reuse", "turn2_ttft_no_reuse")


def reuse_speedup(summary: dict) -> Optional[float]:
    """A server's turn-2 TTFT without reuse over its TTFT with reuse."""
    return ratio(summary["turn2_ttft_no_reuse"], summary["turn2_ttft_reuse"])


def ratios(vanilla: dict, policy: dict) -> dict:
    """policy / vanilla of each median, and each server's turn-2 speed-up from reuse."""
    return {
        **ratios_of(policy, vanilla, RATIO_MEDIANS),
        "vanilla_turn2_reuse_speedup": reuse_speedup(vanilla),
        "policy_turn2_reuse_speedup": reuse_speedup(policy),
    }


def attribution(vanilla: dict, full: dict, policy: dict) -> dict:
    """policy / full (what eviction buys) and full / vanilla (what the plugin's path costs) of each median."""
    return {"policy_vs_full": ratios_of(policy, full, RATIO_MEDIANS), "full_vs_vanilla": ratios_of(full, vanilla, RATIO_MEDIANS)}


def attribution_cells(report: dict, median: str) -> list[str]:
    """The cells ``full``, ``policy / full`` and ``full / vanilla`` of ``median`` (a summary field, or
    ``turn2_reuse_speedup``); ``FULL_NOT_SERVED`` where the report has no ``full`` server (older runs)."""
    if "full" not in report:
        return [FULL_NOT_SERVED, "-", "-"]
    full = report["full"]["summary"]
    if median == "turn2_reuse_speedup":
        return [f"{reuse_speedup(full):.1f}x", "", ""]
    digits = 0 if median == "prefill_tokens_per_second" else 2
    shares = report["attribution"]["policy_vs_full"][median], report["attribution"]["full_vs_vanilla"][median]
    return [f"{full[median]:.{digits}f}", *(f"{value:.2f}" for value in shares)]


def speed_table(report: dict) -> list[str]:
    """The medians of vanilla, ``full`` and the policy with the three ratios, as the report and
    docs/results.md show them (``full`` columns say so where the run served none)."""
    meta, v, p, r = report["meta"], report["vanilla"]["summary"], report["policy"]["summary"], report["ratios"]
    cfg, label = meta["config"], report["policy"]["label"]
    rows = [
        (f"prefill: TTFT of a fresh {v['prefill_prompt_tokens']:.0f}-token prompt, max_tokens 1 (s), n={cfg['prompts']}",
         "prefill_ttft", 2),
        ("prefill tokens/s", "prefill_tokens_per_second", 0),
        (f"decode tokens/s after it ({cfg['decode_tokens']} tokens, single stream), n={cfg['decode_runs']}",
         "decode_tokens_per_second", 2),
        (f"turn 2 ({v['turn2_prompt_tokens']:.0f} tokens): TTFT with turn 1 cached (s), n={cfg['turn2_runs']}",
         "turn2_ttft_reuse", 2),
        ("turn 2: TTFT after /flush_cache, no reuse (s)", "turn2_ttft_no_reuse", 2),
    ]  # fmt: skip
    lines = [
        f"| measure (median) | vanilla | full | {label} | {label} / vanilla | {label} / full | full / vanilla |",
        "|---|---|---|---|---|---|---|",
    ]
    for text, median, digits in rows:
        full, *shares = attribution_cells(report, median)
        lines.append(
            f"| {text} | {v[median]:.{digits}f} | {full} | {p[median]:.{digits}f} | **{ratio(p[median], v[median]):.2f}** "
            f"| {' | '.join(shares)} |"
        )
    full = attribution_cells(report, "turn2_reuse_speedup")[0]
    return lines + [
        f"| turn 2: speed-up from reuse (no reuse / reuse) | {r['vanilla_turn2_reuse_speedup']:.1f}x | {full} "
        f"| **{r['policy_turn2_reuse_speedup']:.1f}x** | | | |",
    ]


def model_shape(model: str) -> tuple[int, int]:
    """(layers, KV heads) from the model's config.json."""
    from sgl_kvevict.models import resolve_model

    config = json.loads((resolve_model(model, log=lambda m: print(m, file=sys.stderr)) / "config.json").read_text())
    return config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"])


def markdown(report: dict) -> str:
    meta, env, cfg, label = report["meta"], report["meta"]["environment"], report["meta"]["config"], report["policy"]["label"]
    lines = [
        "# Engine overhead: prefill, decode, turn-2 reuse and memory, vanilla vs " + label,
        "",
        f"`{meta['command']}`",
        "",
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, torch "
        f"{env['torch']}, sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, "
        f"{env['date']}. Model `{cfg['model']}` (bf16, {meta['num_layers']} layers x {meta['num_kv_heads']} KV heads). "
        f"Every server: `--max-total-tokens {cfg['pool_tokens']}` (the policy server keeps its compressed cells in "
        f"that same pool). One request at a time, greedy, streamed; load average before each server: "
        + ", ".join(f"{report[role]['label']} {report[role]['load_average'][0]:.2f}" for role in ROLES if role in report)
        + f". {ATTRIBUTION}",
        "",
        *speed_table(report),
        "",
        "Turn 2 cached tokens reported: "
        + ", ".join(f"{report[role]['label']} {report[role]['summary']['turn2_cached_tokens_reuse']:.0f}" for role in ROLES if role in report)
        + ".",
    ]
    memory = report["policy"]["memory_per_conversation"]
    if memory:
        m = memory
        lines += [
            "",
            f"Memory of one conversation after turn 1 under {label} (median of {len(report['policy']['samples']['memory'])}, "
            "from `/kvevict/stats`; one cell = one KV head's K and V of one layer and token, one dense token = "
            f"{meta['num_layers'] * meta['num_kv_heads']} cells):",
            "",
            "| | cells held | dense equivalent (cells) | ratio |",
            "|---|---|---|---|",
            f"| compressed segment ({m['compressed_tokens']:.0f} tokens) | {m['kept_cells']:.0f} | "
            f"{m['compressed_dense_equivalent_cells']:.0f} | **{m['compressed_ratio']:.3f}** |",
            f"| whole conversation ({m['conversation_tokens']:.0f} tokens: compressed segment + "
            f"{m['dense_slots_held']:.0f} dense tokens still held, window and answer) | {m['conversation_cells_held']:.0f} | "
            f"{m['conversation_dense_equivalent_cells']:.0f} | **{m['conversation_ratio']:.3f}** |",
        ]
    leaks = [leak for role in ROLES for leak in report[role]["leaks_after_flush"]]
    lines += [
        "",
        "Reading it: prefill TTFT includes scoring (the policy's per-layer observation during the extend forward) and "
        "compaction (gathering kept entries into arena cells, freeing the dense slots). Decode tok/s = (output tokens - 1) "
        "/ (end - first token). Turn 2 re-sends turn 1's prompt and answer plus a new question. "
        "On CPU, stock SGLang's torch_native extend pads the new tokens' queries to the whole sequence, so a cached "
        "prefix saves vanilla its projections and MLP but not its attention over the prefix; the policy's segment "
        "attention attends from the new tokens only, over the kept cells and the dense window. Part of the turn-2 gap "
        "is that, not compression alone; on a GPU vanilla's reuse is much cheaper. "
        "Medians from one run with one server at a time on a shared 2-core machine; compare the ratios, not absolute "
        "numbers across runs. Leak check after the final flush: "
        + ("every arena cell and dense slot returned." if not leaks else "; ".join(leaks)),
    ]
    return "\n".join(lines) + "\n"


def _median_memory(rows: list[dict]) -> Optional[dict]:
    if not rows:
        return None
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def run(config: OverheadConfig, out: Path, name: str, log_dir: Path, argv: Sequence[str], log: Callable[[str], None]) -> dict:
    count_tokens = model_token_counter(config.model)
    spec = ConversationSpec(
        users=config.documents, turns=2, document_tokens=config.prompt_tokens, fact_every=1, shared_document=False, seed=config.seed
    )
    conversations = build_conversations(spec, count_tokens)
    num_layers, num_kv_heads = model_shape(config.model)
    variants = (ServerVariant(VANILLA_POLICY), ServerVariant(FULL_POLICY), ServerVariant(config.policy, config.budget))
    results = {}
    for role, variant in zip(ROLES, variants):
        load_average = os.getloadavg()
        log(f"{variant.label}: starting the server (--max-total-tokens {config.pool_tokens}; load average {load_average[0]:.2f})")
        with launched_server(config.model, variant, config.pool_tokens, log_dir, config.launcher_extra) as server:
            samples = asyncio.run(_measure(server.base_url, config, conversations, variant.label, log))
            log(f"{variant.label}: done; stopping the server")
        memory = [memory_per_conversation(m, num_layers, num_kv_heads) for m in samples.memory]
        results[role] = {
            "label": variant.label,
            "load_average": load_average,
            "summary": summarize(samples),
            "memory_per_conversation": _median_memory(memory),
            "leaks_after_flush": samples.leaks_after_flush,
            "samples": asdict(samples),
        }
    report = {
        "meta": {
            "command": command_line("engine_overhead", argv),
            "config": asdict(config),
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "environment": environment(),
        },
        **results,
        "ratios": ratios(results["vanilla"]["summary"], results["policy"]["summary"]),
        "attribution": attribution(*(results[role]["summary"] for role in ROLES)),
    }
    write_report(out, name, report, markdown(report), log)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("engine_overhead", __doc__)
    add_server_args(parser, ("--policy", "lava", "--kv-evict-policy of the compressing server"), "--kv-evict-budget of the compressing server")
    parser.add_argument(
        "--pool-tokens", type=int, default=16384,
        help="--max-total-tokens of every server, which must hold one prompt dense (default 16384)",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="document length in model tokens (default 2000)")
    parser.add_argument("--prompts", type=int, default=5, help="fresh prompts timed for prefill (default 5)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="output tokens per decode sample (default 64)")
    parser.add_argument("--decode-runs", type=int, default=3, help="decode samples (default 3)")
    parser.add_argument("--turn2-runs", type=int, default=3, help="conversations timed at turn 2, with and without reuse (default 3)")
    parser.add_argument("--answer-tokens", type=int, default=16, help="turn-1 answer cap, part of turn 2's history (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="document seed (default 0)")
    add_output_args(parser, "engine_overhead", server_arg_for="every server")
    return parser


@exits_on(ServerError, MeasurementError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    try:
        config = OverheadConfig(
            model=args.model, policy=args.policy, budget=args.budget, pool_tokens=args.pool_tokens,
            prompt_tokens=args.prompt_tokens, prompts=args.prompts, decode_tokens=args.decode_tokens,
            decode_runs=args.decode_runs, turn2_runs=args.turn2_runs, answer_tokens=args.answer_tokens,
            seed=args.seed, launcher_extra=tuple(args.server_arg),
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    log_dir = log_folder(args.log_dir, "engine-overhead")
    report = run(config, args.out, args.name, log_dir, argv, progress)
    r = report["ratios"]
    print(
        f"{report['policy']['label']} / vanilla: prefill TTFT {r['prefill_ttft']:.2f}, decode tok/s "
        f"{r['decode_tokens_per_second']:.2f}, turn-2 reuse speed-up {r['policy_turn2_reuse_speedup']:.1f}x "
        f"(vanilla {r['vanilla_turn2_reuse_speedup']:.1f}x)"
    )
    return 1 if any(report[role]["leaks_after_flush"] for role in ROLES) else 0


if __name__ == "__main__":
    sys.exit(main())
