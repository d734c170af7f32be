"""Chunked prefill: what a chunk size costs a long prompt, and what it spares the requests already running.

    python -m benchmarks.chunked_prefill                          # SmolLM2: stock and topk:learned@0.25, chunks -1,512,1024,2048
    python -m benchmarks.chunked_prefill --chunk-sizes=-1,1024 --policies topk:learned --scopes request,block

Starts the real launcher (sgl_kvevict/measure/servers.py), one server at a time, for stock SGLang and every
policy variant, each with every ``--chunk-sizes`` value (-1: one forward per prompt), all at the same
``--max-total-tokens``. On each server:

* **TTFT**: ``--samples`` prompts of ``--prompt-tokens`` random token ids (no two share a prefix), one
  at a time, one output token each (``/generate``); the median is the time to first token;
* **decode during a long prefill**: a streamed chat request decodes ``--stream-tokens`` tokens
  (``ignore_eos``) while, once its first ``--arrive-after`` tokens are out, a ``--arrival-tokens``
  prompt arrives. The gaps between its streamed tokens (inter-token latency, the first token
  excluded) give p50, p99 and the maximum: without chunking the longest gap is the whole long
  prefill; with chunks it is about one chunk.

The report gives each server's figures and, per server kind, TTFT and ITL against the same kind
unchunked; it writes ``<name>.json`` (every sample and gap) and ``<name>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args
from benchmarks.cli import add_server_args
from benchmarks.cli import add_resume_arg
from benchmarks.cli import as_json
from benchmarks.cli import checkpoint_path
from benchmarks.cli import log_folder
from benchmarks.cli import other_configuration
from benchmarks.cli import read_checkpoint
from benchmarks.load.metrics import percentile
from benchmarks.load.report import provenance_heading, run_meta, runs_writer, save_figure, titled_with_legend
from sgl_kvevict.measure.client import stream_completion
from sgl_kvevict.measure.results import pyplot as _pyplot
from sgl_kvevict.measure.servers import ServerError, ServerVariant, run_on_server, server_variants

# A gap between streamed tokens this long is a stall (decode alone takes ~0.1-0.2 s here).
STALL_SECONDS = 1.0
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home."
# SmolLM2's vocabulary is 49152 ids; ids from this range are ordinary word pieces.
TOKEN_IDS = range(1000, 40000)


@dataclass(frozen=True)
class ChunkedConfig:
    model: str
    chunk_sizes: tuple[int, ...]
    prompt_tokens: int
    samples: int
    arrival_tokens: int
    stream_tokens: int
    arrive_after: int
    pool_tokens: int
    launcher_extra: tuple[str, ...] = ()
    arrival_output_tokens: int = 1  # tokens the arriving prompt decodes (ignore_eos)

    def __post_init__(self):
        if not self.chunk_sizes or any(size == 0 or size < -1 for size in self.chunk_sizes):
            raise ValueError("--chunk-sizes: positive token counts, or -1 for no chunking")
        if self.arrive_after >= self.stream_tokens:
            raise ValueError("--arrive-after must be smaller than --stream-tokens")
        for name in ("prompt_tokens", "samples", "arrival_tokens", "pool_tokens", "arrival_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def random_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(TOKEN_IDS) for _ in range(tokens)]


async def generate(session: aiohttp.ClientSession, base_url: str, input_ids: list[int], output_tokens: int = 1) -> float:
    """Seconds to prefill ``input_ids`` and sample ``output_tokens`` tokens."""
    sampling = {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": input_ids, "sampling_params": sampling}
    started = time.perf_counter()
    async with session.post(base_url + "/generate", json=payload) as response:
        body = await response.text()
        if response.status != 200:
            raise ServerError(f"/generate answered {response.status}: {body[:300]}")
    return time.perf_counter() - started


async def measure(base_url: str, config: ChunkedConfig, seed: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ttfts = [await generate(session, base_url, random_prompt(config.prompt_tokens, seed + i)) for i in range(config.samples)]
        stream_payload = {
            "model": "default", "messages": [{"role": "user", "content": STREAM_PROMPT}],
            "max_tokens": config.stream_tokens, "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        progress: list[float] = []
        stream = asyncio.ensure_future(
            stream_completion(session, base_url + "/v1/chat/completions", stream_payload, on_token=progress.append)
        )
        while len(progress) < config.arrive_after and not stream.done():
            await asyncio.sleep(0.01)
        arrival_ids = random_prompt(config.arrival_tokens, seed + 1000)
        arrival = asyncio.ensure_future(generate(session, base_url, arrival_ids, config.arrival_output_tokens))
        arrival_sent = progress[-1] if progress else 0.0
        reply = await stream
        arrival_seconds = await arrival
    if reply.error:
        raise ServerError(f"streamed request failed: {reply.error}")
    gaps = [later - earlier for earlier, later in zip(reply.token_times, reply.token_times[1:])]
    return {
        "ttft_samples": ttfts,
        "ttft_median": percentile(ttfts, 50),
        "arrival_prefill_seconds": arrival_seconds,
        "arrival_sent_at": arrival_sent,
        "itl_gaps": gaps,
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "itl_max": max(gaps),
    }


def run(
    variants: Sequence[ServerVariant], config: ChunkedConfig, log_dir: Path, on_done, log=print, done: Sequence[dict] = ()
) -> list[dict]:
    """Every variant at every chunk size, one server at a time; ``on_done(runs)`` after each server.
    ``done``: runs of an earlier invocation with the same config, kept instead of measured again."""
    kept = {(run["server"], run["chunk_size"]): run for run in done}
    runs: list[dict] = []
    for variant in variants:
        for chunk in config.chunk_sizes:
            extra = (*config.launcher_extra, "--chunked-prefill-size", str(chunk))
            label = f"{variant.label} chunk {chunk}"
            if (variant.label, chunk) in kept:
                log(f"{label}: kept from the checkpoint")
                runs.append(kept[variant.label, chunk])
                continue
            runs.append(run_on_server(
                config.model, variant, config.pool_tokens, log_dir, extra, label,
                lambda url: asyncio.run(measure(url, config, seed=len(runs) * 10)), {"chunk_size": chunk},
                lambda f: f"TTFT {f['ttft_median']:.2f} s, ITL p99 {f['itl_p99']:.3f} s, max {f['itl_max']:.2f} s", log,
            ))  # fmt: skip
            on_done(runs)
    return runs


def against_unchunked(runs: Sequence[dict]) -> list[dict]:
    """Per run, its TTFT and ITL p99 / max over the same server's unchunked run (None without one)."""
    unchunked = {run["server"]: run for run in runs if run["chunk_size"] == -1}
    rows = []
    for run in runs:
        base = unchunked.get(run["server"])
        rows.append({
            "server": run["server"], "chunk_size": run["chunk_size"],
            **{f"{name}_vs_unchunked": (run[name] / base[name] if base and base[name] else None)
               for name in ("ttft_median", "itl_p99", "itl_max")},
        })  # fmt: skip
    return rows


def markdown(payload: dict) -> str:
    meta, runs = payload["meta"], payload["runs"]
    lines = [
        *provenance_heading("Chunked prefill: TTFT of a long prompt, and decode while one arrives", meta),
        f"TTFT: median of {meta['samples']} prompts of {meta['prompt_tokens']} tokens, one at a time. Decode: a "
        f"streamed request's gaps between tokens while a {meta['arrival_tokens']}-token prompt arrives after its "
        f"first {meta['arrive_after']} tokens ({meta['stream_tokens']} tokens in all). Pool {meta['pool_tokens']} "
        "tokens for every server.",
        "",
        f"The long prompt stalls the stream in one or a few gaps, so p99 over ~{meta['stream_tokens']} gaps can miss "
        f"it: the longest gap and the gaps over {STALL_SECONDS:g} s (count, sum) show the stall. "
        f"![gaps between streamed tokens]({payload['plot']})" if payload.get("plot") else "",
        "",
        "| server | chunk | TTFT (s) | TTFT vs unchunked | ITL p50 (s) | ITL p99 (s) | ITL max (s) | max vs unchunked "
        f"| gaps > {STALL_SECONDS:g} s (sum s) | long prompt's latency (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run, ratio in zip(runs, against_unchunked(runs)):
        chunk = "none" if run["chunk_size"] == -1 else str(run["chunk_size"])
        stalls = [gap for gap in run["itl_gaps"] if gap > STALL_SECONDS]
        lines.append(
            f"| {run['server']} | {chunk} | {run['ttft_median']:.2f} | {_fmt(ratio['ttft_median_vs_unchunked'])} | "
            f"{run['itl_p50']:.3f} | {run['itl_p99']:.3f} | {run['itl_max']:.2f} | {_fmt(ratio['itl_max_vs_unchunked'])} | "
            f"{len(stalls)} ({sum(stalls):.1f}) | {run['arrival_prefill_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict], path: Path) -> None:
    """Each server's gaps between streamed tokens against the token's index, one panel per server kind."""
    plt = _pyplot()
    kinds = list(dict.fromkeys(run["server"] for run in runs))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 3.8), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        for run in (r for r in runs if r["server"] == kind):
            label = "unchunked" if run["chunk_size"] == -1 else f"chunk {run['chunk_size']}"
            axis.plot(range(2, len(run["itl_gaps"]) + 2), run["itl_gaps"], label=label, linewidth=1.2)
        axis.set_xlabel("token index", fontsize=9)
        axis.set_ylabel("seconds since the previous token", fontsize=9)
        titled_with_legend(axis, f"{kind}: gaps between streamed tokens")
    save_figure(plt, fig, path)


def _fmt(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"x{ratio:.2f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chunked_prefill", description=__doc__.split("\n\n")[0])
    add_server_args(parser, ("--policies", "topk:learned", "comma-separated policy[:score] besides stock"), "their budget", scopes="request")
    parser.add_argument("--chunk-sizes", default="-1,512,1024,2048", help="comma-separated --chunked-prefill-size values, -1: none; a list that starts with -1 needs the = form, --chunk-sizes=-1,512 (default -1,512,1024,2048)")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="TTFT prompt length (default 4096)")
    parser.add_argument("--samples", type=int, default=3, help="TTFT prompts per server (default 3)")
    parser.add_argument("--arrival-tokens", type=int, default=7000, help="the prompt that arrives during the decode (default 7000)")
    parser.add_argument("--stream-tokens", type=int, default=200, help="tokens the streamed request decodes (default 200)")
    parser.add_argument("--arrive-after", type=int, default=20, help="its tokens out before the long prompt is sent (default 20)")
    parser.add_argument("--pool-tokens", type=int, default=16000, help="--max-total-tokens of every server (default 16000)")
    add_output_args(parser, "chunked_prefill", server_arg_for="every server")
    add_resume_arg(parser)
    return parser


def resumed_runs(path: Path, config: ChunkedConfig) -> list[dict]:
    """The runs of the report at ``path``, which must be of the same configuration."""
    previous = read_checkpoint(path)
    if {name: previous["meta"].get(name) for name in asdict(config)} != as_json(asdict(config)):
        raise other_configuration(path)
    return previous["runs"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = ChunkedConfig(
            args.model, tuple(int(size) for size in args.chunk_sizes.split(",")), args.prompt_tokens, args.samples,
            args.arrival_tokens, args.stream_tokens, args.arrive_after, args.pool_tokens, tuple(args.server_arg),
        )  # fmt: skip
        variants = server_variants(args.policies.split(","), [args.budget], args.scopes.split(","), args.block_size)
        done = resumed_runs(checkpoint_path(args), config) if args.resume else []
    except (ValueError, ServerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    meta = run_meta("chunked_prefill", argv, **asdict(config))
    write = runs_writer(args.out, args.name, meta, plot, markdown, lambda runs: {"against_unchunked": against_unchunked(runs)})
    run(variants, config, log_folder(args.log_dir, "chunked-prefill"), write, done=done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
