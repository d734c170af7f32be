"""The multi-turn benchmark: conversation generator, metrics, a real end-to-end comparison run and a
tiny soak, both against the real launcher serving the tiny random Llama."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from benchmarks import multiturn
from benchmarks.load.client import StreamedReply, check_reply
from benchmarks.load.conversations import ConversationError, ConversationSpec, build_conversations
from benchmarks.load.driver import CompareConfig, DriverError, fewest_dense_slots, pool_sizes
from benchmarks.load.servers import ServerVariant
from benchmarks.load.metrics import RequestRecord, hit_rate, percentile, summarize
from benchmarks.load.soak import FAULT_KINDS


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


def test_tight_pool_leaves_a_policy_server_dense_slots_for_the_longest_conversation():
    variants = (ServerVariant("none"), ServerVariant("lava", "0.25"))
    config = CompareConfig("smollm2", variants, ("large", "tight"), 65536, None, 0.33)
    histories, max_tokens = [1300, 1310, 1317, 1313], 32
    # The launcher's default arena fraction 0.5 halves the dense slots of the policy server.
    dense_slots_of = fewest_dense_slots(config)
    assert dense_slots_of(2000) == 1000
    sizes = pool_sizes(config, histories, max_tokens, dense_slots_of)
    assert sizes.tight_raised_for_dense and dense_slots_of(sizes.tight) >= 1317 + max_tokens > dense_slots_of(sizes.tight - 2)
    vanilla_only = CompareConfig("smollm2", variants[:1], ("large", "tight"), 65536, None, 0.33)
    sizes = pool_sizes(vanilla_only, histories, max_tokens, fewest_dense_slots(vanilla_only))
    assert not sizes.tight_raised_for_dense and sizes.tight == 1730
    explicit = CompareConfig("smollm2", variants, ("tight",), 65536, 2000, 0.33)
    with pytest.raises(DriverError, match="leaves 1000 dense slots, too few for the longest conversation"):
        pool_sizes(explicit, histories, max_tokens, fewest_dense_slots(explicit))


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


def test_compare_refuses_an_unknown_policy_with_the_launchers_message(tmp_path, capsys):
    code = multiturn.main(["compare", "--quick", "--policies", "no-such-policy", "--pools", "large", "--out", str(tmp_path)])
    assert code == 2 and not list(tmp_path.iterdir())
    assert "the launcher refuses no-such-policy@0.25: --kv-evict-policy 'no-such-policy'" in capsys.readouterr().err


@pytest.mark.server
def test_tiny_soak_injects_every_fault_once_and_leaks_nothing(tiny_llama_dir, tmp_path):
    code = multiturn.main(
        [
            "soak", "--model", str(tiny_llama_dir), "--pool-tokens", "2048", "--seconds", "20",
            "--max-requests", str(len(FAULT_KINDS)), "--concurrency", "2", "--max-prompt-tokens", "600",
            "--out", str(tmp_path), "--name", "soak", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert summary["injected"] == {kind: 1 for kind in FAULT_KINDS}
    assert summary["violations"] == [] and summary["malformed"] == [] and summary["leaks"] == 0
    for kind in ("invalid_json", "negative_max_tokens", "wrong_field_type"):
        assert summary["outcomes"] == summary["outcomes"] | {f"{kind}: refused (4xx)": 1}
    assert summary["flush_ok"] and summary["healthy_after"] and summary["final_reply_ok"] and summary["server_alive"]
    assert code == 0 and summary["passed"]
    _no_server_left(tmp_path / "logs")
