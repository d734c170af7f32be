"""Compressed segments of the radix tree and what a request sees of them.

* ``CompressedSegment``: the content of one compressed radix node: the kept entries of a logical segment
  ``[start, start + length)``, each a (layer, KV head, position) stored in one arena cell. Entries are
  one flat list, layer-major, then KV head, then position (the order of the plan's CSR), so a layer's
  entries are one slice and a (layer, head)'s one sub-slice. The arena owns the cells and may move
  them (``relocate``); the segment keeps a device copy of its cell ids for the kernels. Under tensor
  parallelism a segment *reserves* more cells than it has entries when another rank keeps more of
  the segment (``sharding.RankCounts``): every rank's tree then takes the same memory decisions. The
  spare cells follow the entries in the cell list and are never read.
* ``PathView``: everything compressed on a request's tree path (root to ``req.last_node``): the logical
  segments (whose ``req_to_token`` entries are dummy slot 0) and, per layer and KV head, the cells of all
  of them in path order, on the device. Attention treats them as one pseudo-sequence per (request, KV
  head); every position outside the segments is dense.

Pure torch: nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.sharding import RankCounts

UNASSIGNED = -1


class CompressedSegment:
    """Kept entries of the segment ``[start, start + length)`` of one compressed radix node.

    counts: int64 ``[L, H_kv]`` entries per (layer, KV head) (host).
    positions: int64 ``[n]`` logical position of each entry (host), entry order as in the module doc.
    rank_counts: every rank's entries of the segment by position (one rank without tensor parallelism).
    cells: int64 ``[num_cells]`` the arena cell of each entry, then the spare cells (host; the arena
        writes it through ``relocate``).
    owner_id: the arena's id of this segment.
    """

    def __init__(self, start: int, length: int, counts: torch.Tensor, positions: torch.Tensor, rank_counts: RankCounts):
        self.start = start
        self.length = length
        self.counts = counts
        self.positions = positions
        self.rank_counts = rank_counts
        self.cells = torch.full((rank_counts.reserved(),), UNASSIGNED, dtype=torch.int64)
        self.owner_id = -1
        self._device_cells: Optional[torch.Tensor] = None

    @classmethod
    def of_plan(cls, plan: CompressionPlan, rank_counts: RankCounts) -> "CompressedSegment":
        """The entries of ``plan`` (already restricted to the node's segment, as ``rank_counts``), cells not
        yet assigned."""
        counts = torch.stack([layer.counts() for layer in plan.layers])
        positions = torch.cat([layer.kept_positions for layer in plan.layers])
        return cls(plan.segment_start, plan.segment_length, counts, positions, rank_counts)

    @property
    def num_entries(self) -> int:
        return len(self.positions)

    @property
    def num_cells(self) -> int:
        """The cells it holds: its entries' and the spare ones (the same on every rank)."""
        return len(self.cells)

    @property
    def entry_cells(self) -> torch.Tensor:
        """int64 ``[n]``: the cell of each entry (host)."""
        return self.cells[: self.num_entries]

    @property
    def end(self) -> int:
        return self.start + self.length

    def layer_ids(self) -> torch.Tensor:
        """int64 ``[n]``: each entry's layer."""
        return torch.repeat_interleave(torch.arange(self.counts.shape[0]), self.counts.sum(1))

    def head_ids(self) -> torch.Tensor:
        """int64 ``[n]``: each entry's KV head."""
        num_kv_heads = self.counts.shape[1]
        return torch.repeat_interleave(torch.arange(num_kv_heads).repeat(self.counts.shape[0]), self.counts.flatten())

    def layer_positions(self, layer: int, head: int = 0) -> torch.Tensor:
        """int64: the positions KV head ``head`` of ``layer`` keeps, ascending."""
        flat = self.counts.flatten()
        group = layer * self.counts.shape[1] + head
        first = int(flat[:group].sum())
        return self.positions[first : first + int(flat[group])]

    def relocate(self, indices: torch.Tensor, cells: torch.Tensor) -> None:
        """Entries ``indices`` now live in ``cells`` (called by the arena)."""
        self.cells[indices] = cells
        self._device_cells = None

    def device_cells(self, device: torch.device) -> torch.Tensor:
        """The cell ids on ``device``, copied once per placement (moves invalidate the copy)."""
        if self._device_cells is None or self._device_cells.device != device:
            self._device_cells = self.entry_cells.to(device)
        return self._device_cells

    def split(self, at: int) -> "Split":
        """The parts before ``at`` and from ``at`` on (``start < at < end``), cells not yet assigned, and
        which of this segment's cells each part takes: its entries' cells, then spare cells (this
        segment's first, then the extra ones a split may need, ``Split.extra``)."""
        assert self.start < at < self.end, (self.start, self.length, at)
        before = self.positions < at
        parts = (self._part(before, self.start, at), self._part(~before, at, self.end))
        spares = torch.arange(self.num_entries, self.num_cells)
        taken = []
        for part, mask in zip(parts, (before, ~before)):
            wanted = part.num_cells - part.num_entries
            taken.append(torch.cat([mask.nonzero().squeeze(1), spares[:wanted]]))
            spares = spares[wanted:]
        return Split(parts, tuple(taken))

    def merged(self, other: "CompressedSegment") -> tuple["CompressedSegment", torch.Tensor, torch.Tensor]:
        """This segment's entries and ``other``'s (the same range, no entry in both; ``other`` has no spare
        cells and keeps as many entries on every rank) as one segment, cells not yet assigned; and where each
        one's cells are in it (int64 ``[num_cells]`` of this one, spare cells last, and ``[m]``): a split head
        gaining the local layers' window before the split (``local_layers.window_before``). Every rank adds
        the same entries, so the reservation grows by them and this segment's spare cells stay spare."""
        assert (self.start, self.length) == (other.start, other.length) and other.num_cells == other.num_entries
        num_kv_heads = self.counts.shape[1]
        groups = torch.cat([self.layer_ids() * num_kv_heads + self.head_ids(), other.layer_ids() * num_kv_heads + other.head_ids()])
        positions = torch.cat([self.positions, other.positions])
        order = torch.argsort(groups * (self.end + 1) + positions)  # layer-major, then head, then position
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))
        counts = self.counts + other.counts
        merged = CompressedSegment(self.start, self.length, counts, positions[order], self.rank_counts.plus(other.rank_counts))
        assert merged.num_cells == self.num_cells + other.num_entries, "the added entries are every rank's alike"
        spares = torch.arange(merged.num_entries, merged.num_cells)
        return merged, torch.cat([where[: self.num_entries], spares]), where[self.num_entries :]

    def _part(self, mask: torch.Tensor, start: int, end: int) -> "CompressedSegment":
        """The entries ``mask`` as the segment of ``[start, end)``."""
        groups = self.layer_ids()[mask] * self.counts.shape[1] + self.head_ids()[mask]
        counts = torch.bincount(groups, minlength=self.counts.numel()).view_as(self.counts)
        return CompressedSegment(start, end - start, counts, self.positions[mask], self.rank_counts.restricted(start, end))


class SpareCells:
    """Cells the arena hands out before a split gives them to its parts (an arena owner meanwhile)."""

    def __init__(self, count: int):
        self.cells = torch.full((count,), UNASSIGNED, dtype=torch.int64)
        self.owner_id = -1

    def relocate(self, indices: torch.Tensor, cells: torch.Tensor) -> None:
        self.cells[indices] = cells


@dataclass(frozen=True)
class Split:
    """A compressed segment cut in two: ``parts`` (head, tail), and per part the indices of the split
    segment's cells it takes, in the part's cell order. A part's cells beyond those (``missing``) are
    extra cells the split takes from the arena: another rank keeps more of each side than this one
    does of the whole, so the reservations grow (never without tensor parallelism)."""

    parts: tuple[CompressedSegment, CompressedSegment]
    taken: tuple[torch.Tensor, torch.Tensor]

    def missing(self, part: int) -> int:
        return self.parts[part].num_cells - len(self.taken[part])

    @property
    def extra(self) -> int:
        return self.missing(0) + self.missing(1)


@dataclass(frozen=True)
class PathView:
    """The compressed part of one request's context.

    ranges: the ``(start, end)`` logical ranges of the compressed nodes on the path, ascending.
    counts: int64 ``[L, H_kv]`` cells per (layer, KV head) over all segments (host).
    layer_offsets: ``L + 1`` host ints: layer ``l``'s cells are ``cells[layer_offsets[l]:layer_offsets[l + 1]]``.
    cells, positions: int64 ``[n]`` on the KV device: cell ids and their logical positions, layer-major,
        then KV head, then path order (so positions ascend within a (layer, head)).
    head_indptr: int64 ``[L, H_kv + 1]`` on the KV device: each KV head's cells inside its layer's slice.
    reserved_cells: the cells the segments hold, spare ones included: the same on every tensor-parallel rank
        (``cells`` are this rank's entries), so decisions read from it agree between ranks.
    """

    ranges: tuple[tuple[int, int], ...]
    counts: torch.Tensor
    layer_offsets: tuple[int, ...]
    cells: torch.Tensor
    positions: torch.Tensor
    head_indptr: torch.Tensor
    reserved_cells: int

    @classmethod
    def of(cls, segments: Sequence[CompressedSegment], device: torch.device) -> "PathView":
        """Segments in path order (root first)."""
        per_segment = torch.stack([segment.counts.flatten() for segment in segments])  # [k, L * H]
        order = _interleave_index(per_segment)
        cells = torch.cat([segment.device_cells(device) for segment in segments])[order.to(device)]
        positions = torch.cat([segment.positions for segment in segments])[order].to(device)
        counts = per_segment.sum(0).view_as(segments[0].counts)
        ranges = tuple((segment.start, segment.end) for segment in segments)
        reserved = sum(segment.num_cells for segment in segments)
        return cls.of_entries(ranges, counts, cells, positions, reserved)

    @classmethod
    def of_entries(
        cls, ranges, counts: torch.Tensor, cells: torch.Tensor, positions: torch.Tensor, reserved_cells: int
    ) -> "PathView":
        """The view of entries already in the view's order (``cells``, ``positions``), with the offsets
        derived from ``counts``."""
        layer_offsets = (0, *torch.cumsum(counts.sum(1), 0).tolist())
        head_indptr = torch.nn.functional.pad(torch.cumsum(counts, 1), (1, 0)).to(cells.device)
        return cls(ranges, counts, layer_offsets, cells, positions, head_indptr, reserved_cells)

    @property
    def compressed_tokens(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def dense_ranges(self, length: int) -> list[tuple[int, int]]:
        """The ranges of ``[0, length)`` outside every compressed segment, ascending (host ints)."""
        ranges, cursor = [], 0
        for start, end in self.ranges:
            if start >= length:
                break
            if start > cursor:
                ranges.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < length:
            ranges.append((cursor, length))
        return ranges


def _interleave_index(per_segment: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]``: the order that turns the concatenated entries of ``k`` segments (each grouped by
    ``g`` = layer * H + head, with ``per_segment[i, g]`` entries in group ``g``) into group-major,
    segment-minor order. One gather, no sort."""
    num_segments, num_groups = per_segment.shape
    source_starts = (torch.cumsum(per_segment.flatten(), 0) - per_segment.flatten()).view(num_segments, num_groups)
    block_counts = per_segment.t().flatten()  # (group, segment) order
    block_sources = source_starts.t().flatten()
    block_targets = torch.cumsum(block_counts, 0) - block_counts
    total = int(block_counts.sum())
    return torch.repeat_interleave(block_sources - block_targets, block_counts, output_size=total) + torch.arange(total)


def ranges_to_positions(ranges: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """int64: the positions of ``ranges`` concatenated, built on ``device`` from host ints."""
    if not ranges:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(start, end, device=device) for start, end in ranges])
