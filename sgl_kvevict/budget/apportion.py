"""Exact integer split of a budget between layers, proportional to weights, under per-layer caps."""

from __future__ import annotations

import torch


def apportion(total: int, weights: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Split ``total`` units over ``n`` items in proportion to ``weights`` (``[n]``, >= 0); ``[n]`` int64.

    Every unit is placed (``total <= caps.sum()`` is required) and no item exceeds its cap: the
    share an item cannot hold goes to the others in proportion to their weights (water-filling).
    Zero-weight items get units only once every weighted item is full, then evenly.

    Rounding is the D'Hondt divisor method (floor of the proportional share, then the leftover units
    one by one to the highest ``weight / (units + 1)``, lower index first on ties), not largest
    remainder: a divisor method never gives an item more units when another item joins with the
    same total, which is what makes LAVa's one-shot allocation equal its layer-by-layer cascade.
    """
    weights = weights.double().cpu()
    caps = caps.to(torch.int64).cpu()
    weighted = weights > 0
    units = _dhondt(min(total, int(caps[weighted].sum())), weights, torch.where(weighted, caps, 0))
    rest = total - int(units.sum())
    if rest > 0:
        units += _dhondt(rest, (~weighted).double(), torch.where(weighted, 0, caps))
    return units


def _dhondt(total: int, weights: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """D'Hondt with caps; items with weight 0 or cap 0 get nothing; ``total <= caps[weights > 0].sum()``."""
    units = torch.zeros_like(caps)
    open_items = (caps > 0) & (weights > 0)
    remaining = total
    while True:
        share = weights * remaining / weights[open_items].sum() if open_items.any() else torch.zeros_like(weights)
        full = open_items & (share >= caps)
        if not full.any():
            break
        units[full] = caps[full]
        remaining -= int(caps[full].sum())
        open_items &= ~full
    units = torch.where(open_items, share.floor().to(torch.int64).clamp(max=caps), units)
    for _ in range(total - int(units.sum())):  # fewer than the number of open items
        priority = torch.where(open_items & (units < caps), weights / (units + 1), -1.0)
        units[int(priority.argmax())] += 1
    return units
