"""The synthetic task generator and the quality benchmark's grid, report and end-to-end run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import quality
from benchmarks.tasks import TASK_KINDS, make_task, task_suite
from sgl_kvevict.config import ConfigError
from sgl_kvevict.reference import Mode


def count_words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_tasks_are_deterministic_in_the_seed(kind):
    first = make_task(kind, seed=7, target_tokens=300, depth=0.4, count_tokens=count_words)
    assert first == make_task(kind, seed=7, target_tokens=300, depth=0.4, count_tokens=count_words)
    assert first.context != make_task(kind, seed=8, target_tokens=300, depth=0.4, count_tokens=count_words).context


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.35, 0.8, 1.0])
def test_answer_is_in_the_context_at_the_stated_depth(kind, depth):
    task = make_task(kind, seed=3, target_tokens=400, depth=depth, count_tokens=count_words)
    needle = task.needles[task.answer_needle]
    position = task.context.index(needle.text)
    assert task.answer in needle.text
    assert needle.depth == position / len(task.context)
    # The requested depth is a share of the filler; the needle lands at the next sentence boundary,
    # shifted by the needles inserted before it.
    longest_sentence = max(len(s) for s in re.split(r"(?<=\.) ", task.context))
    other_needles = sum(len(n.text) + 1 for n in task.needles if n is not needle)
    assert abs(needle.depth - depth) <= (longest_sentence + other_needles) / len(task.context) + 1e-9
    assert abs(count_words(task.context) - 400) <= 25


def test_filler_has_no_repeated_sentence_and_no_digits():
    task = make_task("passkey", seed=1, target_tokens=2000, depth=0.5, count_tokens=count_words)
    filler = task.context.replace(task.needles[0].text, "")
    sentences = [s for s in re.split(r"(?<=\.) ", filler) if s.strip()]
    assert len(sentences) > 100
    assert len(set(sentences)) == len(sentences)
    assert not re.search(r"\d", filler)


def test_variable_chain_is_in_order_and_ends_with_the_asked_variable():
    task = make_task("vartrack", seed=5, target_tokens=500, depth=0.2, count_tokens=count_words)
    positions = [task.context.index(n.text) for n in task.needles]
    assert positions == sorted(positions)
    last_variable = task.needles[-1].text.split(" = ")[0]
    assert last_variable in task.question and task.answer in task.needles[0].text


def test_suite_cycles_kinds_and_depths():
    suite = task_suite(seed=0, samples=8, target_tokens=200, count_tokens=count_words)
    assert [t.kind for t in suite] == list(TASK_KINDS) * 2
    assert len({round(t.depth, 1) for t in suite}) >= 4
    assert len({t.answer for t in suite}) == 8


# ---- the benchmark -----------------------------------------------------------------------------------


def test_grid_validation_and_cells():
    grid, _, _ = quality.parse_args(["--quick", "--policies", "streaming,dbudget", "--budgets", "0.5,128t"])
    cells = grid.cells()
    assert cells[0][2:] == ("full", None, None)  # (policy, budget, block size): request scope
    # dbudget takes no budget: one cell per (length, mode); streaming one per budget.
    assert len(cells) == len(grid.lengths) * len(grid.modes) * (1 + 2 + 1)
    blocks, _, _ = quality.parse_args(
        ["--quick", "--policies", "streaming", "--budgets", "0.5", "--block-sizes", "none,256"]
    )
    # The full cache once, every policy cell in request scope and in block scope.
    assert [cell[4] for cell in blocks.cells()[:3]] == [None, None, 256]
    with pytest.raises(SystemExit):
        quality.parse_args(["--quick", "--block-sizes", "0"])
    with pytest.raises(ConfigError, match="unknown policies"):
        quality.GridConfig(**{**grid.__dict__, "policies": ("nope",)})
    with pytest.raises(ConfigError, match="full cache always runs"):
        quality.GridConfig(**{**grid.__dict__, "policies": ("full",)})


def test_quality_run_end_to_end_on_the_tiny_model(tiny_llama_dir, tmp_path):
    grid = quality.GridConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        policies=("streaming", "snapkv:obc-key"),
        budgets=("0.5",),
        lengths=(120, 160),
        modes=tuple(Mode),
        kinds=("passkey", "fact"),
        samples=2,
        seed=0,
        max_new_tokens=3,
        quick=True,
    )
    lines, partial_reports = [], []

    def checkpoint(partial, meta):
        quality.write_outputs(partial, meta, tmp_path)
        partial_reports.append((tmp_path / "quality.md").read_text())

    results, meta = quality.run_grid(grid, log=lambda line, **_: lines.append(line), checkpoint=checkpoint)
    quality.write_outputs(results, meta, tmp_path)

    total = len(grid.lengths) * len(grid.modes) * 3
    assert len(lines) == len(results) == len(partial_reports) == total
    assert lines[-1].startswith(f"[{total}/{total}]") and "ETA" in lines[-1]
    assert f"Partial run: 1 of {total} cells" in partial_reports[0]
    assert "Partial run" not in (tmp_path / "quality.md").read_text()
    payload = json.loads((tmp_path / "quality.json").read_text())
    cells = {(c["policy"], c["mode"], c["length"]): c for c in payload["cells"]}
    assert cells[("full", "context-only", 120)]["kept_fraction"] == 1.0
    streaming = cells[("streaming", "context-only", 120)]
    assert 0.4 < streaming["kept_fraction"] < 0.6
    assert all(s["prompt_tokens"] > s["context_tokens"] for s in streaming["samples"])
    assert 0.4 < cells[("snapkv:obc-key", "question-aware", 160)]["kept_fraction"] < 0.6
    report = (tmp_path / "quality.md").read_text()
    assert "| streaming | request | 0.5 |" in report and "| snapkv:obc-key | request | 0.5 |" in report
    assert "## context-only" in report
    assert (tmp_path / "quality.png").stat().st_size > 1000


def test_runs_of_one_grid_over_different_lengths_merge(tiny_llama_dir, tmp_path):
    from benchmarks import quality_merge

    base = dict(
        model=str(tiny_llama_dir), dtype="float32", policies=("streaming",), budgets=("0.5",),
        modes=(Mode.CONTEXT_ONLY,), kinds=("passkey",), samples=1, seed=0, max_new_tokens=2, quick=True,
    )  # fmt: skip
    runs = []
    for length in (120, 160):
        results, meta = quality.run_grid(quality.GridConfig(lengths=(length,), **base), log=lambda *a, **k: None)
        quality.write_outputs(results, meta, tmp_path / str(length))
        runs.append(str(tmp_path / str(length) / "quality.json"))

    quality_merge.main([str(tmp_path / "merged"), *runs])
    merged = json.loads((tmp_path / "merged" / "quality.json").read_text())
    assert merged["meta"]["grid"]["lengths"] == [120, 160]
    assert sorted((c["policy"], c["length"]) for c in merged["cells"]) == [
        ("full", 120), ("full", 160), ("streaming", 120), ("streaming", 160),
    ]  # fmt: skip
    report = (tmp_path / "merged" / "quality.md").read_text()
    assert "acc L=120" in report and "acc L=160" in report and "Partial" not in report

    mismatched = json.loads(Path(runs[1]).read_text())
    mismatched["meta"]["grid"]["samples"] = 7
    Path(runs[1]).write_text(json.dumps(mismatched))
    with pytest.raises(SystemExit, match="samples"):
        quality_merge.main([str(tmp_path / "bad"), *runs])
    with pytest.raises(SystemExit, match="more than one run"):
        quality_merge.main([str(tmp_path / "twice"), runs[0], runs[0]])
