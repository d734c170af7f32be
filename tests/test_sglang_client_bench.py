"""SGLang's own benchmark client from the project's environment, and the driver that runs it against
stock SGLang and a plugin server (the real launcher, the tiny random Llama)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from benchmarks import sglang_client
from benchmarks.sglang_client import Workload
from sgl_kvevict.measure.servers import ServerError, attributed_variants, server_variants, under_schedules
from engine_client import MEMORY_FLAGS


def test_sglangs_client_starts_from_the_environment():
    """`python -m sglang.benchmark.serving` as SGLang documents it: torchvision (imported through
    transformers) and datasets must import without our launcher (sgl_kvevict/torchvision_hook.py)."""
    result = subprocess.run(
        [sys.executable, "-m", "sglang.benchmark.serving", "--help"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generated-shared-prefix" in result.stdout and "sglang-oai-chat" in result.stdout


def test_workload_is_validated_and_becomes_the_clients_flags():
    with pytest.raises(ValueError, match="groups, turns"):
        Workload(groups=0, turns=0)
    workload = Workload(groups=3, prompts_per_group=5, turns=2)
    assert workload.requests == 30
    args = workload.client_args()
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--backend"] == "sglang-oai-chat" and flags["--dataset-name"] == "generated-shared-prefix"
    assert (flags["--gsp-num-groups"], flags["--gsp-prompts-per-group"], flags["--gsp-num-turns"]) == ("3", "5", "2")
    assert flags["--warmup-requests"] == "0"  # the driver warms up and flushes itself


def test_ratios_split_each_policy_into_eviction_and_path():
    """policy / vanilla, policy / full of its scope and schedule, full / vanilla: field by field, and
    policy / vanilla = policy / full x full / vanilla."""

    def finished(variant, throughput, ttft, itl):
        client = {"output_throughput": throughput, "median_ttft_ms": ttft, "p90_ttft_ms": 2 * ttft, "mean_itl_ms": itl,
                  "median_itl_ms": itl / 2}  # fmt: skip
        return {"label": variant.label, "variant": asdict(variant), "error": None, "client": client}

    variants = under_schedules(attributed_variants(["topk:learned"], ["0.25"], ["block"]), ["overlap", "serial"])
    vanilla, vanilla_serial, full, full_serial, policy, policy_serial = variants
    runs = [
        finished(vanilla, 4.0, 2000.0, 10.0),
        finished(vanilla_serial, 3.0, 2000.0, 10.0),
        finished(full, 2.0, 2500.0, 20.0),
        finished(full_serial, 1.0, 4000.0, 40.0),
        finished(policy, 6.0, 500.0, 12.0),
        {**finished(policy_serial, 0, 0, 0), "error": "the launcher exited"},
    ]
    rows = {row["comparison"]: row for row in sglang_client.ratios(runs)}
    assert list(rows) == ["vanilla serial / vanilla", "full block / vanilla", "full block serial / vanilla",
                          "topk:learned@0.25 block / vanilla", "topk:learned@0.25 block / full block"]  # fmt: skip
    assert rows["full block / vanilla"] == {
        "comparison": "full block / vanilla", "output_throughput": 0.5, "median_ttft_ms": 1.25, "p90_ttft_ms": 1.25,
        "mean_itl_ms": 2.0, "median_itl_ms": 2.0,
    }  # fmt: skip
    by_stock, by_full = rows["topk:learned@0.25 block / vanilla"], rows["topk:learned@0.25 block / full block"]
    assert (by_stock["output_throughput"], by_stock["median_ttft_ms"], by_stock["mean_itl_ms"]) == (1.5, 0.25, 1.2)
    assert (by_full["output_throughput"], by_full["median_ttft_ms"], by_full["median_itl_ms"]) == (3.0, 0.2, 0.6)
    for field, _ in sglang_client.RATIO_FIELDS:
        assert by_stock[field] == pytest.approx(by_full[field] * rows["full block / vanilla"][field])
    assert sglang_client.ratios(runs[2:]) == [rows["topk:learned@0.25 block / full block"]]  # no vanilla: only vs full


def test_full_is_served_in_every_scope_after_vanilla():
    variants = attributed_variants(["topk:learned", "full"], ["0.25", "0.5"], ["request", "block"], 128)
    assert [v.label for v in variants] == [
        "vanilla", "full", "full block 128", "topk:learned@0.25", "topk:learned@0.25 block 128",
        "topk:learned@0.5", "topk:learned@0.5 block 128",
    ]  # fmt: skip
    assert variants[2].launcher_flags() == ["--kv-evict-policy", "full", "--kv-evict-scope", "block", "--kv-evict-block-size", "128"]
    assert all(v.full_counterpart == variants[1 + (v.tag != "")] for v in variants[3:])
    assert attributed_variants([], ["0.25"]) == server_variants([], ["0.25"])  # vanilla alone: nothing to attribute
    only_full = attributed_variants(["full"], ["0.25"], ["request", "block"])  # stock vs full, nothing evicted
    assert only_full == server_variants(["full"], [None], ["request", "block"])


@pytest.mark.server
def test_client_runs_against_stock_and_plugin_servers(tiny_llama_dir, tmp_path):
    """The cheapest real run: one shared system prompt, two chats of two turns, four answer tokens."""
    out = tmp_path / "results"
    code = sglang_client.main(
        [
            "--model", str(tiny_llama_dir), "--policies", "topk:attn", "--budgets", "0.5", "--pool-tokens", "4000",
            *(f"--server-arg={flag}" for flag in MEMORY_FLAGS),
            "--groups", "1", "--prompts-per-group", "2", "--turns", "2", "--system-prompt-tokens", "96",
            "--question-tokens", "8", "--output-tokens", "4", "--concurrency", "2",
            "--out", str(out), "--name", "client", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    report = json.loads((out / "client.json").read_text())
    vanilla, full, policy = report["runs"]
    assert code == 0, [run["error"] for run in report["runs"]]
    assert (vanilla["label"], full["label"], policy["label"]) == ("vanilla", "full", "topk:attn@0.5")
    for run in report["runs"]:
        assert run["client"]["completed"] == 4 and run["client"]["output_throughput"] > 0
        assert run["cache_report"]["total_cached_tokens"] > 0  # turn 2 re-sends turn 1
        assert run["leaks_after_flush"] == [] and run["log_leak_warnings"] == []
    assert vanilla["kvevict_stats"]["last"] == {"policy": "none"}
    assert full["kvevict_stats"]["last"]["policy"] == "full" and full["kvevict_stats"]["peaks"]["compressed_nodes"] == 0
    assert policy["kvevict_stats"]["last"]["requests_compressed"] >= 1
    assert policy["kvevict_stats"]["peaks"]["compressed_nodes"] >= 1
    comparisons = [row["comparison"] for row in report["ratios"]]
    assert comparisons == ["full / vanilla", "topk:attn@0.5 / vanilla", "topk:attn@0.5 / full"]
    assert all(row["output_throughput"] > 0 and row["median_itl_ms"] > 0 for row in report["ratios"])
    text = (out / "client.md").read_text()
    assert "| topk:attn@0.5 / full |" in text and "| full / vanilla |" in text and (out / "client.png").stat().st_size > 0
