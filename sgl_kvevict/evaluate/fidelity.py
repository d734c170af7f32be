"""How a candidate's answers are judged, and which candidate is recommended.

Answers are compared after SQuAD's normalisation (lower case, punctuation and the articles a/an/the
dropped, whitespace collapsed): **exact** when the normalised texts are equal, **F1** over their
tokens. Three comparisons are kept apart:

* against the **document** (``follows_document``): a probe's answer is in the document (the rest of a
  quoted sentence, the sentence after one), so an answer is right when it says the document's words
  for as long as it runs; a user's reference answer is right when the answer states it;
* against **stock** (fidelity): the same answer as stock SGLang, what a user who switches sees;
* against **``full``**, the plugin with nothing evicted (same code path, same numerics): what
  eviction itself costs, apart from the rounding of another kernel.

The recommendation rests on the third. A candidate's **kept answers** are the share of the answers
its reference (``full`` of its scope) gets right that the candidate gets right too, or, where no
answer can be judged, the share equal to the reference's. Its verdict is a **lower bound**, never a
mean: the one-sided Clopper-Pearson bound at ``confidence`` on effective counts, the counts divided by
the design effect ``1 + (m - 1) * rho`` (Kish), ``m`` answers per document and ``rho`` how alike the
answers on one document are (the intraclass correlation). ``rho`` is the larger of the candidate's own
estimate and that of its reference's right and wrong answers (how much a document decides whether its
questions are answered), so that a verdict depends on the candidate's own answers and its
reference's, never on which other candidates ran; 1 (each document counts once) where neither can be
estimated.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from sgl_kvevict.measure.intervals import clopper_pearson_lower

FORMS = ("multi-request", "multi-turn")
FIDELITY_FORMS = ("both", *FORMS)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact(a: str, b: str) -> bool:
    return normalise(a) == normalise(b)


def token_f1(a: str, b: str) -> float:
    """SQuAD's token F1 of two answers (1.0 for two empty ones)."""
    left, right = normalise(a).split(), normalise(b).split()
    if not left or not right:
        return float(left == right)
    common = sum((Counter(left) & Counter(right)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(left), common / len(right)
    return 2 * precision * recall / (precision + recall)


def contains_reference(output: str, reference: str) -> bool:
    """A reference answer is given when the normalised output states it (equal, or containing it)."""
    said, expected = normalise(output), normalise(reference)
    return bool(expected) and (said == expected or f" {expected} " in f" {said} ")


def follows_document(answer: str, reference: str, cut: bool) -> tuple[bool, float]:
    """A probe's answer against the document's own words ``reference`` (the rest of the quoted
    sentence, or the sentence after it): **exact prefix**, the answer says the reference's words in
    order for as long as either runs, and runs to the reference's end unless ``cut`` (it stopped at its
    token cap); and the token F1 of the answer's words over the reference's length with those words.
    An answer that goes on past the reference is not penalised: a capped continuation may."""
    said, expected = normalise(answer).split(), normalise(reference).split()
    if not expected or not said:
        return False, 0.0
    span = min(len(said), len(expected))
    whole = len(said) >= len(expected) or cut
    prefix = said[:span] == expected[:span] and whole
    compared = expected if len(said) >= len(expected) or not cut else expected[:span]
    return prefix, token_f1(" ".join(said[: len(expected)]), " ".join(compared))


# ---- length buckets --------------------------------------------------------------------------------


def bucket_of(tokens: int) -> str:
    """The document's length bucket: powers of two in K tokens (``2K-4K``), below 1K one bucket."""
    if tokens < 1024:
        return "<1K"
    low = 2 ** int(math.log2(tokens / 1024))
    return f"{low}K-{2 * low}K"


def bucket_order(bucket: str) -> float:
    return 0.0 if bucket == "<1K" else float(bucket.split("K")[0])


# ---- the recommendation ----------------------------------------------------------------------------


def answers_needed(min_kept: float, confidence: float) -> float:
    """The fewest (effective) answers, all kept, whose lower bound reaches ``min_kept``: 22 for 0.9 at
    confidence 0.9, 45 for 0.95; infinite for 1.0, which no finite sample shows."""
    if min_kept >= 1:
        return math.inf
    return max(1, math.ceil(math.log(1 - confidence) / math.log(min_kept) - 1e-9))


def document_correlation(groups: Iterable[Sequence[tuple[int, int]]]) -> Optional[float]:
    """How alike the answers on one document are: the one-way ANOVA estimate of the intraclass
    correlation of a 0/1 outcome, clipped to [0, 1], pooled over ``groups`` (e.g. one per question
    form, each a list of per-document ``(successes, answers)``; every group has its own mean). None
    where it cannot be estimated: no failure and no success to tell apart, or no document with two
    answers."""
    between = within = between_df = within_df = size_sum = 0.0
    for group in groups:
        documents = [(x, m) for x, m in group if m]
        total = sum(m for _, m in documents)
        if not documents:
            continue
        mean = sum(x for x, _ in documents) / total
        between += sum(m * (x / m - mean) ** 2 for x, m in documents)
        within += sum(x * (1 - x / m) for x, m in documents)
        between_df += len(documents) - 1
        within_df += total - len(documents)
        size_sum += total - sum(m * m for _, m in documents) / total
    if not between_df or not within_df:
        return None
    between_mean, within_mean = between / between_df, within / within_df
    size = size_sum / between_df  # the ANOVA's mean answers per document, for unequal documents
    denominator = between_mean + (size - 1) * within_mean
    return None if denominator <= 0 else min(1.0, max(0.0, (between_mean - within_mean) / denominator))


@dataclass(frozen=True)
class Cell:
    """One candidate at one length bucket: per form the answers its reference got right (``eligible``;
    all answers where none can be judged) and of those the ones the candidate kept (``kept``), over
    ``documents`` documents (those with an eligible answer), and its mean kept share (None: stock)."""

    kept: dict[str, int]
    eligible: dict[str, int]
    kept_share: Optional[float]
    documents: int = 1

    def effective(self, form: str, rho: float) -> tuple[float, float]:
        """``form``'s (kept, eligible) divided by the design effect ``1 + (m - 1) * rho``."""
        per_document = self.eligible[form] / max(1, self.documents)
        design_effect = 1 + max(0.0, per_document - 1) * rho
        return self.kept[form] / design_effect, self.eligible[form] / design_effect

    def _lower(self, form: str, value: Callable[[str], float]) -> Optional[float]:
        values = [value(f) for f in (FORMS if form == "both" else (form,)) if self.eligible.get(f)]
        return min(values) if values else None

    def bound(self, form: str, rho: float, confidence: float) -> Optional[float]:
        """The lower bound of the kept answers: ``form``'s, or with ``both`` the lower form's."""
        return self._lower(form, lambda f: clopper_pearson_lower(*self.effective(f, rho), confidence))

    def measured(self, form: str) -> Optional[float]:
        """The share kept: ``form``'s, or with ``both`` the lower form's."""
        return self._lower(form, lambda f: self.kept[f] / self.eligible[f])

    @staticmethod
    def merged(cells: Sequence["Cell"]) -> "Cell":
        """The cells of several buckets as one (kept share weighted by documents)."""
        shares = [(c.kept_share, c.documents) for c in cells if c.kept_share is not None]
        weight = sum(d for _, d in shares)
        return Cell({f: sum(c.kept.get(f, 0) for c in cells) for f in FORMS}, {f: sum(c.eligible.get(f, 0) for c in cells) for f in FORMS},
                    sum(s * d for s, d in shares) / weight if weight else None, sum(c.documents for c in cells))  # fmt: skip


def length_groups(answers: dict[str, float], needed: float) -> list[tuple[str, ...]]:
    """Adjacent length buckets joined, shortest first, until each group has ``needed`` (effective)
    answers (``answers``: per bucket); a short remainder joins the last group. A bucket of one document
    cannot show a bound with three probes: it is judged with its neighbours, not on its own."""
    groups: list[list[str]] = []
    current: list[str] = []
    for bucket in sorted(answers, key=bucket_order):
        current.append(bucket)
        if sum(answers[b] for b in current) >= needed:
            groups.append(current)
            current = []
    if current and groups:
        groups[-1].extend(current)
    elif current:
        groups.append(current)
    return [tuple(group) for group in groups]


def group_label(group: Sequence[str]) -> str:
    """``2K-4K`` + ``4K-8K`` -> ``2K-8K``; ``<1K`` + ``1K-2K`` -> ``<2K``."""
    if len(group) == 1:
        return group[0]
    high = group[-1].split("-")[-1]
    return f"<{high}" if group[0] == "<1K" else f"{group[0].split('-')[0]}-{high}"


@dataclass(frozen=True)
class Candidate:
    """What the recommendation chooses among: a family (the flags but the knob, and the knob: budgets
    and thresholds are two families), the knob (``budget``: smaller is more eviction; ``threshold``:
    larger is more eviction) and its value, its cells per bucket, and ``rho``, the correlation its
    effective counts are taken with."""

    label: str
    family: tuple[str, ...]
    knob: str
    value: float
    flags: tuple[str, ...]
    cells: dict[str, Cell]
    rho: float = 1.0

    def over(self, group: Sequence[str]) -> Optional[Cell]:
        """The cells of the buckets ``group`` as one (None: no answers there)."""
        parts = [self.cells[b] for b in group if b in self.cells]
        return Cell.merged(parts) if parts else None

    def bound_over(self, group: Sequence[str], form: str, confidence: float) -> Optional[float]:
        merged = self.over(group)
        return None if merged is None else merged.bound(form, self.rho, confidence)

    def kept_share(self, groups: Sequence[Sequence[str]]) -> float:
        """The mean kept share over ``groups`` (1 where the server reports none)."""
        shares = [share for g in groups if (cell := self.over(g)) is not None and (share := cell.kept_share) is not None]
        return sum(shares) / len(shares) if shares else 1.0


@dataclass(frozen=True)
class Verdict:
    """One candidate against the target: its lower bound per length group and whether every group's
    bound reaches ``min_kept``. It reads the candidate alone."""

    candidate: Candidate
    bounds: dict[str, Optional[float]]
    passes: bool


def verdict(candidate: Candidate, groups: Sequence[tuple[str, ...]], min_kept: float, form: str, confidence: float) -> Verdict:
    bounds = {group_label(g): candidate.bound_over(g, form, confidence) for g in groups}
    return Verdict(candidate, bounds, all(b is not None and b >= min_kept for b in bounds.values()))


def evicts_more(candidate: Candidate) -> float:
    """Sort key within a family, most eviction first: a smaller budget, a larger threshold."""
    return candidate.value if candidate.knob == "budget" else -candidate.value


@dataclass(frozen=True)
class Recommendation:
    """``verdicts``: every candidate's, in the order they are tried (those that pass first, the least
    kept share first); ``chosen``: the first that passes and whose held-out check holds (None: none);
    ``checks``: the held-out check of each candidate tried, by label (``(measured, holds)``; absent
    without held-out documents)."""

    verdicts: list[Verdict]
    chosen: Optional[Candidate]
    checks: dict[str, tuple[Optional[float], bool]]
    groups: dict[str, tuple[str, ...]]
    min_kept: float
    form: str
    confidence: float
    needed: float

    def verdict_of(self, label: str) -> Verdict:
        return next(v for v in self.verdicts if v.candidate.label == label)


def recommend(
    candidates: Sequence[Candidate], groups: Sequence[tuple[str, ...]], min_kept: float, form: str, confidence: float,
    held_out: Optional[Callable[[Candidate], Optional[float]]] = None, overall: Optional[Callable[[Candidate], Optional[float]]] = None,
) -> Recommendation:  # fmt: skip
    """Of the candidates whose lower bound reaches ``min_kept`` in every length group, the one keeping
    the least (mean kept share over the groups; within a family, the most evicting first), checked on
    the held-out documents: ``held_out(candidate)`` is its kept answers measured there, and the check
    holds when that is at least ``overall(candidate)``, its lower bound over all calibration lengths.
    A candidate whose check fails is not recommended and the next is checked, or none."""
    verdicts = [verdict(c, groups, min_kept, form, confidence) for c in candidates]
    order = {id(c): i for i, c in enumerate(sorted(candidates, key=lambda c: (c.family, evicts_more(c))))}
    verdicts.sort(key=lambda v: (not v.passes, v.candidate.kept_share(groups), order[id(v.candidate)]))
    chosen, checks = None, {}
    for passing in (v for v in verdicts if v.passes):
        candidate = passing.candidate
        if held_out is None:
            chosen = candidate
            break
        measured, bound = held_out(candidate), overall(candidate)
        holds = measured is None or (bound is not None and measured >= bound)
        checks[candidate.label] = (measured, holds)
        if holds:
            chosen = candidate
            break
    labels = {group_label(g): tuple(g) for g in groups}
    return Recommendation(verdicts, chosen, checks, labels, min_kept, form, confidence, answers_needed(min_kept, confidence))
