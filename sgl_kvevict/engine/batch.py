"""ForwardPlan: what the attention backend needs to know about one forward, built once per forward.

``ForwardPlan.build`` runs in ``init_forward_metadata``; every layer then only indexes tensors it built.
Nothing a layer runs loops over layers or KV heads in Python or syncs with the host:

* per request, its query rows, logical length and ``PathView`` (None for a plain request, which goes
  through the stock attention path);
* ``CellBatch``: the compressed requests' cells of *all* layers as one device index, with
  ``kv_indptr[layer]`` the (request, KV head) pseudo-sequences of one layer (offsets into the shared
  index), cached across forwards while the batch and the arena's placements stay the same (decode);
* ``DenseBatch``: the compressed requests' dense keys (every position outside their compressed spans,
  new tokens included) as slot indices, rebuilt per forward from host-known lengths;
* the scoring jobs of an extend: one per span compressed after this forward (``Scope.compressible_spans``)
  of each request whose prompt ends in it (``EngineState.submit``).

Scoring semantics (those of the reference engine, which the parity tests hold it to): a span's last
``w`` queries attend over keys ``[0, span end)`` as this forward computed them. Spans compressed in an
earlier forward (reused blocks, earlier chat turns) enter with their kept entries only, a softmax per
KV head over its own cells plus the dense positions; spans of this forward, earlier blocks included,
are still dense when scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_kvevict.engine.paths import path_view
from sgl_kvevict.engine.reconstruction import needs_reconstruction
from sgl_kvevict.engine.segments import PathView, ranges_to_positions
from sgl_kvevict.engine.state import EngineState, request_state
from sgl_kvevict.policies.base import SegmentCompressor
from sgl_kvevict.scoring.window import StatsRequest


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

    def up_to(self, end: int) -> "RequestSlice":
        """This request as far as position ``end`` (inside this forward): its queries and context there."""
        return dataclasses.replace(self, q_end=self.q_end - (self.seq_len - end), seq_len=end)


@dataclass(frozen=True)
class ScoringJob:
    """Score the segment of ``compressor`` with the last ``window`` queries of ``request`` (the request
    cut at the segment end, ``RequestSlice.up_to``). Its keys: ``dense_slots`` at ``dense_positions``
    (device, every position of ``[0, segment end)`` outside compressed spans) and, when the request
    reuses compressed spans, their cells (``request.view``)."""

    request: RequestSlice
    compressor: SegmentCompressor
    window: int
    stats_request: StatsRequest
    dense_positions: torch.Tensor
    dense_slots: torch.Tensor


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


@dataclass(frozen=True)
class DenseBatch:
    """The compressed requests' dense keys, padded to one batch (device tensors).

    slots int64 ``[B_c, n]`` and positions int64 ``[B_c, n]``; a padded entry repeats a real slot of its
    request (never the placeholder slot 0, whose content is undefined) at a position past every query,
    so the causal mask hides it. query_positions ``[N_c]``: the position of each
    compressed query row (request-major, as ``ForwardPlan.query_rows``).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    query_positions: torch.Tensor

    @classmethod
    def of(cls, requests: list[RequestSlice], req_to_token: torch.Tensor) -> "DenseBatch":
        device = req_to_token.device
        ranges = [request.dense_ranges() for request in requests]
        widest = max(sum(end - start for start, end in request_ranges) for request_ranges in ranges)
        padding = max(request.seq_len for request in requests)
        positions = torch.full((len(requests), widest), padding, dtype=torch.int64, device=device)
        slots = torch.zeros(len(requests), widest, dtype=torch.int64, device=device)
        for index, (request, request_ranges) in enumerate(zip(requests, ranges)):
            request_positions = ranges_to_positions(request_ranges, device)
            request_slots = req_to_token[request.row, request_positions]
            positions[index, : len(request_positions)] = request_positions
            slots[index] = request_slots[-1]  # the new token's slot: every request has one
            slots[index, : len(request_positions)] = request_slots
        query_positions = torch.cat(
            [torch.arange(r.first_query_position, r.seq_len, device=device) for r in requests]
        )
        return cls(slots, positions, query_positions)


@dataclass
class ForwardPlan:
    engine: EngineState
    is_decode: bool
    requests: list[RequestSlice]
    scoring: list[ScoringJob]
    compressed: list[RequestSlice] = dataclasses.field(init=False)
    query_rows: Optional[torch.Tensor] = None  # the compressed requests' query rows, request-major
    qo_indptr: Optional[torch.Tensor] = None
    cells: Optional[CellBatch] = None
    dense: Optional[DenseBatch] = None

    def __post_init__(self):
        self.compressed = [request for request in self.requests if request.view is not None]

    @property
    def max_queries(self) -> int:
        return max(request.num_queries for request in self.compressed)

    @classmethod
    def build(cls, engine: EngineState, forward_batch, req_to_token: torch.Tensor) -> "ForwardPlan":
        if engine.reconstruction is not None:
            return cls.for_reconstruction(engine, engine.reconstruction, req_to_token)
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_extend()):
            return cls(engine, False, [], [])
        device = req_to_token.device
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        query_counts = [1] * len(seq_lens) if mode.is_decode() else list(forward_batch.extend_seq_lens_cpu)
        requests, scoring, q_start = [], [], 0
        for index, (rid, seq_len, count) in enumerate(zip(forward_batch.rids, seq_lens, query_counts)):
            req = engine.requests.get(rid)
            if req is None:  # not matched by this tree (SGLang matches every request first): stock path
                row = int(forward_batch.req_pool_indices[index])
                requests.append(RequestSlice(index, q_start, q_start + count, seq_len, row, None))
            else:
                view = path_view(engine, req, device)
                requests.append(RequestSlice(index, q_start, q_start + count, seq_len, req.kv.req_pool_idx, view))
                if mode.is_extend() and seq_len == len(req.origin_input_ids):
                    scoring += _scoring_jobs(engine, req, requests[-1], req_to_token)
            q_start += count
        plan = cls(engine, mode.is_decode(), requests, scoring)
        if plan.compressed:
            plan._describe_compressed(device, req_to_token)
        return plan

    @classmethod
    def for_reconstruction(cls, engine: EngineState, work, req_to_token: torch.Tensor) -> "ForwardPlan":
        """The plan of a KVzip reconstruction pass (``engine.reconstruction``): one request, the chunk's
        queries over its temporary row, every query scoring (the window is the whole chunk)."""
        request = RequestSlice(0, 0, work.length, work.end + work.length, work.row, work.view)
        job = _job(request, work.collector, work.length, work.stats_request, req_to_token)
        plan = cls(engine, False, [request], [job])
        if plan.compressed:
            plan._describe_compressed(req_to_token.device, req_to_token)
        return plan

    def _describe_compressed(self, device: torch.device, req_to_token: torch.Tensor) -> None:
        compressed = self.compressed
        self.query_rows = torch.cat([torch.arange(r.q_start, r.q_end, device=device) for r in compressed])
        counts = torch.tensor([0] + [r.num_queries for r in compressed])
        self.qo_indptr = torch.cumsum(counts, 0).to(device)
        self.cells = self.cell_batch([r.view for r in compressed], device)
        self.dense = DenseBatch.of(compressed, req_to_token)

    def cell_batch(self, views: list[PathView], device: torch.device) -> CellBatch:
        """The ``CellBatch`` of ``views``, reused from the previous forward when the batch holds the same
        views (a view is rebuilt whenever its path or the arena's placements change)."""
        cached_views, cached = self.engine.cell_batch_cache
        if cached is None or len(cached_views) != len(views) or any(a is not b for a, b in zip(cached_views, views)):
            cached = CellBatch.of(views, device)
            self.engine.cell_batch_cache = (tuple(views), cached)
        return cached


def _scoring_jobs(engine: EngineState, req, request: RequestSlice, req_to_token: torch.Tensor) -> list[ScoringJob]:
    """2. submit (``engine.state``): the request's prompt ends in this forward."""
    start = request.first_query_position
    if start != req.kv.cache_protected_len:
        return []  # the extend starts inside tree-owned tokens: nothing of it is the request's own
    compressors = engine.submit(req, start, request.seq_len)
    setup = request_state(req).setup
    if setup is None or needs_reconstruction(setup.stats_request):
        return []  # scored after this forward, by the reconstruction passes (engine.reconstruction)
    return [
        _job(request.up_to(compressor.spec.end), compressor, min(setup.config.window, compressor.spec.length),
             setup.stats_request, req_to_token)
        for compressor in compressors
        if compressor.needs_stats
    ]  # fmt: skip


def _job(request: RequestSlice, compressor, window: int, stats_request: StatsRequest, req_to_token) -> ScoringJob:
    positions = ranges_to_positions(request.dense_ranges(), req_to_token.device)
    slots = req_to_token[request.row, positions].to(torch.int64)
    return ScoringJob(request, compressor, window, stats_request, positions, slots)
