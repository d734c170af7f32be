"""SGLang's own benchmark client against stock SGLang and the plugin servers, at equal KV memory.

    python -m benchmarks.sglang_client --policies topk:learned --scopes request,block --block-size 256

Each server (vanilla first, then ``full`` in every scope: the plugin's path with nothing evicted, then
every policy at every budget in every scope, named like the other benchmarks' variants) is started
fresh through the launcher with the same ``--max-total-tokens``, one at a time, warmed with one short chat and flushed. Then SGLang's client runs against it as SGLang
documents it:

    python -m sglang.benchmark.serving --backend sglang-oai-chat --dataset-name generated-shared-prefix ...

``generated-shared-prefix`` builds groups of prompts that share one long system prompt (random
tokens); each prompt is a multi-turn chat whose later turns re-send the history, and the client keeps
``--concurrency`` chats in flight. The default (4 groups x 6 prompts x 2 turns over 1500-token system
prompts, 6000-token pool) holds about three system prompts dense, so stock SGLang must evict shared
prefixes that a compressing server keeps. The plugin's ``/kvevict/stats`` is sampled during the run
(peaks) and read after it (reuse, compressed nodes); then the cache is flushed and the ledger checked.

Writes ``<out>/<name>.json`` (the client's figures per server, its command, the stats), ``.md`` and
``.png``, with ratios from the same run (output tokens/s, TTFT, ITL): each policy server against vanilla
and against ``full`` in its scope and schedule (what eviction buys), and ``full`` against vanilla (what
the plugin's path costs). ``--help`` lists every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args, benchmark_parser, command_line, log_folder, parse_command_line, progress
from benchmarks.load.report import ATTRIBUTION, attribution_pairs, heading, ratios_of, save_figure, server_colour
from sgl_kvevict.measure.client import STATS_PATH, StatsSampler, get_json, stream_completion
from sgl_kvevict.measure.results import write_result_files, pyplot as _pyplot, environment
from sgl_kvevict.measure.servers import (
    ServerError,
    WHEN_FLAG,
    ServerVariant,
    attributed_variants,
    check_launcher_accepts,
    launched_server,
    under_schedules,
)
from benchmarks.load.soak import stats_leaks
from sgl_kvevict.measure.client import flush_when_idle

CHAT_PATH = "/v1/chat/completions"
# The client's result fields kept per server (it also reports the server's whole configuration).
CLIENT_FIELDS = (
    "completed", "duration", "total_output_tokens", "request_throughput", "output_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms",
)  # fmt: skip
# Server / baseline: (client field, what it is in the reports).
RATIO_FIELDS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT median"),
    ("p90_ttft_ms", "TTFT p90"),
    ("mean_itl_ms", "ITL mean"),
    ("median_itl_ms", "ITL median"),
)
# /kvevict/stats counters shown beside the client's figures: (field, column).
STATS_COLUMNS = (
    ("requests_compressed", "requests compressed"),
    ("reuse_hits", "reuse hits"),
    ("reused_tokens", "reused tokens"),
)
# Shown where a server of the run compresses under pressure (--kv-evict-when pressure).
PRESSURE_COLUMN = ("nodes_compressed_under_pressure", "compressed under pressure")


class ClientError(RuntimeError):
    """SGLang's client failed or measured fewer requests than it was given; the message says which."""


@dataclass(frozen=True)
class Workload:
    """SGLang's ``generated-shared-prefix`` data set and load: ``groups`` system prompts of
    ``system_prompt_tokens``, ``prompts_per_group`` chats each, ``turns`` rounds per chat of a
    ``question_tokens`` question and ``output_tokens`` of answer, ``concurrency`` chats in flight."""

    groups: int = 4
    prompts_per_group: int = 6
    turns: int = 2
    system_prompt_tokens: int = 1500
    question_tokens: int = 64
    output_tokens: int = 32
    concurrency: int = 8
    seed: int = 0

    def __post_init__(self):
        small = [name for name, value in asdict(self).items() if name != "seed" and value < 1]
        if small:
            raise ValueError(f"{', '.join(small)} must be at least 1")

    @property
    def requests(self) -> int:
        """Requests the client sends: one per round of every chat."""
        return self.groups * self.prompts_per_group * self.turns

    def client_args(self) -> list[str]:
        return [
            "--backend", "sglang-oai-chat", "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(self.groups), "--gsp-prompts-per-group", str(self.prompts_per_group),
            "--gsp-num-turns", str(self.turns), "--gsp-system-prompt-len", str(self.system_prompt_tokens),
            "--gsp-question-len", str(self.question_tokens), "--gsp-output-len", str(self.output_tokens),
            "--max-concurrency", str(self.concurrency), "--seed", str(self.seed),
            "--warmup-requests", "0", "--cache-report", "--disable-tqdm",
        ]  # fmt: skip


def client_command(base_url: str, workload: Workload, output_file: Path) -> list[str]:
    """SGLang's client, from this environment, as SGLang documents it."""
    return [
        sys.executable, "-m", "sglang.benchmark.serving", "--base-url", base_url,
        *workload.client_args(), "--output-file", str(output_file),
    ]  # fmt: skip


async def _warm_up_and_flush(session: aiohttp.ClientSession, base_url: str) -> None:
    payload = {"model": "default", "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 4, "stream": True}
    reply = await stream_completion(session, base_url + CHAT_PATH, payload)
    if reply.error:
        raise ClientError(f"warm-up request failed: {reply.error}")
    if not await flush_when_idle(session, base_url, timeout=60):
        raise ClientError(f"{base_url} did not flush its cache after the warm-up")


async def measure(base_url: str, workload: Workload, work_dir: Path, label: str) -> dict:
    """Warm-up and flush, SGLang's client with ``/kvevict/stats`` sampled meanwhile, then a flush and
    the ledger check. Returns the client's figures, its cache report, the stats and the leaks."""
    output_file, log_file = work_dir / f"client-{label}.jsonl", work_dir / f"client-{label}.log"
    output_file.unlink(missing_ok=True)  # the client appends
    command = client_command(base_url, workload, output_file)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _warm_up_and_flush(session, base_url)
        sampler = StatsSampler(session, base_url)
        await sampler.start()
        with open(log_file, "wb") as log:
            process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=asyncio.subprocess.STDOUT)
            code = await process.wait()
        stats = await sampler.stop()
        if not await flush_when_idle(session, base_url, timeout=120):
            raise ClientError(f"{base_url} did not flush its cache after the run")
        after_flush = await get_json(session, base_url + STATS_PATH)
    if code != 0 or not output_file.exists():
        tail = log_file.read_text(errors="replace")[-2000:]
        raise ClientError(f"SGLang's client exited with code {code} (log: {log_file}):\n{tail}")
    result = json.loads(output_file.read_text().splitlines()[-1])
    if result["completed"] != workload.requests:
        raise ClientError(f"SGLang's client completed {result['completed']} of {workload.requests} requests (log: {log_file})")
    return {
        "client": {name: result[name] for name in CLIENT_FIELDS},
        "cache_report": result["cache_report"],
        "kvevict_stats": {"last": stats.last, "peaks": stats.peaks} if stats.available else None,
        "leaks_after_flush": stats_leaks(after_flush or {}),
    }


def run_variant(
    model: str, variant: ServerVariant, pool_tokens: int, workload: Workload, log_dir: Path, extra: tuple[str, ...]
) -> dict:
    load_average = os.getloadavg()
    run = {"label": variant.label, "variant": asdict(variant), "load_average": load_average, "error": None}
    try:
        with launched_server(model, variant, pool_tokens, log_dir, extra) as server:
            run.update(asyncio.run(measure(server.base_url, workload, log_dir, variant.label.replace(" ", "-"))))
            run["log_leak_warnings"] = server.leak_warnings()
    except (ServerError, ClientError) as error:
        run["error"] = str(error)
    return run


def ratios(runs: Sequence[dict]) -> list[dict]:
    """Field by field of ``RATIO_FIELDS``: every other finished run against the first vanilla run (stock
    SGLang under the first schedule), and every policy run against ``full`` in its scope and schedule
    (``attribution_pairs``)."""
    done = [run for run in runs if not run["error"]]
    variant_of = lambda run: ServerVariant.from_json(run["variant"])  # noqa: E731
    vanilla = next((run for run in done if variant_of(run).is_vanilla), None)
    by_server = {variant_of(run): run for run in done}
    pairs = [(f"{run['label']} / vanilla", run, vanilla) for run in done if variant_of(run).is_vanilla and run is not vanilla]
    pairs += attribution_pairs(done, variant_of, lambda run: vanilla, lambda run: by_server.get(variant_of(run).full_counterpart))
    fields = [name for name, _ in RATIO_FIELDS]
    return [{"comparison": name, **ratios_of(this["client"], base["client"], fields)} for name, this, base in pairs]


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(report: dict) -> list[str]:
    """The per-server table and the ratios of this run (``ratios``), as markdown lines (also docs/results.md's)."""
    under_pressure = any(WHEN_FLAG in run["variant"]["extra"] for run in report["runs"])
    stats_columns = STATS_COLUMNS + ((PRESSURE_COLUMN,) if under_pressure else ())
    columns = [
        "server", "output tok/s", "TTFT median (s)", "TTFT p90 (s)", "ITL mean (ms)", "ITL median (ms)", "hit rate",
        "compressed nodes peak", *(column for _, column in stats_columns), "leaks after flush",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in report["runs"]:
        if run["error"]:
            lines.append(f"| {run['label']} | failed: {run['error'].splitlines()[0]} |" + " |" * (len(columns) - 2))
            continue
        c, stats = run["client"], run["kvevict_stats"]
        last = (stats or {}).get("last") or {}
        peak_nodes = (stats or {}).get("peaks", {}).get("compressed_nodes")
        counters = [str(last.get(name, "-")) for name, _ in stats_columns]
        leaks = len(run["leaks_after_flush"]) + len(run["log_leak_warnings"])
        lines.append(
            f"| {run['label']} | {c['output_throughput']:.2f} | {c['median_ttft_ms'] / 1000:.2f} | "
            f"{c['p90_ttft_ms'] / 1000:.2f} | {c['mean_itl_ms']:.1f} | {c['median_itl_ms']:.1f} | "
            f"{run['cache_report']['cache_hit_rate_pct'] / 100:.2f} | "
            f"{'-' if peak_nodes is None else int(peak_nodes)} | {' | '.join(counters)} | {leaks} |"
        )
    if report["ratios"]:
        lines += ["", f"Ratios from this run (first / second). {ATTRIBUTION}", ""]
        lines += ["| comparison | " + " | ".join(name for _, name in RATIO_FIELDS) + " |", "|---|" + "---|" * len(RATIO_FIELDS)]
        for row in report["ratios"]:
            lines.append(f"| {row['comparison']} | " + " | ".join(_fmt(row[f]) for f, _ in RATIO_FIELDS) + " |")
    return lines


def markdown(report: dict) -> str:
    meta, env = report["meta"], report["meta"]["environment"]
    w = meta["workload"]
    dirty = " (uncommitted changes)" if env.get("git_worktree_dirty") else ""
    lines = [
        *heading("SGLang's benchmark client: stock SGLang vs the plugin at equal KV memory", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, "
        f"torch {env['torch']}, sgl-kvevict {env['git_commit']}{dirty}, {env['date']}. Model `{meta['model']}`, "
        f"every server with `--max-total-tokens {meta['pool_tokens']}`, one server at a time.",
        "",
        f"Client: `python -m sglang.benchmark.serving {' '.join(meta['client_args'])}`: {w['groups']} groups x "
        f"{w['prompts_per_group']} chats x {w['turns']} turns ({w['groups'] * w['prompts_per_group'] * w['turns']} "
        f"requests), {w['system_prompt_tokens']}-token shared system prompts, {w['question_tokens']}-token questions, "
        f"{w['output_tokens']} output tokens, {w['concurrency']} chats in flight.",
        "",
    ]
    lines += tables(report)
    lines += [
        "",
        f"![SGLang's benchmark client]({meta['name']}.png)",
        "",
        "Hit rate: the client's cache report (cached prompt tokens / prompt tokens, from the responses' "
        "`cached_tokens`). Stats columns: the plugin's `/kvevict/stats` after the run (peak sampled every 0.5 s). "
        "Leaks: `/kvevict/stats` after `POST /flush_cache` (every `*_used` 0, every `*_free` equal to its `*_total`) "
        "and SGLang's idle self-check in the server log. Load averages before each server are in the JSON; these "
        "machines are shared, so compare ratios from one run, not absolute numbers across runs.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Output tokens/s, TTFT median and ITL mean, one bar per server."""
    plt = _pyplot()
    done = [r for r in report["runs"] if not r["error"]]
    labels = [r["label"] for r in done]
    colours = [server_colour(ServerVariant.from_json(r["variant"])) for r in done]
    panels = (
        ("output_throughput", 1.0, "output tokens / s (higher is better)"),
        ("median_ttft_ms", 1e-3, "TTFT median, s (lower is better)"),
        ("mean_itl_ms", 1.0, "ITL mean, ms (lower is better)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.8))
    for axis, (field, scale, title) in zip(axes, panels):
        axis.bar(range(len(done)), [r["client"][field] * scale for r in done], color=colours)
        axis.set_xticks(range(len(done)), labels, fontsize=8, rotation=15)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    save_figure(plt, fig, path)


def run(
    model: str,
    variants: Sequence[ServerVariant],
    pool_tokens: int,
    workload: Workload,
    extra: tuple[str, ...],
    out: Path,
    name: str,
    log_dir: Path,
    argv: Sequence[str],
    log: Callable[[str], None],
) -> dict:
    """Every variant in turn; the report is rewritten after each server, so an interrupted run keeps
    the servers it finished."""
    meta = {
        "command": command_line("sglang_client", argv),
        "name": name,
        "model": model,
        "pool_tokens": pool_tokens,
        "launcher_extra": list(extra),
        "workload": asdict(workload),
        "client_args": workload.client_args(),
        "environment": environment(),
    }
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for variant in variants:
        log(f"{variant.label}: starting the server (--max-total-tokens {pool_tokens}), then SGLang's client")
        runs.append(run_variant(model, variant, pool_tokens, workload, log_dir, extra))
        outcome = runs[-1]["error"] or f"{runs[-1]['client']['output_throughput']:.2f} output tok/s"
        log(f"{variant.label}: {outcome}")
        report = {"meta": meta, "runs": runs, "ratios": ratios(runs)}
        write_result_files(out, name, report, markdown(report), lambda path: plot(report, path))
        log(f"wrote {out / name}.json, .md, .png; server and client logs in {log_dir}")
    return report


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("sglang_client", __doc__)
    defaults = Workload()
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument(
        "--policies", default="topk:learned",
        help="comma-separated name[:score] compared with vanilla and with full, which every run serves (default topk:learned)",
    )
    parser.add_argument("--budgets", default="0.25", help="comma-separated budgets for every policy (default 0.25)")
    parser.add_argument("--scopes", default="request", help="comma-separated scopes: request, block (default request)")
    parser.add_argument("--block-size", type=int, help="--kv-evict-block-size of block-scope servers (default: the launcher's)")
    parser.add_argument("--pool-tokens", type=int, default=6000, help="--max-total-tokens of every server (default 6000)")
    parser.add_argument(
        "--when", default="prefill",
        help="comma-separated --kv-evict-when of every policy server: prefill, pressure (a server each; full, which "
             "evicts nothing, is served once) (default prefill)",
    )  # fmt: skip
    parser.add_argument(
        "--schedules", default="overlap",
        help="comma-separated SGLang schedules every server runs under: overlap (SGLang's default), serial "
             "(--disable-overlap-schedule) (default overlap)",
    )  # fmt: skip
    workload = parser.add_argument_group("workload (SGLang's generated-shared-prefix data set)")
    for flag, help_text in (
        ("groups", "shared system prompts"),
        ("prompts-per-group", "chats per system prompt"),
        ("turns", "rounds per chat"),
        ("system-prompt-tokens", "system prompt length"),
        ("question-tokens", "question length per round"),
        ("output-tokens", "answer length per round (EOS ignored)"),
        ("concurrency", "chats in flight"),
        ("seed", "data set seed"),
    ):
        default = getattr(defaults, flag.replace("-", "_"))
        workload.add_argument(f"--{flag}", type=int, default=default, help=f"{help_text} (default {default})")
    add_output_args(parser, "sglang_client", server_arg_for="every server")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    try:
        workload = Workload(
            groups=args.groups, prompts_per_group=args.prompts_per_group, turns=args.turns,
            system_prompt_tokens=args.system_prompt_tokens, question_tokens=args.question_tokens,
            output_tokens=args.output_tokens, concurrency=args.concurrency, seed=args.seed,
        )  # fmt: skip
        variants = attributed_variants(
            _csv(args.policies), _csv(args.budgets), _csv(args.scopes), args.block_size, _csv(args.when)
        )  # fmt: skip
        variants = under_schedules(variants, _csv(args.schedules))
        for variant in variants:  # every refusal before the first server starts
            check_launcher_accepts(args.model, variant, args.pool_tokens, tuple(args.server_arg))
    except (ValueError, ServerError) as error:
        parser.error(str(error))
    log_dir = log_folder(args.log_dir, "sglang-client")
    report = run(
        args.model, variants, args.pool_tokens, workload, tuple(args.server_arg), args.out, args.name, log_dir, argv,
        progress,
    )  # fmt: skip
    print(markdown(report))
    failed = any(r["error"] or r["leaks_after_flush"] or r["log_leak_warnings"] for r in report["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
