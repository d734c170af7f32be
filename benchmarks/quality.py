"""Quality benchmark: accuracy of eviction policies on synthetic retrieval tasks (reference engine).

Grid: policies x budgets x context lengths x modes (question-aware / context-only) x scopes, plus
the full cache. The scope is request scope (the compressed range is one segment) or block scope
(``--block-sizes 256``: the range is cut into full blocks of that many tokens aligned at position 0,
each with its own window inside the block, as a server in block scope compresses shared prefixes).
Each cell runs the same seeded tasks (``benchmarks/tasks.py``) through the HF reference engine
and scores exact match of the answer string in the greedy output. Reported per cell: accuracy,
retained accuracy (accuracy on the samples the full cache answers correctly: the loss due to
eviction alone), and the mean kept fraction measured from the compression plans.

    python -m benchmarks.quality --quick                      # a few minutes on a 2-core CPU
    python -m benchmarks.quality --policies snapkv,lava --budgets 0.5,0.25,0.1 --lengths 1000,2000
    python -m benchmarks.quality --modes context-only --block-sizes none,256   # request vs block scope

Writes ``quality.json``, ``quality.md`` and ``quality.png`` into ``--out`` (default docs/results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from benchmarks.tasks import TASK_KINDS, Task, task_suite
from sgl_kvevict.config import ConfigError, EvictionConfig, build_policy
from sgl_kvevict.policies import get_policy_class, registered_policies
from sgl_kvevict.reference import Mode, Prompt, ReferenceEngine

FULL = "full"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def policy_name(spec: str) -> str:
    """``"snapkv:obc-key"`` -> ``"snapkv"``: a grid policy is a name with an optional score variant."""
    return spec.partition(":")[0]


def eviction_config(spec: str, budget: Optional[str]) -> EvictionConfig:
    name, _, score = spec.partition(":")
    return EvictionConfig(policy=name, budget=budget, **({"score": score} if score else {}))


@dataclass(frozen=True)
class GridConfig:
    """What one benchmark run covers; validated before any model is loaded."""

    model: str
    dtype: str
    policies: tuple[str, ...]
    budgets: tuple[str, ...]
    lengths: tuple[int, ...]
    modes: tuple[Mode, ...]
    kinds: tuple[str, ...]
    samples: int
    seed: int
    max_new_tokens: int
    quick: bool
    block_sizes: tuple[Optional[int], ...] = (None,)  # None: request scope (one segment)

    def __post_init__(self):
        known = set(registered_policies())
        unknown = [p for p in self.policies if policy_name(p) not in known]
        if unknown:
            raise ConfigError(f"unknown policies {unknown}; registered: {', '.join(sorted(known))}")
        if FULL in self.policies:
            raise ConfigError("the full cache always runs as the reference row; do not list it in --policies")
        for policy in self.policies:
            for budget in self.budgets_of(policy):
                eviction_config(policy, budget)  # raises ConfigError with the reason
        bad_kinds = [k for k in self.kinds if k not in TASK_KINDS]
        if bad_kinds:
            raise ConfigError(f"unknown task kinds {bad_kinds}; valid: {', '.join(TASK_KINDS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.samples < 1 or self.max_new_tokens < 1 or any(length < 64 for length in self.lengths):
            raise ConfigError("samples and max-new-tokens must be >= 1 and every length >= 64 tokens")
        if not self.block_sizes or any(size is not None and size < 1 for size in self.block_sizes):
            raise ConfigError(f"block sizes {self.block_sizes} must be positive (or none for request scope)")

    def budgets_of(self, policy: str) -> tuple[Optional[str], ...]:
        """The budgets a policy runs at: the grid's, or ``(None,)`` for a policy that takes none."""
        return self.budgets if get_policy_class(policy_name(policy)).defaults.takes_budget else (None,)

    def cells(self) -> list[tuple[int, Mode, str, Optional[str], Optional[int]]]:
        """(length, mode, policy, budget, block size), full cache first (once) in each (length, mode)."""
        return [
            (length, mode, policy, budget, block_size)
            for length in self.lengths
            for mode in self.modes
            for policy, block_sizes in ((FULL, (None,)), *((p, self.block_sizes) for p in self.policies))
            for block_size in block_sizes
            for budget in self.budgets_of(policy)
        ]


@dataclass(frozen=True)
class SampleResult:
    kind: str
    depth: float
    answer: str
    output: str
    correct: bool
    prompt_tokens: int
    context_tokens: int
    kept_fraction: float


@dataclass(frozen=True)
class CellResult:
    policy: str
    budget: Optional[str]
    mode: str
    length: int
    accuracy: float
    retained_accuracy: Optional[float]  # None when the full cache got nothing right
    kept_fraction: float
    seconds: float
    samples: tuple[SampleResult, ...]
    block_size: Optional[int] = None  # None: request scope


def run_cell(
    engine: ReferenceEngine,
    tasks: Sequence[Task],
    prompts: Sequence[Prompt],
    policy_spec: str,
    budget: Optional[str],
    mode: Mode,
    length: int,
    max_new_tokens: int,
    full_correct: Optional[Sequence[bool]],
    block_size: Optional[int] = None,
) -> CellResult:
    policy = build_policy(eviction_config(policy_spec, budget))
    started = time.perf_counter()
    samples = []
    for task, prompt in zip(tasks, prompts):
        result = engine.generate(prompt, policy, mode, max_new_tokens, block_size)
        samples.append(
            SampleResult(
                kind=task.kind,
                depth=round(task.depth, 3),
                answer=task.answer,
                output=result.text,
                correct=task.is_correct(result.text),
                prompt_tokens=len(prompt),
                context_tokens=prompt.context_end,
                kept_fraction=result.kept_fraction(),
            )
        )
    correct = [s.correct for s in samples]
    reference = full_correct if full_correct is not None else correct
    answerable = [c for c, ok in zip(correct, reference) if ok]
    return CellResult(
        policy=policy_spec,
        budget=budget,
        mode=mode.value,
        length=length,
        accuracy=sum(correct) / len(correct),
        retained_accuracy=sum(answerable) / len(answerable) if answerable else None,
        kept_fraction=sum(s.kept_fraction for s in samples) / len(samples),
        seconds=time.perf_counter() - started,
        samples=tuple(samples),
        block_size=block_size,
    )


def run_grid(
    grid: GridConfig, log=print, checkpoint: Optional[Callable[[list[CellResult], dict], None]] = None
) -> tuple[list[CellResult], dict]:
    """Run every cell; ``checkpoint(results_so_far, meta)`` after each one, so a long run that is cut
    short still leaves its finished cells on disk (``meta["cells_done"] < meta["cells_total"]``)."""
    torch.manual_seed(grid.seed)
    engine = ReferenceEngine(grid.model, dtype=DTYPES[grid.dtype])

    def count_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    suites: dict[int, tuple[list[Task], list[Prompt]]] = {}
    for length in grid.lengths:
        tasks = task_suite(grid.seed, grid.samples, length, count_tokens, kinds=grid.kinds)
        suites[length] = (tasks, [engine.chat_prompt(t.context, t.question, t.answer_prefix) for t in tasks])

    cells = grid.cells()
    results: list[CellResult] = []
    full_correct: dict[tuple[int, Mode], list[bool]] = {}
    started = time.perf_counter()
    for index, (length, mode, policy, budget, block_size) in enumerate(cells, 1):
        tasks, prompts = suites[length]
        cell = run_cell(
            engine, tasks, prompts, policy, budget, mode, length, grid.max_new_tokens, full_correct.get((length, mode)),
            block_size,
        )  # fmt: skip
        if policy == FULL:
            full_correct[(length, mode)] = [s.correct for s in cell.samples]
        results.append(cell)
        elapsed = time.perf_counter() - started
        eta = elapsed / index * (len(cells) - index)
        log(
            f"[{index}/{len(cells)}] {policy:<14} budget={budget or '-':<5} {mode.value:<14} "
            f"scope={_scope(block_size):<10} L={length:<5} "
            f"acc={cell.accuracy:.2f} kept={cell.kept_fraction:.3f} ({cell.seconds:.0f} s; "
            f"elapsed {_duration(elapsed)}, ETA {_duration(eta)})",
            flush=True,
        )
        if checkpoint is not None:
            checkpoint(results, run_meta(grid, engine, suites, started, len(results), len(cells)))
    return results, run_meta(grid, engine, suites, started, len(results), len(cells))


def run_meta(grid: GridConfig, engine: ReferenceEngine, suites: dict, started: float, done: int, total: int) -> dict:
    return {
        "command": "python -m benchmarks.quality " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "model": str(engine.model_dir),
        "grid": {**asdict(grid), "modes": [m.value for m in grid.modes]},
        "mean_prompt_tokens": {
            str(length): sum(len(p) for p in prompts) / len(prompts) for length, (_, prompts) in suites.items()
        },
        "seconds": round(time.perf_counter() - started, 1),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cells_done": done,
        "cells_total": total,
    }


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def _scope(block_size: Optional[int]) -> str:
    return "request" if block_size is None else f"block {block_size}"


def _row_label(cell: CellResult) -> tuple[str, str, str]:
    return cell.policy, "-" if cell.policy == FULL else _scope(cell.block_size), cell.budget or "-"


def markdown_report(results: Sequence[CellResult], meta: dict) -> str:
    grid = meta["grid"]
    lengths = grid["lengths"]
    lines = [
        "# Quality: synthetic retrieval on the reference engine",
        "",
        f"`{meta['command']}` — model `{Path(meta['model']).name}` ({grid['dtype']}), {grid['samples']} samples "
        f"per cell (kinds: {', '.join(grid['kinds'])}), seed {grid['seed']}, greedy, {grid['max_new_tokens']} new "
        f"tokens, {meta['threads']} thread(s), {meta['seconds'] / 60:.1f} min, {meta['date']}.",
        "",
        "acc = exact match of the answer in the output (%); ret = accuracy on the samples the full cache answers "
        "(%); kept = mean kept fraction of the compressed segment measured from the plans (DBudgetKV picks its "
        "own). Mean prompt tokens per length: "
        + ", ".join(f"{length}: {meta['mean_prompt_tokens'][str(length)]:.0f}" for length in lengths)
        + ".",
    ]
    if meta["cells_done"] < meta["cells_total"]:
        lines += ["", f"**Partial run: {meta['cells_done']} of {meta['cells_total']} cells finished.**"]
    for mode in grid["modes"]:
        columns = [f"{name} L={length}" for length in lengths for name in ("acc", "ret", "kept")]
        header = ["policy", "scope", "budget", *columns]
        lines += ["", f"## {mode}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        by_row: dict[tuple[str, str, str], dict[int, CellResult]] = {}
        for cell in results:
            if cell.mode == mode:
                by_row.setdefault(_row_label(cell), {})[cell.length] = cell
        for label, by_length in by_row.items():
            values = []
            for length in lengths:
                cell = by_length.get(length)  # missing while a partial run has not reached it
                if cell is None:
                    values += ["", "", ""]
                    continue
                values += [_percent(cell.accuracy), _percent(cell.retained_accuracy), f"{cell.kept_fraction:.2f}"]
            lines.append("| " + " | ".join([*label, *values]) + " |")
    lines += ["", "## Full cache by task kind", "", "| mode | length | " + " | ".join(grid["kinds"]) + " |"]
    lines.append("|" + "---|" * (2 + len(grid["kinds"])))
    for cell in results:
        if cell.policy == FULL:
            per_kind = []
            for kind in grid["kinds"]:
                hits = [s.correct for s in cell.samples if s.kind == kind]
                per_kind.append(f"{sum(hits)}/{len(hits)}")
            lines.append(f"| {cell.mode} | {cell.length} | " + " | ".join(per_kind) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[CellResult], modes: Sequence[str], path: Path) -> None:
    """Accuracy vs measured kept fraction per policy (averaged over lengths), one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False, sharey=True)
    for axis, mode in zip(axes[0], modes):
        points: dict[str, dict[str, list[CellResult]]] = {}
        for cell in results:
            if cell.mode == mode:
                line = cell.policy if cell.block_size is None else f"{cell.policy} ({_scope(cell.block_size)})"
                points.setdefault(line, {}).setdefault(cell.budget or "-", []).append(cell)
        for policy, by_budget in points.items():
            xy = sorted(
                (
                    sum(c.kept_fraction for c in cells) / len(cells),
                    100 * sum(c.accuracy for c in cells) / len(cells),
                )
                for cells in by_budget.values()
            )
            if policy == FULL:
                axis.axhline(xy[0][1], color="black", linestyle="--", linewidth=1, label="full cache")
            else:
                axis.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=policy)
        axis.set_title(mode)
        axis.set_xlabel("kept fraction (measured)")
        axis.set_xlim(0, 1.02)
        axis.set_ylim(-3, 103)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: Sequence[CellResult], meta: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "cells": [asdict(cell) for cell in results]}
    (out_dir / "quality.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out_dir / "quality.md").write_text(markdown_report(results, meta))
    plot(results, meta["grid"]["modes"], out_dir / "quality.png")


QUICK_DEFAULTS = {
    "policies": "streaming,snapkv",
    "budgets": "0.5,0.25",
    "lengths": "1000",
    "samples": 6,
    "kinds": "passkey,multikey,fact",
}
FULL_DEFAULTS = {
    "policies": None,  # every registered policy
    "budgets": "0.5,0.25,0.1",
    "lengths": "1000,2000",
    "samples": 20,
    "kinds": ",".join(TASK_KINDS),
}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[GridConfig, Path, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small grid, a few minutes: " + str(QUICK_DEFAULTS))
    parser.add_argument(
        "--policies",
        help="comma-separated policy names, each optionally with an OBCache score as name:score "
        "(e.g. snapkv:obc-key); default: all registered; quick: streaming,snapkv",
    )
    parser.add_argument("--budgets", help="comma-separated, e.g. 0.5,0.25 or 128t (default 0.5,0.25,0.1)")
    parser.add_argument("--lengths", help="comma-separated target context lengths in tokens (default 1000,2000)")
    parser.add_argument("--modes", default="question-aware,context-only")
    parser.add_argument(
        "--block-sizes",
        default="none",
        help="comma-separated scopes of the compressed range: none (request scope, one segment) or a block "
        "size in tokens (block scope, the reference's block_size); e.g. none,256 (default none)",
    )
    parser.add_argument("--kinds", help=f"task kinds (default all: {','.join(TASK_KINDS)})")
    parser.add_argument("--samples", type=int, help="samples per cell (default 20; quick 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a HF model folder")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    policies = args.policies or defaults["policies"]
    try:
        grid = GridConfig(
            model=args.model,
            dtype=args.dtype,
            policies=_csv(policies) if policies else tuple(p for p in registered_policies() if p != FULL),
            budgets=_csv(args.budgets or defaults["budgets"]),
            lengths=tuple(int(x) for x in _csv(args.lengths or defaults["lengths"])),
            modes=tuple(Mode(m) for m in _csv(args.modes)),
            kinds=_csv(args.kinds or defaults["kinds"]),
            samples=args.samples or defaults["samples"],
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            quick=args.quick,
            block_sizes=tuple(None if size == "none" else int(size) for size in _csv(args.block_sizes)),
        )
    except (ConfigError, ValueError) as error:
        parser.error(str(error))
    return grid, args.out, args.threads


def main(argv: Optional[Sequence[str]] = None) -> None:
    grid, out_dir, threads = parse_args(argv)
    torch.set_num_threads(threads)
    results, meta = run_grid(grid, checkpoint=lambda partial, meta: write_outputs(partial, meta, out_dir))
    write_outputs(results, meta, out_dir)
    print(f"wrote {out_dir / 'quality.json'}, quality.md, quality.png")


if __name__ == "__main__":
    main()
