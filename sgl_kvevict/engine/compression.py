"""One span's compression in flight, and the statistics a forward computes for it (scoring capture).

A ``SpanCompression`` lives on its request's record from the forward that submits it until the tree
stores its plan (``CompressionCoordinator``). Its ``stage``:

* ``SCORING``: its statistics come from the prefill forward that computes its observation window;
* ``RECONSTRUCTING``: its statistics come from KVzip passes, queued after that forward
  (``engine.reconstruction``);
* ``READY``: every layer was observed; ``plan()`` may run.

Scoring capture (``ScoringCapture.observe``): after a layer's attention, a ``ScoringJob``'s queries
(the span's last ``w`` post-RoPE query rows, or a reconstruction pass's queries) attend over the
span's context as it stands: keys of ``[0, end)`` outside compressed spans, read from their dense
slots, plus the kept cells of spans reused compressed (a softmax per KV head over its own cells and
the dense keys). Spans of the same forward, earlier blocks included, are still dense when scored. The
statistics come from ``kernels.window_stats_paged``, which reads the pool in place and never writes
the ``[H_q, w, L]`` attention matrix; the reference engine's schedules mirror exactly these semantics.
A learned scorer gets the layer's attention-input hidden states of the span instead
(``engine.hidden_states``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from sgl_kvevict.engine.batch import RequestSlice
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.hidden_states import HiddenStateCapture
from sgl_kvevict.kernels import CompressedCells, window_stats_paged
from sgl_kvevict.policies.base import SegmentCompressor, SegmentSpec
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats


class Stage(enum.Enum):
    SCORING = "scoring"
    RECONSTRUCTING = "reconstructing"
    READY = "ready"


def needs_reconstruction(request: StatsRequest) -> bool:
    return request.queries == RECONSTRUCTION_QUERIES


@dataclass(eq=False)
class SpanCompression:
    """spec: the span ``[start, end)``; compressor: its policy state; window: the queries that score it
    (``min(config window, span length)``); stage: see the module docstring."""

    spec: SegmentSpec
    compressor: SegmentCompressor
    window: int
    stats_request: StatsRequest
    stage: Stage

    @classmethod
    def submitted(cls, compressor: SegmentCompressor, window: int, stats_request: StatsRequest) -> "SpanCompression":
        """A new compression: scored by its forward, by KVzip passes, or by nothing (kept whole)."""
        if not compressor.needs_stats:
            stage = Stage.READY
        elif needs_reconstruction(stats_request):
            stage = Stage.RECONSTRUCTING
        else:
            stage = Stage.SCORING
        return cls(compressor.spec, compressor, min(window, compressor.spec.length), stats_request, stage)


class StatsSink(Protocol):
    """What receives a job's statistics, layer by layer: a span's compressor, or a reconstruction pass's
    collector (``engine.reconstruction``)."""

    def observe(self, layer: int, stats: WindowStats) -> None: ...


@dataclass(frozen=True)
class ScoringJob:
    """Score with the last ``window`` queries of ``request`` (the request cut at the span end,
    ``RequestSlice.up_to``) into ``sink``. Its keys: ``dense_slots`` at ``dense_positions`` (device, every
    position of ``[0, end)`` outside compressed spans) and, when the request reuses compressed spans,
    their cells (``request.view``). ``span``: the rows a learned scorer reads (``[start, end)``)."""

    request: RequestSlice
    sink: StatsSink
    window: int
    stats_request: StatsRequest
    span: SegmentSpec
    dense_positions: torch.Tensor
    dense_slots: torch.Tensor

    @classmethod
    def of(
        cls, request: RequestSlice, sink: StatsSink, window: int, stats_request: StatsRequest, span: SegmentSpec,
        req_to_token: torch.Tensor,
    ) -> "ScoringJob":  # fmt: skip
        positions, slots = request.dense_keys(req_to_token)
        return cls(request, sink, window, stats_request, span, positions, slots)


class ScoringCapture:
    """Computes scoring jobs' statistics from a forward's queries and the pool, one layer at a time.

    space: the pool's cells (compressed entries); kv_pool: SGLang's KV pool (``get_key_buffer``);
    hidden_states: the attention inputs of the forward, when a learned scorer may need them.
    """

    def __init__(self, space: CellSpace, kv_pool, hidden_states: Optional[HiddenStateCapture]):
        self.space = space
        self.kv_pool = kv_pool
        self.hidden_states = hidden_states

    def observe(self, job: ScoringJob, q: torch.Tensor, layer) -> None:
        """q ``[N, H_q * D]``: this forward's post-RoPE queries; the KV of the request (prefix and this
        forward) must already be in the pool."""
        job.sink.observe(layer.layer_id, self._stats(job, q, layer))

    def _stats(self, job: ScoringJob, q: torch.Tensor, layer) -> WindowStats:
        if job.stats_request.hidden_states:
            return self._hidden_state_stats(job, self.hidden_states.by_layer[layer.layer_id])
        request = job.request
        queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        q_window = queries[request.q_end - job.window : request.q_end].transpose(0, 1)  # [H_q, w, D]
        k_buffer = self.kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.kv_pool.get_value_buffer(layer.layer_id)
        if request.view is None:
            return window_stats_paged(q_window, k_buffer, v_buffer, job.dense_slots, layer.scaling, job.stats_request)
        view, space = request.view, self.space
        start, end = view.layer_offsets[layer.layer_id], view.layer_offsets[layer.layer_id + 1]
        cells = CompressedCells(
            space.k_rows, space.v_rows, view.cells[start:end], view.positions[start:end], view.head_indptr[layer.layer_id]
        )
        return window_stats_paged(
            q_window, k_buffer, v_buffer, job.dense_slots, layer.scaling, job.stats_request,
            key_positions=job.dense_positions, context_length=request.seq_len, cells=cells,
        )  # fmt: skip

    @staticmethod
    def _hidden_state_stats(job: ScoringJob, hidden_states: torch.Tensor) -> WindowStats:
        """The span's rows of this forward's attention-input hidden states ``[N, d_model]``."""
        span, request = job.span, job.request
        first = request.q_start + span.start - request.first_query_position
        return WindowStats(window=job.window, hidden_states=hidden_states[first : first + span.length], hidden_start=span.start)
