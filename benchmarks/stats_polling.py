"""Does polling ``GET /kvevict/stats`` slow decode? Inter-token latency with and without a client that
polls the route in a tight loop.

    python -m benchmarks.stats_polling                                 # SmolLM2: vanilla, then topk:learned@0.25
    python -m benchmarks.stats_polling --rounds 3 --tokens 64 --policy lava

Starts the real launcher (sgl_kvevict/measure/servers.py) for vanilla and then for the policy, one server
at a time, with the same ``--max-total-tokens``. On each server, after one warm-up request, it runs
``--rounds`` rounds of two streamed chat requests of ``--tokens`` output tokens (``ignore_eos``, one
request in flight): one alone ("quiet"), one while a separate client process sends ``GET
/kvevict/stats`` as fast as the server answers, one request after the other with no pause
("polled"). The two phases alternate so that drift on the shared machine hits both alike.

Inter-token latency (ITL) is the time between two consecutive streamed tokens at the client (the
first token, which waits for the prefill, excluded); the report gives p50, p90, p99 and the maximum
per server and phase over every gap of every round, the polled / quiet ratios, and how many polls per
second the route answered. Vanilla's route answers ``{"policy": "none"}`` from the HTTP process alone,
so its ratio is the cost of the HTTP traffic; the policy's also asks the scheduler's stats thread.
Writes ``<name>.json`` (every gap) and ``<name>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
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
from benchmarks.load.metrics import percentile
from benchmarks.load.report import heading, write_report
from sgl_kvevict.measure.client import STATS_PATH, stream_completion
from sgl_kvevict.measure.results import environment
from sgl_kvevict.measure.servers import VANILLA_POLICY, ServerError, ServerVariant, launched_server

CHAT_PATH = "/v1/chat/completions"
PHASES = ("quiet", "polled")
# About 600 tokens of SmolLM2's tokenizer: long enough that the policy compresses the prompt.
PROMPT = " ".join(f"Note {i}: the archive lists shipment {i * 37 % 1000} under shelf {i % 17}." for i in range(40))
QUESTION = "Summarise the notes above in detail."


@dataclass(frozen=True)
class PollingConfig:
    model: str
    policy: str
    budget: str
    pool_tokens: int
    tokens: int
    rounds: int

    def __post_init__(self):
        for name in ("pool_tokens", "tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.tokens < 2:
            raise ValueError("--tokens must be at least 2: an inter-token gap needs two tokens")


class MeasurementError(RuntimeError):
    """A request of the benchmark failed; the message has the server's answer."""


def poll_forever(url: str, stop, polls, errors) -> None:
    """A separate process: GET ``url`` one request after the other until ``stop`` is set."""
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                response.read()
            with polls.get_lock():
                polls.value += 1
        except (urllib.error.URLError, OSError):
            with errors.get_lock():
                errors.value += 1


async def _stream(session: aiohttp.ClientSession, base_url: str, tokens: int) -> list[float]:
    """One streamed request of ``tokens`` output tokens; its inter-token gaps in seconds."""
    messages = [{"role": "user", "content": f"{PROMPT}\n\n{QUESTION}"}]
    payload = {"model": "default", "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    reply = await stream_completion(session, base_url + CHAT_PATH, payload)
    if reply.error or reply.problems:
        raise MeasurementError(f"request failed: {reply.error or reply.problems}")
    times = reply.token_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


async def _first_poll(polls, errors, timeout: float = 120.0) -> None:
    """Until the poller got its first answer: it is in its loop before the request starts."""
    deadline = time.monotonic() + timeout
    while polls.value == 0:
        if errors.value or time.monotonic() > deadline:
            raise MeasurementError(f"the poller got no answer from {STATS_PATH}")
        await asyncio.sleep(0.1)


async def _measure(base_url: str, config: PollingConfig, log: Callable[[str], None]) -> dict:
    """Every gap by phase, and the polls each polled phase got answered."""
    gaps: dict[str, list[float]] = {phase: [] for phase in PHASES}
    poll_rates: list[float] = []
    context = multiprocessing.get_context("spawn")
    # A new connection per request: the server closes idle keep-alive connections while a poller starts.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=connector) as session:
        await _stream(session, base_url, 4)  # warm-up: the server skips SGLang's own
        for round_index in range(config.rounds):
            for phase in PHASES:
                stop, polls, errors = context.Event(), context.Value("l", 0), context.Value("l", 0)
                poller = None
                if phase == "polled":
                    poller = context.Process(target=poll_forever, args=(base_url + STATS_PATH, stop, polls, errors))
                    poller.start()
                    await _first_poll(polls, errors)
                started, before = time.monotonic(), polls.value
                phase_gaps = await _stream(session, base_url, config.tokens)
                elapsed = time.monotonic() - started
                if poller is not None:
                    stop.set()
                    poller.join(timeout=60)
                    if errors.value:
                        raise MeasurementError(f"{errors.value} polls of {STATS_PATH} failed")
                    poll_rates.append((polls.value - before) / elapsed)
                gaps[phase] += phase_gaps
                log(
                    f"  round {round_index + 1}/{config.rounds} {phase}: ITL p50 {percentile(phase_gaps, 50) * 1000:.1f} ms, "
                    f"p99 {percentile(phase_gaps, 99) * 1000:.1f} ms"
                    + (f", {poll_rates[-1]:.0f} polls/s" if poller is not None else "")
                )
    return {"gaps": gaps, "polls_per_second": poll_rates}


def summarize(gaps: list[float]) -> dict:
    return {
        "gaps": len(gaps),
        **{f"itl_p{q}_ms": percentile(gaps, q) * 1000 for q in (50, 90, 99)},
        "itl_max_ms": max(gaps) * 1000,
        "tokens_per_second": len(gaps) / sum(gaps),
    }


def ratios(quiet: dict, polled: dict) -> dict:
    return {name: polled[name] / quiet[name] for name in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "tokens_per_second")}


def markdown(report: dict) -> str:
    meta = report["meta"]
    env, cfg = meta["environment"], meta["config"]
    lines = [
        *heading("Polling /kvevict/stats during decode: inter-token latency", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, torch "
        f"{env['torch']}, sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, "
        f"{env['date']}. Model `{cfg['model']}`, `--max-total-tokens {cfg['pool_tokens']}`, one server at a time. "
        f"Per server: {cfg['rounds']} rounds of a quiet and a polled request of {cfg['tokens']} output tokens "
        "(one request in flight, greedy, streamed); polled = a separate client process sending GET /kvevict/stats "
        "back to back, no pause.",
        "",
        "| server | phase | ITL p50 (ms) | p90 (ms) | p99 (ms) | max (ms) | tokens/s | polls/s answered | load average before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for server in report["servers"]:
        for phase in PHASES:
            s = server["summary"][phase]
            polls = f"{sum(server['polls_per_second']) / len(server['polls_per_second']):.0f}" if phase == "polled" else "-"
            lines.append(
                f"| {server['label']} | {phase} | {s['itl_p50_ms']:.1f} | {s['itl_p90_ms']:.1f} | {s['itl_p99_ms']:.1f} | "
                f"{s['itl_max_ms']:.1f} | {s['tokens_per_second']:.2f} | {polls} | {server['load_average'][0]:.2f} |"
            )
    lines += ["", "| server | ITL p50 polled / quiet | p90 | p99 | tokens/s polled / quiet |", "|---|---|---|---|---|"]
    for server in report["servers"]:
        r = server["ratios"]
        lines.append(
            f"| {server['label']} | {r['itl_p50_ms']:.2f} | {r['itl_p90_ms']:.2f} | **{r['itl_p99_ms']:.2f}** | "
            f"{r['tokens_per_second']:.2f} |"
        )
    lines += [
        "",
        "Reading it: the stats route is a plain FastAPI handler on the HTTP process's thread pool; with a policy it "
        "asks the scheduler's stats thread over a ZeroMQ socket, at most once per 50 ms (`engine/stats_channel.py`: "
        "every answer is a snapshot taken after its request arrived, polls that come faster wait), so the polls "
        "answered per second are the rate the route allows, not the poller's. Each snapshot takes the scheduler "
        "process's GIL from the scheduler thread. On a 2-core machine the poller, the HTTP process and the "
        "scheduler share the cores, so part of any slowdown is CPU contention rather than the route itself; "
        "vanilla's row (the route answers without the scheduler) measures that share. Ratios from one run on a "
        "shared machine; compare them, not absolute numbers across runs.",
    ]
    return "\n".join(lines) + "\n"


def run(config: PollingConfig, out: Path, name: str, log_dir: Path, argv: Sequence[str], log: Callable[[str], None]) -> dict:
    servers = []
    for variant in (ServerVariant(VANILLA_POLICY), ServerVariant(config.policy, config.budget)):
        load_average = os.getloadavg()
        log(f"{variant.label}: starting the server (load average {load_average[0]:.2f})")
        with launched_server(config.model, variant, config.pool_tokens, log_dir) as server:
            measured = asyncio.run(_measure(server.base_url, config, log))
        summary = {phase: summarize(measured["gaps"][phase]) for phase in PHASES}
        servers.append(
            {
                "label": variant.label,
                "load_average": load_average,
                "summary": summary,
                "ratios": ratios(summary["quiet"], summary["polled"]),
                **measured,
            }
        )
    report = {
        "meta": {
            "command": command_line("stats_polling", argv),
            "config": asdict(config),
            "environment": environment(),
        },
        "servers": servers,
    }
    write_report(out, name, report, markdown(report), log)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("stats_polling", __doc__)
    add_server_args(parser, ("--policy", "topk:learned", "policy[:score] of the compressing server"), "--kv-evict-budget of the compressing server")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="--max-total-tokens of both servers (default 16384)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="quiet + polled request pairs per server (default 5)")
    add_output_args(parser, "stats_polling")
    return parser


@exits_on(ServerError, MeasurementError, code=1)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    try:
        config = PollingConfig(args.model, args.policy, args.budget, args.pool_tokens, args.tokens, args.rounds)
    except ValueError as error:
        parser.error(str(error))
    log_dir = log_folder(args.log_dir, "stats-polling")
    run(config, args.out, args.name, log_dir, argv, progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
