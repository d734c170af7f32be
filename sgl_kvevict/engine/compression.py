"""One segment's compression in flight, and the statistics a forward computes for it (scoring capture).

A ``SegmentCompression`` lives on its request's record from the forward that submits it until the tree
stores its plan (``CompressionCoordinator``). Its ``stage``:

* ``PREFILLING``: its end is not prefilled yet (a chunked prefill feeds it forward by forward: a
  learned scorer's rows, the queries of a window that straddles two forwards);
* ``RECONSTRUCTING``: its statistics come from KVzip passes, queued after the forward that prefilled
  its end (``engine.reconstruction``);
* ``READY``: every layer was observed (or the plan needs no statistics); ``plan()`` may run.

Scoring capture (``ScoringCapture.run``): after a layer's attention, a ``ScoringJob``'s queries
(the segment's last ``w`` post-RoPE query rows, or a reconstruction pass's queries) attend over the
segment's context as it stands: keys of ``[0, end)`` outside compressed segments, read from their dense
slots, plus the kept cells of segments reused compressed (a softmax per KV head over its own cells and
the dense keys). Segments of the same forward, earlier blocks included, are still dense when scored. The
statistics come from ``kernels.window_stats_paged``, which reads the pool in place and never writes
the ``[H_q, w, L]`` attention matrix; the reference engine's schedules mirror exactly these semantics.
A learned scorer gets the layer's attention-input hidden states of the segment instead
(``engine.adapter.hidden_states``, ``HiddenRowsJob``).

Chunked prefill: a segment may be prefilled by several forwards. A learned scorer gets each forward's rows
of it as they come (``HiddenRowsJob``; ``scoring.base.RowScorer`` scores pieces). A window that
straddles two forwards keeps the queries of its first part (``QueryCarryJob``) until the forward that
computes its end scores the segment with all of them (``ScoringJob.carried``); that forward's keys are
the context as it stands then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from sgl_kvevict.engine.batch import RequestSlice
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.kernels import CompressedCells, window_stats_paged
from sgl_kvevict.policies.base import SegmentCompressor, SegmentSpec
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats


class Stage(enum.Enum):
    PREFILLING = "prefilling"
    RECONSTRUCTING = "reconstructing"
    READY = "ready"


def needs_reconstruction(request: StatsRequest) -> bool:
    return request.queries == RECONSTRUCTION_QUERIES


@dataclass(eq=False)
class SegmentCompression:
    """spec: the segment ``[start, end)``; compressor: its policy state; window: the queries that score it
    (``min(config window, segment length)``); stage: see the module docstring. carried_queries: per layer,
    ``[H_q, n, D]`` post-RoPE queries of the window's first ``n`` tokens, computed by an earlier forward
    of a chunked prefill (the window straddles a chunk boundary)."""

    spec: SegmentSpec
    compressor: SegmentCompressor
    window: int
    stats_request: StatsRequest
    stage: Stage
    carried_queries: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def submitted(cls, compressor: SegmentCompressor, window: int, stats_request: StatsRequest) -> "SegmentCompression":
        return cls(compressor.spec, compressor, min(window, compressor.spec.length), stats_request, Stage.PREFILLING)

    @property
    def needs_reconstruction(self) -> bool:
        return self.compressor.needs_stats and needs_reconstruction(self.stats_request)

    @property
    def window_start(self) -> int:
        return self.spec.end - self.window


class StatsSink(Protocol):
    """What receives a job's statistics, layer by layer: a segment's compressor, or a reconstruction pass's
    collector (``engine.reconstruction``)."""

    def observes(self, layer: int) -> bool: ...

    def observe(self, layer: int, stats: WindowStats) -> None: ...


class HiddenStates(Protocol):
    """The attention inputs of the current forward, by layer id (``engine.adapter.hidden_states``)."""

    by_layer: dict[int, torch.Tensor]  # layer id -> [N, d_model]


class ScoringCapture:
    """Runs a forward's scoring jobs, one layer at a time, from its queries and the pool.

    space: the pool's cells (compressed entries); kv_pool: SGLang's KV pool (``get_key_buffer``);
    hidden_states: the attention inputs of the forward, when a learned scorer may need them.
    """

    def __init__(self, space: CellSpace, kv_pool, hidden_states: Optional[HiddenStates]):
        self.space = space
        self.kv_pool = kv_pool
        self.hidden_states = hidden_states

    def run(self, job: "ForwardJob", q: torch.Tensor, layer) -> None:
        """q ``[N, H_q * D]``: this forward's post-RoPE queries; the forward's KV is already in the pool."""
        job.run(self, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), layer)


class ForwardJob(Protocol):
    def run(self, capture: ScoringCapture, queries: torch.Tensor, layer) -> None:
        """queries ``[N, H_q, D]``: the forward's; ``layer``: SGLang's ``RadixAttention`` just run."""


def _rows(request: RequestSlice, positions: slice) -> slice:
    """The forward's query rows of ``positions`` (inside the request's queries)."""
    first = request.q_start + positions.start - request.first_query_position
    return slice(first, first + positions.stop - positions.start)


@dataclass(frozen=True)
class ScoringJob:
    """Window statistics into ``sink``: the last ``window`` queries of ``request`` (the request cut at the
    segment end, ``RequestSlice.up_to``), the first of them from ``carried`` when an earlier forward computed
    them. Its keys: ``dense_slots`` at ``dense_positions`` (device, every position of ``[0, end)`` outside
    compressed segments) and, when the request reuses compressed segments, their cells (``request.view``)."""

    request: RequestSlice
    sink: StatsSink
    window: int
    stats_request: StatsRequest
    dense_positions: torch.Tensor
    dense_slots: torch.Tensor
    carried: Optional[dict[int, torch.Tensor]] = None

    @classmethod
    def of(
        cls, request: RequestSlice, sink: StatsSink, window: int, stats_request: StatsRequest,
        req_to_token: torch.Tensor, carried: Optional[dict[int, torch.Tensor]] = None,
    ) -> "ScoringJob":  # fmt: skip
        positions, slots = request.dense_keys(req_to_token)
        return cls(request, sink, window, stats_request, positions, slots, carried)

    def run(self, capture: ScoringCapture, queries: torch.Tensor, layer) -> None:
        if not self.sink.observes(layer.layer_id):
            return
        request = self.request
        here = min(self.window, request.num_queries)
        q_window = queries[request.q_end - here : request.q_end].transpose(0, 1)  # [H_q, here, D]
        if here < self.window:
            q_window = torch.cat([self.carried[layer.layer_id], q_window], dim=1)
        k_buffer = capture.kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = capture.kv_pool.get_value_buffer(layer.layer_id)
        if request.view is None:
            stats = window_stats_paged(q_window, k_buffer, v_buffer, self.dense_slots, layer.scaling, self.stats_request)
        else:
            view, space = request.view, capture.space
            start, end = view.layer_offsets[layer.layer_id], view.layer_offsets[layer.layer_id + 1]
            cells = CompressedCells(
                space.k_rows, space.v_rows, view.cells[start:end], view.positions[start:end],
                view.head_indptr[layer.layer_id],
            )  # fmt: skip
            stats = window_stats_paged(
                q_window, k_buffer, v_buffer, self.dense_slots, layer.scaling, self.stats_request,
                key_positions=self.dense_positions, context_length=request.seq_len, cells=cells,
            )  # fmt: skip
        self.sink.observe(layer.layer_id, stats)


@dataclass(frozen=True)
class HiddenRowsJob:
    """A learned scorer's piece: the attention-input hidden states of ``positions`` (this forward's part of
    the segment) into ``sink``."""

    request: RequestSlice
    sink: StatsSink
    window: int
    positions: slice

    def run(self, capture: ScoringCapture, queries: torch.Tensor, layer) -> None:
        if not self.sink.observes(layer.layer_id):
            return
        hidden_states = capture.hidden_states.by_layer[layer.layer_id]  # [N, d_model]
        stats = WindowStats(self.window, hidden_states=hidden_states[_rows(self.request, self.positions)],
                            hidden_start=self.positions.start)  # fmt: skip
        self.sink.observe(layer.layer_id, stats)


@dataclass(frozen=True)
class QueryCarryJob:
    """Keep the queries of ``positions`` (the start of a segment's window, computed by this forward; the rest
    of the window comes in a later forward) in ``carried``, per layer."""

    request: RequestSlice
    carried: dict[int, torch.Tensor]
    positions: slice

    def run(self, capture: ScoringCapture, queries: torch.Tensor, layer) -> None:
        rows = queries[_rows(self.request, self.positions)].transpose(0, 1).clone()  # [H_q, n, D]
        earlier = self.carried.get(layer.layer_id)
        self.carried[layer.layer_id] = rows if earlier is None else torch.cat([earlier, rows], dim=1)
