"""The multi-turn workload against N workers behind SGLang's cache-aware router, stock vs a policy
at equal total KV memory, with hit rate, throughput and TTFT in total and per worker.

Each variant is one ``python -m sgl_kvevict.server --workers N`` launch (``launched_server`` with
``--workers N --enable-metrics``): every worker gets the same ``--max-total-tokens``, so stock and
policy fleets hold the same KV memory in all. Totals come from the clients (``run_users``, the
same measurement as ``benchmarks.multiturn``); per-worker numbers from the difference of each
worker's SGLang Prometheus counters before and after the run (the client cannot see which worker
answered), found through the launcher's aggregated ``/kvevict/stats``.

    python -m benchmarks.load.router --quick --workers 2 --policy lava --budget 0.25 --pool-tokens 6000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.load.conversations import ConversationSpec, build_conversations
from benchmarks.load.users import LoadSettings, run_users
from sgl_kvevict.measure.chat import model_token_counter
from sgl_kvevict.measure.results import environment
from sgl_kvevict.measure.servers import VANILLA_POLICY, ServerVariant, launched_server

# SGLang's per-worker counters (sglang/srt/observability): summed over their label sets.
COUNTERS = {
    "requests": "sglang:num_requests_total",
    "prompt_tokens": "sglang:prompt_tokens_total",
    "cached_tokens": "sglang:cached_tokens_total",
    "generation_tokens": "sglang:generation_tokens_total",
    "ttft_sum": "sglang:time_to_first_token_seconds_sum",
    "ttft_count": "sglang:time_to_first_token_seconds_count",
}
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


def scrape(worker_url: str) -> dict[str, float]:
    """The worker's counters of ``COUNTERS`` from its ``/metrics`` (SGLang's ``--enable-metrics``)."""
    with urllib.request.urlopen(worker_url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    totals = dict.fromkeys(COUNTERS, 0.0)
    by_metric = {metric: key for key, metric in COUNTERS.items()}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"] in by_metric:
            totals[by_metric[match["name"]]] += float(match["value"])
    return totals


@dataclass(frozen=True)
class WorkerRun:
    """One worker's share of a run (counter differences over the run's wall time)."""

    url: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: Optional[float]
    output_tokens_per_second: float
    ttft_mean: Optional[float]

    @classmethod
    def of(cls, url: str, before: dict[str, float], after: dict[str, float], wall_seconds: float) -> "WorkerRun":
        delta = {key: after[key] - before[key] for key in COUNTERS}
        return cls(
            url=url,
            requests=int(delta["requests"]),
            prompt_tokens=int(delta["prompt_tokens"]),
            cached_tokens=int(delta["cached_tokens"]),
            hit_rate=delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else None,
            output_tokens_per_second=delta["generation_tokens"] / wall_seconds,
            ttft_mean=delta["ttft_sum"] / delta["ttft_count"] if delta["ttft_count"] else None,
        )


def worker_urls(stats_url: str) -> list[str]:
    with urllib.request.urlopen(stats_url, timeout=60) as response:
        return [worker["url"] for worker in json.loads(response.read())["workers"]]


def run_variant(model, variant: ServerVariant, workers: int, pool_tokens: int, conversations, settings, log_dir, extra):
    extra = ("--workers", str(workers), "--enable-metrics", *extra)
    with launched_server(model, variant, pool_tokens, log_dir, extra) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        urls = worker_urls(f"http://127.0.0.1:{port + 1}/kvevict/stats")
        before = {url: scrape(url) for url in urls}
        outcome = asyncio.run(run_users(server.base_url, conversations, settings, print))
        wall = outcome.metrics.wall_seconds
        per_worker = [WorkerRun.of(url, before[url], scrape(url), wall) for url in urls]
    return {"variant": variant.label, "total": asdict(outcome.metrics), "workers": [asdict(w) for w in per_worker]}


def markdown(runs: list[dict], meta: dict) -> str:
    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [
        f"`{meta['command']}`",
        "",
        "| server | worker | requests | hit rate | output tok/s | TTFT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        total = run["total"]
        rows.append(
            f"| {run['variant']} | all (clients) | {total['requests']} | {number(total['hit_rate'])} | "
            f"{number(total['output_tokens_per_second'])} | p50 {number(total['ttft']['p50'])} |"
        )
        for worker in run["workers"]:
            rows.append(
                f"| {run['variant']} | {worker['url']} | {worker['requests']} | {number(worker['hit_rate'])} | "
                f"{number(worker['output_tokens_per_second'])} | mean {number(worker['ttft_mean'])} |"
            )
    return "\n".join(rows) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load.router", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument("--workers", type=int, default=2, help="workers behind the router (default 2)")
    parser.add_argument("--policy", default="lava", help="the compared policy (default lava)")
    parser.add_argument("--budget", default="0.25", help="its --kv-evict-budget (default 0.25)")
    parser.add_argument("--pool-tokens", type=int, default=65536, help="--max-total-tokens per worker (default 65536)")
    parser.add_argument("--quick", action="store_true", help="4 users x 4 turns over ~1000-token documents")
    parser.add_argument("--users", type=int, default=8, help="concurrent users (default 8)")
    parser.add_argument("--turns", type=int, default=6, help="turns per user (default 6)")
    parser.add_argument("--document-tokens", type=int, default=2000, help="document length (default 2000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length cap (default 32)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder (default docs/results)")
    parser.add_argument("--name", default="router", help="output file stem (default router)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra launcher/SGLang flag (repeatable)")
    args = parser.parse_args(argv)
    users, turns, document = (4, 4, 1000) if args.quick else (args.users, args.turns, args.document_tokens)
    spec = ConversationSpec(users, turns, document, fact_every=1 if args.quick else 2, shared_document=False, seed=0)
    settings = LoadSettings(max_tokens=args.max_tokens)
    conversations = build_conversations(spec, model_token_counter(args.model))
    log_dir = Path(tempfile.mkdtemp(prefix="router-logs-"))
    variants = (ServerVariant(VANILLA_POLICY), ServerVariant(args.policy, args.budget))
    runs = [
        run_variant(args.model, v, args.workers, args.pool_tokens, conversations, settings, log_dir, tuple(args.server_arg))
        for v in variants
    ]
    meta = {"command": "python -m benchmarks.load.router " + " ".join(argv), "environment": environment()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(runs, meta))
    print(markdown(runs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
