"""The synthetic task generator (the quality benchmark itself: tests/test_quality_bench.py)."""

from __future__ import annotations

import re

import pytest

from sgl_kvevict.measure.tasks import RULER_KINDS, TASK_KINDS, make_task, task_suite


def count_words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_tasks_are_deterministic_in_the_seed(kind):
    first = make_task(kind, seed=7, target_tokens=300, depth=0.4, count_tokens=count_words)
    assert first == make_task(kind, seed=7, target_tokens=300, depth=0.4, count_tokens=count_words)
    assert first.context != make_task(kind, seed=8, target_tokens=300, depth=0.4, count_tokens=count_words).context


@pytest.mark.parametrize("kind, count", [("passkey", 1), ("multikey", 4), ("vartrack", 1), ("fact", 3), ("facts", 3)])
def test_every_question_of_a_task_is_answered_by_its_own_needle_alone(kind, count):
    task = make_task(kind, seed=5, target_tokens=400, depth=0.6, count_tokens=count_words)
    assert len(task.questions) == count and task.questions[0].question == task.question
    assert len({q.answer for q in task.questions}) == len({q.needle for q in task.questions}) == count
    for question in task.questions:
        assert question.answer in task.needles[question.needle].text
        others = [n.text for i, n in enumerate(task.needles) if i != question.needle]
        assert not any(question.answer in text for text in others)
        assert question.answer not in question.question + question.answer_prefix
        assert question.is_correct(f"x {question.answer} y") and not question.is_correct("x")


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.35, 0.8, 1.0])
def test_answer_is_in_the_context_at_the_stated_depth(kind, depth):
    task = make_task(kind, seed=3, target_tokens=400, depth=depth, count_tokens=count_words)
    needle = task.needles[task.answer_needle]
    position = task.context.index(needle.text)
    assert task.answer in needle.text
    assert needle.depth == position / len(task.context)
    # The requested depth is a share of the filler; the needle lands at the next sentence boundary,
    # shifted by the needles inserted before it.
    longest_sentence = max(len(s) for s in re.split(r"(?<=\.) ", task.context))
    other_needles = sum(len(n.text) + 1 for n in task.needles if n is not needle)
    assert abs(needle.depth - depth) <= (longest_sentence + other_needles) / len(task.context) + 1e-9
    assert abs(count_words(task.context) - 400) <= 25


def test_filler_has_no_repeated_sentence_and_no_digits():
    task = make_task("passkey", seed=1, target_tokens=2000, depth=0.5, count_tokens=count_words)
    filler = task.context.replace(task.needles[0].text, "")
    sentences = [s for s in re.split(r"(?<=\.) ", filler) if s.strip()]
    assert len(sentences) > 100
    assert len(set(sentences)) == len(sentences)
    assert not re.search(r"\d", filler)


def test_variable_chain_is_in_order_and_ends_with_the_asked_variable():
    task = make_task("vartrack", seed=5, target_tokens=500, depth=0.2, count_tokens=count_words)
    positions = [task.context.index(n.text) for n in task.needles]
    assert positions == sorted(positions)
    last_variable = task.needles[-1].text.split(" = ")[0]
    assert last_variable in task.question and task.answer in task.needles[0].text


def test_suite_cycles_kinds_and_depths():
    suite = task_suite(seed=0, samples=8, target_tokens=200, count_tokens=count_words)
    assert [t.kind for t in suite] == list(RULER_KINDS) * 2
    assert len({round(t.depth, 1) for t in suite}) >= 4
    assert len({t.answer for t in suite}) == 8
