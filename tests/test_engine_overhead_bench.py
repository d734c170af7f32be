"""benchmarks/engine_overhead.py end to end in a tiny configuration on the tiny model: both servers
start and stop, every figure is measured, the report is consistent, and nothing is left running."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import engine_overhead

pytestmark = pytest.mark.server


def test_engine_overhead_report_on_the_tiny_model(tiny_llama_dir, tmp_path):
    code = engine_overhead.main(
        [
            "--model", str(tiny_llama_dir), "--policy", "snapkv", "--budget", "0.25", "--pool-tokens", "4096",
            "--prompt-tokens", "300", "--prompts", "2", "--decode-tokens", "8", "--decode-runs", "1",
            "--turn2-runs", "2", "--answer-tokens", "4", "--out", str(tmp_path), "--name", "overhead",
            "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "overhead.json").read_text())
    vanilla, policy = report["vanilla"], report["policy"]
    assert (vanilla["label"], policy["label"]) == ("vanilla", "snapkv@0.25")
    for server in (vanilla, policy):
        samples = server["samples"]
        assert len(samples["prefill"]) == 2 and len(samples["decode"]) == 1 and len(samples["turn2"]) == 2
        assert all(s["cached_tokens"] == 0 and s["prompt_tokens"] > 300 for s in samples["prefill"])
        assert all(s["completion_tokens"] == 8 for s in samples["decode"])  # ignore_eos: always the full length
        for turn2 in samples["turn2"]:
            assert turn2["cached_tokens_reuse"] > 300 and turn2["cached_tokens_no_reuse"] == 0
        assert server["leaks_after_flush"] == []
        assert server["summary"]["decode_tokens_per_second"] > 0
    assert vanilla["memory_per_conversation"] is None
    memory = policy["memory_per_conversation"]
    # snapkv at 0.25 keeps a quarter of the compressed segment (per layer and head, on average).
    assert 0.1 < memory["compressed_ratio"] <= 0.3
    assert memory["compressed_ratio"] < memory["conversation_ratio"] < 1
    ratios = report["ratios"]
    assert ratios["prefill_ttft"] > 0 and ratios["decode_tokens_per_second"] > 0
    assert ratios["policy_turn2_reuse_speedup"] > 0
    text = (tmp_path / "overhead.md").read_text()
    assert "| prefill: TTFT of a fresh" in text and "| compressed segment" in text
    assert report["meta"]["command"].startswith("python -m benchmarks.engine_overhead --model")
    assert psutil.Process().children(recursive=True) == []
