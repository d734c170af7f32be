"""benchmarks/engine_overhead.py end to end in a tiny configuration on the tiny model: both servers
start and stop, every figure is measured, the report is consistent, and nothing is left running."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import engine_overhead



def summary(prefill_ttft, decode_tps, reuse, no_reuse):
    return {"prefill_ttft": prefill_ttft, "prefill_tokens_per_second": 1000 / prefill_ttft,
            "decode_tokens_per_second": decode_tps, "turn2_ttft_reuse": reuse, "turn2_ttft_no_reuse": no_reuse}  # fmt: skip


def test_attribution_splits_policy_over_vanilla_into_eviction_and_path():
    vanilla, full, policy = summary(8.0, 5.0, 2.0, 8.0), summary(10.0, 4.0, 2.5, 10.0), summary(6.0, 16.0, 0.25, 7.0)
    split = engine_overhead.attribution(vanilla, full, policy)
    assert split["full_vs_vanilla"] == {"prefill_ttft": 1.25, "prefill_tokens_per_second": 0.8, "decode_tokens_per_second": 0.8,
                                        "turn2_ttft_reuse": 1.25, "turn2_ttft_no_reuse": 1.25}  # fmt: skip
    assert split["policy_vs_full"]["decode_tokens_per_second"] == 4.0 and split["policy_vs_full"]["turn2_ttft_reuse"] == 0.1
    by_stock = engine_overhead.ratios(vanilla, policy)
    for median in engine_overhead.RATIO_MEDIANS:
        assert by_stock[median] == pytest.approx(split["policy_vs_full"][median] * split["full_vs_vanilla"][median])
    assert (by_stock["vanilla_turn2_reuse_speedup"], by_stock["policy_turn2_reuse_speedup"]) == (4.0, 28.0)
    report = {"full": {"summary": full}, "attribution": split}
    assert engine_overhead.attribution_cells(report, "decode_tokens_per_second") == ["4.00", "4.00", "0.80"]
    assert engine_overhead.attribution_cells(report, "turn2_reuse_speedup")[0] == "4.0x"
    # A report of a run that served no full (older result files) says so instead of a ratio.
    assert engine_overhead.attribution_cells({}, "prefill_ttft") == ["full: not in this run", "-", "-"]


@pytest.mark.parametrize("policy", ["full", "none"])
def test_a_policy_that_every_run_serves_is_refused(policy, tmp_path, capsys):
    with pytest.raises(SystemExit):
        engine_overhead.main(["--policy", policy, "--out", str(tmp_path)])
    assert f"--policy {policy}: every run serves it already" in capsys.readouterr().err


@pytest.mark.server
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
    vanilla, full, policy = report["vanilla"], report["full"], report["policy"]
    assert (vanilla["label"], full["label"], policy["label"]) == ("vanilla", "full", "snapkv@0.25")
    for server in (vanilla, full, policy):
        samples = server["samples"]
        assert len(samples["prefill"]) == 2 and len(samples["decode"]) == 1 and len(samples["turn2"]) == 2
        assert all(s["cached_tokens"] == 0 and s["prompt_tokens"] > 300 for s in samples["prefill"])
        assert all(s["completion_tokens"] == 8 for s in samples["decode"])  # ignore_eos: always the full length
        for turn2 in samples["turn2"]:
            assert turn2["cached_tokens_reuse"] > 300 and turn2["cached_tokens_no_reuse"] == 0
        assert server["leaks_after_flush"] == []
        assert server["summary"]["decode_tokens_per_second"] > 0
    assert full["memory_per_conversation"] is None  # nothing compressed
    assert vanilla["memory_per_conversation"] is None
    memory = policy["memory_per_conversation"]
    # snapkv at 0.25 keeps a quarter of the compressed segment (per layer and head, on average).
    assert 0.1 < memory["compressed_ratio"] <= 0.3
    assert memory["compressed_ratio"] < memory["conversation_ratio"] < 1
    ratios = report["ratios"]
    assert ratios["prefill_ttft"] > 0 and ratios["decode_tokens_per_second"] > 0
    assert ratios["policy_turn2_reuse_speedup"] > 0
    attribution = report["attribution"]
    assert attribution["policy_vs_full"]["decode_tokens_per_second"] == pytest.approx(
        policy["summary"]["decode_tokens_per_second"] / full["summary"]["decode_tokens_per_second"]
    )
    assert attribution["full_vs_vanilla"]["prefill_ttft"] > 0
    text = (tmp_path / "overhead.md").read_text()
    assert "| prefill: TTFT of a fresh" in text and "| compressed segment" in text
    assert "| full | snapkv@0.25 | snapkv@0.25 / vanilla | snapkv@0.25 / full | full / vanilla |" in text
    assert report["meta"]["command"].startswith("python -m benchmarks.engine_overhead --model")
    assert psutil.Process().children(recursive=True) == []
