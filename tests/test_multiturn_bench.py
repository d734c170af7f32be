"""The multi-turn benchmark: conversation generator, metrics, a real end-to-end comparison run and a
tiny soak, both against the real launcher serving the tiny random Llama."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from benchmarks import multiturn
from benchmarks.load.conversations import ConversationError, ConversationSpec, build_conversations
from benchmarks.load.driver import DriverError, compare_pools, history_tokens, sweep_pools, workload
from benchmarks.load.metrics import RequestRecord, hit_rate, percentile, summarize
from benchmarks.load.soak import FAULT_KINDS, LONG_KINDS, stats_leaks
from sgl_kvevict.measure.client import StreamedReply, check_reply, numeric_fields
from sgl_kvevict.measure.servers import ServerError, server_variants


def count_words(text: str) -> int:
    return len(text.split())


def spec(**overrides) -> ConversationSpec:
    values = dict(users=3, turns=4, document_tokens=300, fact_every=2, shared_document=False, seed=5)
    return ConversationSpec(**{**values, **overrides})


def test_conversations_are_deterministic_and_hold_their_facts():
    first = build_conversations(spec(), count_words)
    assert first == build_conversations(spec(), count_words)
    assert first[0].document != build_conversations(spec(seed=6), count_words)[0].document
    assert len({c.document for c in first}) == 3  # one document per user
    for conversation in first:
        assert 280 <= count_words(conversation.document) <= 330
        filler = conversation.document
        for fact in conversation.facts:
            filler = filler.replace(fact.statement, "")
        assert not re.search(r"\d", filler)  # the only numbers are the facts' answers
        for fact in conversation.facts:
            assert conversation.document.count(fact.statement) == 1
            assert fact.answer in fact.statement and fact.answer not in fact.question
        scored = [t for t in conversation.turns if t.fact is not None]
        assert [i for i, t in enumerate(conversation.turns) if t.fact] == [1, 3]  # every 2nd turn
        assert len({t.fact.answer for t in scored}) == len(scored)
        assert conversation.document in conversation.user_message(0)
        assert conversation.document not in conversation.user_message(1)


def test_shared_document_is_one_document_with_user_specific_questions():
    conversations = build_conversations(spec(shared_document=True, fact_every=1), count_words)
    assert len({c.document for c in conversations}) == 1
    orders = [tuple(t.fact.answer for t in c.turns) for c in conversations]
    assert len(set(orders)) > 1
    assert all(answer in conversations[0].document for order in orders for answer in order)


def test_fact_scoring_is_exact_match_of_the_number():
    fact = build_conversations(spec(fact_every=1), count_words)[0].facts[0]
    assert fact.is_answered_by(f"The answer is {fact.answer}.")
    assert not fact.is_answered_by(f"The answer is 9{fact.answer}.")
    assert not fact.is_answered_by("I do not know.")


def test_spec_validation():
    with pytest.raises(ConversationError, match="users"):
        spec(users=0)
    with pytest.raises(ConversationError, match="facts"):
        spec(turns=200, fact_every=1)


def test_shared_system_prompt_opens_every_conversation():
    conversations = build_conversations(spec(system_prompt_tokens=200), count_words)
    prompts = {c.system_prompt for c in conversations}
    assert len(prompts) == 1 and len({c.document for c in conversations}) == 3
    (prompt,) = prompts
    assert 180 <= count_words(prompt) <= 230 and not re.search(r"\d", prompt)
    assert conversations[0].opening_messages() == [{"role": "system", "content": prompt}]
    assert build_conversations(spec(), count_words)[0].opening_messages() == []
    # The system prompt counts in the history every pool is sized from.
    with_system = history_tokens(conversations[0], count_words, 32)
    without = history_tokens(build_conversations(spec(), count_words)[0], count_words, 32)
    assert with_system - without == count_words(prompt) + 5
    with pytest.raises(ConversationError, match="system_prompt_tokens"):
        spec(system_prompt_tokens=10)


def test_pools_hold_the_longest_request_dense_for_every_server():
    load = workload([1300, 1310, 1317, 1313], max_tokens=32)
    assert (load.all_histories, load.longest_request) == (5240, 1349)
    large, tight = compare_pools(("large", "tight"), load, 65536, None, 0.33)
    assert (large.tokens, tight.tokens) == (65536, 1730)  # a third of all histories, the same for every server
    with pytest.raises(DriverError, match="cannot hold the longest request dense"):
        compare_pools(("tight",), load, 65536, 1300, 0.33)
    with pytest.raises(DriverError, match="holds every history"):
        compare_pools(("tight",), load, 65536, 6000, 0.33)
    sweep = sweep_pools(workload([2000] * 6, 32))
    assert [(p.name, p.tokens) for p in sweep] == [("1.00", 12000), ("0.75", 9000), ("0.50", 6000), ("0.25", 3000)]
    given = sweep_pools(workload([2000] * 6, 32), sizes=(3000, 12000))
    assert [(p.name, p.tokens) for p in given] == [("1.00", 12000), ("0.25", 3000)]
    with pytest.raises(DriverError, match="cannot hold"):
        sweep_pools(workload([2000] * 2, 32), fractions=(1, 0.25))


def test_server_variants_carry_score_scope_and_block_size():
    variants = server_variants(["lava", "topk:kvzip"], ["0.25"], ["request", "block"], 128)
    assert [v.label for v in variants] == [
        "vanilla", "lava@0.25", "lava@0.25 block 128", "topk:kvzip@0.25", "topk:kvzip@0.25 block 128",
    ]  # fmt: skip
    assert variants[4].launcher_flags() == [
        "--kv-evict-policy", "topk", "--kv-evict-score", "kvzip", "--kv-evict-budget", "0.25",
        "--kv-evict-scope", "block", "--kv-evict-block-size", "128",
    ]  # fmt: skip
    assert variants[0].launcher_flags() == ["--kv-evict-policy", "none"]
    with pytest.raises(ServerError, match="scopes"):
        server_variants(["lava"], ["0.25"], ["tree"])
    with pytest.raises(ServerError, match="block scope only"):
        server_variants(["lava"], ["0.25"], ["request"], 128)


def test_ratios_attribute_each_policy_to_eviction_and_to_the_path():
    """At each pool: full / vanilla, policy / vanilla and policy / full of the policy's scope (made-up
    metrics); a scope whose full failed gives no policy / full row."""
    from benchmarks.load.driver import RunResult
    from benchmarks.load.metrics import RunMetrics
    from benchmarks.load.report import ratios
    from sgl_kvevict.measure.servers import attributed_variants
    from benchmarks.load.users import RunOutcome

    def outcome(output_tps, ttft, hit):
        metrics = RunMetrics(
            requests=4, failed_requests=0, malformed_replies=0, wall_seconds=10.0, requests_per_second=0.4,
            output_tokens_per_second=output_tps, ttft={"p50": ttft, "p90": ttft, "p99": ttft},
            latency={"p50": 1.0, "p90": 1.0, "p99": 1.0}, fact_questions=0, fact_correct=0, accuracy=None,
            prompt_tokens=1000, cached_tokens=int(1000 * hit), prompt_tokens_recomputed=1000 - int(1000 * hit),
            hit_rate=hit, hit_rate_by_turn=[hit],
        )  # fmt: skip
        return RunOutcome([], metrics, None, 4000)

    vanilla, full, full_block, lava, lava_block = attributed_variants(["lava"], ["0.25"], ["request", "block"])
    figures = {vanilla: (4.0, 2.0, 0.5), full: (2.0, 4.0, 0.5), lava: (8.0, 0.5, 0.8), lava_block: (6.0, 1.0, 0.8)}
    results = [RunResult("tight", 3000, v, outcome(*figures[v]), None, 1.0, (0, 0, 0)) for v in figures]
    results.insert(2, RunResult("tight", 3000, full_block, None, "the launcher exited", 0.0, (0, 0, 0)))
    rows = {row["comparison"]: row for row in ratios(results)}
    assert list(rows) == ["full / vanilla", "lava@0.25 / vanilla", "lava@0.25 / full", "lava@0.25 block / vanilla"]
    assert (rows["full / vanilla"]["output_tokens_per_second"], rows["full / vanilla"]["ttft_p50"]) == (0.5, 2.0)
    assert (rows["lava@0.25 / full"]["output_tokens_per_second"], rows["lava@0.25 / full"]["ttft_p50"]) == (4.0, 0.125)
    assert rows["lava@0.25 / full"]["hit_rate"] == pytest.approx(1.6)
    for field in ("output_tokens_per_second", "ttft_p50", "hit_rate"):
        assert rows["lava@0.25 / vanilla"][field] == pytest.approx(rows["lava@0.25 / full"][field] * rows["full / vanilla"][field])


def test_engine_stats_are_read_generically():
    stats = {"policy": "lava", "slots_borrowed": 12, "evictions": {"dense": 3, "compressed": 1}, "ok": True, "x": [1]}
    assert numeric_fields(stats) == {"slots_borrowed": 12, "evictions.dense": 3, "evictions.compressed": 1}
    assert stats_leaks({"cells_used": 0, "slots_free": 10, "slots_total": 10}) == []
    leaks = stats_leaks({"cells_used": 4, "pool": {"slots_free": 9, "slots_total": 10}})
    assert leaks == ["cells_used 4 after flush", "pool.slots_free 9 != pool.slots_total 10"]


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(4.0 + 0.6 * 6.0)  # numpy.percentile(values, 90)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def record(user, turn, prompt, cached, completion=4, ttft=1.0, latency=2.0, expected=None, correct=None, error=None):
    return RequestRecord(
        user=user, turn=turn, started=0.0, ttft=ttft, latency=latency, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion, reply="", finish_reason="stop", expected=expected, correct=correct,
        error=error, problems=(),
    )  # fmt: skip


def test_summary_of_synthetic_records():
    records = [
        record(0, 0, 1000, 0, ttft=3.0, latency=5.0),
        record(0, 1, 1050, 1000, ttft=1.0, latency=2.0, expected="42", correct=True),
        record(1, 0, 900, 100, ttft=2.0, latency=4.0),
        record(1, 1, 950, 0, expected="7", correct=False),
        record(1, 2, 0, 0, ttft=None, latency=None, error="HTTP 500"),
    ]
    metrics = summarize(records, wall_seconds=10.0, turns=3)
    assert metrics.requests == 4 and metrics.failed_requests == 1
    assert metrics.requests_per_second == pytest.approx(0.4)
    assert metrics.output_tokens_per_second == pytest.approx(1.6)
    assert metrics.prompt_tokens == 3900 and metrics.cached_tokens == 1100
    assert metrics.hit_rate == pytest.approx(1100 / 3900)
    assert metrics.prompt_tokens_recomputed == 2800
    assert metrics.hit_rate_by_turn == [pytest.approx(100 / 1900), pytest.approx(1000 / 2000), None]
    assert metrics.ttft["p50"] == pytest.approx(1.5) and metrics.latency["p50"] == pytest.approx(3.0)
    assert (metrics.fact_questions, metrics.fact_correct, metrics.accuracy) == (2, 1, 0.5)
    assert hit_rate([]) is None


def test_well_formed_reply_check():
    good = StreamedReply(text="hi", prompt_tokens=40, cached_tokens=10, completion_tokens=8, finish_reason="length", done=True)
    assert check_reply(good, max_tokens=8) == []
    bad = StreamedReply(text="hi", prompt_tokens=40, cached_tokens=50, completion_tokens=3, finish_reason="length")
    problems = " ".join(check_reply(bad, max_tokens=8))
    assert "[DONE]" in problems and "cached_tokens" in problems and "length after 3" in problems


def _no_server_left(log_dir) -> None:
    assert psutil.Process().children(recursive=True) == []
    for log in log_dir.glob("server-*.log"):
        assert log.read_text().rstrip().endswith("[sgl-kvevict] stopped"), log


@pytest.mark.server
def test_compare_end_to_end_on_the_tiny_model(tiny_llama_dir, tmp_path):
    code = multiturn.main(
        [
            "compare", "--model", str(tiny_llama_dir), "--pools", "large", "--users", "2", "--turns", "2",
            "--document-tokens", "150", "--fact-every", "1", "--max-tokens", "4", "--large-pool", "8192",
            "--out", str(tmp_path), "--name", "bench", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {"cpu_model", "cpu_cores", "sglang", "torch", "git_commit"} <= report["environment"].keys()
    (run,) = report["runs"]
    assert run["label"] == "vanilla" and run["pool"] == "large" and run["error"] is None
    assert run["pool_tokens"] == 8192
    metrics = run["metrics"]
    assert metrics["requests"] == 4 and metrics["failed_requests"] == 0 and metrics["malformed_replies"] == 0
    assert metrics["fact_questions"] == 4 and metrics["accuracy"] is not None
    assert metrics["ttft"]["p50"] > 0 and metrics["latency"]["p99"] >= metrics["latency"]["p50"]
    assert metrics["output_tokens_per_second"] > 0
    # Turn 2 re-sends turn 1's history, which the prefix cache holds on a large pool.
    assert metrics["hit_rate_by_turn"][1] > 0.8
    assert [(r["user"], r["turn"]) for r in run["records"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "| large | vanilla | 8192 |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    _no_server_left(tmp_path / "logs")


@pytest.mark.server
def test_sweep_end_to_end_then_resume_keeps_every_finished_server(tiny_llama_dir, tmp_path, capsys):
    argv = [
        "sweep", "--model", str(tiny_llama_dir), "--users", "2", "--turns", "2", "--document-tokens", "150",
        "--system-prompt-tokens", "100", "--max-tokens", "4", "--policies", "snapkv", "--budgets", "0.5",
        "--scopes", "block", "--block-size", "80", "--pool-sizes", "4096,1536", "--out", str(tmp_path),
        "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert multiturn.main(argv) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["meta"]["kind"] == "sweep" and report["meta"]["conversations"]["system_prompt_tokens"] == 100
    runs = [(r["pool_tokens"], r["label"], r["error"]) for r in report["runs"]]
    assert runs == [(4096, "vanilla", None), (4096, "full block 80", None), (4096, "snapkv@0.5 block 80", None),
                    (1536, "vanilla", None), (1536, "full block 80", None), (1536, "snapkv@0.5 block 80", None)]  # fmt: skip
    assert all(r["metrics"]["requests"] == 4 and r["metrics"]["failed_requests"] == 0 for r in report["runs"])
    ratios = sorted((row["comparison"], row["pool_tokens"]) for row in report["ratios"])
    assert ratios == sorted(
        [(comparison, pool) for pool in (4096, 1536) for comparison in
         ("full block 80 / vanilla", "snapkv@0.5 block 80 / vanilla", "snapkv@0.5 block 80 / full block 80")]
        + [(f"vanilla {report['runs'][3]['pool']} / vanilla {report['runs'][0]['pool']}", 1536)]
    )  # fmt: skip
    assert report["runs"][1]["kvevict_stats"]["peaks"]["compressed_nodes"] == 0  # full keeps every block dense
    policy = report["runs"][2]
    assert policy["kvevict_stats"]["available"] and policy["kvevict_stats"]["peaks"]
    assert policy["kvevict_stats"]["peaks"]["compressed_nodes"] > 0  # the blocks were compressed, not left dense
    assert report["runs"][0]["kvevict_stats"]["peaks"] == {}  # vanilla's /kvevict/stats is {"policy": "none"}
    text = (tmp_path / "sweep.md").read_text()
    assert "| vanilla |" in text and "Engine stats of snapkv@0.5 block 80" in text and "facts correct [95% CI]" in text
    assert "| snapkv@0.5 block 80 / full block 80 |" in text and "vs full: tok/s / TTFT p50 / hit rate" in text
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    _no_server_left(tmp_path / "logs")
    logs = sorted((tmp_path / "logs").iterdir())
    capsys.readouterr()

    assert multiturn.main([*argv, "--resume"]) == 0
    assert sorted((tmp_path / "logs").iterdir()) == logs  # no server started again
    assert capsys.readouterr().out.count("done before, kept") == 6
    assert json.loads((tmp_path / "sweep.json").read_text())["runs"] == report["runs"]
    with pytest.raises(SystemExit):
        multiturn.main([*argv, "--resume", "--users", "3"])
    assert "is of another run (differs in conversations, pools)" in capsys.readouterr().err


def test_compare_refuses_an_unknown_policy_with_the_launchers_message(tmp_path, capsys):
    code = multiturn.main(["compare", "--quick", "--policies", "no-such-policy", "--pools", "large", "--out", str(tmp_path)])
    assert code == 2 and not list(tmp_path.iterdir())
    assert "the launcher refuses no-such-policy@0.25: --kv-evict-policy 'no-such-policy'" in capsys.readouterr().err


@pytest.mark.server
def test_tiny_soak_injects_every_fault_once_and_leaks_nothing(tiny_llama_dir, tmp_path):
    """Block scope with 256-token chunks: long prompts are prefilled in chunks, one is aborted while
    prefilling, one is longer than the pool (served, compressed while prefilled), one is just under the
    model's context length (served, or refused for its length: never an error)."""
    code = multiturn.main(
        [
            "soak", "--model", str(tiny_llama_dir), "--policy", "snapkv", "--budget", "0.3", "--scopes", "block",
            "--block-size", "128", "--server-arg=--chunked-prefill-size=256", "--server-arg=--dtype=float32",
            "--pool-tokens", "2048", "--seconds", "60", "--max-requests", str(len(FAULT_KINDS + LONG_KINDS)),
            "--concurrency", "2", "--max-prompt-tokens", "600", "--long-prompt-tokens", "1200",
            "--out", str(tmp_path), "--name", "soak", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    payload = json.loads((tmp_path / "soak.json").read_text())
    (run,) = payload["runs"]
    summary = run["summary"]
    assert summary["injected"] == {kind: 1 for kind in FAULT_KINDS + LONG_KINDS}
    assert summary["violations"] == [] and summary["malformed"] == [] and summary["leaks"] == 0
    for kind in ("invalid_json", "negative_max_tokens", "wrong_field_type"):
        assert summary["outcomes"] == summary["outcomes"] | {f"{kind}: refused (4xx)": 1}
    # 2048 + 256 tokens, more than the pool, served in block scope; the long prompt too, in chunks.
    assert summary["outcomes"] == summary["outcomes"] | {"beyond_pool: completed": 1, "long_prompt: completed": 1}
    near_limit = {k: n for k, n in summary["outcomes"].items() if k.startswith("near_limit: ")}
    assert near_limit in ({"near_limit: completed": 1}, {"near_limit: refused as too long (error in stream)": 1},
                          {"near_limit: refused as too long (4xx)": 1}), near_limit  # fmt: skip
    assert summary["stats_after_flush"]["chunked_prefills"] >= 2
    assert summary["flush_ok"] and summary["healthy_after"] and summary["final_reply_ok"] and summary["server_alive"]
    assert code == 0 and summary["passed"] and payload["summary"]["passed"]
    _no_server_left(tmp_path / "logs")


def test_sigterm_to_a_benchmark_unwinds_so_its_servers_are_stopped(tmp_path):
    """``launched_server`` stops its launcher in a ``finally``; under ``sigterm_raises`` a SIGTERM (a
    ``kill`` of the benchmark) reaches that ``finally`` instead of ending the process where it stands."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "stopped"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from sgl_kvevict.measure.servers import sigterm_raises\n"
        "with sigterm_raises():\n"
        "    try:\n"
        "        print('ready', flush=True); time.sleep(60)\n"
        f"    finally:\n        open({str(marker)!r}, 'w').write('stopped')\n"
    )], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 30 and marker.read_text() == "stopped"
    finally:
        child.kill()
        child.wait()
