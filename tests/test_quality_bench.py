"""The quality benchmark: intervals and orderings, the grid, checkpoints and resume, the cost split,
sample-by-sample comparison of reruns and merging, end to end on the tiny random Llama."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import quality, quality_compare, quality_merge
from sgl_kvevict.measure.intervals import Z_95, ordering, wilson
from benchmarks.quality_report import (
    FULL,
    CellKey,
    CellResult,
    SampleResult,
    load_report,
    markdown_report,
    orderings,
    summaries,
    write_outputs,
)
from sgl_kvevict.config import ConfigError
from sgl_kvevict.reference import Mode

# ---- intervals --------------------------------------------------------------------------------------


def _score_test_accepts(p: float, successes: int, n: int) -> bool:
    """The Wilson interval is the set of p the normal score test does not reject."""
    return abs(successes / n - p) <= Z_95 * math.sqrt(p * (1 - p) / n) + 1e-12


@pytest.mark.parametrize("successes, n", [(0, 20), (1, 20), (9, 20), (16, 20), (20, 20), (3, 7), (50, 100)])
def test_wilson_interval_is_the_score_tests_acceptance_region(successes, n):
    interval = wilson(successes, n)
    assert 0 <= interval.low <= successes / n <= interval.high <= 1
    grid = [i / 20000 for i in range(20001)]
    accepted = [p for p in grid if _score_test_accepts(p, successes, n)]
    assert interval.low == pytest.approx(accepted[0], abs=1e-4)
    assert interval.high == pytest.approx(accepted[-1], abs=1e-4)


def test_wilson_closed_forms_at_the_ends():
    assert wilson(0, 10).low == 0 and wilson(0, 10).high == pytest.approx(Z_95**2 / (10 + Z_95**2))
    assert wilson(10, 10).high == 1 and wilson(10, 10).low == pytest.approx(10 / (10 + Z_95**2))
    assert wilson(9, 20).percent() == "45 [26, 66]"
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_ordering_claims_only_separated_intervals():
    assert ordering(wilson(18, 20), wilson(5, 20)) == ">"
    assert ordering(wilson(5, 20), wilson(18, 20)) == "<"
    assert ordering(wilson(9, 20), wilson(5, 20)) is None  # 45% vs 25% on 20 samples: within noise


# ---- grid and report from synthetic cells -------------------------------------------------------------


def test_grid_validation_and_cells():
    grid, _ = quality.parse_args(["--quick", "--policies", "streaming,dbudget", "--budgets", "0.5,128t"])
    cells = grid.cells()
    assert cells[0] == CellKey(1000, "question-aware", FULL, None, None)
    # dbudget takes no budget: one cell per (length, mode); streaming one per budget.
    assert len(cells) == len(grid.lengths) * len(grid.modes) * (1 + 2 + 1)
    blocks, _ = quality.parse_args(["--quick", "--policies", "streaming", "--budgets", "0.5", "--block-sizes", "none,256"])
    # The full cache once, every policy cell in request scope and in block scope.
    assert [cell.block_size for cell in blocks.cells()[:3]] == [None, None, 256]
    with pytest.raises(SystemExit):
        quality.parse_args(["--quick", "--block-sizes", "0"])
    with pytest.raises(SystemExit):
        quality.parse_args(["--quick", "--threads", "0"])
    with pytest.raises(ConfigError, match="unknown policies"):
        quality.GridConfig(**{**grid.__dict__, "policies": ("nope",)})
    with pytest.raises(ConfigError, match="full cache always runs"):
        quality.GridConfig(**{**grid.__dict__, "policies": ("full",)})


def test_prefill_groups_share_schedule_and_score():
    grid, _ = quality.parse_args(
        ["--quick", "--policies", "snapkv,lava,snapkv:obc-key", "--budgets", "0.5,0.25", "--block-sizes", "none,64"]
    )
    groups = quality.prefill_groups(grid.cells_of(1000, Mode.CONTEXT_ONLY))
    labels = [[cell.label() for cell in group] for group in groups]
    assert labels[0] == ["full"]  # the forward every cost is measured against, first
    assert ["snapkv@0.5", "snapkv@0.25", "lava@0.5", "lava@0.25"] in labels  # attn scores, request scope
    assert ["snapkv:obc-key@0.5 (block 64)", "snapkv:obc-key@0.25 (block 64)"] in labels
    assert sum(len(group) for group in groups) == len(grid.cells_of(1000, Mode.CONTEXT_ONLY)) and len(groups) == 5


def sample(correct: bool, prefill: float = 1.0, plan: float = 0.0) -> SampleResult:
    return SampleResult(
        kind="passkey", depth=0.5, answer="1", output="1" if correct else "2", correct=correct, prompt_tokens=100,
        context_tokens=90, kept_fraction=0.25, prefill_seconds=prefill, plan_seconds=plan, decode_seconds=0.5,
    )  # fmt: skip


def cell(policy: str, budget, correct: list[bool], prefill: float = 1.0, plan: float = 0.0) -> CellResult:
    key = CellKey(1000, "context-only", policy, budget)
    return CellResult(key, tuple(sample(c, prefill + 0.01 * i, plan) for i, c in enumerate(correct)))


def test_summaries_cost_split_and_orderings():
    results = [
        cell(FULL, None, [True] * 18 + [False] * 2, prefill=1.0),
        cell("snapkv", "0.25", [True] * 9 + [False] * 11, prefill=1.2, plan=0.05),
        cell("topk:kvzip", "0.25", [True] * 19 + [False], prefill=2.5, plan=0.1),
        cell("lava", "0.25", [True] * 12 + [False] * 8, prefill=1.3, plan=0.05),
    ]
    by_policy = {s.cell.key.policy: s for s in summaries(results)}
    kvzip = by_policy["topk:kvzip"]
    assert (kvzip.accuracy.successes, kvzip.accuracy.n) == (19, 20)
    assert kvzip.retained == 1.0  # its one miss is a sample the full cache misses too
    assert by_policy["snapkv"].retained == pytest.approx(9 / 18)
    # forward = the full cache's prefill of the same samples; score = the rest of the prefill minus planning
    assert kvzip.forward_seconds == pytest.approx(1.0 + 0.01 * 9.5)
    assert kvzip.score_seconds == pytest.approx(2.5 - 1.0 - 0.1)
    assert kvzip.plan_seconds == pytest.approx(0.1) and kvzip.decode_seconds == pytest.approx(0.5)

    rows = orderings(summaries(results))
    verdicts = {(r["a"], r["b"]): r["verdict"] for r in rows}
    assert verdicts[("snapkv@0.25", "full")] == "<"
    assert verdicts[("topk:kvzip@0.25", "full")] == "within noise"
    assert verdicts[("snapkv@0.25", "topk:kvzip@0.25")] == "<"
    assert verdicts[("snapkv@0.25", "lava@0.25")] == "within noise"
    assert len(rows) == 3 + 3  # each policy vs full, the three pairs at 0.25

    meta = {
        "command": "python -m benchmarks.quality ...", "model": "/m/smollm2", "threads": 1, "seconds": 60,
        "date": "today", "cells_done": 4, "cells_total": 4, "mean_prompt_tokens": {"1000": 1050.0},
        "grid": {"dtype": "bfloat16", "samples": 20, "kinds": ["passkey"], "seed": 0, "max_new_tokens": 8,
                 "lengths": [1000], "modes": ["context-only"]},
    }  # fmt: skip
    report = markdown_report(summaries(results), rows, meta)
    assert "| snapkv | request | 0.25 | 45 [26, 66] | 20 | 50 | 0.25 |" in report
    assert "| topk:kvzip | request | 0.25 | 1095 | 1400 | 100 | 500 |" in report  # forward, score, plan, decode (ms)
    assert "below it: snapkv@0.25" in report and "snapkv@0.25 < topk:kvzip@0.25" in report
    assert "2 of 3 pairs within noise" in report


# ---- end to end on the tiny model -------------------------------------------------------------------


def tiny_grid(model_dir, **overrides) -> quality.GridConfig:
    values = dict(
        model=str(model_dir), dtype="float32", policies=("streaming", "snapkv:obc-key"), budgets=("0.5",),
        lengths=(120,), modes=tuple(Mode), kinds=("passkey", "fact"), samples=2, seed=0, max_new_tokens=3, quick=True,
    )  # fmt: skip
    return quality.GridConfig(**{**values, **overrides})


def test_quality_run_end_to_end_on_the_tiny_model(tiny_llama_dir, tmp_path):
    grid = tiny_grid(tiny_llama_dir, lengths=(120, 160))
    lines, partial_reports = [], []

    def checkpoint(partial, meta):
        write_outputs(partial, meta, tmp_path)
        partial_reports.append((tmp_path / "quality.md").read_text())

    results, meta = quality.run_grid(grid, log=lambda line, **_: lines.append(line), checkpoint=checkpoint)
    write_outputs(results, meta, tmp_path)

    units = len(grid.lengths) * len(grid.modes) * grid.samples  # one line and checkpoint per sample
    assert len(lines) == len(partial_reports) == units and len(results) == len(grid.cells()) == 12
    assert lines[-1].startswith(f"[{units}/{units}] L=160 context-only sample 2/2") and "ETA" in lines[-1]
    assert "Partial run: 0 of 12 cells" in partial_reports[0] and "Partial run: 3 of 12" in partial_reports[1]
    assert "Partial run" not in (tmp_path / "quality.md").read_text()
    assert not list(tmp_path.glob("*.partial"))
    payload = json.loads((tmp_path / "quality.json").read_text())
    cells = {(c["policy"], c["mode"], c["length"]): c for c in payload["cells"]}
    full = cells[("full", "context-only", 120)]
    assert full["kept_fraction"] == 1.0 and full["accuracy"]["n"] == 2
    low, high = full["accuracy"]["ci95"]
    assert 0 <= low <= full["accuracy"]["value"] <= high <= 1
    streaming = cells[("streaming", "context-only", 120)]
    assert 0.4 < streaming["kept_fraction"] < 0.6
    assert all(s["prompt_tokens"] > s["context_tokens"] for s in streaming["samples"])
    assert all(s["prefill_seconds"] > 0 and s["decode_seconds"] >= 0 for s in streaming["samples"])
    assert streaming["mean_seconds"]["forward"] > 0 and streaming["mean_seconds"]["plan"] >= 0
    assert 0.4 < cells[("snapkv:obc-key", "question-aware", 160)]["kept_fraction"] < 0.6
    numerics = payload["meta"]["numerics"]
    assert numerics["dtype"] == "float32" and numerics["intra_op_threads"] == 1
    assert {"torch", "aten_cpu_capability", "cpu_kernel_flags", "deterministic_algorithms", "env"} <= numerics.keys()
    assert len(numerics["probe_sha256"]) == len(numerics["tasks_sha256"]) == 16
    assert {r["kind"] for r in payload["orderings"]} == {"vs full", "same budget"}
    report = (tmp_path / "quality.md").read_text()
    assert "| streaming | request | 0.5 |" in report and "| snapkv:obc-key | request | 0.5 |" in report
    assert "## context-only" in report and "## Orderings" in report and "probe sha256" in report
    assert (tmp_path / "quality.png").stat().st_size > 1000


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_result(tiny_llama_dir, tmp_path):
    grid = tiny_grid(tiny_llama_dir, samples=3)
    whole, _ = quality.run_grid(grid, log=lambda *a, **k: None)

    def stop_after_two(partial, meta):
        write_outputs(partial, meta, tmp_path)
        if sum(len(c.samples) for c in partial) == 2 * len(grid.cells_of(120, Mode.QUESTION_AWARE)):
            raise Interrupted

    with pytest.raises(Interrupted):
        quality.run_grid(grid, log=lambda *a, **k: None, checkpoint=stop_after_two)
    lines = []
    resumed, meta = quality.run_grid(
        grid, log=lambda line, **_: lines.append(line), resume=load_report(json.loads((tmp_path / "quality.json").read_text()))
    )
    assert lines[0].startswith("resuming: 2 of 6") and len(lines) == 1 + 4  # only the samples left ran
    assert meta["cells_done"] == meta["cells_total"] == 6
    assert [[s.output for s in c.samples] for c in resumed] == [[s.output for s in c.samples] for c in whole]

    checkpoint = load_report(json.loads((tmp_path / "quality.json").read_text()))
    with pytest.raises(quality.ResumeError, match="another grid .*samples"):
        quality.run_grid(tiny_grid(tiny_llama_dir, samples=4), resume=checkpoint)
    checkpoint[1]["numerics"]["probe_sha256"] = "0" * 16
    with pytest.raises(quality.ResumeError, match="probe_sha256 differs"):
        quality.run_grid(grid, resume=checkpoint)


def test_a_rerun_is_identical_sample_by_sample(tiny_llama_dir, tmp_path, capsys):
    grid = tiny_grid(tiny_llama_dir, modes=(Mode.CONTEXT_ONLY,))
    for name in ("a", "b"):
        write_outputs(*quality.run_grid(grid, log=lambda *a, **k: None), tmp_path / name)
    a, b = tmp_path / "a" / "quality.json", tmp_path / "b" / "quality.json"
    assert quality_compare.main([str(a), str(b)]) == 0
    assert "identical outputs in every common sample" in capsys.readouterr().out
    changed = json.loads(b.read_text())
    changed["cells"][1]["samples"][0]["output"] += " changed"
    b.write_text(json.dumps(changed))
    assert quality_compare.main([str(a), str(b)]) == 1
    assert "outputs differ in 1 of 2 samples: [0]" in capsys.readouterr().out


def test_runs_of_one_grid_over_different_lengths_merge(tiny_llama_dir, tmp_path, capsys):
    runs = []
    for length in (120, 160):
        grid = tiny_grid(tiny_llama_dir, policies=("streaming",), lengths=(length,), modes=(Mode.CONTEXT_ONLY,), samples=1)
        write_outputs(*quality.run_grid(grid, log=lambda *a, **k: None), tmp_path / str(length))
        runs.append(str(tmp_path / str(length) / "quality.json"))

    quality_merge.main([str(tmp_path / "merged"), *runs])
    merged = json.loads((tmp_path / "merged" / "quality.json").read_text())
    assert merged["meta"]["grid"]["lengths"] == [120, 160]
    assert sorted((c["policy"], c["length"]) for c in merged["cells"]) == [
        ("full", 120), ("full", 160), ("streaming", 120), ("streaming", 160),
    ]  # fmt: skip
    report = (tmp_path / "merged" / "quality.md").read_text()
    assert "acc [95% CI] L=120" in report and "acc [95% CI] L=160" in report and "Partial" not in report

    for field, value, message in (("samples", 7, "differ in samples"), ("probe_sha256", "0" * 16, "numerics probe")):
        mismatched = json.loads((tmp_path / "160" / "quality.json").read_text())
        target = mismatched["meta"]["grid"] if field == "samples" else mismatched["meta"]["numerics"]
        target[field] = value
        (tmp_path / "bad.json").write_text(json.dumps(mismatched))
        with pytest.raises(SystemExit):
            quality_merge.main([str(tmp_path / "bad"), runs[0], str(tmp_path / "bad.json")])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality_merge.main([str(tmp_path / "twice"), runs[0], runs[0]])
    assert "more than one run" in capsys.readouterr().err


def test_the_command_writes_a_complete_report(tiny_llama_dir, tmp_path):
    """``python -m benchmarks.quality`` as a user runs it (the module is then ``__main__``: its cells
    must still be the report's own classes)."""
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "benchmarks.quality", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--policies", "snapkv", "--budgets", "0.25", "--lengths", "120", "--modes", "context-only", "--samples", "2",
        "--max-new-tokens", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    payload = json.loads((tmp_path / "quality.json").read_text())
    assert [row["kind"] for row in payload["orderings"]] == ["vs full"]
    assert payload["meta"]["command"].startswith("python -m benchmarks.quality --model")
    assert payload["meta"]["cells_done"] == payload["meta"]["cells_total"] == 2
