"""benchmarks/stats_polling.py in-process: inter-token gaps summarised per phase, the polled / quiet
ratios, and the report's tables (the benchmark itself starts servers; it is run by hand)."""

from __future__ import annotations

import pytest

from benchmarks.stats_polling import PHASES, PollingConfig, markdown, ratios, summarize


def test_gaps_summarise_into_percentiles_and_polled_over_quiet_ratios():
    quiet = summarize([0.010] * 98 + [0.050, 0.100])
    polled = summarize([0.012] * 98 + [0.060, 0.200])
    assert quiet["gaps"] == 100 and quiet["itl_p50_ms"] == pytest.approx(10.0)
    assert quiet["itl_max_ms"] == pytest.approx(100.0)
    assert quiet["itl_p99_ms"] == pytest.approx(50.0 + 0.01 * 50.0)  # linear between the two slowest gaps
    assert quiet["tokens_per_second"] == pytest.approx(100 / (0.98 + 0.15))
    ratio = ratios(quiet, polled)
    assert ratio["itl_p50_ms"] == pytest.approx(1.2)
    assert ratio["tokens_per_second"] == pytest.approx((0.98 + 0.15) / (1.176 + 0.26))


def test_the_report_has_a_row_per_server_and_phase_and_the_ratios():
    summary = {phase: summarize([0.01, 0.02, 0.03]) for phase in PHASES}
    server = {"label": "vanilla", "load_average": (1.0, 1.0, 1.0), "summary": summary,
              "ratios": ratios(summary["quiet"], summary["polled"]), "polls_per_second": [40.0, 60.0]}  # fmt: skip
    environment = {"cpu_model": "cpu", "cpu_cores": 2, "gpu": "none", "sglang": "0.5.23", "torch": "2",
                   "git_commit": "abc", "git_worktree_dirty": False, "date": "today"}  # fmt: skip
    config = PollingConfig("smollm2", "topk:learned", "0.25", 16384, 128, 5)
    report = {"meta": {"command": "python -m benchmarks.stats_polling", "config": config.__dict__, "environment": environment},
              "servers": [server]}  # fmt: skip
    text = markdown(report)
    assert "| vanilla | quiet | 20.0 |" in text and "| vanilla | polled | 20.0 |" in text
    assert "| 50 | 1.00 |" in text  # the polls per second answered, on the polled row
    assert "| vanilla | 1.00 | 1.00 | **1.00** | 1.00 |" in text
    with pytest.raises(ValueError, match="--tokens must be at least 2"):
        PollingConfig("smollm2", "lava", "0.25", 16384, 1, 5)
