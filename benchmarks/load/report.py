"""The multi-turn benchmark's JSON, markdown and PNG: absolute numbers per run, ratios against vanilla
at the same pool (these machines are shared and noisy; ratios of back-to-back runs travel better),
fact accuracy with its 95% Wilson interval, and the numbers ``/kvevict/stats`` reported per server.

Two layouts over the same runs: ``compare`` (a large and a tight pool, rows per run) and ``sweep``
(several pool sizes, one row per (pool, server), a table of engine stats per policy server across
the pools, and a plot of the ratios and hit rates against the pool size).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, TypeVar

from benchmarks.cli import command_line
from benchmarks.load.driver import RunResult
from benchmarks.load.metrics import RunMetrics
from benchmarks.load.users import outcome_from_json, outcome_to_json
from sgl_kvevict.measure.intervals import wilson
from sgl_kvevict.measure.results import write_result_files, environment, pyplot as _pyplot
from sgl_kvevict.measure.servers import ServerVariant

Run = TypeVar("Run")
# How a speed table's three ratios read.
ATTRIBUTION = (
    "`full` is the plugin's path with nothing evicted, in the policy's scope: policy / full is what eviction buys "
    "(capacity, hits, fewer keys), full / vanilla what the path costs, and policy / vanilla is their product."
)
# What a speed table says where a run served no ``full`` in a policy's scope (older result files).
FULL_NOT_SERVED = "full: not in this run"


def attribution_note(full_served: bool) -> str:
    """What a speed table's ratios attribute (``ATTRIBUTION``), or that its run served no ``full``."""
    if full_served:
        return ATTRIBUTION
    return (
        "`full` (the plugin's path with nothing evicted) is not in this run, which predates it: only policy / "
        "vanilla is shown, not split into what eviction buys (policy / full) and what the path costs (full / vanilla)."
    )


def write_report(out: Path, name: str, report: dict, text: str, log) -> None:
    """``<name>.json`` (every sample) and ``<name>.md`` (``text``) into ``out``."""
    paths = write_result_files(out, name, report, text)
    log(f"wrote {paths[0]}, {name}.md")


def run_meta(module: str, argv: Optional[Sequence[str]], **fields) -> dict:
    """What a result file records of its run: ``fields``, the command as typed (``argv``, None: this
    process's) and the machine."""
    command = command_line(module, sys.argv[1:] if argv is None else argv)
    return {**fields, "command": command, "environment": environment()}


def runs_writer(
    out: Path, name: str, meta: dict, plot: Callable[[list, Path], None], markdown: Callable[[dict], str],
    extra: Callable[[list], dict] = lambda runs: {},
) -> Callable[[list], None]:  # fmt: skip
    """Writes ``<name>.json`` (``meta``, the runs, ``extra`` of them), ``.md`` and ``.png`` into ``out``:
    called after every server, so a stopped benchmark keeps what finished."""

    def write(runs: list) -> None:
        out.mkdir(parents=True, exist_ok=True)
        plot(runs, out / f"{name}.png")
        payload = {"meta": meta, "runs": runs, **extra(runs), "plot": f"{name}.png"}
        write_report(out, name, payload, markdown(payload), print)

    return write


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


def result_from_json(run: dict) -> RunResult:
    variant = ServerVariant.from_json(run["variant"])
    outcome = outcome_from_json(run) if "records" in run else None
    return RunResult(
        run["pool"], run["pool_tokens"], variant, outcome, run["error"], run["startup_seconds"], tuple(run["load_average"])
    )


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """``numerator / denominator``; None where either is missing or the denominator is 0."""
    return numerator / denominator if numerator is not None and denominator else None


def ratios_of(this: Mapping, base: Mapping, fields: Iterable[str]) -> dict[str, Optional[float]]:
    """``this / base`` of each of ``fields`` (``ratio``)."""
    return {name: ratio(this.get(name), base.get(name)) for name in fields}


def attribution_pairs(
    runs: Sequence[Run], variant_of: Callable[[Run], ServerVariant], stock_of: Callable[[Run], Optional[Run]],
    full_of: Callable[[Run], Optional[Run]],
) -> list[tuple[str, Run, Run]]:  # fmt: skip
    """The comparisons of a speed result, each ``("<server> / <baseline>", run, baseline run)``: every
    finished ``runs`` server but stock against stock (``stock_of``), and every policy server against
    ``full`` in its scope (``full_of``): policy / stock = policy / full (what eviction buys: capacity,
    hits, fewer keys) x full / stock (what the plugin's path costs). A baseline that is None (failed,
    or not served in this run) gives no comparison."""
    pairs = []
    for run in runs:
        variant = variant_of(run)
        bases = [] if variant.is_vanilla else [stock_of(run)] if variant.is_full else [stock_of(run), full_of(run)]
        pairs += [(f"{variant.label} / {variant_of(base).label}", run, base) for base in bases if base is not None]
    return pairs


def _ratio_row(rows: Sequence[dict], comparison: str, pool_tokens: int) -> Optional[dict]:
    """The row of ``rows`` (``ratios``, as a result file holds them) comparing ``comparison`` at ``pool_tokens``."""
    return next((r for r in rows if r["comparison"] == comparison and r["pool_tokens"] == pool_tokens), None)


def versus_stock(rows: Sequence[dict], run: dict) -> dict:
    """The ratio row of ``run`` (as a result file holds it) against vanilla at its pool; {} for vanilla."""
    return _ratio_row(rows, f"{run['label']} / vanilla", run["pool_tokens"]) or {}


# The sweep tables' ratios against full: (ratio row field, what it is).
VERSUS_FULL = (("output_tokens_per_second", "tok/s"), ("ttft_p50", "TTFT p50"), ("hit_rate", "hit rate"))


def versus_full_column() -> str:
    return "vs full: " + " / ".join(name for _, name in VERSUS_FULL)


def versus_full(rows: Sequence[dict], runs: Sequence[dict], run: dict) -> str:
    """A policy run's ``VERSUS_FULL`` fields of its ratio row against ``full`` in its scope and pool (``a / b / c``), or
    why there is none: ``-`` for stock and ``full`` themselves. ``rows`` and ``runs`` as a result file
    holds them (``comparison``, ``pool_tokens``; ``label``, ``variant``)."""
    variant = ServerVariant.from_json(run["variant"])
    if variant.is_vanilla or variant.is_full:
        return "-"
    full = variant.full_counterpart.label
    row = _ratio_row(rows, f"{variant.label} / {full}", run["pool_tokens"])
    if row is not None:
        return " / ".join(_fmt(row[name]) for name, _ in VERSUS_FULL)
    served = any(r["label"] == full and r["pool_tokens"] == run["pool_tokens"] for r in runs)
    return f"{full}: failed" if served else FULL_NOT_SERVED


def ratios(results: Sequence[RunResult]) -> list[dict]:
    """Each policy run against vanilla and against ``full`` in its scope at the same pool, ``full``
    against vanilla (``attribution_pairs``), and vanilla at each smaller pool against vanilla at the
    largest (what eviction costs the stock server)."""
    done = [r for r in results if r.outcome]
    vanilla = {r.pool_tokens: r for r in done if r.variant.is_vanilla}
    by_server = {(r.pool_tokens, r.variant): r for r in done}
    pairs = attribution_pairs(
        done, lambda r: r.variant, lambda r: vanilla.get(r.pool_tokens),
        lambda r: by_server.get((r.pool_tokens, r.variant.full_counterpart)),
    )  # fmt: skip
    if vanilla:
        largest = vanilla[max(vanilla)]
        pairs += [(f"vanilla {r.pool} / vanilla {largest.pool}", r, largest) for r in vanilla.values() if r is not largest]
    rows = []
    for name, this, base in pairs:
        a, b = this.outcome.metrics, base.outcome.metrics
        flips = sum(
            1
            for x, y in zip(this.outcome.records, base.outcome.records)
            if x.expected is not None and x.correct is not None and y.correct is not None and x.correct != y.correct
        )
        rows.append(
            {
                "comparison": name,
                "pool": this.pool,
                "pool_tokens": this.pool_tokens,
                "requests_per_second": ratio(a.requests_per_second, b.requests_per_second),
                "output_tokens_per_second": ratio(a.output_tokens_per_second, b.output_tokens_per_second),
                "hit_rate": ratio(a.hit_rate, b.hit_rate),
                "ttft_p50": ratio(a.ttft["p50"], b.ttft["p50"]),
                "ttft_p90": ratio(a.ttft["p90"], b.ttft["p90"]),
                "latency_p50": ratio(a.latency["p50"], b.latency["p50"]),
                "prompt_tokens_recomputed": ratio(a.prompt_tokens_recomputed, b.prompt_tokens_recomputed),
                "accuracy": a.accuracy,
                "baseline_accuracy": b.accuracy,
                "fact_answers_flipped": flips,
            }
        )
    return rows


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def facts(m: RunMetrics) -> str:
    """``9/16 (56% [33, 77])``: fact answers correct with the 95% Wilson interval."""
    if not m.fact_questions:
        return "-"
    return f"{m.fact_correct}/{m.fact_questions} ({wilson(m.fact_correct, m.fact_questions).percent()})"


def _header(payload: dict) -> list[str]:
    env, meta = payload["environment"], payload["meta"]
    c = meta["conversations"]
    system = f", a shared ~{c['system_prompt_tokens']}-token system prompt first" if c.get("system_prompt_tokens") else ""
    return [
        f"`{meta['command']}`",
        "",
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, no GPU (CPU development mode). SGLang {env['sglang']}, "
        f"torch {env['torch']}, sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, "
        f"{env['date']}. Model `{meta['model']}`.",
        "",
        f"Workload: {c['users']} concurrent users x {c['turns']} turns, "
        f"{'one shared document' if c['shared_document'] else 'one document per user'} of ~{c['document_tokens']} tokens"
        f"{system}, answers up to {meta['load']['max_tokens']} tokens (greedy), a fact question every {c['fact_every']} "
        f"turn(s), seed {c['seed']}. All final histories together: ~{meta['workload']['all_histories']} tokens (longest "
        f"~{meta['workload']['longest_history']}; estimates with every answer at full length). Every server of a pool "
        "gets the same `--max-total-tokens`: a policy server keeps its compressed cells in that same pool.",
    ]


def _ratio_table(rows: Sequence[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "Ratios (first / second; throughput and hit rate: higher is better, TTFT and recomputed tokens: lower is "
        f"better). {ATTRIBUTION} Flipped = fact answers scored differently from the baseline's answer to the same "
        "question.",
        "",
        "| comparison | pool | output tok/s | req/s | hit rate | TTFT p50 | TTFT p90 | latency p50 | recomputed tokens "
        "| accuracy (vs baseline) | flipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['comparison']} | {row['pool']} ({row['pool_tokens']}) | {_fmt(row['output_tokens_per_second'])} "
            f"| {_fmt(row['requests_per_second'])} | {_fmt(row['hit_rate'])} | {_fmt(row['ttft_p50'])} "
            f"| {_fmt(row['ttft_p90'])} | {_fmt(row['latency_p50'])} | {_fmt(row['prompt_tokens_recomputed'])} "
            f"| {_fmt(row['accuracy'])} ({_fmt(row['baseline_accuracy'])}) | {row['fact_answers_flipped']} |"
        )
    return lines


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


def _stats_tables(results: Sequence[RunResult]) -> list[str]:
    """Per policy variant, every numeric ``/kvevict/stats`` field: last value (peak during the run), one
    column per pool. The engine's fields are shown as it reports them."""
    lines = []
    variants = list(dict.fromkeys(r.variant.label for r in results if r.outcome and r.outcome.stats.available))
    for label in variants:
        runs = [r for r in results if r.variant.label == label and r.outcome and r.outcome.stats.available]
        names = list(dict.fromkeys(name for r in runs for name in r.outcome.stats.last_numbers()))
        if not names:
            continue
        lines += ["", f"Engine stats of {label} (`GET /kvevict/stats`: after the run, peak during it in brackets):", ""]
        lines.append("| field | " + " | ".join(f"{r.pool} ({r.pool_tokens})" for r in runs) + " |")
        lines.append("|---|" + "---|" * len(runs))
        for name in names:
            cells = []
            for r in runs:
                last, peak = r.outcome.stats.last_numbers().get(name), r.outcome.stats.peaks.get(name)
                cells.append("-" if last is None else _number(last) + ("" if peak in (None, last) else f" ({_number(peak)})"))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


READING = (
    "Reading it: hit rate = cached prompt tokens / prompt tokens (`usage.prompt_tokens_details.cached_tokens`). "
    "KV pool = the `--max-total-tokens` every server of a pool gets; SGLang's token slots = what its "
    "`/server_info` reports. Engine stats come from `GET /kvevict/stats`, sampled twice a second (vanilla has none). "
    "Greedy answers are not bit-identical across runs on this CPU (batch composition changes bf16 numerics), so a "
    "couple of flipped fact answers is noise: compare the Wilson intervals. The load average before each run is in "
    "the JSON."
)


def compare_markdown(payload: dict, results: Sequence[RunResult]) -> str:
    lines = ["# Multi-turn serving benchmark: vanilla SGLang vs KV eviction at equal KV memory", "", *_header(payload)]
    lines += [
        "",
        "| pool | server | KV pool (tokens) | SGLang token slots | req/s | output tok/s | TTFT p50 / p90 / p99 (s) "
        "| latency p50 / p90 / p99 (s) | hit rate | prompt tokens recomputed | facts correct [95% CI] | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.outcome is None:
            lines.append(f"| {r.pool} | {r.variant.label} | {r.pool_tokens} | failed: {r.error.splitlines()[0]} |" + " |" * 8)
            continue
        m = r.outcome.metrics
        ttft = " / ".join(_fmt(m.ttft[k]) for k in ("p50", "p90", "p99"))
        latency = " / ".join(_fmt(m.latency[k]) for k in ("p50", "p90", "p99"))
        lines.append(
            f"| {r.pool} | {r.variant.label} | {r.pool_tokens} | {r.outcome.dense_slots or '?'} | {m.requests_per_second:.3f} "
            f"| {m.output_tokens_per_second:.2f} | {ttft} | {latency} | {_fmt(m.hit_rate)} | {m.prompt_tokens_recomputed} "
            f"| {facts(m)} | {m.failed_requests} |"
        )
    lines += _ratio_table(payload["ratios"]) + _stats_tables(results) + ["", READING]
    return "\n".join(lines) + "\n"


def sweep_markdown(payload: dict, results: Sequence[RunResult]) -> str:
    meta = payload["meta"]
    lines = ["# Pool-size sweep: vanilla SGLang vs KV eviction at several KV pool sizes", "", *_header(payload)]
    lines += [
        "",
        "Pools (`--max-total-tokens`, as a fraction of all final histories): "
        + ", ".join(f"{p['name']} = {p['tokens']}" for p in meta["pools"])
        + ".",
        "",
        "| pool | server | output tok/s | req/s | TTFT p50 / p90 (s) | hit rate | facts correct [95% CI] "
        f"| tok/s vs vanilla | req/s vs vanilla | TTFT p50 vs vanilla | hit rate vs vanilla | {versus_full_column()} | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, run in zip(results, payload["runs"]):
        if r.outcome is None:
            lines.append(f"| {r.pool} ({r.pool_tokens}) | {r.variant.label} | failed: {r.error.splitlines()[0]} |" + " |" * 10)
            continue
        m, row = r.outcome.metrics, versus_stock(payload["ratios"], run)
        lines.append(
            f"| {r.pool} ({r.pool_tokens}) | {r.variant.label} | {m.output_tokens_per_second:.2f} | {m.requests_per_second:.3f} "
            f"| {_fmt(m.ttft['p50'])} / {_fmt(m.ttft['p90'])} | {_fmt(m.hit_rate)} | {facts(m)} "
            f"| {_fmt(row.get('output_tokens_per_second'))} | {_fmt(row.get('requests_per_second'))} "
            f"| {_fmt(row.get('ttft_p50'))} | {_fmt(row.get('hit_rate'))} | {versus_full(payload['ratios'], payload['runs'], run)} "
            f"| {m.failed_requests} |"
        )
    lines += _ratio_table(payload["ratios"]) + _stats_tables(results)
    lines += ["", "![pool-size sweep](" + meta["name"] + ".png)", "", READING]
    return "\n".join(lines) + "\n"


def compare_plot(results: Sequence[RunResult], path: Path) -> None:
    """Four panels: output tokens/s, TTFT p50, fact accuracy (bars per pool and server), and the hit
    rate per turn (one line per run: a tight pool shows histories falling out of the cache)."""
    plt = _pyplot()
    done = [r for r in results if r.outcome is not None]
    labels = [f"{r.variant.label}\n{r.pool}" for r in done]
    colours = [server_colour(r.variant) for r in done]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    bars = [
        (axes[0][0], [r.outcome.metrics.output_tokens_per_second for r in done], "output tokens / s (higher is better)"),
        (axes[0][1], [r.outcome.metrics.ttft["p50"] or 0 for r in done], "TTFT p50, s (lower is better)"),
    ]
    for axis, values, title in bars:
        axis.bar(range(len(done)), values, color=colours)
        axis.set_xticks(range(len(done)), labels, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    _accuracy_bars(axes[1][0], done, labels, colours)
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
    titled_with_legend(axis, "prefix-cache hit rate by turn")
    save_figure(plt, fig, path)


def _accuracy_bars(axis, done: Sequence[RunResult], labels: Sequence[str], colours: Sequence[str]) -> None:
    values, low, high = [], [], []
    for r in done:
        m = r.outcome.metrics
        interval = wilson(m.fact_correct, m.fact_questions) if m.fact_questions else None
        value = 100 * interval.value if interval else 0.0
        values.append(value)
        low.append(value - 100 * interval.low if interval else 0.0)
        high.append(100 * interval.high - value if interval else 0.0)
    axis.bar(range(len(done)), values, color=colours, yerr=[low, high], capsize=3)
    axis.set_xticks(range(len(done)), labels, fontsize=8)
    axis.set_title("fact answers correct, % (95% Wilson interval)", fontsize=10)
    axis.set_ylim(0, 100)
    axis.grid(axis="y", alpha=0.3)


def sweep_plot(payload: dict, results: Sequence[RunResult], path: Path) -> None:
    """Against the pool size (fraction of all histories): output tok/s and TTFT p50 ratios to vanilla,
    the hit rate of every server, and fact accuracy with its interval."""
    plt = _pyplot()
    working_set = payload["meta"]["workload"]["all_histories"]
    done = [r for r in results if r.outcome is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    labels = list(dict.fromkeys(r.variant.label for r in done))
    for label in labels:
        runs = sorted((r for r in done if r.variant.label == label), key=lambda r: r.pool_tokens)
        x = [r.pool_tokens / working_set for r in runs]
        style = {"color": "tab:grey", "linestyle": "--"} if runs[0].variant.is_vanilla else {}
        axes[1][0].plot(x, [r.outcome.metrics.hit_rate or 0 for r in runs], marker="o", label=label, **style)
        m = [r.outcome.metrics for r in runs]
        intervals = [wilson(k.fact_correct, k.fact_questions) if k.fact_questions else None for k in m]
        y = [100 * i.value if i else float("nan") for i in intervals]
        axes[1][1].errorbar(
            x, y, yerr=[[v - 100 * i.low if i else 0 for v, i in zip(y, intervals)],
                        [100 * i.high - v if i else 0 for v, i in zip(y, intervals)]],
            marker="o", capsize=3, label=label, **style,
        )  # fmt: skip
    for label in labels:
        rows = sorted(
            (row for row in payload["ratios"] if row["comparison"] == f"{label} / vanilla"), key=lambda row: row["pool_tokens"]
        )
        if rows:
            x = [row["pool_tokens"] / working_set for row in rows]
            axes[0][0].plot(x, [row["output_tokens_per_second"] or float("nan") for row in rows], marker="o", label=label)
            axes[0][1].plot(x, [row["ttft_p50"] or float("nan") for row in rows], marker="o", label=label)
    titles = (
        (axes[0][0], "output tok/s, policy / vanilla (higher is better)"),
        (axes[0][1], "TTFT p50, policy / vanilla (lower is better)"),
        (axes[1][0], "prefix-cache hit rate"),
        (axes[1][1], "fact answers correct, % (95% Wilson interval)"),
    )
    for axis, title in titles:
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("KV pool / all histories")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a checkpoint before the first policy server has no ratios yet
            axis.legend(fontsize=8)
    for axis in (axes[0][0], axes[0][1]):
        axis.axhline(1.0, color="black", linewidth=0.8)
    axes[1][0].set_ylim(-0.03, 1.03)
    axes[1][1].set_ylim(-3, 103)
    save_figure(plt, fig, path)


def server_colour(variant: ServerVariant) -> str:
    """A server's bar colour: stock grey, ``full`` orange, a policy blue."""
    return "tab:grey" if variant.is_vanilla else "tab:orange" if variant.is_full else "tab:blue"


def titled_with_legend(axis, title: str) -> None:
    """A line plot's title, grid and legend, as every benchmark figure draws them."""
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def save_figure(plt, fig, path: Path) -> None:
    """Lay out, write (110 dpi) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heading(title: str, meta: dict) -> list[str]:
    """A report's first lines: ``# title`` and the command that wrote it."""
    return [f"# {title}", "", f"`{meta['command']}`", ""]


def provenance_heading(title: str, meta: dict) -> list[str]:
    """``# title`` and the ``provenance_line``."""
    return [f"# {title}", "", provenance_line(meta), ""]


def provenance_line(meta: dict) -> str:
    """Where a report's figures come from: its command, the machine, the commit and the date."""
    env = meta["environment"]
    return f"Command: `{meta['command']}`. {env['cpu_model']}, {env['cpu_cores']} cores, commit {env['git_commit']}, {env['date']}."


def write_comparison(results: Sequence[RunResult], meta: dict, out_dir: Path, name: str) -> list[Path]:
    """``<name>.json``, ``.md`` and ``.png`` in the layout of ``meta["kind"]`` (compare or sweep)."""
    payload = {
        "environment": environment(),
        "meta": {**meta, "name": name},
        "ratios": ratios(results),
        "runs": [result_to_json(r) for r in results],
    }
    if meta.get("kind") == "sweep":
        return write_result_files(out_dir, name, payload, sweep_markdown(payload, results), lambda path: sweep_plot(payload, results, path))
    return write_result_files(out_dir, name, payload, compare_markdown(payload, results), lambda path: compare_plot(results, path))


def load_comparison(path: Path) -> tuple[list[RunResult], dict]:
    """The runs and meta of a written comparison (to resume it)."""
    payload = json.loads(path.read_text())
    return [result_from_json(run) for run in payload["runs"]], payload["meta"]
