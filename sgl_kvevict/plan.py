"""CompressionPlan: which (layer, KV head, position) entries of one segment are kept.

A *segment* is a contiguous logical token range ``[segment_start, segment_end)`` of one request that
is compressed once. The plan is engine-independent: the reference engine turns it into a masked HF
cache, the SGLang engine gathers the kept entries into arena cells. Both read the same plan, which
is what makes the parity test between them meaningful.

Layout per layer is CSR over KV heads: ``kept_positions[head_indptr[h]:head_indptr[h+1]]`` are the
sorted absolute positions that KV head ``h`` keeps. Observation-window positions are always part of
the plan (every head keeps them), so "kept fraction" and budgets count the window, as the papers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerPlan:
    """Kept positions of one layer.

    kept_positions: int64 ``[total_kept]``, absolute logical positions, ascending within each head,
        heads concatenated in order.
    head_indptr: int64 ``[H_kv + 1]``, CSR offsets into ``kept_positions``.
    """

    kept_positions: torch.Tensor
    head_indptr: torch.Tensor

    @classmethod
    def from_heads(cls, per_head: list[torch.Tensor]) -> "LayerPlan":
        """Build from one 1-D position tensor per KV head (any order; sorted and de-duplicated here)."""
        sorted_heads = [torch.unique(p.to(torch.int64).cpu()) for p in per_head]
        counts = torch.tensor([len(p) for p in sorted_heads], dtype=torch.int64)
        indptr = torch.zeros(len(sorted_heads) + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(counts, 0)
        positions = torch.cat(sorted_heads) if sorted_heads else torch.zeros(0, dtype=torch.int64)
        return cls(kept_positions=positions, head_indptr=indptr)

    @property
    def num_kv_heads(self) -> int:
        return len(self.head_indptr) - 1

    def counts(self) -> torch.Tensor:
        """int64 ``[H_kv]``: entries kept per KV head."""
        return self.head_indptr[1:] - self.head_indptr[:-1]

    def head_positions(self, head: int) -> torch.Tensor:
        """int64 ``[kept_h]``: sorted kept positions of KV head ``head``."""
        return self.kept_positions[self.head_indptr[head] : self.head_indptr[head + 1]]

    def head_ids(self) -> torch.Tensor:
        """int64 ``[total_kept]``: the KV head of every entry of ``kept_positions``."""
        return torch.repeat_interleave(torch.arange(self.num_kv_heads), self.counts())

    def restricted(self, start: int, end: int) -> "LayerPlan":
        """The entries at positions ``[start, end)``, each head's in order."""
        inside = (self.kept_positions >= start) & (self.kept_positions < end)
        indptr = torch.zeros(self.num_kv_heads + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.bincount(self.head_ids()[inside], minlength=self.num_kv_heads), 0)
        return LayerPlan(kept_positions=self.kept_positions[inside], head_indptr=indptr)


@dataclass(frozen=True)
class CompressionPlan:
    """Per-layer kept positions of one segment ``[segment_start, segment_end)``."""

    segment_start: int
    segment_end: int
    layers: tuple[LayerPlan, ...]

    @property
    def segment_length(self) -> int:
        return self.segment_end - self.segment_start

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def counts(self) -> torch.Tensor:
        """int64 ``[num_layers, H_kv]``: entries kept per (layer, KV head)."""
        return torch.stack([layer.counts() for layer in self.layers])

    def total_kept(self) -> int:
        return int(sum(len(layer.kept_positions) for layer in self.layers))

    def kept_fraction(self) -> float:
        """Mean over (layer, KV head) of kept / segment length (window included)."""
        cells = self.segment_length * self.num_layers * self.layers[0].num_kv_heads
        return self.total_kept() / cells if cells else 1.0

    def keep_mask(self, layer: int) -> torch.Tensor:
        """bool ``[H_kv, segment_length]``: True where (head, position) is kept in ``layer``."""
        lp = self.layers[layer]
        mask = torch.zeros(lp.num_kv_heads, self.segment_length, dtype=torch.bool)
        mask[lp.head_ids(), lp.kept_positions - self.segment_start] = True
        return mask

    def restricted(self, start: int, end: int) -> "CompressionPlan":
        """The plan's entries at positions ``[start, end)``, as the plan of that segment."""
        return CompressionPlan(start, end, tuple(layer.restricted(start, end) for layer in self.layers))

    @classmethod
    def keep_all(cls, segment_start: int, segment_end: int, num_layers: int, num_kv_heads: int) -> "CompressionPlan":
        """The identity plan: every entry kept (used for segments too short to compress)."""
        segment = torch.arange(segment_start, segment_end, dtype=torch.int64)
        layer = LayerPlan.from_heads([segment] * num_kv_heads)
        return cls(segment_start, segment_end, tuple([layer] * num_layers))
