"""What one forward holds, as the engine sees it: the requests, their compressed paths, and the metadata
the attention backends build from them once per forward.

* ``ForwardRequests`` (built by the coordinator's ``forward_begin``): per request of the batch, its
  query rows, logical length, ``req_to_token`` row and ``PathView`` (None for a request without
  compressed nodes on its path, which the stock attention path serves).
* ``SegmentMetadata`` (built by a backend when a forward has compressed requests): their query rows
  and the ``CellBatch`` of their cells of every layer. The torch backend adds a ``DenseBatch``; the
  FlashInfer backend plans its own dense layout. Both read a request's dense keys through
  ``RequestSlice.dense_keys``.

Nothing a layer runs loops over layers or KV heads in Python or syncs with the host: everything is
built here once per forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_kvevict.engine.segments import PathView, ranges_to_positions


@dataclass(frozen=True)
class RequestSlice:
    """One request of the forward: queries ``q[q_start:q_end]`` at logical positions
    ``[seq_len - (q_end - q_start), seq_len)``; ``row`` is its ``req_to_token`` row index."""

    index: int
    q_start: int
    q_end: int
    seq_len: int
    row: int
    view: Optional[PathView]

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def first_query_position(self) -> int:
        return self.seq_len - self.num_queries

    def dense_ranges(self) -> list[tuple[int, int]]:
        """The position ranges of ``[0, seq_len)`` read from dense slots (host ints)."""
        return [(0, self.seq_len)] if self.view is None else self.view.dense_ranges(self.seq_len)

    def dense_keys(self, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[n]`` positions and slots (on ``req_to_token``'s device) of the dense keys, ascending."""
        positions = ranges_to_positions(self.dense_ranges(), req_to_token.device)
        return positions, req_to_token[self.row, positions].to(torch.int64)

    def up_to(self, end: int) -> "RequestSlice":
        """This request as far as position ``end`` (inside this forward): its queries and context there."""
        return dataclasses.replace(self, q_end=self.q_end - (self.seq_len - end), seq_len=end)


@dataclass(frozen=True)
class ForwardRequests:
    """The requests of one forward, in batch order (``forward_batch.rids``)."""

    is_decode: bool
    requests: tuple[RequestSlice, ...]

    @property
    def compressed(self) -> tuple[RequestSlice, ...]:
        return tuple(request for request in self.requests if request.view is not None)


@dataclass(frozen=True)
class CellBatch:
    """The compressed requests' cells, every layer at once (device tensors).

    kv_indices int64 ``[n]``: cell ids, layer-major, then request, then KV head; kv_indptr int64
    ``[L, B_c * H_kv + 1]``: ``kv_indptr[l]`` are the pseudo-sequence offsets of layer ``l`` into
    ``kv_indices`` (sequence ``r * H_kv + h``). max_cells: the longest sequence (host int).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_cells: int

    @classmethod
    def of(cls, views: list[PathView], device: torch.device) -> "CellBatch":
        counts = torch.stack([view.counts for view in views], dim=1)  # [L, B_c, H_kv]
        num_layers = counts.shape[0]
        flat_counts = counts.flatten()
        ends = torch.cumsum(flat_counts, 0)
        starts = ends - flat_counts
        kv_indptr = torch.cat([starts.view(num_layers, -1), ends.view(num_layers, -1)[:, -1:]], dim=1)
        # The (layer, request) blocks are contiguous in each view's cells: one gather builds the index.
        view_bases = torch.cumsum(torch.tensor([0] + [len(view.cells) for view in views[:-1]]), 0)
        layer_starts = torch.tensor([view.layer_offsets[:-1] for view in views]).t()  # [L, B_c]
        block_sources = (layer_starts + view_bases).flatten()
        block_counts = counts.sum(2).flatten()
        block_targets = torch.cumsum(block_counts, 0) - block_counts
        total = int(block_counts.sum())
        gather = torch.repeat_interleave(block_sources - block_targets, block_counts, output_size=total)
        gather += torch.arange(total)
        cells = torch.cat([view.cells for view in views])
        return cls(kv_indptr.to(device), cells[gather.to(device)], int(flat_counts.max()))


class CellBatchCache:
    """The last forward's ``CellBatch`` and the views it was built from: decode steps of the same batch
    reuse it (a view is rebuilt whenever its path or the arena's placements change)."""

    def __init__(self):
        self._views: tuple[PathView, ...] = ()
        self._cells: Optional[CellBatch] = None

    def of(self, views: tuple[PathView, ...], device: torch.device) -> CellBatch:
        same = self._cells is not None and len(self._views) == len(views)
        if not (same and all(a is b for a, b in zip(self._views, views))):
            self._views, self._cells = views, CellBatch.of(list(views), device)
        return self._cells


@dataclass(frozen=True)
class SegmentMetadata:
    """A backend's per-forward metadata of the compressed requests (``forward.compressed``).

    query_rows int64 ``[N_c]``: their query rows in the forward, request-major; qo_indptr int64
    ``[B_c + 1]`` (device); cells: their ``CellBatch``; max_queries: the most queries of one of them.
    """

    forward: ForwardRequests
    query_rows: torch.Tensor
    qo_indptr: torch.Tensor
    cells: CellBatch
    max_queries: int

    @classmethod
    def of(cls, forward: ForwardRequests, device: torch.device, cell_cache: CellBatchCache) -> "SegmentMetadata":
        compressed = forward.compressed
        query_rows = torch.cat([torch.arange(r.q_start, r.q_end, device=device) for r in compressed])
        counts = torch.tensor([0] + [r.num_queries for r in compressed])
        return cls(
            forward,
            query_rows,
            torch.cumsum(counts, 0).to(device),
            cell_cache.of(tuple(r.view for r in compressed), device),
            max(r.num_queries for r in compressed),
        )


@dataclass(frozen=True)
class DenseBatch:
    """The compressed requests' dense keys, padded to one batch (device tensors; the torch backend's).

    slots int64 ``[B_c, n]`` and positions int64 ``[B_c, n]``; a padded entry repeats a real slot of its
    request (never the placeholder slot 0, whose content is undefined) at a position past every query,
    so the causal mask hides it. query_positions ``[N_c]``: the position of each compressed query row
    (request-major, as ``SegmentMetadata.query_rows``).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    query_positions: torch.Tensor

    @classmethod
    def of(cls, requests: tuple[RequestSlice, ...], req_to_token: torch.Tensor) -> "DenseBatch":
        device = req_to_token.device
        keys = [request.dense_keys(req_to_token) for request in requests]
        widest = max(len(positions) for positions, _ in keys)
        padding = max(request.seq_len for request in requests)
        positions = torch.full((len(requests), widest), padding, dtype=torch.int64, device=device)
        slots = torch.zeros(len(requests), widest, dtype=torch.int64, device=device)
        for index, (request_positions, request_slots) in enumerate(keys):
            positions[index, : len(request_positions)] = request_positions
            slots[index] = request_slots[-1]  # the new token's slot: every request has one
            slots[index, : len(request_positions)] = request_slots
        query_positions = torch.cat(
            [torch.arange(r.first_query_position, r.seq_len, device=device) for r in requests]
        )
        return cls(slots, positions, query_positions)
