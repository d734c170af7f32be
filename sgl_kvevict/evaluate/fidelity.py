"""How a candidate's answers compare with stock's and with reference answers, and the recommendation.

Answers are compared after SQuAD's normalisation (lower case, punctuation and the articles a/an/the
dropped, whitespace collapsed): **exact** when the normalised texts are equal, **F1** over their
tokens. Fidelity to stock is the share of questions a candidate answers exactly as stock did (the
same right or wrong answer), in each question form. The recommendation reads, per form, the fidelity a
further answer is expected to have, ``(matches + 1) / (answers + 2)`` (Laplace's rule of succession:
24 of 24 answers equal to stock's predict 0.96, not 1.00, so a small calibration set cannot promise a
perfect score), and the lower of the two forms (``--fidelity-form`` picks one).

Answers on one document are not independent: a document whose turn-1 summary changes under
eviction loses most of its later-turn answers together. The counts enter the rule divided by the
design effect ``1 + (m - 1) * rho`` (Kish), ``m`` answers per document and ``rho`` how alike the
answers on one document are (the intraclass correlation, estimated from the calibration answers;
1 when they hold no miss to estimate it from, so that each document then counts as one answer).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

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


def expected_fidelity(matches: float, answers: float) -> float:
    """The fidelity a further answer is expected to have after ``matches`` of ``answers`` equal stock's:
    the mean of the uniform prior's posterior (Laplace's rule of succession). Effective counts (divided
    by the design effect) may be fractional."""
    return (matches + 1) / (answers + 2)


def answers_needed(min_fidelity: float) -> float:
    """The fewest (effective) answers per form whose expected fidelity can reach ``min_fidelity`` (all
    equal to stock's): 18 for 0.95, 98 for 0.99; infinite for 1.0, which no finite sample promises."""
    return max(0, math.ceil((2 * min_fidelity - 1) / (1 - min_fidelity) - 1e-9)) if min_fidelity < 1 else math.inf


def document_correlation(groups: Iterable[Sequence[tuple[int, int]]]) -> Optional[float]:
    """How alike the answers on one document are: the one-way ANOVA estimate of the intraclass
    correlation of "equal to stock's", clipped to [0, 1], pooled over ``groups`` (one per candidate and
    form, each a list of per-document ``(matches, answers)``; every group has its own mean, so that a
    candidate missing more than another does not read as correlation). None where it cannot be
    estimated: no miss and no document with two answers."""
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
    """One candidate at one length bucket: per form the answers equal to stock's (``matches``) of ``n``
    compared, over ``documents`` documents, and their mean kept share (None where the server reports no
    slots: stock)."""

    matches: dict[str, int]
    n: dict[str, int]
    kept_share: Optional[float]
    documents: int = 1

    def _effective(self, form: str, correlation: float) -> tuple[float, float]:
        """``form``'s (matches, answers) divided by the design effect ``1 + (m - 1) * correlation``."""
        per_document = self.n[form] / max(1, self.documents)
        design_effect = 1 + max(0.0, per_document - 1) * correlation
        return self.matches[form] / design_effect, self.n[form] / design_effect

    def _lower(self, form: str, rate: Callable[[str], float]) -> Optional[float]:
        """``rate(form)`` of ``form``, or with ``both`` the lower of the two forms'."""
        values = [rate(f) for f in (FORMS if form == "both" else (form,)) if self.n.get(f)]
        return min(values) if values else None

    def reads(self, form: str, correlation: float = 0.0) -> Optional[float]:
        """The expected fidelity the recommendation reads, on the effective counts: ``form``'s, or with
        ``both`` the lower one (``correlation`` 0: answers independent)."""
        return self._lower(form, lambda f: expected_fidelity(*self._effective(f, correlation)))

    def measured(self, form: str) -> Optional[float]:
        """The share of answers equal to stock's: ``form``'s, or with ``both`` the lower one."""
        return self._lower(form, lambda f: self.matches[f] / self.n[f])

    def answers(self, correlation: float = 0.0) -> float:
        """The effective answers of the form with fewer (what limits how high ``reads`` can go)."""
        return min((self._effective(f, correlation)[1] if self.n.get(f) else 0 for f in FORMS), default=0)

    @staticmethod
    def merged(cells: Sequence["Cell"]) -> "Cell":
        """The cells of several buckets as one (kept share weighted by documents)."""
        shares = [(c.kept_share, c.documents) for c in cells if c.kept_share is not None]
        weight = sum(d for _, d in shares)
        return Cell({f: sum(c.matches.get(f, 0) for c in cells) for f in FORMS}, {f: sum(c.n.get(f, 0) for c in cells) for f in FORMS},
                    sum(s * d for s, d in shares) / weight if weight else None, sum(c.documents for c in cells))  # fmt: skip


def length_groups(answers: dict[str, float], needed: float) -> list[tuple[str, ...]]:
    """Adjacent length buckets joined, shortest first, until each group has ``needed`` (effective)
    answers (``answers``: per bucket); a short remainder joins the last group. A bucket of one document
    cannot show 0.95 with three probes: it is judged with its neighbours, not on its own."""
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
    """What the recommendation chooses among: a family (the flags but the knob), the knob (``budget``:
    smaller is more eviction; ``threshold``: larger is more eviction) and its value, and its cells."""

    label: str
    family: tuple[str, ...]
    knob: str
    value: float
    flags: tuple[str, ...]
    cells: dict[str, Cell]

    def over(self, group: Sequence[str]) -> Optional[Cell]:
        """The cells of the buckets ``group`` as one (None: no answers there)."""
        parts = [self.cells[b] for b in group if b in self.cells]
        return Cell.merged(parts) if parts else None


@dataclass(frozen=True)
class Recommendation:
    """The chosen candidate (None: no candidate meets the target in every length group), per length
    group the most evicting candidate that meets it there, and the expected fidelity and kept share per
    group. ``needed``: the effective answers per form a group must have to show the target at all;
    ``correlation``: the intraclass correlation the effective counts were taken with; ``groups``: each
    group's label and its buckets."""

    chosen: Optional[Candidate]
    per_bucket: dict[str, Optional[Candidate]]
    predicted: dict[str, Optional[float]]
    kept_share: dict[str, Optional[float]]
    min_fidelity: float
    form: str
    needed: float = 0
    correlation: float = 0.0
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def flag_lines(self, dense_flags: Sequence[str]) -> list[str]:
        """What to start the server with; dense (no eviction) when nothing met the target."""
        if self.chosen is None:
            return [" ".join(dense_flags)]
        return [" ".join(self.chosen.flags)]


def _evicts_more(candidate: Candidate) -> float:
    """Sort key, most eviction first: a smaller budget, a larger threshold."""
    return candidate.value if candidate.knob == "budget" else -candidate.value


def recommend(candidates: Sequence[Candidate], buckets: Iterable[str], min_fidelity: float, form: str,
              correlation: float = 0.0) -> Recommendation:  # fmt: skip
    """Per family, the most evicting candidate whose expected fidelity meets ``min_fidelity`` in every
    length group (buckets joined until each holds ``answers_needed`` effective answers per form, the
    counts divided by the design effect of ``correlation``; 0: answers independent); across families,
    the one keeping the least (mean kept share over groups, then the family order). Per group, the most
    evicting candidate meeting the target there (what a length-aware deployment could use)."""
    buckets = sorted(buckets, key=bucket_order)
    needed = answers_needed(min_fidelity)
    answers = {b: max((c.cells[b].answers(correlation) for c in candidates if b in c.cells), default=0) for b in buckets}
    groups = length_groups(answers, needed)

    def meets(candidate: Candidate, group: tuple[str, ...]) -> bool:
        value = None if (merged := candidate.over(group)) is None else merged.reads(form, correlation)
        return value is not None and value >= min_fidelity

    ordered = sorted(candidates, key=_evicts_more)
    per_bucket = {group_label(g): next((c for c in ordered if meets(c, g)), None) for g in groups}
    families: dict[tuple[str, ...], Candidate] = {}
    for candidate in ordered:
        if candidate.family not in families and all(meets(candidate, g) for g in groups):
            families[candidate.family] = candidate

    def kept(candidate: Candidate) -> float:
        shares = [share for g in groups if (share := candidate.over(g).kept_share) is not None]
        return sum(shares) / len(shares) if shares else 1.0

    chosen = min(families.values(), key=kept) if families else None
    predicted = {group_label(g): (chosen.over(g).reads(form, correlation) if chosen else None) for g in groups}
    shares = {group_label(g): (chosen.over(g).kept_share if chosen else None) for g in groups}
    return Recommendation(chosen, per_bucket, predicted, shares, min_fidelity, form, needed, correlation, {group_label(g): g for g in groups})
