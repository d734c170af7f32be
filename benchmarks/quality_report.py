"""The quality grid's results (cells and samples), JSON, markdown and plot (``benchmarks/quality.py``
runs the grid; the data model lives here so that the report never imports the runner).

Every accuracy is reported with its sample count and 95% Wilson interval; the orderings section
claims ``A > B`` only where the two intervals separate (``sgl_kvevict/measure/intervals.py``), for each policy
against the full cache and for the policies against each other at the same length, mode, budget and
scope. The cost table splits the mean prefill per sample into the forward (the full cache's prefill
of the same sample), the score's extra work and planning.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from sgl_kvevict.measure.intervals import Proportion, ordering, wilson
from sgl_kvevict.measure.results import write_result_files

FULL = "full"
NOISE = "within noise"


@dataclass(frozen=True)
class CellKey:
    """One cell of the grid; ``block_size`` None is request scope (one segment)."""

    length: int
    mode: str
    policy: str
    budget: Optional[str]
    block_size: Optional[int] = None

    def label(self) -> str:
        budget = f"@{self.budget}" if self.budget else ""
        scope = "" if self.block_size is None else f" (block {self.block_size})"
        return f"{self.policy}{budget}{scope}"


@dataclass(frozen=True)
class SampleResult:
    """One sample of one cell. Times are CPU seconds of this process (``time.process_time``: on a shared
    machine other processes stretch wall time, not these): ``prefill`` until the compressed cache is
    ready (the forward(s), scoring and planning), of which ``plan`` is planning; ``decode`` the tokens."""

    kind: str
    depth: float
    answer: str
    output: str
    correct: bool
    prompt_tokens: int
    context_tokens: int
    kept_fraction: float
    prefill_seconds: float = 0.0
    plan_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass(frozen=True)
class CellResult:
    """A cell and the samples run so far (all of them once the run is complete)."""

    key: CellKey
    samples: tuple[SampleResult, ...]

    @property
    def correct(self) -> list[bool]:
        return [s.correct for s in self.samples]


@dataclass(frozen=True)
class CellSummary:
    """What the report shows of a cell. Costs are mean seconds per sample; ``None`` without timings
    (samples of runs before they were measured) or without the full cache's samples to subtract."""

    cell: CellResult
    accuracy: Proportion
    retained: Optional[float]  # accuracy on the samples the full cache answers
    kept_fraction: float
    forward_seconds: Optional[float]
    score_seconds: Optional[float]
    plan_seconds: Optional[float]
    decode_seconds: Optional[float]


def summarize_cell(cell: CellResult, full: Optional[CellResult]) -> CellSummary:
    samples = cell.samples
    pairs = list(zip(samples, full.samples)) if full is not None else []
    answerable = [s.correct for s, f in pairs if f.correct]
    timed = all(s.prefill_seconds > 0 for s in samples) and bool(pairs) and len(pairs) == len(samples)
    compressed = timed and cell.key.policy != FULL  # the full cache has no score or plan of its own
    return CellSummary(
        cell=cell,
        accuracy=wilson(sum(cell.correct), len(samples)),
        retained=sum(answerable) / len(answerable) if answerable else None,
        kept_fraction=statistics.fmean(s.kept_fraction for s in samples),
        forward_seconds=statistics.fmean(f.prefill_seconds for _, f in pairs) if timed else None,
        score_seconds=statistics.fmean(s.prefill_seconds - f.prefill_seconds - s.plan_seconds for s, f in pairs)
        if compressed
        else None,
        plan_seconds=statistics.fmean(s.plan_seconds for s in samples) if compressed else None,
        decode_seconds=statistics.fmean(s.decode_seconds for s in samples) if timed else None,
    )


def summaries(results: Sequence[CellResult]) -> list[CellSummary]:
    full = {(c.key.length, c.key.mode): c for c in results if c.key.policy == FULL}
    return [summarize_cell(c, full.get((c.key.length, c.key.mode))) for c in results]


def orderings(summaries_: Sequence[CellSummary]) -> list[dict]:
    """Each policy cell against the full cache of its (length, mode), and every pair of policy cells
    at the same (length, mode, budget, scope); the verdict is ``>``/``<`` or within noise."""
    by_key = {s.cell.key: s for s in summaries_}
    rows = []

    def add(kind: str, a: CellSummary, b: CellSummary) -> None:
        rows.append(
            {
                "kind": kind,
                "length": a.cell.key.length,
                "mode": a.cell.key.mode,
                "a": a.cell.key.label(),
                "b": b.cell.key.label(),
                "a_accuracy": a.accuracy.as_json(),
                "b_accuracy": b.accuracy.as_json(),
                "verdict": ordering(a.accuracy, b.accuracy) or NOISE,
            }
        )

    groups: dict[tuple, list[CellSummary]] = {}
    for summary in summaries_:
        key = summary.cell.key
        if key.policy == FULL:
            continue
        full = by_key.get(CellKey(key.length, key.mode, FULL, None))
        if full is not None:
            add("vs full", summary, full)
        if key.budget is not None:
            groups.setdefault((key.length, key.mode, key.budget, key.block_size), []).append(summary)
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                add("same budget", a, b)
    return rows


def cell_to_json(summary: CellSummary) -> dict:
    cell = summary.cell
    return {
        **asdict(cell.key),
        "accuracy": summary.accuracy.as_json(),
        "retained_accuracy": summary.retained,
        "kept_fraction": summary.kept_fraction,
        "mean_seconds": {
            "forward": summary.forward_seconds,
            "score": summary.score_seconds,
            "plan": summary.plan_seconds,
            "decode": summary.decode_seconds,
        },
        "samples": [asdict(sample) for sample in cell.samples],
    }


def cell_from_json(cell: dict) -> CellResult:
    """A cell of this report, or of a report written before keys and intervals (flat fields)."""
    key = CellKey(cell["length"], cell["mode"], cell["policy"], cell["budget"], cell.get("block_size"))
    return CellResult(key, tuple(SampleResult(**sample) for sample in cell["samples"]))


def load_report(payload: dict) -> tuple[list[CellResult], dict]:
    return [cell_from_json(cell) for cell in payload["cells"]], payload["meta"]


def write_outputs(results: Sequence[CellResult], meta: dict, out_dir: Path) -> None:
    cells = summaries(results)
    payload = {"meta": meta, "orderings": orderings(cells), "cells": [cell_to_json(s) for s in cells]}
    text = markdown_report(cells, payload["orderings"], meta)
    write_result_files(out_dir, "quality", payload, text, lambda path: plot(cells, meta["grid"]["modes"], meta["grid"]["lengths"], path))


# ---- markdown --------------------------------------------------------------------------------------


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _row_label(key: CellKey) -> list[str]:
    scope = "-" if key.policy == FULL else "request" if key.block_size is None else f"block {key.block_size}"
    return [key.policy, scope, key.budget or "-"]


def _rows(cells: Sequence[CellSummary], mode: str) -> dict[tuple, dict[int, CellSummary]]:
    rows: dict[tuple, dict[int, CellSummary]] = {}
    for summary in cells:
        key = summary.cell.key
        if key.mode == mode:
            rows.setdefault((key.policy, key.block_size, key.budget), {})[key.length] = summary
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _length_table(
    cells: Sequence[CellSummary], mode: str, lengths: Sequence[int], columns: Sequence[str],
    values: Callable[[CellSummary], list[str]],
) -> list[str]:  # fmt: skip
    """A row per policy, scope and budget of ``mode``; ``columns`` per length, their ``values`` of a cell
    (blank where a partial run has not reached it)."""
    header = ["policy", "scope", "budget"] + [f"{c} L={n}" for n in lengths for c in columns]
    rows = []
    for by_length in _rows(cells, mode).values():
        row = _row_label(next(iter(by_length.values())).cell.key)
        for length in lengths:
            s = by_length.get(length)
            row += [""] * len(columns) if s is None else values(s)
        rows.append(row)
    return _table(header, rows)


def _accuracy_table(cells: Sequence[CellSummary], mode: str, lengths: Sequence[int]) -> list[str]:
    return _length_table(
        cells, mode, lengths, ("acc [95% CI]", "n", "ret", "kept"),
        lambda s: [s.accuracy.percent(), str(s.accuracy.n), _percent(s.retained), f"{s.kept_fraction:.2f}"],
    )  # fmt: skip


def _cost_table(cells: Sequence[CellSummary], mode: str, lengths: Sequence[int]) -> list[str]:
    return _length_table(
        cells, mode, lengths, ("forward", "score", "plan", "decode"),
        lambda s: [_ms(s.forward_seconds), _ms(s.score_seconds), _ms(s.plan_seconds), _ms(s.decode_seconds)],
    )  # fmt: skip


def _ordering_lines(rows: Sequence[dict], lengths: Sequence[int], modes: Sequence[str]) -> list[str]:
    lines = []
    for mode in modes:
        for length in lengths:
            here = [r for r in rows if r["mode"] == mode and r["length"] == length]
            if not here:
                continue
            lines += ["", f"**L={length}, {mode}**", ""]
            vs_full = [r for r in here if r["kind"] == "vs full"]
            below = [r["a"] for r in vs_full if r["verdict"] == "<"]
            above = [r["a"] for r in vs_full if r["verdict"] == ">"]
            level = [r["a"] for r in vs_full if r["verdict"] == NOISE]
            lines.append(
                "* against the full cache: below it: " + (", ".join(below) or "none")
                + "; within noise of it: " + (", ".join(level) or "none")
                + (f"; above it: {', '.join(above)}" if above else "")
            )  # fmt: skip
            pairs = [r for r in here if r["kind"] == "same budget"]
            separated = [f"{r['a']} {r['verdict']} {r['b']}" for r in pairs if r["verdict"] != NOISE]
            if pairs:
                lines.append(
                    "* between policies at the same budget and scope: "
                    + (", ".join(separated) if separated else "no pair separates")
                    + f"; {len(pairs) - len(separated)} of {len(pairs)} pairs within noise"
                )
    return lines


def _reproducibility(numerics: dict) -> str:
    if not numerics:
        return "**Reproducibility.** This run predates the numerics record (`benchmarks/numerics.py`): its kernels are unknown."
    return (
        "**Reproducibility.** The greedy answers are a deterministic function of the inputs (tasks sha256 "
        f"`{numerics['tasks_sha256']}`) and of the CPU kernels torch dispatches to, which the logits of one fixed forward "
        f"fingerprint (probe sha256 `{numerics['probe_sha256']}`): {numerics['cpu_model']} (kernel flags "
        f"{', '.join(numerics['cpu_kernel_flags'])}), ATen {numerics['aten_cpu_capability']}, oneDNN {numerics['onednn']}, "
        f"torch {numerics['torch']}, transformers {numerics['transformers']}, {numerics['dtype']}, "
        f"{numerics['intra_op_threads']} intra-op thread(s), environment {numerics['env'] or 'unset'}. Measured on these "
        "machines: a rerun with the same command gives the same answers sample for sample with 1 or 2 threads, in any cell "
        "order, and with other processes loading both cores; capping the kernels' instruction set (ATen AVX2 instead of "
        "AVX512, or oneDNN without AVX512-BF16, as on a CPU that lacks it) changes the probe and flips answers of the full "
        "cache and of the policies. That is why a rerun elsewhere can disagree: compare probes first "
        "(`python -m benchmarks.quality_compare A.json B.json`). `quality_merge` and `--resume` refuse to mix probes."
    )


def markdown_report(cells: Sequence[CellSummary], ordering_rows: Sequence[dict], meta: dict) -> str:
    grid, numerics = meta["grid"], meta.get("numerics", {})
    lengths, modes = grid["lengths"], grid["modes"]
    lines = [
        "# Quality: synthetic retrieval on the reference engine",
        "",
        f"`{meta['command']}` — model `{Path(meta['model']).name}` ({grid['dtype']}), {grid['samples']} samples "
        f"per cell (kinds: {', '.join(grid['kinds'])}), seed {grid['seed']}, greedy, {grid['max_new_tokens']} new "
        f"tokens, {meta['threads']} thread(s), {meta['seconds'] / 60:.1f} min, {meta['date']}.",
        "",
        "acc = exact match of the answer in the output (%), with its 95% Wilson interval and sample count n; ret = "
        "accuracy on the samples the full cache answers (%); kept = mean kept fraction of the compressed segment "
        "measured from the plans (DBudgetKV picks its own). Mean prompt tokens per length: "
        + ", ".join(f"{length}: {meta['mean_prompt_tokens'][str(length)]:.0f}" for length in lengths)
        + ". With 20 samples an interval spans about ±20 points: most differences between policies here are "
        "within noise, and the orderings section lists only those the intervals support.",
    ]
    lines += ["", _reproducibility(numerics)]
    if meta["cells_done"] < meta["cells_total"]:
        lines += ["", f"**Partial run: {meta['cells_done']} of {meta['cells_total']} cells finished.**"]
    for mode in modes:
        lines += ["", f"## {mode}", "", *_accuracy_table(cells, mode, lengths)]
        lines += [
            "",
            f"Prefill cost per sample ({mode}, mean ms): forward = the full cache's prefill of the same sample; "
            "score = the policy's prefill minus that forward minus planning (window statistics, a reconstruction "
            "pass); plan = the allocator; decode = the greedy tokens. The machine is shared, so differences of a "
            "few percent of the forward are noise.",
            "",
            *_cost_table(cells, mode, lengths),
        ]
    lines += ["", "## Orderings (95% Wilson intervals)", ""]
    lines.append("`A > B` where A's interval lies wholly above B's; every other pair is within noise.")
    lines += _ordering_lines(ordering_rows, lengths, modes)
    lines += ["", "## Full cache by task kind", "", "| mode | length | " + " | ".join(grid["kinds"]) + " |"]
    lines.append("|" + "---|" * (2 + len(grid["kinds"])))
    for summary in cells:
        cell = summary.cell
        if cell.key.policy == FULL:
            per_kind = []
            for kind in grid["kinds"]:
                hits = [s.correct for s in cell.samples if s.kind == kind]
                per_kind.append(f"{sum(hits)}/{len(hits)}")
            lines.append(f"| {cell.key.mode} | {cell.key.length} | " + " | ".join(per_kind) + " |")
    return "\n".join(lines) + "\n"


# ---- plot ------------------------------------------------------------------------------------------


def plot(cells: Sequence[CellSummary], modes: Sequence[str], lengths: Sequence[int], path: Path) -> None:
    """Accuracy vs measured kept fraction, one panel per (mode, length), 95% Wilson error bars; the full
    cache is a dashed line with its interval shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(modes), len(lengths), figsize=(5.2 * len(lengths), 4.0 * len(modes)), squeeze=False, sharey=True
    )
    for row, mode in enumerate(modes):
        for col, length in enumerate(lengths):
            axis = axes[row][col]
            lines: dict[str, list[CellSummary]] = {}
            for summary in cells:
                key = summary.cell.key
                if key.mode == mode and key.length == length:
                    scope = "" if key.block_size is None else f" (block {key.block_size})"
                    lines.setdefault(key.policy + scope, []).append(summary)
            for name, members in lines.items():
                if name == FULL:
                    acc = members[0].accuracy
                    axis.axhline(100 * acc.value, color="black", linestyle="--", linewidth=1, label="full cache")
                    axis.axhspan(100 * acc.low, 100 * acc.high, color="black", alpha=0.08)
                    continue
                members = sorted(members, key=lambda s: s.kept_fraction)
                y = [100 * s.accuracy.value for s in members]
                axis.errorbar(
                    [s.kept_fraction for s in members],
                    y,
                    yerr=[
                        [v - 100 * s.accuracy.low for v, s in zip(y, members)],
                        [100 * s.accuracy.high - v for v, s in zip(y, members)],
                    ],
                    marker="o",
                    markersize=4,
                    capsize=3,
                    linewidth=1,
                    label=name,
                )
            axis.set_title(f"{mode}, L={length}", fontsize=10)
            axis.set_xlabel("kept fraction (measured)")
            axis.set_xlim(0, 1.02)
            axis.set_ylim(-3, 103)
            axis.grid(alpha=0.3)
        axes[row][0].set_ylabel("accuracy (%), 95% Wilson interval")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
