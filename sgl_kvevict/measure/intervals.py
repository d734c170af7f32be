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
