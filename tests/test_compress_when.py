"""The "when to compress" page (``benchmarks.compress_when``) is generated from the committed results, and
its reply comparison pairs replies by user and turn."""

from __future__ import annotations

from benchmarks.compress_when import NAME, RESULTS, _same_replies, render


def test_the_committed_page_is_up_to_date():
    assert (RESULTS / f"{NAME}.md").read_text() == render(), "run python -m benchmarks.compress_when"


def test_replies_are_compared_by_user_and_turn_and_failed_ones_are_left_out():
    stock = [
        {"user": 0, "turn": 0, "reply": "a", "error": None},
        {"user": 0, "turn": 1, "reply": "b", "error": None},
        {"user": 1, "turn": 0, "reply": "c", "error": "timeout"},
    ]
    served = [
        {"user": 0, "turn": 1, "reply": "b", "error": None},
        {"user": 0, "turn": 0, "reply": "x", "error": None},
        {"user": 1, "turn": 0, "reply": "c", "error": None},
    ]
    assert _same_replies(served, stock) == (1, 2)
