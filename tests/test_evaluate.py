"""``python -m sgl_kvevict.evaluate``: answer comparison, probes, the recommendation on synthetic
results, the command's refusals (one line, exit 2, before any server starts), and real runs through
the launcher on the tiny model: both question forms, both scopes, a threshold candidate, a document
skipped as too long, --resume, and Ctrl-C leaving no server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sgl_kvevict.evaluate import __main__ as evaluate
from sgl_kvevict.evaluate.fidelity import (
    Candidate,
    Cell,
    answers_needed,
    bucket_of,
    contains_reference,
    document_correlation,
    exact,
    expected_fidelity,
    group_label,
    length_groups,
    recommend,
    token_f1,
)
from sgl_kvevict.evaluate.inputs import NEXT_SENTENCE_PREFIX, InputError, probes, read_documents, sentences
from sgl_kvevict.evaluate.report import analyse, calibration_correlation, document_interval, recommendation_lines
from sgl_kvevict.measure.servers import ServerError
from sgl_kvevict.measure.tasks import filler_sentence

ROOT = Path(__file__).resolve().parent.parent


def test_answers_compare_after_normalisation_and_by_token_f1():
    assert exact("The platform is 12.", "platform is 12")
    assert not exact("platform 12", "platform 13")
    assert token_f1("the red cat sat", "a red cat stood") == pytest.approx(2 / 3)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0
    assert contains_reference("It is in room 42, upstairs.", "room 42") and not contains_reference("room 421", "room 42")


def test_length_buckets_are_powers_of_two_in_k_tokens():
    assert [bucket_of(n) for n in (500, 1024, 2047, 2048, 5000, 9000)] == ["<1K", "1K-2K", "1K-2K", "2K-4K", "4K-8K", "8K-16K"]


def _candidate(label, value, cells, knob="budget", family=("topk",), per_document=None):
    """``cells``: per bucket (multi-request matches, multi-turn matches, answers per form, kept share);
    4 documents per bucket, or ``per_document`` answers on each."""
    return Candidate(label, family, knob, value, (f"--{knob}", str(value)),
                     {b: Cell({"multi-request": mr, "multi-turn": mt}, {"multi-request": n, "multi-turn": n}, share,
                              n // per_document if per_document else 4)
                      for b, (mr, mt, n, share) in cells.items()})  # fmt: skip


def test_the_expected_fidelity_is_laplaces_rule_and_sets_the_answers_a_target_needs():
    assert expected_fidelity(24, 24) == pytest.approx(25 / 26) and expected_fidelity(0, 0) == 0.5
    assert answers_needed(0.95) == 18 and answers_needed(0.99) == 98 and answers_needed(0.5) == 0
    assert expected_fidelity(18, 18) >= 0.95 > expected_fidelity(17, 17)
    assert answers_needed(1.0) == float("inf")
    cell = Cell({"multi-request": 9, "multi-turn": 10}, {"multi-request": 10, "multi-turn": 10}, 0.5)
    assert cell.measured("both") == 0.9 and cell.measured("multi-turn") == 1.0
    assert cell.reads("both") == pytest.approx(10 / 12) and cell.reads("multi-turn") == pytest.approx(11 / 12)


def test_small_length_buckets_join_their_neighbours_until_they_can_show_the_target():
    assert length_groups({"1K-2K": 3, "2K-4K": 9, "4K-8K": 6}, 18) == [("1K-2K", "2K-4K", "4K-8K")]
    assert length_groups({"4K-8K": 20, "2K-4K": 30, "1K-2K": 3}, 18) == [("1K-2K", "2K-4K"), ("4K-8K",)]
    assert length_groups({"2K-4K": 30, "4K-8K": 5}, 18) == [("2K-4K", "4K-8K")]  # a short remainder joins the last group
    assert [group_label(g) for g in (("2K-4K",), ("1K-2K", "2K-4K", "4K-8K"), ("<1K", "1K-2K"))] == ["2K-4K", "1K-8K", "<2K"]
    merged = Cell.merged([Cell({"multi-request": 3, "multi-turn": 2}, {"multi-request": 3, "multi-turn": 3}, 0.4, 1),
                          Cell({"multi-request": 6, "multi-turn": 6}, {"multi-request": 6, "multi-turn": 6}, 0.7, 2)])  # fmt: skip
    assert merged.matches == {"multi-request": 9, "multi-turn": 8} and merged.n == {"multi-request": 9, "multi-turn": 9}
    assert merged.kept_share == pytest.approx(0.6) and merged.documents == 3


def test_the_recommendation_is_the_smallest_budget_meeting_the_target_at_every_length():
    candidates = [
        _candidate("0.25", 0.25, {"2K-4K": (40, 36, 40, 0.3), "4K-8K": (32, 28, 40, 0.3)}),
        _candidate("0.4", 0.4, {"2K-4K": (40, 40, 40, 0.45), "4K-8K": (36, 40, 40, 0.45)}),
        _candidate("0.6", 0.6, {"2K-4K": (40, 39, 40, 0.65), "4K-8K": (40, 39, 40, 0.65)}),
    ]
    both = recommend(candidates, ["4K-8K", "2K-4K"], 0.95, "both")
    assert both.chosen.label == "0.6" and both.predicted == {"2K-4K": pytest.approx(40 / 42), "4K-8K": pytest.approx(40 / 42)}
    assert {b: c.label for b, c in both.per_bucket.items()} == {"2K-4K": "0.4", "4K-8K": "0.6"}
    assert recommend(candidates, ["2K-4K", "4K-8K"], 0.95, "multi-turn").chosen.label == "0.4"
    assert recommend(candidates, ["2K-4K"], 0.85, "both").chosen.label == "0.25"
    nothing = recommend(candidates, ["2K-4K", "4K-8K"], 0.99, "both")
    assert nothing.chosen is None and nothing.flag_lines(["--kv-evict-policy", "none"]) == ["--kv-evict-policy none"]


def test_a_perfect_score_on_few_answers_recommends_nothing_and_a_lone_bucket_is_judged_with_its_neighbours():
    # Three probes on the one 1K-2K document, all equal to stock's, do not make 0.25 safe there.
    candidates = [_candidate("0.25", 0.25, {"1K-2K": (3, 3, 3, 0.4), "2K-4K": (30, 28, 30, 0.3)}),
                  _candidate("0.6", 0.6, {"1K-2K": (3, 3, 3, 0.7), "2K-4K": (30, 30, 30, 0.6)})]  # fmt: skip
    rec = recommend(candidates, ["1K-2K", "2K-4K"], 0.95, "both")
    assert list(rec.per_bucket) == ["1K-4K"] and rec.chosen.label == "0.6" and rec.needed == 18
    assert rec.predicted == {"1K-4K": pytest.approx(34 / 35)} and rec.kept_share == {"1K-4K": pytest.approx(0.65)}
    few = [_candidate("0.25", 0.25, {"2K-4K": (12, 12, 12, 0.3)})]
    assert recommend(few, ["2K-4K"], 0.95, "both").chosen is None  # 13/14 < 0.95: twelve answers cannot show it


def test_a_threshold_recommendation_is_the_largest_threshold_and_families_compete_on_kept_share():
    thresholds = [_candidate(f"t{t}", t, {"2K-4K": (m, m, 40, s)}, knob="threshold", family=("kvzap",))
                  for t, m, s in ((-3.0, 32, 0.2), (-4.0, 40, 0.35), (-5.0, 40, 0.5))]  # fmt: skip
    assert recommend(thresholds, ["2K-4K"], 0.95, "both").chosen.label == "t-4.0"
    budgets = [_candidate("b0.4", 0.4, {"2K-4K": (40, 40, 40, 0.42)})]
    assert recommend(thresholds + budgets, ["2K-4K"], 0.95, "both").chosen.label == "t-4.0"  # keeps 0.35 < 0.42


def test_answers_on_one_document_count_by_how_alike_they_are():
    # One document missing all four, others none: the documents, not the answers, differ (rho 1);
    # one miss on each document: no document differs from another (rho 0); no miss: nothing to estimate.
    assert document_correlation([[(0, 4), (4, 4), (4, 4), (4, 4)]]) == pytest.approx(1.0)
    assert document_correlation([[(3, 4)] * 4]) == 0.0
    assert document_correlation([[(4, 4)] * 4, [(2, 2)] * 3]) is None
    # By hand: mean 13/16, between-document mean square 0.5625, within 0.0625, 4 answers each.
    assert document_correlation([[(1, 4), (4, 4), (4, 4), (4, 4)]]) == pytest.approx((0.5625 - 0.0625) / (0.5625 + 3 * 0.0625))
    # Each group has its own mean: a candidate missing everywhere is no evidence of correlation.
    assert document_correlation([[(4, 4)] * 4, [(3, 4)] * 4]) == 0.0
    # 28 of 28 on 7 documents: as 28 answers (rho 0), 14 (rho 1/3: design effect 2) or 7 (rho 1).
    cell = Cell({"multi-request": 28, "multi-turn": 28}, {"multi-request": 28, "multi-turn": 28}, 0.9, 7)
    assert cell.reads("both") == pytest.approx(29 / 30) and cell.answers() == 28
    assert cell.reads("both", 1 / 3) == pytest.approx(15 / 16) and cell.answers(1 / 3) == pytest.approx(14)
    assert cell.reads("both", 1.0) == pytest.approx(8 / 9) and cell.measured("both") == 1.0


def test_correlated_answers_need_more_documents_before_a_length_is_called_safe():
    # The 33-README run's failure: 0.95 met 1K-2K on 28 of 28 calibration answers (7 documents) and
    # missed all four answers of one held-out document there.
    candidates = [_candidate("0.95", 0.95, {"1K-2K": (28, 28, 28, 0.95), "2K-4K": (40, 39, 40, 0.95)}, per_document=4)]
    independent = recommend(candidates, ["1K-2K", "2K-4K"], 0.95, "both")
    assert list(independent.per_bucket) == ["1K-2K", "2K-4K"] and independent.per_bucket["1K-2K"].label == "0.95"
    alike = recommend(candidates, ["1K-2K", "2K-4K"], 0.95, "both", correlation=1 / 3)
    assert alike.correlation == pytest.approx(1 / 3)
    assert list(alike.per_bucket) == ["1K-4K"]  # 14 effective answers cannot show 0.95 alone
    assert alike.chosen.label == "0.95" and alike.predicted["1K-4K"] == pytest.approx((67 / 2 + 1) / (68 / 2 + 2))
    assert recommend(candidates, ["1K-2K", "2K-4K"], 0.95, "both", correlation=1.0).chosen is None


def test_the_runs_correlation_is_estimated_from_the_calibration_documents_only():
    names = {f"d{i}" for i in range(6)}
    stock, clustered = _answers({d: ([0, 1, 2, 3] if d == "d0" else []) for d in names})
    assert calibration_correlation([clustered], stock, names, "both") == pytest.approx(1.0)
    assert calibration_correlation([clustered], stock, names - {"d0"}, "both") is None  # the miss is held out
    stock, spread = _answers({d: ([0] if d in {"d0", "d1", "d2", "d3"} else []) for d in names})
    assert 0.0 <= calibration_correlation([spread], stock, names, "multi-turn") < 0.2


def _answers(misses: dict[str, list[int]], per_document: int = 4) -> tuple[dict, dict]:
    """Stock and a candidate answering ``per_document`` questions per form on each document; the
    candidate differs from stock on the question indices ``misses[document]`` (both forms)."""
    stock, candidate = [], []
    for document, missed in misses.items():
        for form in ("multi-request", "multi-turn"):
            for index in range(per_document):
                stock.append({"document": document, "form": form, "index": index, "text": f"answer {index}"})
                candidate.append({"document": document, "form": form, "index": index, "text": "other" if index in missed else f"answer {index}"})
    return {"answers": stock}, {"answers": candidate}


def test_the_predictions_interval_draws_whole_documents():
    names = {f"d{i}" for i in range(6)}
    stock, same = _answers({d: [] for d in names})
    assert document_interval(same, stock, names, "both") == (1.0, 1.0)
    # Four misses in all (fidelity 20/24 either way): on one document the documents disagree, spread
    # over four they barely do, so the interval is wider for the first.
    stock, one = _answers({d: ([0, 1, 2, 3] if d == "d0" else []) for d in names})
    stock, spread = _answers({d: ([0] if d in {"d0", "d1", "d2", "d3"} else []) for d in names})
    low_one, high_one = document_interval(one, stock, names, "both")
    low_spread, high_spread = document_interval(spread, stock, names, "both")
    assert low_one <= 20 / 24 <= high_one and low_spread <= 20 / 24 <= high_spread
    assert high_one - low_one > 1.5 * (high_spread - low_spread)
    assert high_one == 1.0 and low_one <= 2 / 3 + 1e-9  # the bad document drawn 0 and 2+ times
    assert document_interval(one, stock, {"elsewhere"}, "both") is None


def _server(label, role, answers, value=None):
    """A server's record as ``analyse`` reads it, from ``_answers``'s answers."""
    timed = [a | {"itl": [0.1], "prompt_tokens": 10, "cached_tokens": 5, "ttft": 0.5, "correct": None} for a in answers["answers"]]
    return {"label": label, "role": role, "scope": "block", "answers": timed, "family": ["topk"], "knob": "budget", "value": value,
            "recommend_flags": ["--kv-evict-budget", str(value)],
            "documents": [{"document": d, "kept_share": value} for d in sorted({a["document"] for a in timed})]}  # fmt: skip


def test_each_length_groups_pick_is_checked_on_the_held_out_documents_of_that_group():
    # 2K-4K: d0-d11, d1 and d3 held out, 0.5 misses every answer on d0 and d1; 4K-8K: d12-d20, d13
    # held out, 0.5 misses every answer there only.
    names = [f"d{i}" for i in range(21)]
    buckets = {d: "2K-4K" if i < 12 else "4K-8K" for i, d in enumerate(names)}
    holdout = {"d1", "d3", "d13"}
    stock, clean = _answers({d: [] for d in names}, per_document=6)
    _, half = _answers({d: (list(range(6)) if d in {"d0", "d1", "d13"} else []) for d in names}, per_document=6)
    servers = [_server("stock", "stock", stock), _server("0.5", "candidate", half, 0.5), _server("0.8", "candidate", clean, 0.8)]
    analysis = analyse(servers, buckets, holdout, 0.9, "both")
    rec = analysis["recommendation"]
    assert rec["correlation_estimated"] and rec["correlation"] == pytest.approx(1.0)  # d0's misses: all of a document
    # Each document counts as one answer, so 0.9 needs 8 per group: 10 and 8 calibration documents.
    check = rec["per_bucket_check"]
    assert set(check) == {"2K-4K", "4K-8K"} and rec["chosen"] == "0.8"
    # 2K-4K: 0.5 fails d0 of 10 (10/12 < 0.9), 0.8 none (11/12); held out d1, d3: all answered.
    assert check["2K-4K"] == {"candidate": "0.8", "predicted": pytest.approx(11 / 12), "held_out": 1.0, "held_out_documents": 2}
    # 4K-8K: 0.5 fails none of 8 (9/10), and fails the held-out d13: the check shows it.
    assert check["4K-8K"] == {"candidate": "0.5", "predicted": pytest.approx(9 / 10), "held_out": 0.0, "held_out_documents": 1}
    lines = recommendation_lines(analysis, ["--kv-evict-policy", "none"])
    assert "rho = 1.00" in lines[0]
    assert "- 4K-8K: the most evicting candidate with expected fidelity >= 0.9: 0.5 (predicted 0.90; held out: 0.00 over 1 document)" in lines


def test_probes_quote_the_documents_own_sentences(tmp_path):
    import random

    rng = random.Random(0)
    text = "# Title\n\n| a | b |\n\n" + " ".join(filler_sentence(rng) for _ in range(30))
    said = sentences(text)
    assert said and all(not s.startswith("|") for s in said)
    made = probes(text, 4, seed=1)
    assert [q.kind for q in made] == ["continue", "next", "continue", "next"]
    for question in made:
        quoted = question.text.split('"')[1]
        assert quoted in text and any(s.startswith(quoted) or s == quoted for s in said)
        # The reply starts for the model: the quoted head goes on, or the next sentence opens.
        assert question.answer_prefix == (quoted if question.kind == "continue" else NEXT_SENTENCE_PREFIX)
    assert probes(text, 4, seed=1) == made and probes("Too short.", 3, seed=0) == ()


def test_documents_from_a_folder_and_a_jsonl_and_their_refusals(tmp_path):
    (tmp_path / "a.md").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    (tmp_path / "c.pdf").write_text("ignored")
    assert [d.name for d in read_documents(tmp_path)] == ["a.md", "b.txt"]
    lines = tmp_path / "q.jsonl"
    lines.write_text(json.dumps({"document": "doc", "questions": ["q1", "q2"], "answers": ["x", "y"]}) + "\n\n")
    (document,) = read_documents(lines)
    assert [(q.text, q.reference) for q in document.questions] == [("q1", "x"), ("q2", "y")]
    for bad, message in [("{", "line 1: not JSON"), ('{"text": "x"}', "expected"),
                         ('{"document": "d", "questions": ["q"], "answers": []}', "as long as questions")]:  # fmt: skip
        lines.write_text(bad + "\n")
        with pytest.raises(InputError, match=message):
            read_documents(lines)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no non-empty"):
        read_documents(empty)


def _args(*argv: str):
    return evaluate.build_parser().parse_args(list(argv))


def test_the_lineup_reaches_both_scopes_every_policy_and_score_and_thresholds():
    servers = evaluate.lineup(_args("--policies", "topk:learned,lava:attn,ada-snapkv:learned,ada-snapkv", "--budgets", "0.3",
                                    "--scopes", "request,block", "--thresholds=-4", "--learned-weights", "/w.safetensors"))  # fmt: skip
    labels = [s.label for s in servers]
    assert labels[:3] == ["stock", "full request", "full block"]
    assert "lava:attn@0.3 block" in labels and "ada-snapkv:learned@0.3 request" in labels
    threshold = next(s for s in servers if s.label == "topk:learned threshold -4 block")
    assert threshold.knob == "threshold" and threshold.value == -4.0
    assert threshold.flags[-4:] == ("--kv-evict-score-threshold", "-4", "--kv-evict-budget", "0.99")
    assert "--kv-evict-learned-weights" in threshold.flags
    assert "--kv-evict-learned-weights" not in next(s for s in servers if s.label == "lava:attn@0.3 request").flags
    assert threshold.family == next(s for s in servers if s.label == "topk:learned@0.3 block").family
    url = evaluate.url_lineup(["stock=http://h:1", "x=http://h:2 --kv-evict-policy topk --kv-evict-budget 0.5"])
    assert url[0].url == "http://h:1" and url[1].flags == ("--kv-evict-policy", "topk", "--kv-evict-budget", "0.5")
    assert evaluate.described(url[1], None).value == 0.5


def test_every_candidate_policy_and_score_passes_the_launchers_model_checks_on_the_tiny_model(tiny_llama_dir, learned_weights):
    args = _args("--model", str(tiny_llama_dir), "--policies", "topk:learned,topk:attn,lava:learned,lava:attn,ada-snapkv:learned,ada-snapkv:attn",
                 "--budgets", "0.3", "--scopes", "request,block", "--thresholds=-4", "--learned-weights", learned_weights)  # fmt: skip
    servers = evaluate.lineup(args)
    assert len(servers) == 3 + 6 * 2 + 3 * 2  # thresholds: topk and lava take a learned score's threshold too
    evaluate.preflight(servers, args, 4096, model=True)  # raises on a refusal


def test_held_out_documents_alternate_in_length_order():
    names = [f"d{i}" for i in range(8)]
    assert evaluate.held_out(names, 0.5) == {"d1", "d3", "d5", "d7"}
    assert len(evaluate.held_out(names, 0.25)) == 2


def run_command(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgl_kvevict.evaluate", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("case", ["empty folder", "bad flag", "bad budget", "bad policy", "refused model", "no candidate"])
def test_bad_input_gets_one_line_and_exit_2_before_any_server(case, tmp_path, tiny_llama_dir):
    from sgl_kvevict.checkpoints import build_tiny_model

    docs = tmp_path / "docs"
    docs.mkdir()
    argv = {
        "empty folder": ["--documents", str(docs), "--policies", "topk:attn"],
        "bad flag": ["--min-fidelity", "1.5"],
        "bad budget": ["--budgets", "2"],
        "bad policy": ["--policies", "nosuch"],
        "no candidate": ["--budgets", ""],
    }.get(case)
    if case == "refused model":
        (docs / "a.md").write_text("Some words here. " * 50)
        argv = ["--model", str(build_tiny_model(tmp_path / "deepseek", "deepseek-v3")), "--documents", str(docs), "--budgets", "0.3"]
    if case != "refused model":
        argv = ["--model", str(tiny_llama_dir), *argv]
    before = time.monotonic()
    result = run_command(*argv, "--out", str(tmp_path / "out"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    expected = {"empty folder": "no non-empty", "bad flag": "--min-fidelity", "bad budget": "budget '2'", "bad policy": "'nosuch' is not a policy",
                "refused model": "MLA", "no candidate": "no candidate"}[case]  # fmt: skip
    assert expected in lines[0]
    assert "serving on" not in result.stdout and time.monotonic() - before < 120


def _documents(folder: Path) -> Path:
    import random

    rng = random.Random(3)
    folder.mkdir()
    for name, count in (("short.md", 10), ("longer.txt", 20)):
        (folder / name).write_text(f"# {name}\n\n" + " ".join(filler_sentence(rng) for _ in range(count)))
    (folder / "huge.md").write_text(" ".join(filler_sentence(rng) for _ in range(200)))  # past the tiny model's 4096
    return folder


@pytest.mark.server
def test_an_evaluation_through_the_tiny_server_both_forms_scopes_and_a_threshold_then_resume(tiny_llama_dir, learned_weights, tmp_path):
    docs = _documents(tmp_path / "docs")
    argv = ["--model", str(tiny_llama_dir), "--documents", str(docs), "--budgets", "0.3", "--scopes", "block",
            "--learned-weights", learned_weights, "--questions-per-document", "2", "--summary-tokens", "4", "--answer-tokens", "6",
            "--candidate", f"threshold=--kv-evict-policy topk --kv-evict-score learned --kv-evict-learned-weights {learned_weights} "
            "--kv-evict-score-threshold -4 --kv-evict-budget 0.99 --kv-evict-scope request",
            "--holdout", "0.5", "--out", str(tmp_path / "out")]  # fmt: skip
    result = run_command(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.strip().splitlines()
    assert out[-1].startswith("--kv-evict-policy ") and out[-2].startswith("recommended server flags")
    assert any(line.startswith("skipping huge.md:") and "longer than the context" in line for line in out)
    payload = json.loads((tmp_path / "out" / "evaluate.json").read_text())
    assert [s["label"] for s in payload["servers"]] == ["stock", "full block", "topk:learned@0.3 block", "threshold"]
    assert {d["name"] for d in payload["documents"]} == {"short.md", "longer.txt"}
    for server in payload["servers"]:
        assert {a["form"] for a in server["answers"]} == {"multi-request", "multi-turn"} and len(server["answers"]) == 8
        assert server["fidelity"]["all"]["multi-request"]["n"] == 4
    stock, full, budget, threshold = payload["servers"]
    assert stock["fidelity"]["all"]["multi-turn"]["exact"] == 1.0  # stock against itself
    assert all(d["kept_share"] is None for d in stock["documents"])
    assert all(0.95 <= d["kept_share"] <= 1.01 for d in full["documents"])
    assert all(0.15 <= d["kept_share"] <= 0.6 for d in budget["documents"])  # 0.3 of the full blocks, the tail dense
    assert threshold["knob"] == "threshold" and threshold["scope"] == "request"
    assert budget["vs_full"]["output_tokens_per_second"] is not None and stock["speed"]["hit_rate"] > 0
    rec = payload["analysis"]["recommendation"]
    assert rec["held_out"] is None or rec["held_out"]["documents"] == ["longer.txt"]
    assert 0 <= rec["correlation"] <= 1 and rec["correlation_estimated"] in (True, False)
    assert all(set(check) == {"candidate", "predicted", "held_out", "held_out_documents"} for check in rec["per_bucket_check"].values())
    assert set(payload["analysis"]["held_out_by_server"]) == {"full block", "topk:learned@0.3 block", "threshold"}
    assert (tmp_path / "out" / "evaluate.png").stat().st_size > 0 and "Held-out check" in (tmp_path / "out" / "evaluate.md").read_text()
    assert psutil.Process().children(recursive=True) == []

    assert all(s["measured_on"]["git_commit"] == payload["environment"]["git_commit"] for s in payload["servers"])
    assert "Measured on" not in (tmp_path / "out" / "evaluate.md").read_text()

    # A resumed report analyses the kept servers with today's code and says on which commit they ran
    # (a record without its own stamp, as older runs wrote, takes its file's).
    payload["environment"]["git_commit"] = "0ld0ld0"
    for server in payload["servers"]:
        server.pop("measured_on")
    (tmp_path / "out" / "evaluate.json").write_text(json.dumps(payload))
    again = run_command(*argv, "--resume")
    assert again.returncode == 0 and "serving on" not in again.stdout and again.stdout.count("kept from") == 4
    assert again.stdout.strip().splitlines()[-1] == out[-1]
    resumed = json.loads((tmp_path / "out" / "evaluate.json").read_text())
    assert {s["measured_on"]["git_commit"] for s in resumed["servers"]} == {"0ld0ld0"}
    assert "Measured on: stock, full block, topk:learned@0.3 block, threshold: sgl-kvevict 0ld0ld0" in (tmp_path / "out" / "evaluate.md").read_text()
    other = run_command(*[a if a != "6" else "7" for a in argv], "--resume")
    assert other.returncode == 2 and "another configuration" in other.stderr


@pytest.mark.server
def test_ctrl_c_stops_the_server_it_started(tiny_llama_dir, tmp_path):
    docs = _documents(tmp_path / "docs")
    process = subprocess.Popen(
        [sys.executable, "-m", "sgl_kvevict.evaluate", "--model", str(tiny_llama_dir), "--documents", str(docs), "--budgets", "0.3",
         "--policies", "topk:attn", "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        for line in process.stdout:
            if "serving on" in line:
                break
            assert time.monotonic() < deadline
        launched = [p for p in psutil.Process(process.pid).children(recursive=True)]
        assert launched, "no server process under the command"
        os.kill(process.pid, signal.SIGINT)
        assert process.wait(timeout=180) == 130
        assert "interrupted" in process.stderr.read()
        gone, alive = psutil.wait_procs(launched, timeout=30)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_answer_the_model_ends_at_once_is_an_empty_answer_not_a_failure():
    """SGLang's stream for a reply whose first token is the end of turn: a role chunk, a finish chunk,
    the usage chunk and [DONE], no content (seen on a probe whose given start ended the sentence)."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from sgl_kvevict.evaluate.run import speed
    from sgl_kvevict.measure.client import CHAT_PATH, ask
    from sgl_kvevict.measure.servers import ServerError

    async def empty_reply(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 32}}}]  # fmt: skip
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def scenario():
        app = web.Application()
        app.router.add_post(CHAT_PATH, empty_reply)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        messages = [{"role": "user", "content": "Continue."}, {"role": "assistant", "content": 'It says: "'}]
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(ServerError, match="no token streamed"):
                    await ask(session, base_url, messages, 8)
                return await ask(session, base_url, messages, 8, empty_ok=True)
        finally:
            await runner.cleanup()

    reply = asyncio.run(scenario())
    assert reply.text == "" and reply.ttft is None and reply.completion_tokens == 0 and reply.problems == []
    answers = [{"itl": [0.1, 0.1], "prompt_tokens": 40, "cached_tokens": 32, "ttft": 2.0},
               {"itl": [], "prompt_tokens": 40, "cached_tokens": 32, "ttft": None}]  # fmt: skip
    assert speed(answers)["ttft_median"] == 2.0 and speed(answers)["hit_rate"] == 0.8
