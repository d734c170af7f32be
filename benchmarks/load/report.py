"""The comparison's JSON, markdown and PNG: absolute numbers per run, and ratios against vanilla at
the same pool (these machines are shared and noisy; ratios of back-to-back runs travel better)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.load.driver import RunResult
from benchmarks.load.users import outcome_to_json

REPO = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    """The machine and versions a result was measured with."""
    status = _git("status", "--porcelain")
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "gpu": "none (CPU development mode)",
        "python": platform.python_version(),
        "sglang": _version("sglang"),
        "torch": _version("torch"),
        "sgl_kvevict": _version("sgl-kvevict"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_worktree_dirty": bool(status) if status is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def result_to_json(result: RunResult) -> dict:
    return {
        "pool": result.pool,
        "pool_tokens": result.pool_tokens,
        "variant": asdict(result.variant),
        "label": result.variant.label,
        "error": result.error,
        "startup_seconds": result.startup_seconds,
        "load_average": result.load_average,
        **(outcome_to_json(result.outcome) if result.outcome else {}),
    }


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def ratios(results: Sequence[RunResult]) -> list[dict]:
    """Each policy run against vanilla at the same pool, and vanilla tight against vanilla large
    (what eviction costs the stock server)."""
    vanilla = {r.pool: r for r in results if r.variant.is_vanilla and r.outcome}
    pairs = [(f"{r.variant.label} / vanilla", r.pool, r, vanilla.get(r.pool)) for r in results if not r.variant.is_vanilla]
    if "tight" in vanilla and "large" in vanilla:
        pairs.append(("vanilla tight / vanilla large", "tight", vanilla["tight"], vanilla["large"]))
    rows = []
    for name, pool, this, base in pairs:
        if this.outcome is None or base is None:
            continue
        a, b = this.outcome.metrics, base.outcome.metrics
        flips = sum(
            1
            for x, y in zip(this.outcome.records, base.outcome.records)
            if x.expected is not None and x.correct is not None and y.correct is not None and x.correct != y.correct
        )
        rows.append(
            {
                "comparison": name,
                "pool": pool,
                "requests_per_second": _ratio(a.requests_per_second, b.requests_per_second),
                "output_tokens_per_second": _ratio(a.output_tokens_per_second, b.output_tokens_per_second),
                "hit_rate": _ratio(a.hit_rate, b.hit_rate),
                "ttft_p50": _ratio(a.ttft["p50"], b.ttft["p50"]),
                "latency_p50": _ratio(a.latency["p50"], b.latency["p50"]),
                "prompt_tokens_recomputed": _ratio(a.prompt_tokens_recomputed, b.prompt_tokens_recomputed),
                "accuracy": a.accuracy,
                "baseline_accuracy": b.accuracy,
                "fact_answers_flipped": flips,
            }
        )
    return rows


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _stats_columns(result: RunResult) -> str:
    """Peak arena cells (of the total), peak compressed nodes and requests compressed, peak dense
    slots used, from ``/kvevict/stats``: n/a without the endpoint, - without an arena (vanilla)."""
    stats = result.outcome.stats
    if not stats.available:
        return "n/a | n/a | n/a"
    last = stats.last or {}
    if "arena_cells_total" not in last:
        return "- | - | -"
    arena = f"{int(stats.peaks['arena_cells_used'])} of {last['arena_cells_total']}"
    nodes = f"{int(stats.peaks['compressed_nodes'])} / {last['requests_compressed']}"
    return f"{arena} | {nodes} | {stats.peak_dense_slots_used} of {last['dense_slots_total']}"


def markdown(payload: dict, results: Sequence[RunResult]) -> str:
    env, meta = payload["environment"], payload["meta"]
    lines = [
        "# Multi-turn serving benchmark: vanilla SGLang vs KV eviction at equal KV memory",
        "",
        f"`{meta['command']}`",
        "",
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, no GPU (CPU development mode). SGLang {env['sglang']}, "
        f"torch {env['torch']}, sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, "
        f"{env['date']}. Model `{meta['model']}`.",
        "",
        f"Workload: {meta['conversations']['users']} concurrent users x {meta['conversations']['turns']} turns, "
        f"{'one shared document' if meta['conversations']['shared_document'] else 'one document per user'} of "
        f"~{meta['conversations']['document_tokens']} tokens, answers up to {meta['load']['max_tokens']} tokens (greedy), "
        f"a fact question every {meta['conversations']['fact_every']} turn(s), seed {meta['conversations']['seed']}. "
        f"All final histories together: ~{meta['pools']['all_histories']} tokens (longest "
        f"~{meta['pools']['longest_history']}). Pools (`--max-total-tokens`, the same for every server of a row "
        f"group): large {meta['pools']['large']}, tight {meta['pools']['tight']}.",
        "",
        "| pool | server | KV memory (tokens) | dense slots | req/s | output tok/s | TTFT p50 / p90 / p99 (s) "
        "| latency p50 / p90 / p99 (s) | hit rate | prompt tokens recomputed | facts correct | peak arena cells "
        "| compressed nodes peak / requests compressed | peak dense slots used | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.outcome is None:
            lines.append(f"| {r.pool} | {r.variant.label} | {r.pool_tokens} | failed: {r.error.splitlines()[0]} |" + " |" * 11)
            continue
        m = r.outcome.metrics
        ttft = " / ".join(_fmt(m.ttft[k]) for k in ("p50", "p90", "p99"))
        latency = " / ".join(_fmt(m.latency[k]) for k in ("p50", "p90", "p99"))
        lines.append(
            f"| {r.pool} | {r.variant.label} | {r.pool_tokens} | {r.outcome.dense_slots or '?'} | {m.requests_per_second:.3f} "
            f"| {m.output_tokens_per_second:.2f} | {ttft} | {latency} | {_fmt(m.hit_rate)} | {m.prompt_tokens_recomputed} "
            f"| {m.fact_correct}/{m.fact_questions} | {_stats_columns(r)} | {m.failed_requests} |"
        )
    rows = payload["ratios"]
    if rows:
        lines += [
            "",
            "Ratios (first / second; throughput and hit rate: higher is better, TTFT and recomputed tokens: lower "
            "is better). Flipped = fact answers scored differently from the baseline's answer to the same question.",
            "",
            "| comparison | pool | output tok/s | req/s | hit rate | TTFT p50 | latency p50 | recomputed tokens "
            "| accuracy (vs baseline) | flipped |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['comparison']} | {row['pool']} | {_fmt(row['output_tokens_per_second'])} "
                f"| {_fmt(row['requests_per_second'])} | {_fmt(row['hit_rate'])} | {_fmt(row['ttft_p50'])} "
                f"| {_fmt(row['latency_p50'])} | {_fmt(row['prompt_tokens_recomputed'])} "
                f"| {_fmt(row['accuracy'])} ({_fmt(row['baseline_accuracy'])}) | {row['fact_answers_flipped']} |"
            )
    lines += [
        "",
        "Reading it: hit rate = cached prompt tokens / prompt tokens (`usage.prompt_tokens_details.cached_tokens`). "
        "KV memory = the `--max-total-tokens` every server of a pool gets; a policy server gives part of it to its "
        "arena and SGLang's dense slots are the rest. Arena cells, compressed nodes and dense slots used come from "
        "`GET /kvevict/stats` (sampled twice a second; n/a when the server has no such endpoint, - when it reports no "
        "arena: vanilla). Greedy answers are not bit-identical across runs on this CPU (batch composition changes "
        "bf16 numerics), so a couple of flipped fact answers is noise; the load average before each run is in the JSON.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: Sequence[RunResult], path: Path) -> None:
    """Four panels: output tokens/s, TTFT p50, fact accuracy (bars per pool and server), and the hit
    rate per turn (one line per run: a tight pool shows histories falling out of the cache)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.outcome is not None]
    labels = [f"{r.variant.label}\n{r.pool}" for r in done]
    colours = ["tab:grey" if r.variant.is_vanilla else "tab:blue" for r in done]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    bars = [
        (axes[0][0], [r.outcome.metrics.output_tokens_per_second for r in done], "output tokens / s (higher is better)"),
        (axes[0][1], [r.outcome.metrics.ttft["p50"] or 0 for r in done], "TTFT p50, s (lower is better)"),
        (axes[1][0], [100 * (r.outcome.metrics.accuracy or 0) for r in done], "fact answers correct, %"),
    ]
    for axis, values, title in bars:
        axis.bar(range(len(done)), values, color=colours)
        axis.set_xticks(range(len(done)), labels, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    axis = axes[1][1]
    for r in done:
        by_turn = r.outcome.metrics.hit_rate_by_turn
        axis.plot(
            range(1, len(by_turn) + 1),
            [float("nan") if v is None else v for v in by_turn],
            marker="o",
            linestyle="-" if r.pool == "large" else "--",
            label=f"{r.variant.label}, {r.pool}",
        )
    axis.set_xticks(range(1, max((len(r.outcome.metrics.hit_rate_by_turn) for r in done), default=1) + 1))
    axis.set_xlabel("turn")
    axis.set_ylim(-0.03, 1.03)
    axis.set_title("prefix-cache hit rate by turn", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(results: Sequence[RunResult], meta: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment(),
        "meta": meta,
        "ratios": ratios(results),
        "runs": [result_to_json(r) for r in results],
    }
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md", out_dir / f"{name}.png"]
    paths[0].write_text(json.dumps(payload, indent=1) + "\n")
    paths[1].write_text(markdown(payload, results))
    plot(results, paths[2])
    return paths
