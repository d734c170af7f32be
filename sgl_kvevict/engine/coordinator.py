"""The compression coordinator: the one owner of every compression's life in one scheduler process.

SGLang 0.5.23 has this shape for its own sparse attention (``mem_cache/sparsity/core/
sparse_coordinator.py``: ``on_request_begin/end``, ``forward_begin``, ``attention_end``;
``managers/hisparse_coordinator.py``), and the methods here keep its vocabulary. The data flow of one
request, every arrow one call (docs/design.md draws it):

1. **begin** — the tree's ``match_prefix`` sees the ``Req`` (SGLang passes it) and calls
   ``on_request_begin``: the request is indexed by rid (the attention backend sees only rids) and gets
   its ``RequestRecord`` with the eviction setup that serves it.
2. **submit** — the attention backend's ``init_forward_metadata`` calls ``forward_begin``: each request
   of the forward with its compressed path (``engine.paths``), and, at a request's first
   prefill forward, one ``SegmentCompression`` per segment its scope compresses.
3. **statistics** — after each layer's attention the backend calls ``attention_end``: the scoring
   jobs of the forward observe that layer. KVzip segments instead queue reconstruction passes, which
   ``between_batches`` runs one piece at a time after each scheduler batch (``engine.reconstruction``).
4. **plan** — the tree's ``checkpoint`` calls ``handover``: the plans of the request's segments that are
   ready, in position order, and where its still-pending segments begin (the tree inserts nothing from
   there). When a request's passes finish after its prefill, ``between_batches`` returns it and the
   adapter's after-batch hook checkpoints it at once; at the request's final checkpoint its remaining
   passes run to the end first.
5. **store** — the tree turns each plan into a compressed node (``engine.adapter.radix_cache``).
6. **end** — the tree's ``on_release`` calls ``on_request_end``: what is still in flight is dropped.

The coordinator never calls the tree: it reads a request's compressed path through ``PathViews``
(``engine.paths``), and its collaborators (scoring capture, reconstructor, TP ranks, a plan listener)
are given at construction (``engine.adapter.factory.build_engine``). It imports no SGLang.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sgl_kvevict.engine.batch import ForwardRequests, RequestSlice
from sgl_kvevict.engine.compression import (
    ForwardJob,
    HiddenRowsJob,
    QueryCarryJob,
    ScoringCapture,
    ScoringJob,
    SegmentCompression,
    Stage,
)
from sgl_kvevict.engine.paths import PathViews
from sgl_kvevict.engine.reconstruction import NoRoomForReconstruction, ReconstructionWork, Reconstructor
from sgl_kvevict.engine.records import RECORD_ATTR, RequestRecord, request_record
from sgl_kvevict.engine.setups import ModelShape, Setups
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.engine.tensor_parallel import RankGroup
from sgl_kvevict.footprint import LocalShare, PrefillFootprint
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import SegmentSpec
from sgl_kvevict.scope import BlockScope, Scope
from sgl_kvevict.scoring.kvzip import NoRoomForPasses
from sgl_kvevict.sharding import RankCounts

logger = logging.getLogger(__name__)
# Why the overlap schedule waits for a batch's results (``settles_before_next_batch``; counted per reason).
SETTLED_FOR_PREFILL, SETTLED_FOR_BLOCK, SETTLED_FOR_KVZIP = "prefill", "block", "kvzip"
# Told of every plan handed to the tree: (request id, the plan, the scope's block index or None).
PlanListener = Callable[[str, CompressionPlan, Optional[int]], None]


@dataclass(frozen=True)
class ReadyPlan:
    """A segment's plan for the tree: store the entries of ``[spec.start, node_end)`` as one compressed node
    (request scope leaves the window after ``node_end`` dense)."""

    spec: SegmentSpec
    plan: CompressionPlan
    node_end: int
    rank_counts: RankCounts


@dataclass(frozen=True)
class Handover:
    """What a checkpoint may store: ``ready`` plans in position order; ``hold_from``: where the request's
    first segment still in flight begins (None: none is), so nothing from there on enters the tree yet."""

    ready: tuple[ReadyPlan, ...] = ()
    hold_from: Optional[int] = None


class CompressionCoordinator:
    """setups: the configurations that serve requests; scope: which segments are compressed; shape: the
    model's (this rank's heads); capture: computes scoring statistics; stats: the engine's counters;
    paths: the compressed paths requests see; reconstructor: KVzip passes (None when no setup can ask for
    them); chunk_size: SGLang's chunked-prefill size (None: prompts are prefilled in one forward); ranks:
    the tensor-parallel ranks plans are made with (None: this one only); plan_listener: told of every plan
    handed to the tree (a debug dump, ``engine.plan_dump``); local_share: the model's local attention
    layers, which hold only their window of a block (admission counts it)."""

    def __init__(
        self,
        setups: Setups,
        scope: Scope,
        shape: ModelShape,
        capture: ScoringCapture,
        stats: EngineStats,
        paths: PathViews,
        reconstructor: Optional[Reconstructor] = None,
        chunk_size: Optional[int] = None,
        ranks: Optional[RankGroup] = None,
        plan_listener: Optional[PlanListener] = None,
        local_share: Optional[LocalShare] = None,
    ):
        self.setups = setups
        self.local_share = local_share
        self.ranks = ranks or RankGroup.single(shape.num_kv_heads, shape.num_layers)
        self.scope = scope
        self.chunk_size = chunk_size
        self.shape = shape
        self.capture = capture
        self.stats = stats
        self.paths = paths
        self.reconstructor = reconstructor
        self.plan_listener = plan_listener
        self._requests: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
        self._jobs: list[ForwardJob] = []

    # ---- 1. begin / 6. end ---------------------------------------------------------------------

    def on_request_begin(self, req) -> None:
        """The tree matched ``req`` (SGLang may match a waiting request several times)."""
        self._requests[req.rid] = req
        if request_record(req) is None:
            setattr(req, RECORD_ATTR, RequestRecord(self.setups.for_request(req.extra_key)))

    def on_request_end(self, req) -> None:
        """``req`` released its row (finished, aborted or retracted): drop what is still in flight."""
        record = request_record(req)
        if record is None:
            return
        if record.prefill_forwards and not record.prefilled:
            self.stats.count("chunked_prefills_aborted")
        if self.reconstructor is not None:
            self.reconstructor.drop(req)
        record.compressions.clear()

    # ---- 2. submit -----------------------------------------------------------------------------

    def forward_begin(self, forward_batch, req_to_token: torch.Tensor) -> ForwardRequests:
        """The forward's requests as the engine sees them; submits and schedules the scoring of segments."""
        piece = None if self.reconstructor is None else self.reconstructor.piece_in_flight
        if piece is not None and list(forward_batch.rids) == [piece.rid]:
            self._jobs = [piece.job]
            return ForwardRequests(False, (piece.request,))
        self._jobs = []
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_extend()):
            return ForwardRequests(False, ())
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        query_counts = [1] * len(seq_lens) if mode.is_decode() else list(forward_batch.extend_seq_lens_cpu)
        requests, q_start = [], 0
        for index, (rid, seq_len, count) in enumerate(zip(forward_batch.rids, seq_lens, query_counts)):
            req = self._requests.get(rid)
            if req is None:  # not matched by this tree (SGLang matches every request first): stock path
                row = int(forward_batch.req_pool_indices[index])
                requests.append(RequestSlice(index, q_start, q_start + count, seq_len, row, None))
            else:
                view = self.paths.of(req.last_node)
                request = RequestSlice(index, q_start, q_start + count, seq_len, req.kv.req_pool_idx, view)
                requests.append(request)
                if mode.is_extend():
                    self._jobs += self._prefill_jobs(req, request, req_to_token)
            q_start += count
        return ForwardRequests(mode.is_decode(), tuple(requests))

    def _prefill_jobs(self, req, request: RequestSlice, req_to_token: torch.Tensor) -> list[ForwardJob]:
        """The request's prompt tokens ``[first query, seq_len)`` are prefilled by this forward (the whole
        prompt, or one chunk of it)."""
        record = request_record(req)
        setup = record.setup
        start, end = request.first_query_position, request.seq_len
        prompt_end = len(req.origin_input_ids)
        if setup is None or end > prompt_end:
            return []  # dense, or a retracted request prefilling its output again
        if not record.submitted:
            record.submitted = True
            if start != req.kv.cache_protected_len:
                return []  # the extend starts inside tree-owned tokens: nothing of it is the request's own
            shape = self.shape
            record.compressions = [
                SegmentCompression.submitted(
                    setup.policy.start(SegmentSpec(a, b, shape.num_layers, shape.num_kv_heads, shape.num_q_heads)),
                    setup.config.window, setup.stats_request,
                )
                for a, b in self.scope.compressible_segments(start, prompt_end, setup.config.window)
            ]  # fmt: skip
        record.prefill_forwards += 1
        record.prefilled = end == prompt_end
        if record.prefilled and record.prefill_forwards > 1:
            self.stats.count("chunked_prefills")
        jobs: list[ForwardJob] = []
        for compression in list(record.compressions):
            if compression.stage is not Stage.PREFILLING or compression.spec.end <= start:
                continue
            ends_here = compression.spec.end <= end
            if compression.needs_reconstruction:
                if ends_here:
                    self._submit_reconstruction(req, compression)
                continue
            if compression.compressor.needs_stats:
                jobs += self._statistics_jobs(compression, request, req_to_token)
            if ends_here:
                compression.stage = Stage.READY  # the forward observes every layer before any checkpoint
        return jobs

    def _submit_reconstruction(self, req, compression: SegmentCompression) -> None:
        try:
            self.reconstructor.submit(req, compression)
        except NoRoomForPasses:
            self.stats.count("reconstructions_skipped")
            request_record(req).compressions.remove(compression)  # the segment stays dense
            return
        compression.stage = Stage.RECONSTRUCTING

    @staticmethod
    def _statistics_jobs(compression: SegmentCompression, request: RequestSlice, req_to_token) -> list[ForwardJob]:
        """What this forward (``request``'s queries) computes for a segment it overlaps."""
        spec, start, end = compression.spec, request.first_query_position, request.seq_len
        if compression.stats_request.hidden_states:  # every forward over the segment hands its rows on
            rows = slice(max(spec.start, start), min(spec.end, end))
            return [HiddenRowsJob(request, compression.compressor, compression.window, rows)] if rows.start < rows.stop else []
        if spec.end <= end:
            return [ScoringJob.of(request.up_to(spec.end), compression.compressor, compression.window,
                                  compression.stats_request, req_to_token, compression.carried_queries)]  # fmt: skip
        if compression.window_start < end:  # the window starts here and ends in a later forward
            return [QueryCarryJob(request, compression.carried_queries, slice(max(compression.window_start, start), end))]
        return []

    # ---- 3. statistics -------------------------------------------------------------------------

    def attention_end(self, q: torch.Tensor, layer) -> None:
        """After ``layer``'s attention of the forward: every job of the forward runs on it."""
        for job in self._jobs:
            self.capture.run(job, q, layer)

    def between_batches(self):
        """After a scheduler batch: one piece of the oldest reconstruction pass. Returns the request whose
        passes that finished, when its prefill is over: its plans are to be stored now (the caller
        checkpoints it; else they are stored at its next checkpoint). None otherwise."""
        reconstructor = self.reconstructor
        if reconstructor is None or not reconstructor.queue:
            return None
        work = reconstructor.queue[0]
        if self._run_piece(work):
            req = work.req
            if request_record(req).prefilled and not reconstructor.work_of(req):
                return req
        return None

    def _run_piece(self, work: ReconstructionWork) -> bool:
        """One piece of ``work``; True when the work ended (its segment is ready, or stays dense for want of
        room)."""
        try:
            if not self.reconstructor.step(work):
                return False
        except NoRoomForReconstruction:
            self.stats.count("reconstructions_skipped")
            request_record(work.req).compressions.remove(work.compression)  # the segment stays dense
            return True
        compression = work.compression
        for layer in sorted(work.collector.per_layer):
            compression.compressor.observe(layer, work.collector.per_layer[layer])
        compression.stage = Stage.READY
        return True

    # ---- overlap schedule ------------------------------------------------------------------------

    def settles_before_next_batch(self, last_batch) -> str:
        """Under SGLang's overlap schedule: why ``last_batch``'s results must be processed (its checkpoints
        run) before the next batch is formed, or "" when they need not. ``SETTLED_FOR_KVZIP``: KVzip work is
        queued (a reconstruction pass is a forward of its own, run between batches); else, when a request
        of it has a segment ready to store, ``SETTLED_FOR_BLOCK`` in block scope, ``SETTLED_FOR_PREFILL`` in
        request scope (its prompt's segment). Formed first, the next batch would decode those requests over
        their whole dense prompts (answers differ from the serial schedule's, the dense slots stay taken
        one more step). Every other batch overlaps as in stock SGLang. Under ``--kv-evict-when pressure`` the
        same batches wait: a checkpoint there still stores a segment that diverges inside a compressed node,
        which the next batch's own evictions may compress after this decision."""
        if self.reconstructor is not None and self.reconstructor.queue:
            return SETTLED_FOR_KVZIP
        if any(_has_ready_segment(req) for req in last_batch.reqs):
            return SETTLED_FOR_BLOCK if isinstance(self.scope, BlockScope) else SETTLED_FOR_PREFILL
        return ""

    # ---- 4. plan -------------------------------------------------------------------------------

    def handover(self, req, final: bool) -> Handover:
        """The request's ready plans, in position order, up to its first segment still in flight. ``final``:
        the request finished; its passes run to the end now and segments still unscored stay dense."""
        record = request_record(req)
        if record is None or not record.compressions:
            return Handover()
        if final:
            self._finish_reconstructions(req)
            record.compressions = [c for c in record.compressions if c.stage is Stage.READY]
        ready = []
        while record.compressions and record.compressions[0].stage is Stage.READY:
            compression = record.compressions.pop(0)
            ready.append(self._ready_plan(req, compression))
        hold_from = record.compressions[0].spec.start if record.compressions else None
        return Handover(tuple(ready), hold_from)

    def _finish_reconstructions(self, req) -> None:
        """The request's own passes, to the end (other requests' work keeps its turn)."""
        if self.reconstructor is None:
            return
        for work in self.reconstructor.work_of(req):
            while not self._run_piece(work):
                pass

    def _ready_plan(self, req, compression: SegmentCompression) -> ReadyPlan:
        plan, rank_counts = self.ranks.plan(compression.compressor)
        if self.plan_listener is not None:
            scope = self.scope
            block = plan.segment_start // scope.block_size if isinstance(scope, BlockScope) else None
            self.plan_listener(req.rid, plan, block)
        spec = compression.spec
        window_kept_dense = compression.window if self.scope.window_stays_dense else 0
        return ReadyPlan(spec, plan, spec.end - window_kept_dense, rank_counts)

    # ---- admission -----------------------------------------------------------------------------

    def footprint_of(self, req) -> Optional[PrefillFootprint]:
        """How the request's prompt occupies the pool while prefilled (None: dense until its end)."""
        record = request_record(req)
        if record is None or record.setup is None:
            return None
        return PrefillFootprint.of(record.setup.config, self.scope, self.chunk_size, self.local_share)

    # ---- reporting -----------------------------------------------------------------------------

    def describe(self) -> dict:
        """The server's configuration, for the stats snapshot."""
        config = self.setups.default.config
        budget = config.budget
        return {
            "policy": config.policy,
            "budget": None if budget is None else str(budget),
            "score": config.score,
            "window": config.window,
            "scope": self.scope.name,
            "block_size": getattr(self.scope, "block_size", None),
        }


def _has_ready_segment(req) -> bool:
    record = request_record(req)
    return record is not None and any(c.stage is Stage.READY for c in record.compressions)
