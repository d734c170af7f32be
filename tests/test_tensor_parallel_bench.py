"""benchmarks.tensor_parallel's pure parts: the request options of a method and the report's ratios."""

from __future__ import annotations

from benchmarks.tensor_parallel import markdown, method_options


def test_method_options_name_the_policy_score_and_budget_it_takes():
    assert method_options("lava", "0.25") == "policy=lava,budget=0.25"
    assert method_options("topk:learned", "0.5") == "policy=topk,score=learned,budget=0.5"
    assert method_options("dbudget", "0.25") == "policy=dbudget"  # it decides its own budget


def sample(ttft: float, sent: int = 0, freed: int = 0) -> dict:
    return {"ttft_s": ttft, "bytes_sent_per_rank": sent, "kv_bytes_freed": freed, "exchanges": 2 if sent else 0}


def test_the_report_divides_by_one_rank_and_by_stock_at_the_same_tp():
    meta = {"command": "python -m benchmarks.tensor_parallel", "model": "smollm2", "prompt_tokens": 100, "budget": "0.25",
            "environment": {"cpu_model": "cpu", "cpu_cores": 2, "git_commit": "abc", "date": "today"}}  # fmt: skip
    rows = [
        {"tp": 1, "method": "none", "samples": [sample(4.0)]},
        {"tp": 1, "method": "lava", "samples": [sample(5.0), sample(6.0), sample(7.0)]},
        {"tp": 2, "method": "none", "samples": [sample(3.0)]},
        {"tp": 2, "method": "lava", "samples": [sample(9.0, sent=1024, freed=2**20)]},
    ]
    lines = markdown({"meta": meta, "rows": rows}).splitlines()
    assert "| 1 | lava | 0 | 0.0 | 0.0 | - | 6.00 | 1.00 | 1.50 |" in lines
    assert "| 2 | lava | 2 | 1.0 | 1.0 | 0.10% | 9.00 | 1.50 | 3.00 |" in lines
