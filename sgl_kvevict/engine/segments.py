"""Compressed spans of the radix tree and what a request sees of them.

* ``CompressedSegment``: the content of one compressed radix node, i.e. the kept entries of a
  logical span ``[start, start + length)`` as arena cells, per layer CSR over KV heads; split at a
  position when a request diverges inside its node (request scope, shared prefixes).
* ``PathView``: everything compressed on a request's tree path (root to ``req.last_node``): the
  logical spans (whose ``req_to_token`` entries are dummy slot 0) and, per layer and KV head, the
  cells of all those spans. Attention treats the cells as one pseudo-sequence per (request, KV head)
  and every position outside the spans as dense.

Pure torch: nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sgl_kvevict.plan import CompressionPlan, LayerPlan


def truncate_plan(plan: CompressionPlan, end: int) -> CompressionPlan:
    """The plan restricted to positions ``[plan.segment_start, end)`` (drops the dense window)."""
    return _restrict_plan(plan, plan.segment_start, end)


def skip_plan_prefix(plan: CompressionPlan, start: int) -> CompressionPlan:
    """The plan restricted to positions ``[start, plan.segment_end)`` (drops the positions a shared
    compressed node already holds)."""
    return _restrict_plan(plan, start, plan.segment_end)


def _restrict_plan(plan: CompressionPlan, start: int, end: int) -> CompressionPlan:
    layers = []
    for layer in plan.layers:
        inside = (layer.kept_positions >= start) & (layer.kept_positions < end)
        indptr = _head_indptr(layer.head_ids()[inside], layer.num_kv_heads)
        layers.append(LayerPlan(kept_positions=layer.kept_positions[inside], head_indptr=indptr))
    return CompressionPlan(start, end, tuple(layers))


def _head_indptr(heads: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """int64 ``[H_kv + 1]``: the CSR offsets of head-major entries whose KV heads are ``heads``."""
    indptr = torch.zeros(num_kv_heads + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(heads, minlength=num_kv_heads), 0)
    return indptr


@dataclass(frozen=True)
class CompressedSegment:
    """Kept entries of the span ``[start, start + length)`` of one radix node.

    cells: per layer, int64 ``[kept_l]`` arena cell ids in the plan's CSR order (head-major,
        positions ascending); head_indptr: per layer, int64 ``[H_kv + 1]`` (cpu); positions: per
        layer, int64 ``[kept_l]`` the logical position of each cell (cpu).
    """

    start: int
    length: int
    cells: tuple[torch.Tensor, ...]
    head_indptr: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, plan: CompressionPlan, cells: Sequence[torch.Tensor]) -> "CompressedSegment":
        """``plan`` (already truncated to the compressed span) stored in ``cells[layer]``."""
        return cls(
            plan.segment_start,
            plan.segment_length,
            tuple(cells),
            tuple(layer.head_indptr for layer in plan.layers),
            tuple(layer.kept_positions for layer in plan.layers),
        )

    @property
    def num_cells(self) -> int:
        return sum(len(cells) for cells in self.cells)

    def head_ids(self, layer: int) -> torch.Tensor:
        """int64 ``[kept_l]``: the KV head of every cell of ``layer``."""
        indptr = self.head_indptr[layer]
        return torch.repeat_interleave(torch.arange(len(indptr) - 1), indptr[1:] - indptr[:-1])

    def split(self, at: int) -> tuple["CompressedSegment", "CompressedSegment"]:
        """The segments of ``[start, at)`` and ``[at, start + length)``: each layer's cells are
        partitioned by position (no K/V is copied), each part keeping the head-major CSR order."""
        assert self.start < at < self.start + self.length, (self.start, self.length, at)
        return self._restricted(self.start, at), self._restricted(at, self.start + self.length)

    def _restricted(self, start: int, end: int) -> "CompressedSegment":
        num_kv_heads = len(self.head_indptr[0]) - 1
        cells, head_indptr, positions = [], [], []
        for layer, layer_positions in enumerate(self.positions):
            inside = (layer_positions >= start) & (layer_positions < end)
            cells.append(self.cells[layer][inside.to(self.cells[layer].device)])
            head_indptr.append(_head_indptr(self.head_ids(layer)[inside], num_kv_heads))
            positions.append(layer_positions[inside])
        return CompressedSegment(start, end - start, tuple(cells), tuple(head_indptr), tuple(positions))


@dataclass(frozen=True)
class PathView:
    """The compressed part of one request's context.

    spans: the ``(start, end)`` logical ranges of the compressed nodes on the path, ascending.
    head_counts: per layer, int64 ``[H_kv]`` cells per KV head over all spans (cpu).
    cells: per layer, int64 ``[sum(head_counts)]`` cell ids, head-major (all spans of head 0, ...).
    positions: per layer, int64 ``[sum(head_counts)]`` the logical position of each cell (cpu).
    """

    spans: tuple[tuple[int, int], ...]
    head_counts: tuple[torch.Tensor, ...]
    cells: tuple[torch.Tensor, ...]
    positions: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, segments: Sequence[CompressedSegment], num_layers: int, num_kv_heads: int) -> "PathView":
        """Segments in path order (root first)."""
        head_counts, cells, positions = [], [], []
        for layer in range(num_layers):
            layer_cells = torch.cat([segment.cells[layer] for segment in segments])
            heads = torch.cat([segment.head_ids(layer) for segment in segments])
            order = torch.sort(heads, stable=True).indices  # head-major, path order within a head
            cells.append(layer_cells[order.to(layer_cells.device)])
            positions.append(torch.cat([segment.positions[layer] for segment in segments])[order])
            head_counts.append(torch.bincount(heads, minlength=num_kv_heads))
        spans = tuple((segment.start, segment.start + segment.length) for segment in segments)
        return cls(spans, tuple(head_counts), tuple(cells), tuple(positions))

    @property
    def compressed_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def dense_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """int64 ``[n]``: the positions of ``[0, length)`` outside every compressed span, ascending."""
        dense = torch.ones(length, dtype=torch.bool, device=device)
        for start, end in self.spans:
            dense[start:end] = False
        return dense.nonzero().squeeze(1)

    def kept_keys(
        self, layer: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What KV head ``h`` of ``layer`` holds of positions ``[0, length)`` (every span lies inside).

        Returns dense_positions int64 ``[n]`` (read from dense slots for every head), and per cell its
        KV head and position, int64 ``[sum(head_counts[layer])]`` each (in ``cells[layer]`` order).
        """
        heads = torch.repeat_interleave(torch.arange(len(self.head_counts[layer])), self.head_counts[layer])
        return self.dense_positions(length, device), heads.to(device), self.positions[layer].to(device)
