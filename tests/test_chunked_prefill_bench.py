"""benchmarks.chunked_prefill without a server: its report's stall columns and --resume's checks."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks import chunked_prefill
from benchmarks.load.report import run_meta, runs_writer

CONFIG = chunked_prefill.ChunkedConfig(
    model="m", chunk_sizes=(-1, 512), prompt_tokens=4096, samples=2, arrival_tokens=7000, stream_tokens=6,
    arrive_after=2, pool_tokens=16000,
)  # fmt: skip


def run(chunk: int, gaps: list[float], ttft: float) -> dict:
    return {
        "server": "policy", "vanilla": False, "chunk_size": chunk, "ttft_samples": [ttft], "ttft_median": ttft,
        "arrival_prefill_seconds": sum(g for g in gaps if g > 1), "arrival_sent_at": 1.0, "itl_gaps": gaps,
        "itl_p50": sorted(gaps)[len(gaps) // 2], "itl_p99": max(gaps), "itl_max": max(gaps),
    }  # fmt: skip


def payload() -> dict:
    meta = {**asdict(CONFIG), "command": "python -m benchmarks.chunked_prefill", "environment": {
        "cpu_model": "cpu", "cpu_cores": 2, "git_commit": "abc", "date": "today"}}  # fmt: skip
    runs = [run(-1, [0.1, 0.1, 40.0, 0.1, 0.1], 10.0), run(512, [0.1, 5.0, 6.0, 0.5, 0.1], 11.0)]
    return {"meta": meta, "runs": runs, "against_unchunked": chunked_prefill.against_unchunked(runs), "plot": "x.png"}


def test_the_report_counts_the_stalls_that_p99_can_miss():
    text = chunked_prefill.markdown(payload())
    unchunked, chunked = (line for line in text.splitlines() if line.startswith("| policy |"))
    assert unchunked.endswith("| 1 (40.0) | 40.0 |")
    assert chunked.endswith("| 2 (11.0) | 11.0 |") and "| x1.10 |" in chunked and "| x0.15 |" in chunked


def test_resume_keeps_runs_of_the_same_configuration_only(tmp_path):
    path = tmp_path / "chunked_prefill.json"
    path.write_text(json.dumps(payload()))
    assert [r["chunk_size"] for r in chunked_prefill.resumed_runs(path, CONFIG)] == [-1, 512]
    other = chunked_prefill.ChunkedConfig(**{**asdict(CONFIG), "pool_tokens": 8000})
    with pytest.raises(ValueError, match="another configuration"):
        chunked_prefill.resumed_runs(path, other)
    with pytest.raises(ValueError, match="does not exist"):
        chunked_prefill.resumed_runs(tmp_path / "missing.json", CONFIG)


def test_the_writer_rewrites_json_markdown_and_plot_after_each_server_and_resume_reads_them(tmp_path):
    meta = run_meta("chunked_prefill", ["--samples", "2"], **asdict(CONFIG))
    assert meta["command"] == "python -m benchmarks.chunked_prefill --samples 2" and meta["environment"]["cpu_cores"]
    extra = lambda runs: {"against_unchunked": chunked_prefill.against_unchunked(runs)}  # noqa: E731
    write = runs_writer(tmp_path, "cp", meta, chunked_prefill.plot, chunked_prefill.markdown, extra)
    runs = payload()["runs"]
    write(runs[:1])
    write(runs)
    written = json.loads((tmp_path / "cp.json").read_text())
    assert written["runs"] == runs and written["against_unchunked"] == chunked_prefill.against_unchunked(runs)
    assert written["plot"] == "cp.png" and (tmp_path / "cp.png").stat().st_size > 0
    assert "python -m benchmarks.chunked_prefill --samples 2" in (tmp_path / "cp.md").read_text()
    assert [r["chunk_size"] for r in chunked_prefill.resumed_runs(tmp_path / "cp.json", CONFIG)] == [-1, 512]
