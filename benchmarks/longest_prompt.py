"""The longest prompt a server serves, against its KV pool: stock SGLang against compress while prefilling.

    python -m benchmarks.longest_prompt                                       # pools 1000-6000, ~20 min
    python -m benchmarks.longest_prompt --pool-sizes 1500,3000 --server-arg=--dtype=float32

For every ``--pool-sizes`` value, stock SGLang and each policy (block scope by default: the scope that
compresses while prefilling) are started with that ``--max-total-tokens``. On each server:

* **limit**: a prompt longer than the model's context (``--probe-tokens``) is refused with the context
  length C; then a prompt of C - 1 tokens is sent: a server that cannot hold it refuses it with SGLang's
  own HTTP 400 "Input length (N tokens) exceeds the maximum allowed length (M tokens)" (N >= M), and
  M - 1 is the longest prompt it accepts (stock: about the pool; a compressing server: the longest prompt whose
  compressed peak fits the pool); a server that serves it is bounded by the context only (M = C - 1);
* **served**: a prompt of exactly M random token ids is sent with one output token; it must come back
  with that token (not only be accepted). The peak of the pool's used slots during it is read from
  ``/kvevict/stats`` (``kv_slots_total - kv_slots_free``, sampled; policy servers only).

Writes ``<name>.json``, ``.md`` and ``.png`` (longest prompt served against pool size, one line per
server) into ``--out``.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args, add_server_args, benchmark_parser, exits_on, log_folder
from benchmarks.load.report import provenance_heading, run_meta, runs_writer, save_figure, titled_with_legend
from sgl_kvevict.measure.client import StatsSampler
from sgl_kvevict.measure.results import pyplot as _pyplot
from sgl_kvevict.measure.servers import ServerError, ServerVariant, run_on_server, server_variants

# SGLang's tokenizer refusals of a prompt over the context and over the pool's limit (0.5.23).
CONTEXT_MESSAGE = re.compile(r"context length \((\d+) tokens\)")
LIMIT_MESSAGE = re.compile(r"maximum allowed length \((\d+) tokens\)")


# Ordinary ids in every vocabulary here (the tiny test model has 512).
TOKEN_IDS = range(100, 500)


def random_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(TOKEN_IDS) for _ in range(tokens)]


@dataclass(frozen=True)
class LongestConfig:
    model: str
    pool_sizes: tuple[int, ...]
    probe_tokens: int
    launcher_extra: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.pool_sizes or min(self.pool_sizes) < 64:
            raise ValueError("--pool-sizes: token counts of at least 64")
        if self.probe_tokens < 2:
            raise ValueError("--probe-tokens must be at least 2")


async def _generate(session: aiohttp.ClientSession, base_url: str, input_ids: list[int]) -> tuple[int, dict]:
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
    async with session.post(base_url + "/generate", json=payload) as response:
        return response.status, await response.json(content_type=None)


async def measure(base_url: str, config: LongestConfig, seed: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        status, body = await _generate(session, base_url, random_prompt(config.probe_tokens, seed))
        context = CONTEXT_MESSAGE.search(str(body))
        if status != 400 or context is None:
            raise ServerError(f"a {config.probe_tokens}-token prompt was not refused for the context: {status} {str(body)[:300]}")
        sampler = StatsSampler(session, base_url, interval=0.25)
        await sampler.start()
        limit, started = int(context.group(1)) - 1, time.perf_counter()
        status, body = await _generate(session, base_url, random_prompt(limit, seed + 1))
        refusal = LIMIT_MESSAGE.search(str(body)) if status == 400 else None
        if refusal is not None:  # the pool bounds it before the context does; SGLang refuses N >= M
            limit, started = int(refusal.group(1)) - 1, time.perf_counter()
            status, body = await _generate(session, base_url, random_prompt(limit, seed + 2))
        seconds = time.perf_counter() - started
        peaks = await sampler.stop()
    served = status == 200 and body.get("meta_info", {}).get("completion_tokens") == 1
    total, fewest_free = peaks.peaks.get("kv_slots_total"), peaks.lows.get("kv_slots_free")
    return {
        "limit": limit,
        "served": served,
        "served_seconds": seconds,
        "error": None if served else f"HTTP {status}: {str(body)[:300]}",
        "peak_slots_used": None if total is None or fewest_free is None else total - fewest_free,
    }


def run(variants: Sequence[ServerVariant], config: LongestConfig, log_dir: Path, on_done, log=print) -> list[dict]:
    """Every variant at every pool size, one server at a time; ``on_done(runs)`` after each server."""
    runs: list[dict] = []
    for pool in config.pool_sizes:
        for variant in variants:
            runs.append(run_on_server(
                config.model, variant, pool, log_dir, config.launcher_extra, f"{variant.label}, pool {pool}",
                lambda url: asyncio.run(measure(url, config, seed=len(runs) * 10)), {"pool_tokens": pool},
                lambda f: f"longest prompt {f['limit']}, {'served' if f['served'] else 'NOT served'} in {f['served_seconds']:.1f} s",
                log,
            ))  # fmt: skip
            on_done(runs)
    return runs


def markdown(payload: dict) -> str:
    meta, runs = payload["meta"], payload["runs"]
    lines = [
        *provenance_heading("The longest prompt served, against the KV pool", meta),
        "Longest prompt: M - 1 from the server's refusal of a prompt one token shorter than the context (\"exceeds the "
        "maximum allowed length (M tokens)\"), or that prompt itself where it was served; served: a prompt of that many random tokens answered with its one output token. Peak slots: "
        "the most pool slots in use while it was served (`/kvevict/stats`, policy servers).",
        "",
        f"![longest prompt served against pool size]({payload['plot']})",
        "",
        "| server | pool (tokens) | longest prompt (tokens) | x pool | served | prefill (s) | peak slots used |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        peak = "-" if run["peak_slots_used"] is None else f"{run['peak_slots_used']:.0f}"
        lines.append(
            f"| {run['server']} | {run['pool_tokens']} | {run['limit']} | {run['limit'] / run['pool_tokens']:.2f} | "
            f"{'yes' if run['served'] else 'NO: ' + str(run['error'])} | {run['served_seconds']:.1f} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict], path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6.5, 4))
    for server in dict.fromkeys(run["server"] for run in runs):
        mine = [run for run in runs if run["server"] == server and run["served"]]
        axis.plot([r["pool_tokens"] for r in mine], [r["limit"] for r in mine], marker="o", label=server)
    axis.set_xlabel("KV pool, --max-total-tokens")
    axis.set_ylabel("longest prompt served (tokens)")
    titled_with_legend(axis, "Longest prompt served against pool size")
    save_figure(plt, fig, path)


def build_parser():
    parser = benchmark_parser("longest_prompt", __doc__)
    add_server_args(parser, ("--policies", "topk:learned", "comma-separated policy[:score] besides stock"), "their budget", scopes="block")
    parser.add_argument("--pool-sizes", default="1000,2000,3000,4000,6000", help="comma-separated --max-total-tokens values (default 1000,2000,3000,4000,6000)")
    parser.add_argument("--probe-tokens", type=int, default=8300, help="the prompt that reads the model's context length from its refusal; longer than the context (default 8300, SmolLM2's is 8192)")
    add_output_args(parser, "longest_prompt", server_arg_for="every server")
    return parser


@exits_on(ServerError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = LongestConfig(
            args.model, tuple(int(size) for size in args.pool_sizes.split(",")), args.probe_tokens, tuple(args.server_arg)
        )
        variants = server_variants(args.policies.split(","), [args.budget], args.scopes.split(","), args.block_size)
    except (ValueError, ServerError) as error:
        parser.error(str(error))
    meta = run_meta("longest_prompt", argv, **asdict(config))
    run(variants, config, log_folder(args.log_dir, "longest-prompt"), runs_writer(args.out, args.name, meta, plot, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
