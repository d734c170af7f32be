"""ForwardPlan: what the attention backend needs to know about each request of one forward.

Built once per forward (``init_forward_metadata``), read by every layer:

* per request, its query rows, logical length and ``PathView`` (None for a plain request, which
  goes through the stock attention path);
* the compressed requests' arena cells per layer, flattened into the (request, KV head)
  pseudo-sequences ``kernels.segment_attention`` takes;
* the scoring jobs of the extend: requests whose prompt ends in this forward and whose own span is
  long enough to compress. Their compressor lives on the request until the tree's checkpoint.

Scoring approximation: when the context before a segment holds compressed spans (a later chat
turn), the window softmax is taken over the dense positions only (the compressed cells differ per
head and would need a per-head softmax); the statistics are spread back to absolute positions with
zeros at the compressed ones, which are never candidates of the new segment anyway.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from sgl_kvevict.engine.radix_cache import compressed_path
from sgl_kvevict.engine.segments import PathView
from sgl_kvevict.engine.state import EngineState, request_state
from sgl_kvevict.policies.base import SegmentCompressor
from sgl_kvevict.scoring.window import WindowStats


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


@dataclass(frozen=True)
class ScoringJob:
    """Score the segment of ``compressor`` (ending at ``request.seq_len``) with its last ``window`` queries."""

    request: RequestSlice
    compressor: SegmentCompressor
    window: int


def spread_columns(stats: WindowStats, positions: torch.Tensor, length: int) -> WindowStats:
    """Statistics over the columns ``positions`` as statistics over ``[0, length)`` (zeros elsewhere)."""

    def spread(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_zeros(*tensor.shape[:-1], length)
        out[..., positions] = tensor
        return out

    tensors = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    return dataclasses.replace(
        stats, **{name: spread(value) for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    )


def path_view(engine: EngineState, req) -> Optional[PathView]:
    """The request's ``PathView``, memoised per ``last_node`` (a locked path cannot change)."""
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
                job = cls._scoring_job(engine, req, request)
                if job is not None:
                    scoring.append(job)
        return cls(engine, requests, scoring)

    @staticmethod
    def _scoring_job(engine: EngineState, req, request: RequestSlice) -> Optional[ScoringJob]:
        start = request.seq_len - request.num_queries
        if start != req.kv.cache_protected_len:
            return None  # the extend starts inside tree-owned tokens: nothing of it is the request's own
        compressor = engine.start_segment(req, start, request.seq_len)
        if compressor is None or not compressor.needs_stats:
            return None
        return ScoringJob(request, compressor, min(engine.eviction.window, request.seq_len - start))

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
