"""Multi-turn serving benchmark: concurrent simulated users against SGLang, vanilla vs KV eviction.

    python -m benchmarks.multiturn compare --quick --policies lava --budgets 0.25   # large and tight pool, ~10 min
    python -m benchmarks.multiturn compare --policies lava,snapkv --budgets 0.5,0.25  # 8 users x 6 turns
    python -m benchmarks.multiturn sweep --policies lava --budgets 0.25            # 4 pool sizes, 6 users x 4 turns
    python -m benchmarks.multiturn sweep --system-prompt-tokens 200 --document-tokens 1500 \
        --policies lava --scopes request,block --block-size 256 --name block_scope   # a shared system prompt
    python -m benchmarks.multiturn run --url http://127.0.0.1:30000 --users 4 --turns 3
    python -m benchmarks.multiturn soak --seconds 300 --max-requests 3000 --pool-tokens 6500

``compare`` and ``sweep`` start the real launcher themselves, one server at a time, every server of a
pool with the same ``--max-total-tokens``, and write ``<name>.json``, ``<name>.md`` and ``<name>.png``
into ``--out`` (default docs/results) after every server, so ``--resume`` carries on after an
interruption (same workload and pools; finished servers are kept). ``compare`` runs a large pool
(every history fits) and a tight one; ``sweep`` runs pool sizes from every history fitting
(``1.00``) down to a quarter of them, as fractions of the workload's history tokens counted with the
model's tokenizer (``--pool-fractions``) or given in tokens (``--pool-sizes``).

Policy servers are ``name[:score]`` at each budget (``topk:kvzip`` is ``--kv-evict-policy topk
--kv-evict-score kvzip``), in each scope of ``--scopes`` (``block`` adds ``--kv-evict-scope block``
and ``--kv-evict-block-size``); ``--server-arg`` passes a flag to every server. In block scope a
shared prefix that ends inside a block is reused through the split of that block at the divergence;
the launcher refuses a block size whose budget keeps no more than the window (nothing would compress).
With any policy, every pool also serves ``full`` (``--kv-evict-policy full``: the plugin's path with
nothing evicted) in each scope, after vanilla: each policy's ratios are against vanilla and against
``full`` (what eviction buys), and ``full``'s against vanilla (what the path costs).

``run`` measures one server that is already running. ``soak`` injects faults and checks for leaks; it
writes ``<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.load.conversations import ConversationError, ConversationSpec, build_conversations
from sgl_kvevict.measure.chat import model_context_length, model_token_counter
from benchmarks.load.driver import (
    POOL_NAMES,
    CompareConfig,
    DriverError,
    Pool,
    RunResult,
    compare_pools,
    history_tokens,
    run_plan,
    sweep_pools,
    workload,
)
from benchmarks.cli import RESULTS_DIR
from benchmarks.cli import add_output_args
from benchmarks.cli import add_resume_arg
from benchmarks.cli import as_json
from benchmarks.cli import benchmark_parser
from benchmarks.cli import checkpoint_path
from benchmarks.cli import command_line
from benchmarks.cli import exits_on
from benchmarks.cli import log_folder
from benchmarks.cli import parse_command_line
from benchmarks.cli import progress
from benchmarks.load.report import heading, load_comparison, write_comparison
from benchmarks.load.soak import SoakConfig, SoakError, SoakReport, combined_summary, run_soak
from benchmarks.load.users import LoadError, LoadSettings, run_users
from sgl_kvevict.measure.client import flush_when_idle
from sgl_kvevict.measure.results import environment
from sgl_kvevict.measure.servers import VANILLA_POLICY
from sgl_kvevict.measure.servers import ServerError
from sgl_kvevict.measure.servers import ServerVariant
from sgl_kvevict.measure.servers import attributed_variants
from sgl_kvevict.measure.servers import launched_server
from sgl_kvevict.measure.servers import server_variants

# --quick: 4 users x 4 turns over ~1,000-token documents, every turn a fact question.
QUICK = {"users": 4, "turns": 4, "document_tokens": 1000, "fact_every": 1}
FULL = {"users": 8, "turns": 6, "document_tokens": 2000, "fact_every": 2}
# The sweep's default: histories longer than its smallest pool (a quarter of all of them).
SWEEP = {"users": 6, "turns": 4, "document_tokens": 1750, "fact_every": 1}
# How far past the pool the soak's beyond-pool prompt goes.
BEYOND_POOL_MARGIN = 256
# How far under the model's context length the soak's near-limit prompt stops (the chat template, the
# instruction and the answer fit in it, or SGLang refuses the prompt for its length: both are fine).
NEAR_LIMIT_MARGIN = 96
# The engine's chunked-prefill counters the soak report quotes.
CHUNK_COUNTERS = ("chunked_prefills", "chunked_prefills_aborted")
SETTING_ERRORS = (ConversationError, DriverError, LoadError, SoakError, ValueError)


class ResumeError(ValueError):
    """A checkpoint of another workload or plan; the message says what differs."""


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _add_workload_flags(parser: argparse.ArgumentParser, preset: dict) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--quick", action="store_true", help=f"small workload for a run of a few minutes: {QUICK}")
    group.add_argument("--users", type=int, help=f"concurrent simulated users (default {preset['users']})")
    group.add_argument("--turns", type=int, help=f"user messages per conversation (default {preset['turns']})")
    group.add_argument(
        "--document-tokens", type=int, help=f"document length in model tokens (default {preset['document_tokens']})"
    )
    group.add_argument(
        "--fact-every", type=int, help=f"every N-th turn asks a fact from the document, scored (default {preset['fact_every']})"
    )
    group.add_argument("--shared-document", action="store_true", help="one document for all users (shared prefix)")
    group.add_argument(
        "--system-prompt-tokens", type=int, default=0,
        help="every conversation starts with the same system prompt of about this many tokens (default 0: none)",
    )  # fmt: skip
    group.add_argument("--seed", type=int, default=0, help="conversation seed (default 0)")
    group.add_argument("--max-tokens", type=int, default=32, help="answer length cap per request (default 32)")
    group.add_argument(
        "--request-timeout", type=float, default=900.0, help="seconds before a request counts as failed (default 900)"
    )
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="output folder (default docs/results)")
    parser.set_defaults(preset=preset)


def _add_server_flags(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--policies", default="", help="comma-separated name[:score] to compare with vanilla, e.g. lava,topk:kvzip "
        "(default: vanilla only)",
    )  # fmt: skip
    parser.add_argument("--budgets", default="0.25", help="comma-separated budgets for every policy (default 0.25)")
    parser.add_argument(
        "--scopes", default="request", help="comma-separated scopes for every policy: request, block (default request)"
    )
    parser.add_argument("--block-size", type=int, help="--kv-evict-block-size of block-scope servers (default: the launcher's)")
    parser.add_argument(
        "--when", default="prefill", help="comma-separated --kv-evict-when of every policy server: prefill, pressure "
        "(a server each; full, which evicts nothing, is served once) (default prefill)",
    )  # fmt: skip
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra launcher/SGLang flag for every server, e.g. "
        "--server-arg=--kv-evict-window=16 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--name", default=name, help=f"output file stem (default {name})")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary folder)")
    add_resume_arg(parser, "keep the finished servers of --out/<name>.json and run the rest")


def _workload(args: argparse.Namespace) -> tuple[ConversationSpec, LoadSettings]:
    preset = QUICK if args.quick else args.preset

    def pick(name: str) -> int:
        value = getattr(args, name)
        return preset[name] if value is None else value

    spec = ConversationSpec(
        users=pick("users"),
        turns=pick("turns"),
        document_tokens=pick("document_tokens"),
        fact_every=pick("fact_every"),
        shared_document=args.shared_document,
        seed=args.seed,
        system_prompt_tokens=args.system_prompt_tokens,
    )
    return spec, LoadSettings(max_tokens=args.max_tokens, request_timeout=args.request_timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("multiturn", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    comparison = commands.add_parser(
        "compare",
        help="start vanilla and each policy server in turn, at a large and a tight pool, and compare",
        description="Vanilla SGLang vs each policy@budget at equal KV memory (the same --max-total-tokens), at a "
        "large pool (every history fits) and a tight pool (vanilla must evict histories).",
    )
    _add_workload_flags(comparison, FULL)
    _add_server_flags(comparison, "multiturn")
    comparison.add_argument("--pools", default=",".join(POOL_NAMES), help="which pools to run (default large,tight)")
    comparison.add_argument("--large-pool", type=int, default=65536, help="--max-total-tokens of the large pool (default 65536)")
    comparison.add_argument("--tight-pool", type=int, help="--max-total-tokens of the tight pool (default: --tight-fraction)")
    comparison.add_argument(
        "--tight-fraction", type=float, default=0.33, help="tight pool as a share of all final histories' tokens (default 0.33)"
    )

    sweep = commands.add_parser(
        "sweep",
        help="one workload at several pool sizes, from every history fitting down to a quarter, vanilla vs each policy",
        description="Vanilla SGLang vs each policy server at several --max-total-tokens, largest first.",
    )
    _add_workload_flags(sweep, SWEEP)
    _add_server_flags(sweep, "sweep")
    sweep.add_argument(
        "--pool-fractions", default="1,0.75,0.5,0.25",
        help="pool sizes as fractions of all final histories' tokens (default 1,0.75,0.5,0.25)",
    )  # fmt: skip
    sweep.add_argument("--pool-sizes", default="", help="pool sizes in tokens instead, e.g. 12000,9000,6000,3000")

    single = commands.add_parser("run", help="measure one server that is already running (its cache is flushed first)")
    _add_workload_flags(single, FULL)
    single.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:30000")
    single.add_argument("--label", default="server", help="name of this server in the report (default server)")
    single.add_argument("--name", default="multiturn-run", help="output file stem (default multiturn-run)")

    soak = commands.add_parser("soak", help="minutes of load with client aborts and invalid requests, then leak checks")
    soak.add_argument("--url", help="soak a running server instead of starting one")
    soak.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    soak.add_argument("--policy", default=VANILLA_POLICY, help="--kv-evict-policy of the started server (default none)")
    soak.add_argument("--budget", help="--kv-evict-budget of the started server")
    soak.add_argument("--pool-tokens", type=int, default=6500, help="--max-total-tokens of the started server (default 6500)")
    soak.add_argument("--seconds", type=float, default=300.0, help="load duration bound (default 300)")
    soak.add_argument("--max-requests", type=int, default=3000, help="request count bound (default 3000)")
    soak.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    soak.add_argument(
        "--max-prompt-tokens", type=int, default=1200,
        help="longest chat prompt, also the size of prompts aborted mid-prefill; keep it below the pool (default 1200)",
    )
    soak.add_argument(
        "--long-prompt-tokens", type=int,
        help="also send fresh prompts this long (longer than a prefill chunk), some aborted between chunks, one "
        "longer than the pool (needs a started server) and one just under the model's context length; default: no "
        "long prompts",
    )  # fmt: skip
    soak.add_argument("--scopes", default="request", help="comma-separated scopes of the policy, one server each (default request)")
    soak.add_argument("--block-size", type=int, help="block size in block scope (default: the launcher's)")
    soak.add_argument("--seed", type=int, default=0, help="fault and prompt seed (default 0)")
    add_output_args(soak, "soak", server_arg_for="every started server")
    return parser


# The meta fields a resumed run must share with its checkpoint.
RESUME_FIELDS = ("kind", "model", "conversations", "load", "pools", "launcher_extra")


def _resumed_runs(args: argparse.Namespace, meta: dict) -> list[RunResult]:
    path = checkpoint_path(args)
    if not args.resume:
        return []
    if not path.exists():
        raise ResumeError(f"--resume: {path} does not exist")
    runs, previous = load_comparison(path)
    differing = [name for name in RESUME_FIELDS if as_json(meta[name]) != previous.get(name)]
    if differing:
        raise ResumeError(f"--resume: {path} is of another run (differs in {', '.join(differing)})")
    return runs


def _run_servers(
    args: argparse.Namespace, argv: Sequence[str], kind: str, choose_pools: Callable[..., list[Pool]]
) -> int:
    spec, settings = _workload(args)
    config = CompareConfig(
        model=args.model,
        variants=attributed_variants(
            _csv(args.policies), _csv(args.budgets), _csv(args.scopes), args.block_size, _csv(args.when)
        ),
        launcher_extra=tuple(args.server_arg),
    )
    count_tokens = model_token_counter(args.model)
    conversations = build_conversations(spec, count_tokens)
    load = workload([history_tokens(c, count_tokens, settings.max_tokens) for c in conversations], settings.max_tokens)
    pools = choose_pools(load)
    meta = {
        "command": command_line("multiturn", argv),
        "kind": kind,
        "model": args.model,
        "conversations": asdict(spec),
        "load": asdict(settings),
        "workload": asdict(load),
        "pools": [asdict(pool) for pool in pools],
        "variants": [v.label for v in config.variants],
        "launcher_extra": list(config.launcher_extra),
    }
    done = _resumed_runs(args, meta)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="multiturn-logs-"))
    print(
        f"{len(conversations)} users x {spec.turns} turns, ~{load.all_histories} history tokens in all; pools: "
        + ", ".join(f"{p.name} {p.tokens}" for p in pools)
        + f"; servers: {', '.join(v.label for v in config.variants)}; server logs in {log_dir}",
        flush=True,
    )

    def checkpoint(results: list[RunResult]) -> None:
        write_comparison(results, meta, args.out, args.name)

    results = run_plan(
        config, pools, spec, conversations, settings, log_dir, progress, done, checkpoint
    )  # fmt: skip
    paths = write_comparison(results, meta, args.out, args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if any(r.error for r in results) else 0


def run_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return _run_servers(
        args, argv, "compare",
        lambda load: compare_pools(_csv(args.pools), load, args.large_pool, args.tight_pool, args.tight_fraction),
    )  # fmt: skip


def run_sweep(args: argparse.Namespace, argv: Sequence[str]) -> int:
    fractions = [float(f) for f in _csv(args.pool_fractions)]
    sizes = [int(s) for s in _csv(args.pool_sizes)]
    if len(sizes or fractions) < 2:
        raise DriverError("a sweep needs at least two pool sizes")
    return _run_servers(args, argv, "sweep", lambda load: sweep_pools(load, fractions, sizes))


def run_single(args: argparse.Namespace, argv: Sequence[str]) -> int:
    spec, settings = _workload(args)
    count_tokens = model_token_counter(args.model)
    conversations = build_conversations(spec, count_tokens)
    load = workload([history_tokens(c, count_tokens, settings.max_tokens) for c in conversations], settings.max_tokens)
    base_url = args.url.rstrip("/")

    async def measure():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            if not await flush_when_idle(session, base_url, timeout=60):
                raise ServerError(f"{base_url} did not flush its cache (busy, or not an SGLang server)")
        return await run_users(base_url, conversations, settings, progress)

    outcome = asyncio.run(measure())
    # Named by --label: the benchmark does not know what the external server runs.
    result = RunResult("external", outcome.dense_slots or 0, ServerVariant(args.label), outcome, None, 0.0, (0, 0, 0))
    meta = {
        "command": command_line("multiturn", argv),
        "kind": "compare",
        "model": args.model,
        "conversations": asdict(spec),
        "load": asdict(settings),
        "workload": asdict(load),
        "pools": [],
        "url": base_url,
        "label": args.label,
    }
    paths = write_comparison([result], meta, args.out, args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def soak_markdown(payload: dict) -> str:
    meta, summary = payload["meta"], payload["summary"]
    lines = [
        *heading("Soak: concurrent load with client aborts and invalid requests", meta),
        f"Machine: {meta['environment']['cpu_model']}, {meta['environment']['cpu_cores']} cores; SGLang "
        f"{meta['environment']['sglang']}, sgl-kvevict {meta['environment']['git_commit']}, {meta['environment']['date']}.",
        "",
        f"**{'PASSED' if summary['passed'] else 'FAILED'}**: {summary['requests']} requests on {len(payload['runs'])} "
        f"server(s) in {summary['seconds']} s; malformed replies {len(summary['malformed'])}, violations "
        f"{len(summary['violations'])}, leaks {summary['leaks']}.",
    ]
    for run in payload["runs"]:
        lines += ["", *soak_run_markdown(run, meta["server_log_checked"])]
    return "\n".join(lines) + "\n"


def soak_run_markdown(run: dict, log_checked: bool) -> list[str]:
    summary, stats = run["summary"], run["summary"]["stats_after_flush"]
    lines = [
        f"## {run['server']}",
        "",
        f"**{'PASSED' if summary['passed'] else 'FAILED'}**: {summary['requests']} requests in {summary['seconds']} s; "
        f"malformed replies {len(summary['malformed'])}, violations {len(summary['violations'])}, leaks {summary['leaks']}; "
        f"flush {'ok' if summary['flush_ok'] else 'FAILED'}, healthy afterwards {summary['healthy_after']}, "
        f"answers afterwards {summary['final_reply_ok']}.",
        "",
        "| request kind | sent | outcomes |",
        "|---|---|---|",
    ]
    for kind, sent in summary["injected"].items():
        outcomes = ", ".join(f"{k.split(': ', 1)[1]} {n}" for k, n in summary["outcomes"].items() if k.startswith(kind + ": "))
        lines.append(f"| {kind} | {sent} | {outcomes} |")
    chunked = {name: stats[name] for name in CHUNK_COUNTERS if stats and name in stats}
    lines += [
        "",
        ("Chunked prefills (engine counters): " + ", ".join(f"{k} {v}" for k, v in chunked.items()) + ". " if chunked else "")
        + "Leak checks after `POST /flush_cache`: "
        + (f"`/kvevict/stats` = `{json.dumps(stats)}`; " if stats else "`/kvevict/stats` not served (vanilla); ")
        + "SGLang's idle self-check warnings in the server log: "
        + (str(len(summary["log_leak_warnings"])) if log_checked else "not checked (external server)")
        + ".",
    ]
    for title, items in (("Violations", summary["violations"]), ("Malformed replies", summary["malformed"])):
        if items:
            lines += ["", f"{title}:", *[f"* {item}" for item in items[:20]]]
    return lines


def _soak_config(args: argparse.Namespace, beyond_pool_tokens: Optional[int]) -> SoakConfig:
    long = args.long_prompt_tokens is not None
    return SoakConfig(
        seconds=args.seconds,
        max_requests=args.max_requests,
        concurrency=args.concurrency,
        prompt_tokens=(min(40, args.max_prompt_tokens), args.max_prompt_tokens),
        seed=args.seed,
        long_prompt_tokens=args.long_prompt_tokens,
        beyond_pool_tokens=beyond_pool_tokens if long else None,
        near_limit_tokens=model_context_length(args.model) - NEAR_LIMIT_MARGIN if long else None,
    )


def run_soak_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    count_tokens = model_token_counter(args.model)
    log = progress
    meta = {
        "command": command_line("multiturn", argv),
        "server_log_checked": not args.url,
        "launcher_extra": list(args.server_arg),
        "environment": environment(),
    }
    runs: list[tuple[str, SoakConfig, SoakReport]] = []
    if args.url:
        config = _soak_config(args, None)
        report = asyncio.run(run_soak(args.url.rstrip("/"), config, count_tokens, log))
        runs.append((f"external {args.url}", config, report))
    else:
        # A prompt past the pool: served only where the server compresses while prefilling.
        config = _soak_config(args, args.pool_tokens + BEYOND_POOL_MARGIN)
        log_dir = log_folder(args.log_dir, "soak")
        scopes = ["request"] if args.policy == VANILLA_POLICY else _csv(args.scopes)
        variants = server_variants([args.policy], [args.budget], scopes, args.block_size)
        for variant in variants[1:] or variants:
            description = f"{variant.label}, --max-total-tokens {args.pool_tokens}, model {args.model}"
            log(f"starting {description}")
            with launched_server(args.model, variant, args.pool_tokens, log_dir, extra=tuple(args.server_arg)) as server:
                report = asyncio.run(run_soak(server.base_url, config, count_tokens, log))
                report.server_alive = server.is_running()
                report.log_leak_warnings = server.leak_warnings()
            runs.append((description, config, report))
            _write_soak(args, meta, runs)  # after each server: a later one may not finish
    summary = _write_soak(args, meta, runs)
    print(f"soak {'passed' if summary['passed'] else 'FAILED'}: {summary['requests']} requests, injected {summary['injected']}")
    print(f"wrote {args.out / (args.name + '.json')}, {args.name}.md")
    return 0 if summary["passed"] else 1


def _write_soak(args: argparse.Namespace, meta: dict, runs: list[tuple[str, SoakConfig, SoakReport]]) -> dict:
    """``<name>.json`` and ``.md`` of the servers soaked so far; returns the combined summary."""
    payload = {
        "meta": meta,
        "summary": combined_summary([report for _, _, report in runs]),
        "runs": [{"server": name, "config": asdict(config), "summary": report.to_json()} for name, config, report in runs],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(soak_markdown(payload))
    return payload["summary"]


@exits_on(ServerError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    handler = {"compare": run_compare, "sweep": run_sweep, "run": run_single, "soak": run_soak_command}[args.command]
    try:
        return handler(args, argv)
    except (*SETTING_ERRORS, ResumeError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
