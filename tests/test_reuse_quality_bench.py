"""benchmarks/reuse_quality.py: the two-turn conversation, the summary against stock, and a tiny run
through the real launcher (stock and a policy server) with resume."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import reuse_quality
from sgl_kvevict.measure.tasks import make_task
from bench_checks import check_resume


def count_words(text: str) -> int:
    return len(text.split())


def test_turn_two_resends_turn_one_and_starts_the_answer():
    task = make_task("passkey", seed=1, target_tokens=200, depth=0.5, count_tokens=count_words)
    first = reuse_quality.conversation(task)
    assert first == [{"role": "user", "content": f"{task.context}\n\n{reuse_quality.SUMMARY_INSTRUCTION}"}]
    second = reuse_quality.conversation(task, "A short summary.")
    assert second[:1] == first  # the history is re-sent unchanged: its prefix is what the cache can reuse
    assert second[1:] == [
        {"role": "assistant", "content": "A short summary."},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": task.answer_prefix},
    ]
    assert task.answer not in reuse_quality.SUMMARY_INSTRUCTION + task.question + task.answer_prefix


def test_summary_against_stock():
    stock = {"accuracy": {"value": 0.8}, "turn1_ttft_median": 2.0, "turn2_ttft_median": 1.5}
    policy = {"accuracy": {"value": 0.4}, "turn1_ttft_median": 2.5, "turn2_ttft_median": 0.5}
    ratios = reuse_quality.against_stock(policy, stock)
    assert ratios["accuracy_ratio"] == pytest.approx(0.5)
    assert ratios["turn1_ttft_ratio"] == pytest.approx(1.25) and ratios["turn2_ttft_ratio"] == pytest.approx(1 / 3)
    # 0.5 s more on turn 1, 1.0 s less on turn 2: one reuse gains 0.5 s net
    assert ratios["net_cost_per_reuse_seconds"] == pytest.approx(-0.5)
    assert reuse_quality._changed({"hits": 1, "x": {"y": 2}}, {"hits": 3, "x": {"y": 2}, "new": 1}) == {"hits": 2, "new": 1}
    with pytest.raises(reuse_quality.ReuseError, match="kinds"):
        reuse_quality.ReuseConfig("m", ("lava",), "0.25", 2, 0, 200, ("nope",), 8, 4, 4096)


@pytest.mark.server
def test_reuse_quality_through_the_tiny_server_and_resume(tiny_llama_dir, tmp_path, capsys):
    argv = [
        "--model", str(tiny_llama_dir), "--policies", "snapkv", "--budget", "0.5", "--samples", "2",
        "--document-tokens", "150", "--summary-tokens", "6", "--answer-tokens", "3", "--pool-tokens", "4096",
        "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert reuse_quality.main(argv) == 0
    assert psutil.Process().children(recursive=True) == []
    report = json.loads((tmp_path / "reuse_quality.json").read_text())
    stock, policy = report["servers"]
    assert (stock["label"], policy["label"]) == ("vanilla", "snapkv@0.5")
    for server in (stock, policy):
        assert [s["index"] for s in server["samples"]] == [0, 1]
        for sample in server["samples"]:
            assert sample["turn2_prompt_tokens"] > sample["turn1_prompt_tokens"] > 150
            assert sample["reused"] and sample["turn2_cached_tokens"] >= sample["turn1_prompt_tokens"]
            assert sample["turn1_ttft"] > 0 and sample["turn2_ttft"] > 0
        assert server["summary"]["reuse_rate"] == 1.0 and server["summary"]["accuracy"]["n"] == 2
    # the policy server's own counters moved while turn 2 reused the compressed turn 1; stock has none
    assert all(sample["stats_change"] for sample in policy["samples"])
    assert all(not sample["stats_change"] for sample in stock["samples"])
    assert stock["vs_stock"] is None and policy["vs_stock"]["turn1_ttft_ratio"] > 0
    text = (tmp_path / "reuse_quality.md").read_text()
    assert "| snapkv@0.5 |" in text and "net cost per reuse" in text
    check_resume(reuse_quality.main, argv, tmp_path / "logs", capsys, ["--samples", "3"])
