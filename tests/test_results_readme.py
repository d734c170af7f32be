"""The README's generated Results part is rebuilt from the committed benchmark outputs, and only the
text between the markers changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import results_readme

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_rewrite_replaces_only_the_marked_part(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{results_readme.BEGIN}\nstale\n{results_readme.END}\n\nafter\n")
    results_readme.rewrite(readme, RESULTS)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n" + results_readme.BEGIN) and text.endswith(results_readme.END + "\n\nafter\n")
    assert "stale" not in text
    for name in ("engine_overhead", "multiturn", "soak"):
        assert json.loads((RESULTS / f"{name}.json").read_text())["meta"]["command"] in text
    assert "![multi-turn benchmark](docs/results/multiturn.png)" in text


def test_the_committed_readme_is_up_to_date(tmp_path):
    readme = tmp_path / "README.md"
    committed = (RESULTS.parents[1] / "README.md").read_text()
    readme.write_text(committed)
    results_readme.rewrite(readme, RESULTS)
    assert readme.read_text() == committed, "run python -m benchmarks.results_readme"


def test_missing_markers_are_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(results_readme.ResultsError, match="marker lines"):
        results_readme.rewrite(readme, RESULTS)
