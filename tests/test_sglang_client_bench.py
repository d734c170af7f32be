"""SGLang's own benchmark client from the project's environment, and the driver that runs it against
stock SGLang and a plugin server (the real launcher, the tiny random Llama)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import sglang_client
from benchmarks.load.servers import ServerError, server_variants, under_schedules
from benchmarks.sglang_client import Workload
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


def test_ratios_are_against_the_vanilla_run_of_the_same_report():
    def finished(policy, label, throughput, ttft):
        client = {"output_throughput": throughput, "median_ttft_ms": ttft, "p90_ttft_ms": ttft, "mean_itl_ms": 10.0}
        return {"label": label, "variant": {"policy": policy}, "error": None, "client": client}

    runs = [
        finished("none", "vanilla", 4.0, 2000.0),
        finished("topk:learned", "topk:learned@0.25", 6.0, 500.0),
        {"label": "lava@0.25", "variant": {"policy": "lava"}, "error": "the launcher exited"},
    ]
    [row] = sglang_client.ratios(runs)
    assert row["label"] == "topk:learned@0.25"
    assert (row["output_throughput"], row["median_ttft_ms"], row["mean_itl_ms"]) == (1.5, 0.25, 1.0)
    assert sglang_client.ratios(runs[1:]) == []  # no vanilla run: nothing to compare with


def test_every_variant_runs_under_every_schedule_in_turn():
    variants = server_variants(["topk:learned"], ["0.25"], ["request", "block"])
    both = under_schedules(variants, ["overlap", "serial"])
    assert [v.label for v in both] == [
        "vanilla", "vanilla serial", "topk:learned@0.25", "topk:learned@0.25 serial",
        "topk:learned@0.25 block", "topk:learned@0.25 block serial",
    ]  # fmt: skip
    assert both[1].launcher_flags()[-1] == "--disable-overlap-schedule" and "--disable-overlap-schedule" not in both[0].launcher_flags()
    assert under_schedules(variants, ["overlap"]) == variants
    with pytest.raises(ServerError, match="choose from overlap, serial"):
        under_schedules(variants, ["eager"])


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
    vanilla, policy = report["runs"]
    assert code == 0, [run["error"] for run in report["runs"]]
    assert (vanilla["label"], policy["label"]) == ("vanilla", "topk:attn@0.5")
    for run in report["runs"]:
        assert run["client"]["completed"] == 4 and run["client"]["output_throughput"] > 0
        assert run["cache_report"]["total_cached_tokens"] > 0  # turn 2 re-sends turn 1
        assert run["leaks_after_flush"] == [] and run["log_leak_warnings"] == []
    assert vanilla["kvevict_stats"]["last"] == {"policy": "none"}
    assert policy["kvevict_stats"]["last"]["requests_compressed"] >= 1
    assert policy["kvevict_stats"]["peaks"]["compressed_nodes"] >= 1
    [ratio] = report["ratios"]
    assert ratio["label"] == "topk:attn@0.5" and ratio["output_throughput"] > 0
    assert "| topk:attn@0.5 |" in (out / "client.md").read_text() and (out / "client.png").stat().st_size > 0
