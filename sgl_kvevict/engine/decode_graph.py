"""Decode in a replayable form: the compressed part's per-forward metadata in fixed-capacity buffers.

A CUDA graph replays the kernels it captured on the tensors it captured: same addresses, same
shapes. SGLang captures one decode graph per batch size (and per *attention variant*, its
``AttentionGraphVariants``) and, before each replay, pads the batch to that size and refreshes its own
buffers in place (``init_forward_metadata_out_graph``). The compressed part of the segment attention
takes that form here:

* ``GraphCapacity``: the bounds the buffers are sized by, once, for the largest captured batch.
* ``DecodeGraphState.fill`` (outside the graph, before a replay): writes one decode batch's cells into
  the buffers in place; ``DecodeGraphState.check`` says, without writing, why a batch does not fit
  (it then runs eagerly).
* ``DecodeGraphState.attend`` (captured): one layer's attention of every request of the batch over its
  cells, reading only those buffers; every shape depends on the batch size alone and nothing reads a
  device value on the host. A request without compressed nodes, or a padded one, has no cells: its
  ``lse`` is ``-inf`` and it merges away.
* ``SegmentGraphVariants``: the decode graphs the CUDA backend captures per batch size, ``stock``
  (SGLang's own body, for batches without a compressed request) and the ``segments`` graphs (the dense
  part through FlashInfer's graph-mode decode wrapper, planned before the replay over each request's
  dense positions; the compressed part here; their merge), and the choice between them per batch.

The compressed part is ``kernels.segment_attention`` over each (request, KV head)'s cells: a fixed grid
given the batch size and a bound on a sequence's cells, host ints from which the Triton kernel's split
count follows, so the split count is fixed per captured graph. A bound from the model's context length
would split every batch as if its sequences were that long (up to 32 ways where the H100 measurement
says not to split below ``MIN_CELLS_TO_SPLIT`` cells), so each batch size has a ``segments`` graph per
bound (``segment_graph_limits``, as SGLang's own ``Dsv41CandidateGraphVariants`` keys graphs by the
longest request): one that never splits, for batches whose longest sequence stays below the split
threshold, and one bounded by the context length, for the others. A batch replays the first whose
bound holds its longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sgl_kvevict.engine.batch import CellBatch, CellBatchCache, ForwardRequests
from sgl_kvevict.engine.host_copies import write
from sgl_kvevict.kernels import MIN_CELLS_TO_SPLIT, merge_attention_states, segment_attention

# What ``DecodeGraphState.fill`` and ``check`` return for a batch that fits (for one that does not: why).
FITS = ""
# The capture labels of SGLang's decode graph variants, in capture order (SGLang shares one memory
# pool between a batch size's variants; the larger capture comes last, as SGLang's own DSA variants do):
# the stock graph, the segments graph that never splits a sequence, the one that may.
STOCK, SEGMENTS, SEGMENTS_SPLIT = "stock", "segments", "segments-split"
# The most memory the cell index of the graphs takes. It is allocated when SGLang captures, after it sized
# the KV pool, from the memory it leaves beside the pool for activations and graphs (at least 10 GiB on
# GPUs above 60 GiB, 2 MiB per captured batch size of it for graphs: sglang/srt/arg_groups/memory_hook.py),
# so it is bounded rather than sized by the pool: 128 MiB hold 33.5M cells, batch 32 at a quarter of 8K
# histories on Llama-3-8B (32 layers, 8 KV heads: 16.8M cells). A batch with more runs eagerly, counted.
GRAPH_CELL_INDEX_BYTES = 128 << 20


def cell_index_dtype(cell_id_bound: int) -> torch.dtype:
    """The narrowest index dtype of cell ids below ``cell_id_bound``."""
    return torch.int32 if cell_id_bound <= torch.iinfo(torch.int32).max else torch.int64


def cell_index_capacity(pool_cells: int, cell_id_bound: int) -> int:
    """Entries of the graphs' cell index: every cell of the pool once (``pool_cells``: layers x slots x KV
    heads, the K rows only: a V row is never a cell id), at most ``GRAPH_CELL_INDEX_BYTES`` of them."""
    return min(pool_cells, GRAPH_CELL_INDEX_BYTES // cell_index_dtype(cell_id_bound).itemsize)


def segment_graph_limits(cells_per_sequence: int) -> tuple[tuple[str, int], ...]:
    """The ``segments`` graphs of one batch size, ``(label, the cells of one sequence it serves)``,
    ascending: one bounded below ``MIN_CELLS_TO_SPLIT`` (the kernel never splits it), and, when a sequence
    may hold more (``cells_per_sequence``: the capacity's bound), one bounded by that."""
    unsplit = min(cells_per_sequence, MIN_CELLS_TO_SPLIT - 1)
    return ((SEGMENTS, unsplit),) + (((SEGMENTS_SPLIT, cells_per_sequence),) if cells_per_sequence > unsplit else ())


def segments_limit(limits: tuple[tuple[str, int], ...], longest: int) -> tuple[str, int]:
    """The ``(label, bound)`` of ``limits`` a batch whose longest sequence holds ``longest`` cells replays:
    the first whose bound holds it (``DecodeGraphState.check`` lets no longer one replay)."""
    return next(limit for limit in limits if longest <= limit[1])


def longest_sequence(forward: ForwardRequests) -> int:
    """The most cells one (layer, request, KV head) of ``forward`` holds (host ints; 0 without cells)."""
    return max((int(request.view.counts.max()) for request in forward.compressed), default=0)


@dataclass(frozen=True)
class GraphCapacity:
    """Bounds of one forward in replayable form: ``max_batch`` requests; ``cells`` cell entries over every
    layer, request and KV head; ``cells_per_sequence`` cells of one (layer, request, KV head) (it sizes
    the compressed part's work per sequence: the Triton kernel's split-KV choice, the torch form's
    padding)."""

    max_batch: int
    cells: int
    cells_per_sequence: int

    def __post_init__(self):
        bounds = {name: getattr(self, name) for name in ("max_batch", "cells", "cells_per_sequence")}
        bad = [f"{name}={value}" for name, value in bounds.items() if not isinstance(value, int) or value < 1]
        if bad:
            raise ValueError(f"graph capacity bounds must be positive integers: {', '.join(bad)}")


class DecodeGraphState:
    """The buffers of one model's replayable compressed decode (device tensors, allocated once).

    qo_indptr int32 ``[max_batch + 1]``: one query per request (``arange``), never written again.
    cell_indptr int32 ``[L, max_batch * H_kv + 1]``: per layer, the (request, KV head) sequences' offsets
    into ``cell_indices`` ``[cells]`` (layer-major, then request, then KV head: ``CellBatch``'s order),
    int32 where the cell ids fit (``cell_id_bound``).

    ``fill`` writes only what changed since the last batch: a request's cells do not change between its
    decode steps (its view is rebuilt when they do), so the index is built once per set of compressed
    views (``CellBatchCache``) and copied on the device; the offsets are written from pinned memory when
    the batch's layout changes (``engine.host_copies``).
    """

    def __init__(
        self, capacity: GraphCapacity, num_layers: int, num_kv_heads: int, device: torch.device, cell_id_bound: int
    ):
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        sequences = capacity.max_batch * num_kv_heads
        self.qo_indptr = torch.arange(capacity.max_batch + 1, dtype=torch.int32, device=device)
        self.cell_indptr = torch.zeros(num_layers, sequences + 1, dtype=torch.int32, device=device)
        self.cell_indices = torch.zeros(capacity.cells, dtype=cell_index_dtype(cell_id_bound), device=device)
        self.cell_batches = CellBatchCache()
        self._indexed: Optional[CellBatch] = None  # the cells ``cell_indices`` holds
        self._layout: tuple = ()  # (batch size, compressed requests' indices) ``cell_indptr`` holds for them

    def _counts(self, forward: ForwardRequests, batch_size: int) -> torch.Tensor:
        """int64 ``[L, batch_size, H_kv]`` (host): the cells of every (layer, request, KV head)."""
        counts = torch.zeros(self.cell_indptr.shape[0], batch_size, self.num_kv_heads, dtype=torch.int64)
        for request in forward.requests:
            if request.view is not None:
                counts[:, request.index] = request.view.counts
        return counts

    def check(self, forward: ForwardRequests) -> str:
        """``FITS``, or why the decode batch ``forward`` is beyond the capacity (host ints only). Read from
        bounds every tensor-parallel rank shares (a rank's cells are at most the cells its segments reserve,
        a sequence's at most its compressed tokens), so every rank replays or every rank runs eagerly:
        their collectives must match."""
        capacity = self.capacity
        if len(forward.requests) > capacity.max_batch:
            return f"the batch has {len(forward.requests)} requests, above {capacity.max_batch}"
        views = [request.view for request in forward.requests if request.view is not None]
        longest = max((view.compressed_tokens for view in views), default=0)
        if longest > capacity.cells_per_sequence:
            return f"a request has {longest} compressed tokens, above {capacity.cells_per_sequence} cells per sequence"
        total = sum(view.reserved_cells for view in views)
        if total > capacity.cells:
            return f"the batch reserves {total} cells, above {capacity.cells}"
        return FITS

    def fill(self, forward: ForwardRequests, batch_size: int) -> str:
        """Write the cells of the decode batch ``forward`` (its requests first, padded to ``batch_size``
        requests without cells) into the buffers in place. Returns ``FITS``, or why the batch is beyond
        the capacity (the buffers are then left as they were). Host work on a batch's change only, and
        copies that never make the host wait; nothing the replayed body reads is reallocated."""
        assert forward.is_decode and len(forward.requests) <= batch_size <= self.capacity.max_batch
        why = self.check(forward)
        if why:
            return why
        compressed = forward.compressed
        if compressed:
            cells = self.cell_batches.of(tuple(request.view for request in compressed), self.cell_indices.device)
            if cells is not self._indexed:
                self.cell_indices[: cells.kv_indices.numel()].copy_(cells.kv_indices)  # device to device
                self._indexed, self._layout = cells, ()
        layout = (batch_size, tuple(request.index for request in compressed))
        if layout != self._layout:
            counts = self._counts(forward, batch_size)
            num_layers = counts.shape[0]
            ends = torch.cumsum(counts.view(num_layers, -1), 1)  # [L, B * H_kv], within each layer
            layer_starts = torch.cumsum(ends[:, -1:], 0) - ends[:, -1:]  # the cells of the layers before
            indptr = torch.cat([layer_starts, ends + layer_starts], 1).to(torch.int32)
            write(self.cell_indptr[:, : batch_size * self.num_kv_heads + 1], indptr)
            self._layout = layout
        return FITS

    def attend(
        self, q: torch.Tensor, layer, k_rows: torch.Tensor, v_rows: torch.Tensor, cells_per_sequence: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's attention of the filled batch (its size is ``q``'s first dimension) over each
        (request, KV head)'s cells. q ``[B, H_q, D]``; k_rows, v_rows: the pool's cells;
        ``cells_per_sequence``: the captured graph's bound on the longest sequence (its split count).
        Returns out ``[B, H_q, D_v]`` and natural-log lse fp32 ``[B, H_q]`` (``-inf`` for a head
        without cells)."""
        batch_size = q.shape[0]
        return segment_attention(
            q, k_rows, v_rows, self.qo_indptr[: batch_size + 1],
            self.cell_indptr[layer.layer_id, : batch_size * self.num_kv_heads + 1], self.cell_indices,
            self.num_kv_heads, layer.scaling, 1, cells_per_sequence,
        )  # fmt: skip

    def attend_with_dense(
        self, q: torch.Tensor, layer, k_rows: torch.Tensor, v_rows: torch.Tensor, cells_per_sequence: int,
        dense_out: torch.Tensor, dense_lse: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A ``segments`` graph's layer: ``attend`` merged with the dense part of the same queries (out
        ``[B, H_q, D_v]``, natural-log lse fp32 ``[B, H_q]``, computed by the caller: FlashInfer's
        graph-mode decode wrapper in the CUDA backend). Returns ``[B, H_q, D_v]``."""
        compressed_out, compressed_lse = self.attend(q, layer, k_rows, v_rows, cells_per_sequence)
        merged, _ = merge_attention_states(dense_out, dense_lse, compressed_out, compressed_lse)
        return merged


@dataclass(frozen=True)
class SegmentGraphVariants:
    """SGLang's ``AttentionGraphVariants`` protocol for the CUDA backend: per batch size a decode graph for
    batches without compressed requests (``STOCK``) and the ``segments`` graphs of ``limits``
    (``segment_graph_limits``) for batches with some. ``select`` is the backend's choice for a batch
    (``KVEvictFlashInferBackend.select_graph_variant``)."""

    select: Callable[[object], str]
    limits: tuple[tuple[str, int], ...]

    @property
    def capture_labels(self) -> tuple[str, ...]:
        return (STOCK, *(label for label, _ in self.limits))

    def segments_for(self, longest: int) -> str:
        """The ``segments`` graph of a batch whose longest sequence holds ``longest`` cells."""
        return segments_limit(self.limits, longest)[0]

    def bound_of(self, label: str) -> int:
        """The cells per sequence the ``segments`` graph ``label`` is captured for."""
        return dict(self.limits)[label]
