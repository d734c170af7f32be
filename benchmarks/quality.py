"""Quality benchmark: accuracy of eviction policies on synthetic retrieval tasks (reference engine).

Grid: policies x budgets x context lengths x modes (question-aware / context-only) x scopes, plus
the full cache. The scope is request scope (the compressed range is one segment) or block scope
(``--block-sizes 256``: the range is cut into full blocks of that many tokens aligned at position 0,
each with its own window inside the block, as a server in block scope compresses shared prefixes).
Each cell runs the same seeded tasks (``sgl_kvevict/measure/tasks.py``) through the HF reference engine
and scores exact match of the answer string in the greedy output. A policy is ``name[:score]``
(``snapkv``, ``snapkv:obc-key``, ``topk:kvzip``, ``lava:learned``).

Reported per cell (``quality_report.py``): accuracy with its sample count and 95% Wilson interval,
retained accuracy (on the samples the full cache answers), the kept fraction measured from the plans,
and the mean prefill cost per sample split into the forward (the full cache's prefill of the same
sample), the score's extra work (the policy's prefill minus that forward minus planning: window
statistics, KVzip's reconstruction pass, ...) and planning; plus the orderings the intervals support.

Runs are sample-major: for each length and mode, one sample at a time runs every cell of the grid
(the full cache first), so every cell of a sample shares its moment on a shared machine, and the cells
that can share a prefill (same schedule and score) are grouped for an engine that prefills once for
several policies. After each sample the partial result is written (atomically); ``--resume`` carries
on from it after an interruption, refusing a file of another grid or of other numerics.

Reproducibility: greedy bf16 answers depend on which CPU kernels run (``benchmarks/numerics.py``):
the JSON records the threads, dtype, versions, CPU kernel flags and a hash of one forward's logits.
Two runs with the same command and the same probe give the same answers, sample for sample, whatever
else runs on the machine (``python -m benchmarks.quality_merge --compare A.json B.json`` checks it).

    python -m benchmarks.quality --quick                      # a few minutes on a 2-core CPU
    python -m benchmarks.quality --policies snapkv,lava --budgets 0.5,0.25,0.1 --lengths 1000,2000
    python -m benchmarks.quality --modes context-only --block-sizes none,256   # request vs block scope
    python -m benchmarks.quality ... --out /tmp/q --resume                      # continue a cut-short run

Writes ``quality.json``, ``quality.md`` and ``quality.png`` into ``--out`` (default docs/results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from benchmarks.cli import RESULTS_DIR, benchmark_parser
from benchmarks.numerics import numerics_environment, numerics_probe, tasks_fingerprint
from benchmarks.quality_report import FULL, CellKey, CellResult, SampleResult, load_report, write_outputs
from sgl_kvevict.config import ConfigError, EvictionConfig, build_policy
from sgl_kvevict.measure.tasks import RULER_KINDS, TASK_KINDS, Task, task_suite
from sgl_kvevict.policies import Policy, get_policy_class, registered_policies
from sgl_kvevict.reference import Mode, Prompt, ReferenceEngine

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

    def cells_of(self, length: int, mode: Mode) -> list[CellKey]:
        """The cells of one (length, mode), the full cache first: the order a sample runs them in."""
        return [CellKey(length, mode.value, FULL, None)] + [
            CellKey(length, mode.value, policy, budget, block_size)
            for policy in self.policies
            for block_size in self.block_sizes
            for budget in self.budgets_of(policy)
        ]

    def cells(self) -> list[CellKey]:
        return [cell for length in self.lengths for mode in self.modes for cell in self.cells_of(length, mode)]

    def as_json(self) -> dict:
        """The grid as its JSON reads back (lists, mode names), so a checkpoint's grid compares equal."""
        return json.loads(json.dumps({**asdict(self), "modes": [m.value for m in self.modes]}))


class _TimedPolicy:
    """A policy whose compressors' ``plan()`` calls are timed; everything else is the policy's own."""

    def __init__(self, policy: Policy):
        self._policy = policy
        self.plan_seconds = 0.0

    def __getattr__(self, name: str):
        return getattr(self._policy, name)

    def start(self, spec):
        return _TimedCompressor(self._policy.start(spec), self)


class _TimedCompressor:
    def __init__(self, compressor, owner: _TimedPolicy):
        self._compressor, self._owner = compressor, owner

    def __getattr__(self, name: str):
        return getattr(self._compressor, name)

    def plan(self):
        started = time.process_time()
        try:
            return self._compressor.plan()
        finally:
            self._owner.plan_seconds += time.process_time() - started


class ForwardClock:
    """The CPU time at the start of every forward of ``model`` (a forward pre-hook). A greedy generation
    ends with one single-token forward per output token after the first, so the start of the first of
    those splits its time into the prefill (forwards, scoring, planning) and the decode."""

    def __init__(self, model: torch.nn.Module):
        self.starts: list[float] = []
        self._handle = model.register_forward_pre_hook(lambda module, args: self.starts.append(time.process_time()))

    def close(self) -> None:
        self._handle.remove()


def run_sample(
    engine: ReferenceEngine,
    clock: ForwardClock,
    task: Task,
    prompt: Prompt,
    cell: CellKey,
    policy: Policy,
    max_new_tokens: int,
) -> SampleResult:
    timed = _TimedPolicy(policy)
    clock.starts.clear()
    started = time.process_time()
    result = engine.generate(prompt, timed, Mode(cell.mode), max_new_tokens, cell.block_size)
    ended = time.process_time()
    decode_forwards = len(result.output_ids) - 1
    prefill_end = clock.starts[-decode_forwards] if decode_forwards else ended
    return SampleResult(
        kind=task.kind,
        depth=round(task.depth, 3),
        answer=task.answer,
        output=result.text,
        correct=task.is_correct(result.text),
        prompt_tokens=len(prompt),
        context_tokens=prompt.context_end,
        kept_fraction=result.kept_fraction(),
        prefill_seconds=prefill_end - started,
        plan_seconds=timed.plan_seconds,
        decode_seconds=ended - prefill_end,
    )


def prefill_groups(cells: Sequence[CellKey]) -> list[list[CellKey]]:
    """Cells whose prefill is the same computation: the same schedule (mode, scope) and the same score
    (the forward, its window statistics or KVzip's reconstruction). An engine that prefills once for
    several policies runs a group together; one that cannot runs its cells one after another."""
    groups: dict[tuple, list[CellKey]] = {}
    for cell in cells:
        score = None if cell.policy == FULL else eviction_config(cell.policy, cell.budget).score
        groups.setdefault((cell.mode, cell.block_size, cell.policy == FULL, score), []).append(cell)
    return list(groups.values())


@dataclass
class GridProgress:
    """Samples done per cell, for checkpoints and the ETA (resumed samples are not timed)."""

    grid: GridConfig
    samples: dict[CellKey, list[SampleResult]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    units_done_here: int = 0

    def results(self) -> list[CellResult]:
        return [CellResult(cell, tuple(self.samples[cell])) for cell in self.grid.cells() if self.samples.get(cell)]

    def unit_done(self, length: int, mode: Mode, index: int) -> bool:
        return all(len(self.samples.get(cell, ())) > index for cell in self.grid.cells_of(length, mode))


def run_grid(
    grid: GridConfig,
    log: Callable[..., None] = print,
    checkpoint: Optional[Callable[[list[CellResult], dict], None]] = None,
    resume: Optional[tuple[list[CellResult], dict]] = None,
) -> tuple[list[CellResult], dict]:
    """Run every cell; ``checkpoint(results_so_far, meta)`` after each sample of each (length, mode),
    so a run that is cut short leaves its finished samples on disk. ``resume``: the results and meta
    of such a run of the same grid, whose samples are kept and not run again."""
    torch.manual_seed(grid.seed)
    engine = ReferenceEngine(grid.model, dtype=DTYPES[grid.dtype])

    def count_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    suites: dict[int, tuple[list[Task], list[Prompt]]] = {}
    for length in grid.lengths:
        tasks = task_suite(grid.seed, grid.samples, length, count_tokens, kinds=grid.kinds)
        suites[length] = (tasks, [engine.chat_prompt(t.context, t.question, t.answer_prefix) for t in tasks])
    meta = run_meta(grid, engine, suites)
    progress = GridProgress(grid)
    if resume is not None:
        check_resumable(meta, resume[1])
        progress.samples = {cell.key: list(cell.samples) for cell in resume[0]}
    policies = {cell: build_policy(eviction_config(cell.policy, cell.budget)) for cell in grid.cells()}
    units = [(length, mode, i) for length in grid.lengths for mode in grid.modes for i in range(grid.samples)]
    to_run = [unit for unit in units if not progress.unit_done(*unit)]
    if len(to_run) < len(units):
        log(f"resuming: {len(units) - len(to_run)} of {len(units)} samples x (length, mode) already done", flush=True)
    warm_up(engine, grid, suites, policies)
    clock = ForwardClock(engine.model)
    try:
        for length, mode, index in to_run:
            tasks, prompts = suites[length]
            unit_started = time.perf_counter()
            for group in prefill_groups(grid.cells_of(length, mode)):
                for cell in group:
                    sample = run_sample(engine, clock, tasks[index], prompts[index], cell, policies[cell], grid.max_new_tokens)
                    progress.samples.setdefault(cell, []).append(sample)
            progress.units_done_here += 1
            _log_unit(log, progress, len(to_run), length, mode, index, tasks[index], time.perf_counter() - unit_started)
            if checkpoint is not None:
                checkpoint(progress.results(), finished_meta(meta, progress))
    finally:
        clock.close()
    return progress.results(), finished_meta(meta, progress)


def warm_up(engine: ReferenceEngine, grid: GridConfig, suites: dict, policies: dict[CellKey, Policy]) -> None:
    """One untimed generation per mode (full cache and the first policy), so one-off costs of the first
    calls (allocations, kernel selection) do not land on the first sample's timings."""
    length = grid.lengths[0]
    prompt = suites[length][1][0]
    for mode in grid.modes:
        for cell in grid.cells_of(length, mode)[:2]:
            engine.generate(prompt, policies[cell], mode, 2, cell.block_size)


def _log_unit(log, progress: GridProgress, units: int, length: int, mode: Mode, index: int, task: Task, seconds: float) -> None:
    elapsed = time.perf_counter() - progress.started
    eta = elapsed / progress.units_done_here * (units - progress.units_done_here)
    cells = progress.grid.cells_of(length, mode)
    right = sum(progress.samples[cell][index].correct for cell in cells)
    full = "right" if progress.samples[cells[0]][index].correct else "wrong"
    log(
        f"[{progress.units_done_here}/{units}] L={length} {mode.value} sample {index + 1}/{progress.grid.samples} "
        f"({task.kind}): full {full}, {right}/{len(cells)} cells right, {seconds:.0f} s "
        f"(elapsed {_duration(elapsed)}, ETA {_duration(eta)})",
        flush=True,
    )


def run_meta(grid: GridConfig, engine: ReferenceEngine, suites: dict) -> dict:
    prompts = [prompt.token_ids for length in grid.lengths for prompt in suites[length][1]]
    return {
        "command": "python -m benchmarks.quality " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "model": str(engine.model_dir),
        "grid": grid.as_json(),
        "mean_prompt_tokens": {
            str(length): sum(len(p) for p in prompts) / len(prompts) for length, (_, prompts) in suites.items()
        },
        "numerics": {
            **numerics_environment(grid.dtype),
            "tasks_sha256": tasks_fingerprint(prompts),
            "probe_sha256": numerics_probe(
                lambda ids: engine.extend(engine.new_sequence(), ids), engine.model.config.vocab_size
            ),
        },
        "threads": torch.get_num_threads(),
        "seconds": 0.0,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def finished_meta(meta: dict, progress: GridProgress) -> dict:
    """``meta`` with the run's time (a resumed run adds to the earlier part's) and how much is done."""
    results = progress.results()
    return {
        **meta,
        "seconds": round(meta.get("resumed_seconds", 0.0) + time.perf_counter() - progress.started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cells_done": sum(1 for cell in results if len(cell.samples) == progress.grid.samples),
        "cells_total": len(progress.grid.cells()),
    }


class ResumeError(ValueError):
    """A checkpoint that cannot be continued by this run; the message says why."""


def check_resumable(meta: dict, previous: dict) -> None:
    """Refuse to continue a checkpoint of another grid, other inputs or other arithmetic."""
    if previous["grid"] != meta["grid"]:
        differing = sorted(k for k in meta["grid"] if previous["grid"].get(k) != meta["grid"][k])
        raise ResumeError(f"the checkpoint is of another grid (differs in {', '.join(differing)})")
    for name in ("tasks_sha256", "probe_sha256"):
        if previous.get("numerics", {}).get(name) != meta["numerics"][name]:
            raise ResumeError(
                f"the checkpoint's {name} differs from this run's: it was computed with other inputs or other "
                "CPU kernels (see benchmarks/numerics.py), so its samples would not match this run's"
            )
    meta["resumed_seconds"] = previous.get("seconds", 0.0)


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


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
    "kinds": ",".join(RULER_KINDS),
}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[GridConfig, argparse.Namespace]:
    parser = benchmark_parser("quality", __doc__)
    parser.add_argument("--quick", action="store_true", help="small grid, a few minutes: " + str(QUICK_DEFAULTS))
    parser.add_argument(
        "--policies",
        help="comma-separated policies, each name[:score] (e.g. snapkv:obc-key, topk:kvzip); default: all "
        "registered; quick: streaming,snapkv",
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
    parser.add_argument("--kinds", help=f"task kinds (default {','.join(RULER_KINDS)}; also: facts)")
    parser.add_argument("--samples", type=int, help="samples per cell (default 20; quick 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a HF model folder")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: fastest on a shared 2-core machine)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--resume", action="store_true", help="continue the run checkpointed in --out/quality.json (same grid)"
    )
    args = parser.parse_args(argv)
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    policies = args.policies or defaults["policies"]
    try:
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads} must be >= 1")
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
    if args.resume and not (args.out / "quality.json").exists():
        parser.error(f"--resume: {args.out / 'quality.json'} does not exist")
    return grid, args


def main(argv: Optional[Sequence[str]] = None) -> None:
    grid, args = parse_args(argv)
    torch.set_num_threads(args.threads)
    resume = load_report(json.loads((args.out / "quality.json").read_text())) if args.resume else None
    try:
        results, meta = run_grid(
            grid, checkpoint=lambda partial, meta: write_outputs(partial, meta, args.out), resume=resume
        )
    except ResumeError as error:
        sys.exit(f"--resume: {error}")
    write_outputs(results, meta, args.out)
    print(f"wrote {args.out / 'quality.json'}, quality.md, quality.png")


if __name__ == "__main__":
    main()
