"""How a candidate's answers compare with stock's and with reference answers, and the recommendation.

Answers are compared after SQuAD's normalisation (lower case, punctuation and the articles a/an/the
dropped, whitespace collapsed): **exact** when the normalised texts are equal, **F1** over their
tokens. Fidelity to stock is the share of questions a candidate answers exactly as stock did (the
same right or wrong answer), in each question form; the recommendation reads the lower of the two
forms (``--fidelity-form`` picks one).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

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


@dataclass(frozen=True)
class Cell:
    """One candidate at one length bucket: fidelity (exact, per form) over ``n`` questions per form, and
    the mean kept share of its documents (None where the server reports no slots: stock)."""

    fidelity: dict[str, Optional[float]]
    n: dict[str, int]
    kept_share: Optional[float]

    def reads(self, form: str) -> Optional[float]:
        """The fidelity the recommendation reads: ``form``, or with ``both`` the lower of the two."""
        values = [self.fidelity.get(f) for f in (FORMS if form == "both" else (form,))]
        values = [v for v in values if v is not None]
        return min(values) if values else None


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


@dataclass(frozen=True)
class Recommendation:
    """The chosen candidate (None: no candidate meets the target at every bucket), per bucket the most
    evicting candidate that meets it there, and the fidelity predicted per bucket."""

    chosen: Optional[Candidate]
    per_bucket: dict[str, Optional[Candidate]]
    predicted: dict[str, Optional[float]]
    kept_share: dict[str, Optional[float]]
    min_fidelity: float
    form: str

    def flag_lines(self, dense_flags: Sequence[str]) -> list[str]:
        """What to start the server with; dense (no eviction) when nothing met the target."""
        if self.chosen is None:
            return [" ".join(dense_flags)]
        return [" ".join(self.chosen.flags)]


def _evicts_more(candidate: Candidate) -> float:
    """Sort key, most eviction first: a smaller budget, a larger threshold."""
    return candidate.value if candidate.knob == "budget" else -candidate.value


def recommend(candidates: Sequence[Candidate], buckets: Iterable[str], min_fidelity: float, form: str) -> Recommendation:
    """Per family, the most evicting candidate whose fidelity meets ``min_fidelity`` at every bucket;
    across families, the one keeping the least (mean kept share over buckets, then the family order).
    Per bucket, the most evicting candidate meeting the target there (what a length-aware deployment
    could use)."""
    buckets = sorted(buckets, key=bucket_order)

    def meets(candidate: Candidate, bucket: str) -> bool:
        cell = candidate.cells.get(bucket)
        value = None if cell is None else cell.reads(form)
        return value is not None and value >= min_fidelity

    ordered = sorted(candidates, key=_evicts_more)
    per_bucket = {bucket: next((c for c in ordered if meets(c, bucket)), None) for bucket in buckets}
    families: dict[tuple[str, ...], Candidate] = {}
    for candidate in ordered:
        if candidate.family not in families and all(meets(candidate, b) for b in buckets):
            families[candidate.family] = candidate

    def kept(candidate: Candidate) -> float:
        shares = [candidate.cells[b].kept_share for b in buckets if candidate.cells[b].kept_share is not None]
        return sum(shares) / len(shares) if shares else 1.0

    chosen = min(families.values(), key=kept) if families else None
    predicted = {b: (chosen.cells[b].reads(form) if chosen else None) for b in buckets}
    shares = {b: (chosen.cells[b].kept_share if chosen else None) for b in buckets}
    return Recommendation(chosen, per_bucket, predicted, shares, min_fidelity, form)
