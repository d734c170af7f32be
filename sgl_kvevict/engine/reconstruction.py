"""KVzip's reconstruction passes as work of their own, one forward per piece, between batches.

``scoring.kvzip`` has the contract: after the forward that prefills a segment ``[start, end)``, per chunk
of the segment, an extra forward feeds the chunk's ids (repeat instruction, the chat template's
assistant opening, the segment's tokens again) at logical positions ``end, end + 1, ...``; its queries
see the request's keys ``[0, end)`` as they are (dense slots, and the cells of compressed nodes on its
path) and the chunk's own keys, causally; its statistics are the chunk queries' window statistics over
those keys, cropped to ``[0, end)``, merged over chunks, and observed once per layer.

Here a chunk's pass is fed in *pieces* of at most ``piece_tokens`` tokens, one forward per piece, and
``Reconstructor.step`` runs one piece between two scheduler batches: a running request's decode waits
at most one piece, not a whole pass (SGLang's chunked prefill bounds a prompt's prefill the same
way). The pieces of a chunk share one temporary ``req_to_token`` row: positions ``[0, end)`` copied
from the request's row before every piece (the request's other segments may be stored between two
pieces), the chunk's tokens at ``[end, end + m)`` in slots taken from SGLang's allocator (the tree
evicts for them if it must). A piece's queries attend over ``[0, end)`` plus the chunk's tokens before
them, exactly as in one forward, and the statistics of a chunk's pieces merge as those of its chunks
do (a max stays a max, sums add). Row and slots go back when the chunk is done, or when its request
ends: nothing of a pass is inserted in the tree, and the request's own row, output and sampled tokens
are untouched.

A segment ending too close to the model's context length for its passes (``scoring.kvzip.NoRoomForPasses``)
is refused at ``submit`` and stays dense.

A piece's forward is an ordinary EXTEND batch of one pseudo-request: ``PieceForward`` says what it
feeds, and the ``run_forward`` the reconstructor is built with runs it (the adapter builds SGLang's
``ForwardBatch`` for it, ``engine.adapter.reconstruction_forward``); the coordinator's ``forward_begin``
recognises it by its rid (``Reconstructor.piece_in_flight``). Rows and slots come from a ``SlotPool``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from sgl_kvevict.engine.batch import RequestSlice
from sgl_kvevict.engine.compression import ScoringJob, SegmentCompression
from sgl_kvevict.engine.paths import PathViews
from sgl_kvevict.scoring.kvzip import ReconstructionChunk, ReconstructionPrompt, crop_columns, merge_chunk_stats, reconstruction_chunks
from sgl_kvevict.scoring.window import WindowStats

RECONSTRUCTION_RID_PREFIX = "kvevict-reconstruction-"


class SlotPool(Protocol):
    """Where a pass's temporary row and slots come from: SGLang's request table and KV allocator."""

    req_to_token: torch.Tensor  # [rows, context]: every request's slot per position

    def alloc_row(self) -> Optional[int]:
        """A free row of ``req_to_token`` (None: none is free)."""

    def free_row(self, row: int) -> None: ...

    def alloc_slots(self, count: int) -> Optional[torch.Tensor]:
        """``count`` free KV slots, evicting from the tree when the allocator is short (None: still short)."""

    def free_slots(self, slots: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PieceForward:
    """One piece's EXTEND forward of one pseudo-request: ``input_ids`` at positions ``first, first + 1, ...``
    of row ``row``, their K/V written to ``slots``; ``rid`` names it."""

    rid: str
    row: int
    input_ids: list[int]
    first: int
    slots: torch.Tensor


class NoRoomForReconstruction(Exception):
    """The pool (or the request table) has no room for a piece even after evicting the tree: every other
    slot is held by running requests. The segment then stays dense."""


@dataclass
class ChunkStats:
    """One segment's statistics over its passes so far, cropped to the context ``[0, end)`` and merged
    over pieces and chunks."""

    end: int
    per_layer: dict[int, WindowStats] = field(default_factory=dict)

    def observes(self, layer: int) -> bool:
        return True  # the segment's compressor observes the merged statistics of the layers it reads

    def observe(self, layer: int, stats: WindowStats) -> None:
        self.per_layer[layer] = merge_chunk_stats(self.per_layer.get(layer), crop_columns(stats, self.end))


@dataclass(eq=False)
class ReconstructionWork:
    """The passes of one segment of ``req``: ``chunks`` in order; ``fed`` tokens of chunk ``chunk_index`` done,
    in temporary row ``row`` with the slots ``slots`` (None between chunks)."""

    req: object
    compression: SegmentCompression
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

    slots: rows and KV slots for the passes. run_forward: runs one piece's forward (the model's).
    paths: the compressed paths requests see. prompt: the passes' fixed token ids. piece_tokens: the most
    tokens one forward feeds. position_limit: the positions a pass may use (the model's context length,
    at most a ``req_to_token`` row).
    """

    def __init__(
        self,
        slots: SlotPool,
        run_forward: Callable[[PieceForward], None],
        paths: PathViews,
        prompt: ReconstructionPrompt,
        piece_tokens: int,
        position_limit: int,
    ):
        self.slots = slots
        self.run_forward = run_forward
        self.paths = paths
        self.prompt = prompt
        self.piece_tokens = piece_tokens
        self.position_limit = position_limit
        self.queue: list[ReconstructionWork] = []
        self.piece_in_flight: Optional[PieceInFlight] = None
        self._rids = itertools.count()

    def submit(self, req, compression: SegmentCompression) -> None:
        """Queue the passes of ``compression``'s segment. Raises ``NoRoomForPasses`` (nothing queued)."""
        spec = compression.spec
        ids = req.full_untruncated_fill_ids[spec.start : spec.end]
        chunks = reconstruction_chunks(ids, spec.start, self.prompt, self.position_limit)
        self.queue.append(ReconstructionWork(req, compression, chunks, ChunkStats(end=spec.end)))

    def step(self, work: ReconstructionWork) -> bool:
        """Run one piece of ``work``; True when that finished it (its statistics are then in its collector
        and it left the queue). Raises ``NoRoomForReconstruction`` (the work is dropped first)."""
        try:
            self._run_piece(work)
        except NoRoomForReconstruction:
            self._drop(work)
            raise
        if not work.done:
            return False
        self.queue.remove(work)
        return True

    def work_of(self, req) -> list[ReconstructionWork]:
        return [work for work in self.queue if work.req is req]

    def drop(self, req) -> None:
        """``req`` ended: give back the rows and slots of its work in flight, forget its queued work."""
        for work in self.work_of(req):
            self._drop(work)

    # ---- one piece -------------------------------------------------------------------------------

    def _run_piece(self, work: ReconstructionWork) -> None:
        pool = self.slots
        if work.row is None:
            work.row = pool.alloc_row()
            if work.row is None:
                raise NoRoomForReconstruction("no free req_to_token row for a reconstruction pass")
        chunk_ids = work.chunk.input_ids
        length = min(self.piece_tokens, len(chunk_ids) - work.fed)
        slots = pool.alloc_slots(length)
        if slots is None:
            raise NoRoomForReconstruction(f"no {length} free KV slots for a reconstruction pass")
        work.slots.append(slots)
        table, end = pool.req_to_token, work.end
        first = end + work.fed
        table[work.row, :end] = table[work.req.kv.req_pool_idx, :end]
        table[work.row, first : first + length] = slots.to(table.dtype)
        view = self.paths.of(work.req.last_node)
        request = RequestSlice(0, 0, length, first + length, work.row, view)
        job = ScoringJob.of(request, work.collector, length, work.compression.stats_request, table)
        rid = f"{RECONSTRUCTION_RID_PREFIX}{next(self._rids)}"
        self.piece_in_flight = PieceInFlight(rid, request, job)
        try:
            self.run_forward(PieceForward(rid, work.row, list(chunk_ids[work.fed : work.fed + length]), first, slots))
        finally:
            self.piece_in_flight = None
        work.fed += length
        if work.fed == len(chunk_ids):
            self._release(work)
            work.chunk_index, work.fed = work.chunk_index + 1, 0

    def _release(self, work: ReconstructionWork) -> None:
        for slots in work.slots:
            self.slots.free_slots(slots)
        work.slots = []
        if work.row is not None:
            self.slots.free_row(work.row)
            work.row = None

    def _drop(self, work: ReconstructionWork) -> None:
        self._release(work)
        self.queue.remove(work)
