"""ForwardPlan: what the attention backend needs to know about each request of one forward.

Built once per forward (``init_forward_metadata``), read by every layer:

* per request, its query rows, logical length and ``PathView`` (None for a plain request, which
  goes through the stock attention path);
* the compressed requests' arena cells per layer, flattened into the (request, KV head)
  pseudo-sequences ``kernels.segment_attention`` takes;
* the scoring jobs of the extend: one per span compressed after this forward (``Scope.compressible_spans``:
  the request's own span in request scope, every block ending in this forward in block scope) of
  each request whose prompt ends in it. Their compressors live on the request until the tree's
  checkpoint.

Scoring semantics (those of the reference engine, which the parity tests hold it to): a span's last
``w`` queries attend over keys ``[0, span end)`` as this forward computed them. Spans compressed in
an earlier forward (reused blocks, earlier chat turns) enter with their kept entries only, a softmax
per KV head over its own cells plus the dense positions (``window_stats(kept=...)``); spans of this
forward, earlier blocks included, are still dense when scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from sgl_kvevict.engine.radix_cache import compressed_path
from sgl_kvevict.engine.segments import PathView
from sgl_kvevict.engine.state import EngineState, request_state
from sgl_kvevict.kernels import window_stats_paged
from sgl_kvevict.policies.base import SegmentCompressor
from sgl_kvevict.scoring.window import StatsRequest, WindowStats, window_stats


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

    def query_positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.seq_len - self.num_queries, self.seq_len, device=device)

    def dense_positions(self, device: torch.device) -> torch.Tensor:
        """int64: the positions of ``[0, seq_len)`` read from dense slots."""
        if self.view is None:
            return torch.arange(self.seq_len, device=device)
        return self.view.dense_positions(self.seq_len, device)

    def up_to(self, end: int) -> "RequestSlice":
        """This request as far as position ``end`` (inside this forward): its queries and context there."""
        return dataclasses.replace(self, q_end=self.q_end - (self.seq_len - end), seq_len=end)


@dataclass(frozen=True)
class ScoringJob:
    """Score the segment of ``compressor`` with its last ``window`` queries, the last queries of
    ``request`` (the request cut at the segment end, ``RequestSlice.up_to``)."""

    request: RequestSlice
    compressor: SegmentCompressor
    window: int

    def window_stats(
        self, q_window: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, row: torch.Tensor,
        arena_k: torch.Tensor, arena_v: torch.Tensor, layer: int, scaling: float, stats_request: StatsRequest,
    ) -> WindowStats:  # fmt: skip
        """The segment's ``WindowStats`` of ``layer`` over keys ``[0, segment end)`` (module docstring).

        q_window ``[H_q, w, D]``; k_buffer ``[slots, H_kv, D]``, v_buffer ``[slots, H_kv, D_v]`` (this
        layer's dense pool); row: the request's ``req_to_token`` row; arena_k ``[cells, D]``, arena_v
        ``[cells, D_v]`` (this layer's arena).
        """
        request, length = self.request, self.request.seq_len
        if request.view is None:
            return window_stats_paged(q_window, k_buffer, v_buffer, row[:length], scaling, stats_request)
        # Scatter every head's kept entries into a position-indexed [H_kv, L] cache, as the reference
        # engine's keep mask sees its dense cache: dense positions for every head, cells per head.
        dense, cell_heads, cell_positions = request.view.kept_keys(layer, length, row.device)
        cells = request.view.cells[layer].to(arena_k.device)
        slots = row[dense].long()
        num_kv_heads = k_buffer.shape[1]
        keys = k_buffer.new_zeros(num_kv_heads, length, k_buffer.shape[2])
        values = v_buffer.new_zeros(num_kv_heads, length, v_buffer.shape[2])
        keys[:, dense] = k_buffer[slots].transpose(0, 1)
        values[:, dense] = v_buffer[slots].transpose(0, 1)
        keys[cell_heads, cell_positions] = arena_k[cells]
        values[cell_heads, cell_positions] = arena_v[cells]
        kept = torch.zeros(num_kv_heads, length, dtype=torch.bool, device=keys.device)
        kept[:, dense] = True
        kept[cell_heads, cell_positions] = True
        return window_stats(q_window, keys, values, scaling, stats_request, kept=kept)


def path_view(engine: EngineState, req) -> Optional[PathView]:
    """The request's ``PathView``, memoised per ``last_node`` (a locked path only changes by the split
    of a compressed node, which keeps its cells and their order within each KV head)."""
    state = request_state(req)
    if state.view_node is not req.last_node:
        segments = compressed_path(req.last_node)
        shape = engine.shape
        state.view = PathView.of(segments, shape.num_layers, shape.num_kv_heads) if segments else None
        state.view_node = req.last_node
    return state.view


@dataclass
class ForwardPlan:
    engine: EngineState
    requests: list[RequestSlice]
    scoring: list[ScoringJob]
    compressed: list[RequestSlice] = field(init=False)
    _layer_cells: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)

    def __post_init__(self):
        self.compressed = [request for request in self.requests if request.view is not None]

    @classmethod
    def build(cls, engine: EngineState, forward_batch) -> "ForwardPlan":
        mode = forward_batch.forward_mode
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        rows = forward_batch.req_pool_indices.tolist()
        if mode.is_decode():
            query_counts = [1] * len(seq_lens)
        elif mode.is_extend():
            query_counts = list(forward_batch.extend_seq_lens_cpu)
        else:
            return cls(engine, [], [])
        requests, scoring, q_start = [], [], 0
        for index, (rid, seq_len, row, count) in enumerate(zip(forward_batch.rids, seq_lens, rows, query_counts)):
            req = engine.requests.get(rid)
            view = path_view(engine, req) if req is not None else None
            request = RequestSlice(index, q_start, q_start + count, seq_len, row, view)
            requests.append(request)
            q_start += count
            if mode.is_extend() and req is not None and seq_len == len(req.origin_input_ids):
                scoring += cls._scoring_jobs(engine, req, request)
        return cls(engine, requests, scoring)

    @staticmethod
    def _scoring_jobs(engine: EngineState, req, request: RequestSlice) -> list[ScoringJob]:
        start = request.seq_len - request.num_queries
        if start != req.kv.cache_protected_len:
            return []  # the extend starts inside tree-owned tokens: nothing of it is the request's own
        window = engine.eviction.window
        return [
            ScoringJob(request.up_to(compressor.spec.end), compressor, min(window, compressor.spec.length))
            for compressor in engine.start_segments(req, start, request.seq_len)
            if compressor.needs_stats
        ]

    # ---- compressed requests ------------------------------------------------------------------

    def compressed_query_rows(self, device: torch.device) -> torch.Tensor:
        """int64: the query rows of the compressed requests, request-major."""
        return torch.cat([torch.arange(r.q_start, r.q_end, device=device) for r in self.compressed])

    def compressed_qo_indptr(self, device: torch.device) -> torch.Tensor:
        counts = torch.tensor([0] + [r.num_queries for r in self.compressed], device=device)
        return torch.cumsum(counts, 0)

    def compressed_cells(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_indptr [B_c * H_kv + 1], kv_indices [nnz])`` of ``layer``: sequence ``r * H_kv + h``
        holds the cells of KV head ``h`` over every compressed span on request ``r``'s path."""
        if layer not in self._layer_cells:
            counts = torch.cat([r.view.head_counts[layer] for r in self.compressed])
            indptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
            indptr[1:] = torch.cumsum(counts, 0)
            cells = torch.cat([r.view.cells[layer] for r in self.compressed])
            self._layer_cells[layer] = (indptr.to(device), cells.to(device))
        return self._layer_cells[layer]
