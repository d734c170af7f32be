"""Binomial confidence intervals for accuracies measured on a few dozen samples, and the one ordering
rule every report uses: ``A > B`` is claimed only where the two 95% intervals do not overlap.

Non-overlap of two 95% Wilson intervals is a conservative test (a difference can be significant while
the intervals still touch), which is the right side to err on for the claims the documentation makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class Proportion:
    """``successes`` of ``n`` and its Wilson score interval ``[low, high]`` at 95%."""

    successes: int
    n: int
    low: float
    high: float

    @property
    def value(self) -> float:
        return self.successes / self.n

    def as_json(self) -> dict:
        return {"successes": self.successes, "n": self.n, "value": self.value, "ci95": [self.low, self.high]}

    def percent(self) -> str:
        """``45 [26, 66]``: the accuracy and its interval in percent."""
        return f"{100 * self.value:.0f} [{100 * self.low:.0f}, {100 * self.high:.0f}]"

    @classmethod
    def from_json(cls, data: dict) -> "Proportion":
        """The proportion ``as_json`` wrote (a report read back)."""
        return cls(data["successes"], data["n"], *data["ci95"])


def wilson(successes: int, n: int, z: float = Z_95) -> Proportion:
    """Wilson score interval of a binomial proportion (good coverage at small ``n`` and at 0 or n)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes ({successes}) <= n ({n}) and n >= 1")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Exact ends at 0 and n (the formula gives them up to rounding).
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Proportion(successes, n, low, high)


def ordering(a: Proportion, b: Proportion) -> Optional[str]:
    """``">"`` or ``"<"`` when the intervals separate, ``None`` (within noise) when they overlap."""
    if a.low > b.high:
        return ">"
    if a.high < b.low:
        return "<"
    return None


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (Lentz's continued fraction, as in Numerical
    Recipes' ``betai``); ``a`` and ``b`` may be fractional (effective counts)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean: use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return front * value


def clopper_pearson_lower(successes: float, n: float, confidence: float) -> float:
    """The one-sided lower confidence bound of a binomial proportion (Clopper-Pearson): the ``p`` at
    which ``successes`` or more of ``n`` have probability ``1 - confidence``, i.e. the
    ``1 - confidence`` quantile of Beta(successes, n - successes + 1). Counts may be fractional
    (effective counts, divided by a design effect); 0 successes give 0."""
    if not 0 <= successes <= n or n <= 0 or not 0 < confidence < 1:
        raise ValueError(f"need 0 <= successes ({successes}) <= n ({n}), n > 0 and confidence ({confidence}) in (0, 1)")
    if successes == 0:
        return 0.0
    a, b, alpha = successes, n - successes + 1, 1 - confidence
    low, high = 0.0, 1.0
    for _ in range(60):  # bisection: I_p(a, b) rises with p
        middle = (low + high) / 2
        low, high = (middle, high) if _incomplete_beta(a, b, middle) < alpha else (low, middle)
    return low
