"""KVzip's reconstruction passes as work of their own, through SGLang's model runner, between batches.

``scoring.kvzip`` has the contract: after the forward that prefills a span ``[start, end)``, per chunk
of the span, an extra forward feeds the chunk's ids (repeat instruction, the chat template's
assistant opening, the span's tokens again) at logical positions ``end, end + 1, ...``; its queries
see the request's keys ``[0, end)`` as they are (dense slots, and the cells of compressed nodes on its
path) and the chunk's own keys, causally; its statistics are the chunk queries' window statistics over
those keys, cropped to ``[0, end)``, merged over chunks, and observed once per layer.

Here a chunk's pass is fed in *pieces* of at most ``piece_tokens`` tokens, one forward per piece, and
``Reconstructor.step`` runs one piece between two scheduler batches: a running request's decode waits
at most one piece, not a whole pass (SGLang's chunked prefill bounds a prompt's prefill the same
way). The pieces of a chunk share one temporary ``req_to_token`` row: positions ``[0, end)`` copied
from the request's row before every piece (the request's other spans may be stored between two
pieces), the chunk's tokens at ``[end, end + m)`` in slots taken from SGLang's allocator (the tree
evicts for them if it must). A piece's queries attend over ``[0, end)`` plus the chunk's tokens before
them, exactly as in one forward, and the statistics of a chunk's pieces merge as those of its chunks
do (a max stays a max, sums add). Row and slots go back when the chunk is done, or when its request
ends: nothing of a pass is inserted in the tree, and the request's own row, output and sampled tokens
are untouched.

A span ending too close to the model's context length for its passes (``scoring.kvzip.NoRoomForPasses``)
is refused at ``submit`` and stays dense.

A piece's forward is an ordinary EXTEND batch of one pseudo-request (``ModelRunner.forward``); the
coordinator's ``forward_begin`` recognises it by its rid (``Reconstructor.piece_in_flight``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from sgl_kvevict.engine.batch import RequestSlice
from sgl_kvevict.engine.compression import ScoringJob, SpanCompression
from sgl_kvevict.scoring.kvzip import ReconstructionChunk, ReconstructionPrompt, crop_columns, merge_chunk_stats, reconstruction_chunks
from sgl_kvevict.scoring.window import WindowStats

RECONSTRUCTION_RID_PREFIX = "kvevict-reconstruction-"


class NoRoomForReconstruction(Exception):
    """The pool (or the request table) has no room for a piece even after evicting the tree: every other
    slot is held by running requests. The span then stays dense."""


@dataclass
class ChunkStats:
    """One span's statistics over its passes so far, cropped to the context ``[0, end)`` and merged
    over pieces and chunks."""

    end: int
    per_layer: dict[int, WindowStats] = field(default_factory=dict)

    def observe(self, layer: int, stats: WindowStats) -> None:
        self.per_layer[layer] = merge_chunk_stats(self.per_layer.get(layer), crop_columns(stats, self.end))


@dataclass(eq=False)
class ReconstructionWork:
    """The passes of one span of ``req``: ``chunks`` in order; ``fed`` tokens of chunk ``chunk_index`` done,
    in temporary row ``row`` with the slots ``slots`` (None between chunks)."""

    req: object
    compression: SpanCompression
    chunks: list[ReconstructionChunk]
    collector: ChunkStats
    chunk_index: int = 0
    fed: int = 0
    row: Optional[int] = None
    slots: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.compression.spec.end

    @property
    def chunk(self) -> ReconstructionChunk:
        return self.chunks[self.chunk_index]

    @property
    def done(self) -> bool:
        return self.chunk_index == len(self.chunks)


@dataclass(frozen=True)
class PieceInFlight:
    """The forward being run: its pseudo-request's rid, its slice and its scoring job."""

    rid: str
    request: RequestSlice
    job: ScoringJob


class Reconstructor:
    """Runs the reconstruction passes of one scheduler's requests, oldest work first.

    model_runner: SGLang's, for the forwards. prompt: the passes' fixed token ids. piece_tokens: the
    most tokens one forward feeds. position_limit: the positions a pass may use (the model's context
    length, at most a ``req_to_token`` row). The ``store`` each call takes is the tree: its pools, ``evict`` for
    slots, and ``path_view`` of a request.
    """

    def __init__(self, model_runner, prompt: ReconstructionPrompt, piece_tokens: int, position_limit: int):
        self.model_runner = model_runner
        self.prompt = prompt
        self.piece_tokens = piece_tokens
        self.position_limit = position_limit
        self.queue: list[ReconstructionWork] = []
        self.piece_in_flight: Optional[PieceInFlight] = None
        self._rids = itertools.count()

    def submit(self, req, compression: SpanCompression) -> None:
        """Queue the passes of ``compression``'s span. Raises ``NoRoomForPasses`` (nothing queued)."""
        spec = compression.spec
        ids = req.full_untruncated_fill_ids[spec.start : spec.end]
        chunks = reconstruction_chunks(ids, spec.start, self.prompt, self.position_limit)
        self.queue.append(ReconstructionWork(req, compression, chunks, ChunkStats(end=spec.end)))

    def step(self, work: ReconstructionWork, store) -> bool:
        """Run one piece of ``work``; True when that finished it (its statistics are then in its collector
        and it left the queue). Raises ``NoRoomForReconstruction`` (the work is dropped first)."""
        try:
            self._run_piece(work, store)
        except NoRoomForReconstruction:
            self._drop(work, store)
            raise
        if not work.done:
            return False
        self.queue.remove(work)
        return True

    def work_of(self, req) -> list[ReconstructionWork]:
        return [work for work in self.queue if work.req is req]

    def drop(self, req, store) -> None:
        """``req`` ended: give back the rows and slots of its work in flight, forget its queued work."""
        for work in self.work_of(req):
            self._drop(work, store)

    # ---- one piece -------------------------------------------------------------------------------

    def _run_piece(self, work: ReconstructionWork, store) -> None:
        pool = store.req_to_token_pool
        if work.row is None:
            rows = pool.alloc_rows(1)
            if rows is None:
                raise NoRoomForReconstruction("no free req_to_token row for a reconstruction pass")
            (work.row,) = rows
        chunk_ids = work.chunk.input_ids
        length = min(self.piece_tokens, len(chunk_ids) - work.fed)
        slots = self._slots(length, store)
        work.slots.append(slots)
        table, end = pool.req_to_token, work.end
        first = end + work.fed
        table[work.row, :end] = table[work.req.kv.req_pool_idx, :end]
        table[work.row, first : first + length] = slots.to(table.dtype)
        view = store.path_view(work.req.last_node)
        request = RequestSlice(0, 0, length, first + length, work.row, view)
        job = ScoringJob.of(request, work.collector, length, work.compression.stats_request, table)
        self.piece_in_flight = PieceInFlight(f"{RECONSTRUCTION_RID_PREFIX}{next(self._rids)}", request, job)
        try:
            self.model_runner.forward(self._forward_batch(chunk_ids[work.fed : work.fed + length], first, slots))
        finally:
            self.piece_in_flight = None
        work.fed += length
        if work.fed == len(chunk_ids):
            self._release(work, store)
            work.chunk_index, work.fed = work.chunk_index + 1, 0

    def _release(self, work: ReconstructionWork, store) -> None:
        allocator = store.token_to_kv_pool_allocator
        for slots in work.slots:
            allocator.free(slots)
        work.slots = []
        if work.row is not None:
            store.req_to_token_pool.free_rows([work.row])
            work.row = None

    def _drop(self, work: ReconstructionWork, store) -> None:
        self._release(work, store)
        self.queue.remove(work)

    @staticmethod
    def _slots(count: int, store) -> torch.Tensor:
        allocator = store.token_to_kv_pool_allocator
        shortfall = count - allocator.available_size()
        if shortfall > 0:
            store.evict(EvictParams(num_tokens=shortfall))
        slots = allocator.alloc(count)
        if slots is None:
            raise NoRoomForReconstruction(f"no {count} free KV slots for a reconstruction pass")
        return slots

    def _forward_batch(self, input_ids, first: int, slots: torch.Tensor) -> ForwardBatch:
        device = slots.device
        length = len(input_ids)
        seq_len = first + length
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor([self.piece_in_flight.request.row], dtype=torch.int64, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
            seq_lens_cpu=torch.tensor([seq_len], dtype=torch.int64),
            orig_seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
            out_cache_loc=slots,
            seq_lens_sum=seq_len,
            positions=torch.arange(first, seq_len, dtype=torch.int64, device=device),
            extend_num_tokens=length,
            extend_seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
            extend_prefix_lens=torch.tensor([first], dtype=torch.int32, device=device),
            extend_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            extend_prefix_lens_cpu=[first],
            extend_seq_lens_cpu=[length],
            extend_logprob_start_lens_cpu=[length],
            return_logprob=False,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            rids=[self.piece_in_flight.rid],
        )
