"""Ridge regression in closed form from sufficient statistics (pure torch, float64).

Rows are added in batches (``RegressionStatistics.add``), so a corpus never has to fit in memory:
the fit, its error on other rows and its R^2 all follow from ``n``, the sums of ``x`` and ``y``,
``X^T X``, ``X^T Y`` and the sum of ``y^2``. Features are standardised for the fit (the penalty
then treats every feature alike) and the solution is mapped back to raw features, so a prediction
is one ``x @ W^T + b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RegressionStatistics:
    """Sufficient statistics of rows ``(x [d], y [k])``, float64."""

    count: int
    sum_x: torch.Tensor  # [d]
    sum_y: torch.Tensor  # [k]
    xtx: torch.Tensor  # [d, d]
    xty: torch.Tensor  # [d, k]
    sum_yy: torch.Tensor  # [k]

    @classmethod
    def empty(cls, num_features: int, num_targets: int) -> "RegressionStatistics":
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
        return cls(0, zeros(num_features), zeros(num_targets), zeros(num_features, num_features),
                   zeros(num_features, num_targets), zeros(num_targets))  # fmt: skip

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x [n, d]``, ``y [n, k]``."""
        x, y = x.double(), y.double()
        self.count += x.shape[0]
        self.sum_x += x.sum(0)
        self.sum_y += y.sum(0)
        self.xtx += x.t() @ x
        self.xty += x.t() @ y
        self.sum_yy += y.square().sum(0)

    def __add__(self, other: "RegressionStatistics") -> "RegressionStatistics":
        return RegressionStatistics(
            self.count + other.count,
            self.sum_x + other.sum_x,
            self.sum_y + other.sum_y,
            self.xtx + other.xtx,
            self.xty + other.xty,
            self.sum_yy + other.sum_yy,
        )

    def fit(self, ridges: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per ridge penalty ``l``, the ``(W [k, d], b [k])`` minimising
        ``|| Y - X W^T - b ||^2 / n + l || W_std ||^2`` over these rows, ``W_std`` the weights of
        the standardised features (so ``l`` is relative: the features' covariance becomes their
        correlation). One eigendecomposition serves every penalty."""
        mean_x, mean_y = self.sum_x / self.count, self.sum_y / self.count
        covariance = self.xtx / self.count - torch.outer(mean_x, mean_x)
        cross = self.xty / self.count - torch.outer(mean_x, mean_y)
        scale = covariance.diagonal().clamp(min=1e-12).sqrt()
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance / torch.outer(scale, scale))
        projected = eigenvectors.t() @ (cross / scale.unsqueeze(1))
        fits = []
        for ridge in ridges:
            standardised = eigenvectors @ (projected / (eigenvalues + ridge).unsqueeze(1))  # [d, k]
            weight = (standardised / scale.unsqueeze(1)).t()
            fits.append((weight, mean_y - weight @ mean_x))
        return fits

    def squared_error(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``[k]``: the sum over these rows of ``(y - W x - b)^2``, per target."""
        weight, bias = weight.double(), bias.double()
        predicted_cross = (weight * self.xty.t()).sum(1)  # sum y_j (w_j . x)
        predicted_square = (weight @ self.xtx * weight).sum(1)  # sum (w_j . x)^2
        return (
            self.sum_yy
            - 2 * predicted_cross
            - 2 * bias * self.sum_y
            + predicted_square
            + 2 * bias * (weight @ self.sum_x)
            + self.count * bias.square()
        )

    def total_squares(self) -> torch.Tensor:
        """``[k]``: the sum of ``(y - mean y)^2`` over these rows (R^2's denominator)."""
        return self.sum_yy - self.sum_y.square() / self.count
