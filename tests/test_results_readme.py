"""The generated part of docs/results.md is rebuilt from the committed benchmark outputs, and only the
text between the markers changes; the README's headline table is what ``python -m benchmarks.headline``
prints, and every number in it is a value of the JSON its row links."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import headline, results_readme

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_rewrite_replaces_only_the_marked_part(tmp_path):
    readme = tmp_path / "results.md"
    readme.write_text(f"# title\n\nbefore\n\n{results_readme.BEGIN}\nstale\n{results_readme.END}\n\nafter\n")
    results_readme.rewrite(readme, RESULTS)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n" + results_readme.BEGIN) and text.endswith(results_readme.END + "\n\nafter\n")
    assert "stale" not in text
    for name in ("engine_overhead", "multiturn", "soak"):
        assert json.loads((RESULTS / f"{name}.json").read_text())["meta"]["command"] in text
    assert "![multi-turn benchmark](results/multiturn.png)" in text  # relative to docs/, where results.md lives
    # The one-stream run serves full, so its table splits each ratio; a multi-turn run that predates
    # the full server says so instead of a ratio, and one that served it does not.
    assert "| topk:learned@0.25 / vanilla | topk:learned@0.25 / full | full / vanilla |" in text
    predating = [name for name in ("multiturn", "sweep", "block_scope")
                 if not any(run["variant"]["policy"] == "full" for run in json.loads((RESULTS / f"{name}.json").read_text())["runs"])]  # fmt: skip
    assert "multiturn" not in predating and "| full / vanilla | large |" in text
    assert text.count("`full` (the plugin's path with nothing evicted) is not in this run") == len(predating)
    assert ("full: not in this run |" in text) == ("sweep" in predating or "block_scope" in predating)
    # SGLang's client and the decode step: runs with full and keep-99, so the three ratios are shown.
    client = json.loads((RESULTS / "sglang_client.json").read_text())
    assert [row["comparison"] for row in client["ratios"]] == [
        "full block / vanilla", "topk:learned@0.25 block / vanilla", "topk:learned@0.25 block / full block",
    ]  # fmt: skip
    for row in client["ratios"]:
        assert f"| {row['comparison']} | {row['output_throughput']:.2f} |" in text
    assert "### One decode step at equal batch and context" in text and "default-block / keep-99 tok/s" in text
    profile = json.loads((RESULTS / "decode_step.json").read_text())["summary"]["profile"]["default-block"]
    assert f"per step against keep-99's in the same round (py-spy profile, batch 8; median over rounds, each round's in parentheses): default-block {profile['attention_vs_keep_all']['median']:.2f} (" in text


def test_the_committed_results_page_is_up_to_date(tmp_path):
    page = tmp_path / "results.md"
    committed = (RESULTS.parent / "results.md").read_text()
    page.write_text(committed)
    results_readme.rewrite(page, RESULTS)
    assert page.read_text() == committed, "run python -m benchmarks.results_readme"


def test_check_reports_a_stale_part_and_writes_nothing(tmp_path, capsys):
    page = tmp_path / "results.md"
    stale = f"# title\n\n{results_readme.BEGIN}\nstale\n{results_readme.END}\n"
    page.write_text(stale)
    assert results_readme.main(["--check", "--file", str(page)]) == 1
    assert page.read_text() == stale and "stale" in capsys.readouterr().out
    assert results_readme.main(["--file", str(page)]) == 0
    assert results_readme.main(["--check", "--file", str(page)]) == 0
    assert results_readme.main(["--check"]) == 0  # the committed docs/results.md


def test_missing_markers_are_refused(tmp_path):
    readme = tmp_path / "results.md"
    readme.write_text("# no markers\n")
    with pytest.raises(results_readme.ResultsError, match="marker lines"):
        results_readme.rewrite(readme, RESULTS)


def _outcome(output_tps: float, ttft: float, hit: float, correct: int):
    from sgl_kvevict.measure.client import StatsPeaks
    from benchmarks.load.metrics import RunMetrics
    from benchmarks.load.users import RunOutcome

    metrics = RunMetrics(
        requests=8, failed_requests=0, malformed_replies=0, wall_seconds=10.0, requests_per_second=0.8,
        output_tokens_per_second=output_tps, ttft={"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft},
        latency={"p50": 1.0, "p90": 2.0, "p99": 3.0}, fact_questions=8, fact_correct=correct, accuracy=correct / 8,
        prompt_tokens=1000, cached_tokens=int(1000 * hit), prompt_tokens_recomputed=1000 - int(1000 * hit),
        hit_rate=hit, hit_rate_by_turn=[0.0, hit],
    )  # fmt: skip
    return RunOutcome([], metrics, StatsPeaks(True, 3, {"cells_used": 5}, {"cells_used": 4}), 4000)


def test_optional_parts_render_when_their_outputs_exist(tmp_path):
    """A sweep, a block-scope sweep and a reuse-quality run next to the committed outputs."""
    import shutil

    from benchmarks import reuse_quality
    from benchmarks.load.driver import RunResult
    from benchmarks.load.report import write_comparison
    from sgl_kvevict.measure.servers import ServerVariant

    for name in ("engine_overhead", "multiturn", "soak"):
        shutil.copy(RESULTS / f"{name}.json", tmp_path)
    vanilla, full, lava = ServerVariant("none"), ServerVariant("full"), ServerVariant("lava", "0.25")
    runs = [
        RunResult("1.00", 4000, vanilla, _outcome(10.0, 1.0, 0.7, 6), None, 20.0, (1.0, 1.0, 1.0)),
        RunResult("1.00", 4000, full, _outcome(8.0, 0.4, 0.7, 6), None, 20.0, (1.0, 1.0, 1.0)),
        RunResult("1.00", 4000, lava, _outcome(12.0, 0.5, 0.7, 3), None, 20.0, (1.0, 1.0, 1.0)),
        RunResult("0.25", 1000, vanilla, _outcome(5.0, 4.0, 0.1, 6), None, 20.0, (1.0, 1.0, 1.0)),
        RunResult("0.25", 1000, lava, None, "the launcher exited", 0.0, (1.0, 1.0, 1.0)),
    ]
    meta = {
        "command": "python -m benchmarks.multiturn sweep --policies lava", "kind": "sweep", "model": "smollm2",
        "conversations": {"users": 2, "turns": 2, "document_tokens": 1750, "fact_every": 1, "shared_document": False,
                          "seed": 0, "system_prompt_tokens": 200},
        "load": {"max_tokens": 32}, "workload": {"all_histories": 4000, "longest_history": 2000, "max_tokens": 32},
        "pools": [{"name": "1.00", "tokens": 4000}, {"name": "0.25", "tokens": 1000}],
    }  # fmt: skip
    write_comparison(runs, meta, tmp_path, "sweep")
    write_comparison(runs, meta, tmp_path, "block_scope")
    summary = {"accuracy": {"successes": 9, "n": 20, "value": 0.45, "ci95": [0.258, 0.658]}, "reuse_rate": 1.0,
               "turn1_ttft_median": 2.0, "turn2_ttft_median": 0.5, "turn2_cached_fraction": 0.9}  # fmt: skip
    servers = [
        {"label": "vanilla", "variant": {"policy": "none"}, "summary": {**summary, "turn2_ttft_median": 1.0}, "samples": []},
        {"label": "lava@0.25", "variant": {"policy": "lava"}, "summary": summary, "samples": []},
    ]
    config = {"model": "smollm2", "samples": 20, "seed": 0, "document_tokens": 1300, "kinds": ["passkey"],
              "summary_tokens": 48, "answer_tokens": 8, "pool_tokens": 16384}  # fmt: skip
    reuse_quality.write_outputs(servers, {"command": "python -m benchmarks.reuse_quality", "config": config}, tmp_path, "reuse_quality")

    worker = {"url": "http://127.0.0.1:41000", "requests": 8, "hit_rate": 0.9, "output_tokens_per_second": 5.0, "ttft_mean": 0.4}
    router_run = {"variant": "lava@0.25", "total": {"requests": 16, "hit_rate": 0.75, "output_tokens_per_second": 9.5,
                                                   "ttft": {"p50": 0.3}}, "workers": [worker, {**worker, "requests": 8}]}
    router_meta = {"command": "python -m benchmarks.load.router --quick", "environment": {"git_commit": "abc1234", "date": "d"}}
    (tmp_path / "router.json").write_text(json.dumps({"meta": router_meta, "runs": [router_run]}))

    text = results_readme.generated_part(tmp_path)
    assert "### Scale-out: workers behind SGLang's cache-aware router" in text
    assert "| lava@0.25 | all (clients) | 16 | 0.75 | 9.50 | p50 0.30 |" in text
    assert "| lava@0.25 | http://127.0.0.1:41000 | 8 | 0.90 | 5.00 | mean 0.40 |" in text
    assert "### KV pool sweep at equal memory" in text and "### A shared system prompt: block scope vs request scope" in text
    # vs vanilla: 12 / 10, 0.5 / 1, 0.7 / 0.7; vs full: 12 / 8, 0.5 / 0.4, 0.7 / 0.7
    assert "| 1.00 (4000) | lava@0.25 | 12.00 | 0.50 | 0.70 | 3/8 (38 [14, 69]) | 1.20 | 0.50 | 1.00 | 1.50 / 1.25 / 1.00 |" in text
    assert "| 1.00 (4000) | full | 8.00 | 0.40 | 0.70 | 6/8 (75 [41, 93]) | 0.80 | 0.40 | 1.00 | - |" in text
    assert "policy / full is what eviction buys" in text
    assert "| 0.25 | lava@0.25 | failed: the launcher exited |" in text
    assert "after a shared ~200-token system prompt" in text and "![KV pool sweep at equal memory](results/sweep.png)" in text
    # accuracy, vs stock, reuse rate, TTFT 1 and its ratio, TTFT 2 and its ratio, net cost: (2-2) - (1-0.5)
    assert "| lava@0.25 | 45 [26, 66] (n=20) | 1.00 | 1.00 | 2.00 | 1.00 | 0.50 | 0.50 | -0.50 |" in text
    assert text.index("### Soak") < text.index("### KV pool sweep") < text.index("### Answers through the server")


# The README's headline: one generated table, every figure in the JSON its row links.
README = RESULTS.parents[1] / "README.md"
NUMBER = re.compile(r"(?<![\w.\-:@/])\d+(?:\.\d+)?(?![\w.])|(?<=/)\d+(?:\.\d+)?(?![\w.])")


def _leaves(value) -> list[float]:
    """Every number of a JSON document, numeric strings ("0.25") included."""
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        try:
            return [float(value)]
        except ValueError:
            return []
    return []


def unsourced_figures(row: str, results: Path = RESULTS) -> list[str]:
    """The numbers of a headline row that no value of the JSON it links gives, rounded as the row prints
    them (as a value, a percentage of one, or a percentage as a share): ``headline``'s own rule."""
    cited = re.search(r"\]\(docs/results/([\w-]+)\.md\)", row)
    assert cited, f"a headline row links no results page: {row}"
    leaves = _leaves(json.loads((results / f"{cited.group(1)}.json").read_text()))
    shown = {}
    for leaf in leaves:
        for value in (leaf, leaf * 100, leaf / 100):
            for digits in range(4):
                shown.setdefault(f"{value:.{digits}f}", True)
    text = re.sub(r"\]\([^)]*\)", "]", row)  # link targets are not figures
    return [number for number in NUMBER.findall(text) if number not in shown]


def _headline_rows(text: str) -> list[str]:
    return [line for line in headline.SECTION.of(text).split("\n") if line.startswith("| [")]


def test_the_readme_carries_the_current_headline():
    text = README.read_text()
    assert headline.SECTION.of(text) == headline.SECTION.fresh(), "run python -m benchmarks.headline --write README.md"
    assert len(_headline_rows(text)) == len(headline.ROWS)


def test_every_headline_figure_is_in_the_json_its_row_links():
    rows = _headline_rows(README.read_text())
    assert rows and all(NUMBER.findall(row) for row in rows)
    problems = {row.split("](")[0]: missing for row in rows if (missing := unsourced_figures(row))}
    assert not problems, problems


def test_a_figure_edited_by_hand_is_caught():
    row = next(row for row in _headline_rows(README.read_text()) if "sglang_client.md" in row)
    assert unsourced_figures(row) == []
    assert unsourced_figures(row.replace("**×4.66**", "**×4.76**")) == ["4.76"]
    assert "70" in NUMBER.findall("| [x](docs/results/x.md) | **70% [48, 85]** | 13/24 | keep-99's | fp32 |")
    assert NUMBER.findall("13/24 keep-99's fp32 Gemma-3-shaped ×1.28 / ×1.21") == ["13", "24", "1.28", "1.21"]


def test_check_reports_a_stale_headline(tmp_path, capsys):
    page = tmp_path / "README.md"
    page.write_text(f"# title\n\n{headline.SECTION.begin}\n\nstale\n\n{headline.SECTION.end}\n")
    assert headline.main(["--check", str(page)]) == 1 and "stale" in capsys.readouterr().out
    assert headline.main(["--write", str(page)]) == 0 and headline.main(["--check", str(page)]) == 0
    assert page.read_text().startswith("# title\n\n" + headline.SECTION.fresh())
