"""KVzip's reconstruction passes through SGLang's own model runner (``scoring.kvzip`` has the contract).

After the prefill forward of a request whose spans ask for reconstruction statistics, and before any of
its spans is compressed, the tree's checkpoint runs, per span and per chunk of it, one extra forward:
the chunk's ids (repeat instruction, the chat template's assistant opening, the span's tokens again)
at logical positions ``end, end + 1, ...`` with ``end`` the span's end. Its queries see the request's
keys ``[0, end)`` as they are (dense slots, and the cells of compressed nodes already on its path) and
the chunk's own keys, causally; its statistics are the chunk queries' ``window_stats`` over those keys,
cropped to ``[0, end)``, merged over chunks, and fed to the span's compressor once per layer.

The pass lives in a temporary ``req_to_token`` row (``alloc_rows``): positions ``[0, end)`` copied from
the request's row, the chunk at ``[end, end + m)`` in slots taken from SGLang's allocator (the tree
evicts for them if it must; the request's own path is locked). Row and slots are given back right
after the pass: nothing of it is inserted in the tree, and the request's own row, its output and the
tokens it has sampled are untouched. The forward is an ordinary EXTEND batch of one request
(``ModelRunner.forward``); ``ForwardPlan.build`` recognises it by ``EngineState.reconstruction``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from sgl_kvevict.engine.segments import PathView
from sgl_kvevict.policies.base import SegmentCompressor
from sgl_kvevict.scoring.kvzip import (
    ReconstructionChunk,
    ReconstructionPrompt,
    crop_columns,
    merge_chunk_stats,
    reconstruction_chunks,
)
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats

RECONSTRUCTION_RID = "kvevict-reconstruction"


class NoRoomForReconstruction(Exception):
    """The pool (or the request table) has no room for a pass even after evicting the tree: every
    other slot is held by running requests. The request's spans then stay dense."""


def needs_reconstruction(request: StatsRequest) -> bool:
    return request.queries == RECONSTRUCTION_QUERIES


@dataclass
class ChunkStats(SegmentCompressor):
    """Collects one pass's per-layer statistics, cropped to the context ``[0, end)`` and merged with the
    chunks before it; stands in for the span's compressor during the pass."""

    end: int
    per_layer: dict[int, WindowStats] = field(default_factory=dict)
    needs_stats: bool = True

    def observe(self, layer: int, stats: WindowStats) -> None:
        self.per_layer[layer] = merge_chunk_stats(self.per_layer.get(layer), crop_columns(stats, self.end))

    def plan(self):
        raise NotImplementedError("reconstruction statistics are handed to the span's compressor")


@dataclass(frozen=True)
class ReconstructionPass:
    """The forward in flight: the temporary row, the chunk and what it sees (read by ``ForwardPlan``)."""

    row: int
    end: int
    chunk: ReconstructionChunk
    view: Optional[PathView]
    collector: ChunkStats
    stats_request: StatsRequest

    @property
    def length(self) -> int:
        return len(self.chunk.input_ids)


class Reconstructor:
    """Runs the reconstruction passes of one scheduler's requests (owned by the ``EngineState``)."""

    def __init__(self, engine, model_runner, tree, prompt: ReconstructionPrompt):
        self.engine = engine
        self.model_runner = model_runner
        self.tree = tree
        self.prompt = prompt

    def score(self, req, compressors: list[SegmentCompressor], stats_request: StatsRequest, view) -> None:
        """Every compressor of ``req`` gets its reconstruction statistics, layer by layer."""
        for compressor in compressors:
            if not compressor.needs_stats:
                continue
            spec = compressor.spec
            collector = ChunkStats(end=spec.end)
            ids = req.full_untruncated_fill_ids[spec.start : spec.end]
            for chunk in reconstruction_chunks(ids, spec.start, self.prompt):
                self._run_pass(req, spec.end, chunk, view, collector, stats_request)
            for layer in sorted(collector.per_layer):
                compressor.observe(layer, collector.per_layer[layer])

    def _run_pass(self, req, end: int, chunk, view, collector: ChunkStats, stats_request: StatsRequest) -> None:
        pool, allocator = self.tree.req_to_token_pool, self.tree.token_to_kv_pool_allocator
        rows = pool.alloc_rows(1)
        if rows is None:
            raise NoRoomForReconstruction("no free req_to_token row for a reconstruction pass")
        (row,) = rows
        slots = None
        try:
            work = ReconstructionPass(row, end, chunk, view, collector, stats_request)
            slots = self._slots(work.length)
            table = pool.req_to_token
            table[row, :end] = table[req.kv.req_pool_idx, :end]
            table[row, end : end + work.length] = slots.to(table.dtype)
            self.engine.reconstruction = work
            self.model_runner.forward(self._forward_batch(work, slots))
        finally:
            self.engine.reconstruction = None
            if slots is not None:
                allocator.free(slots)
            pool.free_rows([row])

    def _slots(self, count: int) -> torch.Tensor:
        allocator = self.tree.token_to_kv_pool_allocator
        shortfall = count - allocator.available_size()
        if shortfall > 0:
            self.tree.evict(EvictParams(num_tokens=shortfall))
        slots = allocator.alloc(count)
        if slots is None:
            raise NoRoomForReconstruction(f"no {count} free KV slots for a reconstruction pass")
        return slots

    def _forward_batch(self, work: ReconstructionPass, slots: torch.Tensor) -> ForwardBatch:
        device = slots.device
        length, end = work.length, work.end
        seq_len = end + length
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=torch.tensor(work.chunk.input_ids, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor([work.row], dtype=torch.int64, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
            seq_lens_cpu=torch.tensor([seq_len], dtype=torch.int64),
            orig_seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
            out_cache_loc=slots,
            seq_lens_sum=seq_len,
            positions=torch.arange(end, seq_len, dtype=torch.int64, device=device),
            extend_num_tokens=length,
            extend_seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
            extend_prefix_lens=torch.tensor([end], dtype=torch.int32, device=device),
            extend_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            extend_prefix_lens_cpu=[end],
            extend_seq_lens_cpu=[length],
            extend_logprob_start_lens_cpu=[length],
            return_logprob=False,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            rids=[RECONSTRUCTION_RID],
        )
