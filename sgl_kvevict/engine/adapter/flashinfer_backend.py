"""The CUDA attention backend: SGLang's ``FlashInferAttnBackend`` plus scoring capture and segment attention.

Written against FlashInfer's documented Python API and tested on CPU against
``tests/fake_flashinfer.py``, a torch implementation of exactly the calls made here
(``tests/test_engine_flashinfer.py``). What ran on a GPU and what did not (a server end to end has
not): the status table in docs/gpu.md.

Registered in place of the stock ``flashinfer`` factory (``contacts.CONTACTS``). A forward without
compressed requests is the stock backend's (ragged + paged wrappers, CUDA kernels, no change). A
forward with compressed requests (``SegmentAttentionBackend`` dispatch, shared with the CPU backend)
runs every request of the batch as

* **dense part**, FlashInfer: the stock paged prefill wrapper (``prefill_wrappers_paged[0]``),
  re-planned over each request's *dense* positions only (everything outside its compressed segments,
  this forward's tokens included) with ``causal=True``, page size 1, ``return_lse=True``. The
  compressed segments all precede the new tokens, so FlashInfer's bottom-right causal alignment over
  the compacted position list is exactly "query at position p sees dense keys at positions <= p".
  The same wrapper serves decode (one query per request): its prefill kernels pack the GQA group
  into the query tile, like the decode wrapper's tensor-core mode, and have no group-size limits.
* **compressed part**, Triton: ``kernels.segment_attention``, one pseudo-sequence per (request, KV
  head), GQA group as its query heads (shared with the CPU backend through ``compressed_attention``).
* **merge**: ``flashinfer.cascade.merge_state`` of the two, compressed requests' rows only.
* **local layers** (Gemma 3's sliding-window layers, ``sgl_kvevict.local_layers``): no merge. A compressed
  node keeps, in every KV head of a local layer, its last ``window`` positions, so every key a local query
  reads is a dense slot or one of those cells; per forward every request's keys from its first query's
  window start to its last query (``WindowKeys``, kept across decode steps as the torch backend keeps them)
  are gathered per local layer into a buffer of their own (``WindowLayout``: request-major, positions
  ascending and contiguous) and attended by SGLang's sliding-window wrapper (``prefill_wrappers_paged[0]``),
  planned once per forward with ``causal=True`` and ``window_left`` = SGLang's ``sliding_window_size``:
  over a contiguous span, FlashInfer's mask by key index (bottom-right aligned: query ``i`` sees key ``j``
  iff ``i + kv_len - qo_len - window_left <= j <= i + kv_len - qo_len``) is the window by position.
  Global layers plan the full-attention wrapper (``[1]``) as above.

Why Triton and not FlashInfer for the compressed part (the alternative in docs/design.md#segment-attention,
a paged prefill wrapper planned with ``num_kv_heads=1`` over the (request, head)
pseudo-sequences): the per-(layer, head) cell counts of Ada-KV/PyramidKV/LAVa differ by layer, so
FlashInfer would need one ``plan`` per layer per forward (host-side scheduling and H2D copies on
every decode step) and one wrapper with its own int workspace per layer, plus a permutation of ``q``
into (request, head, token) order and back. The Triton kernel takes each layer's CSR as device
tensors, reads ``q`` in place, and returns ``lse = -inf`` for heads without cells, a case where
FlashInfer's ``kv_len = 0`` behaviour is undocumented. At decode it splits a sequence's cells over
several programs (flash-decoding) and merges their partial states (``kernels/segment_attention.py``).

**Decode CUDA graphs** (SGLang's ``DecodeCudaGraphRunner``; docs/design.md#segment-attention): the
backend captures per batch size SGLang's own graph (``stock``) and the ``segments`` graphs (one per
bound on a sequence's cells, which fixes the kernel's split count: ``decode_graph.segment_graph_limits``),
chosen per batch by ``select_graph_variant``. A ``segments`` graph runs every request of the batch through a
graph-mode ``BatchDecodeWithPagedKVCacheWrapper`` over its dense positions (one wrapper per batch size
on SGLang's fixed graph buffers, planned in ``init_forward_metadata_out_graph`` before each replay)
and ``DecodeGraphState`` over its cells, merged in the graph. ``graph_can_replay`` sends a batch whose
cells exceed the buffers to the eager path. The plugin's hooks on the runner install the variants and
the check (``contacts.CONTACTS``).

LSE bases: FlashInfer's ``run(..., return_lse=True)`` returns base-2 LSEs (``log2 sum exp``) and
``merge_state`` consumes them; ``segment_attention`` returns natural-log LSEs, converted here by
``* log2(e)`` before merging (the graph body converts FlashInfer's instead, ``* ln 2``, for
``kernels.merge_attention_states``).

Limits (refused, not approximated): cross-attention models and hybrid SWA pools (gpt-oss, Llama 4),
page size > 1, quantised KV caches, attention logit soft-capping (the segment kernel has none), decode CUDA
graphs on a model with local layers (the ``segments`` graph has no windowed part: the launcher refuses
them before the weights load, ``--cuda-graph-backend-decode disabled`` serves such a model).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from flashinfer.cascade import merge_state
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend, WrapperDispatch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant

from sgl_kvevict.engine.adapter.attention import SegmentAttentionBackend, local_window
from sgl_kvevict.engine.adapter.pool import cell_space_of
from sgl_kvevict.engine.batch import ForwardRequests, SegmentMetadata, WindowKeys, WindowKeysCache, window_span
from sgl_kvevict.engine.decode_graph import (
    FITS,
    STOCK,
    DecodeGraphState,
    GraphCapacity,
    SegmentGraphVariants,
    cell_index_capacity,
    longest_sequence,
    segment_graph_limits,
)

logger = logging.getLogger(__name__)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
_CUDA_MAX_THREADS_PER_BLOCK = 1024
_UNQUANTISED_KV_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PagedLayout:
    """A FlashInfer paged batch with page size 1 (one page per token: a page id is a row of the cache).

    qo_indptr int32 ``[B + 1]`` and kv_indptr int32 ``[B + 1]`` on the host, built from host-known
    lengths: ``plan`` schedules from host copies, so device tensors would cost a synchronising D2H copy.
    kv_indices int32 ``[nnz]`` on the KV cache's device, request-major, positions ascending.
    kv_last_page_len int32 ``[B]`` (host): all ones, every page holds one token.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor

    def paged_kv(self, shape: "AttentionShape") -> tuple:
        """``plan``'s paged-KV arguments, the same for the prefill and the decode wrapper: indptr, indices,
        last-page lengths, query and KV heads, head dim, page size 1 (one token per page: the row is the
        page id)."""
        return (self.kv_indptr, self.kv_indices, self.kv_last_page_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 1)


@dataclass(frozen=True)
class DenseLayout(PagedLayout):
    """Every request's dense positions: kv_indices gathered on the device from ``req_to_token``, the slot of
    each dense position (rows of the layer's paged cache)."""

    @classmethod
    def of(cls, forward: ForwardRequests, req_to_token: torch.Tensor, batch_size: Optional[int] = None) -> "DenseLayout":
        """``req_to_token`` ``[rows, max_len]`` int32 (device): the slots of every request's row.
        ``batch_size``: the decode batch padded to a captured graph's size; a padded request has one
        query and one key, SGLang's padding slot 0 (where its padded token's K/V are written)."""
        slots = [request.dense_keys(req_to_token)[1] for request in forward.requests]
        padding = (batch_size or len(slots)) - len(slots)
        slots += [torch.zeros(1, dtype=torch.int64, device=req_to_token.device)] * padding
        kv_counts = [len(request_slots) for request_slots in slots]  # sizes are host-known: no sync
        qo_counts = [request.num_queries for request in forward.requests] + [1] * padding
        # The new tokens are dense, so no request has an empty dense part (FlashInfer's kv_len = 0
        # behaviour is undocumented) and its queries are the last entries of its dense list.
        assert all(kv >= qo > 0 for kv, qo in zip(kv_counts, qo_counts))
        kv_indices = torch.cat(slots).to(torch.int32)
        return cls(
            qo_indptr=_indptr(qo_counts),
            kv_indptr=_indptr(kv_counts),
            kv_indices=kv_indices,
            kv_last_page_len=torch.ones(len(slots), dtype=torch.int32),
        )


@dataclass(frozen=True)
class WindowLayout(PagedLayout):
    """Every request's local-layer keys (``WindowKeys``), each local layer's gathered into a buffer of its
    own (``gathered``): request ``b``'s ``n_b`` keys are rows ``[b * K, b * K + n_b)`` of it (``K``: the
    keys' padded width), positions ascending and contiguous, the last one its last query's."""

    @classmethod
    def of(cls, forward: ForwardRequests, keys: WindowKeys, window: int) -> "WindowLayout":
        """``keys``: ``forward``'s requests' window keys, in its order; ``window``: the keys a query reads."""
        width = keys.rows.shape[-1]
        kv_counts = [end - start for start, end in (window_span(request, window) for request in forward.requests)]
        columns = torch.arange(width)
        rows = columns[None, :] + width * torch.arange(len(kv_counts))[:, None]  # [B, K]
        kv_indices = rows[columns[None, :] < torch.tensor(kv_counts)[:, None]].to(torch.int32)
        return cls(
            qo_indptr=_indptr([request.num_queries for request in forward.requests]),
            kv_indptr=_indptr(kv_counts),
            kv_indices=kv_indices.to(keys.rows.device, non_blocking=True),
            kv_last_page_len=torch.ones(len(kv_counts), dtype=torch.int32),
        )

    @staticmethod
    def gathered(keys: WindowKeys, layer_id: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple:
        """Local layer ``layer_id``'s keys and values as the planned paged cache (NHD, page size 1):
        ``[B * K, 1, H_kv, D]`` each."""
        k, v = keys.keys_of(layer_id, k_rows, v_rows)  # [B, K, H_kv, D]
        return k.reshape(-1, 1, *k.shape[2:]), v.reshape(-1, 1, *v.shape[2:])


@dataclass(frozen=True)
class AttentionShape:
    """What ``plan`` needs of the model, fixed for the server's life. scaling: the softmax scale of the
    model's attention layers (the first one's when they differ: a layer with another re-plans, which a
    decode graph cannot: ``one_scaling`` says whether every layer shares it)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    one_scaling: bool = True

    @classmethod
    def of(cls, model_runner, kv_pool) -> "AttentionShape":
        from sglang.srt.layers.radix_attention import RadixAttention

        layers = [module for module in model_runner.model.modules() if isinstance(module, RadixAttention)]
        first = layers[0]
        return cls(
            num_q_heads=first.tp_q_head_num,
            num_kv_heads=first.tp_k_head_num,
            head_dim=first.qk_head_dim,
            v_head_dim=first.v_head_dim,
            scaling=first.scaling,
            q_dtype=model_runner.dtype,
            kv_dtype=kv_pool.dtype,
            one_scaling=all(layer.scaling == first.scaling for layer in layers),
        )


def _indptr(counts: list[int]) -> torch.Tensor:
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
    return indptr


def merge_state_heads_per_launch(num_heads: int, head_dim: int, element_size: int) -> int:
    """Heads per ``merge_state`` call that keep its CUDA block within 1024 threads.

    FlashInfer's MergeState launches ``(head_dim / vec_size, num_heads)`` threads per block with
    ``vec_size = max(16 / element_size, head_dim / 32)`` (mirrored from SGLang's
    ``_merge_state_max_safe_num_heads``); the largest divisor of ``num_heads`` within the limit.
    """
    vec_size = max(16 // element_size, head_dim // 32)
    limit = max(1, _CUDA_MAX_THREADS_PER_BLOCK // max(1, head_dim // vec_size))
    return max(d for d in range(1, min(num_heads, limit) + 1) if num_heads % d == 0)


def merge_states_base2(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashinfer.cascade.merge_state`` of ``[N, H, D]`` outputs with base-2 LSEs fp32 ``[N, H]``.

    The merge is independent per (token, head) row, so heads are folded into the token dimension
    when ``H`` exceeds what one launch takes (large-head models).
    """
    num_tokens, num_heads, head_dim = out_a.shape
    per_launch = merge_state_heads_per_launch(num_heads, head_dim, out_a.element_size())
    groups = num_tokens * (num_heads // per_launch)
    out, lse = merge_state(
        out_a.reshape(groups, per_launch, head_dim),
        lse_a.reshape(groups, per_launch),
        out_b.reshape(groups, per_launch, head_dim),
        lse_b.reshape(groups, per_launch),
    )
    return out.view(num_tokens, num_heads, head_dim), lse.view(num_tokens, num_heads)


class KVEvictFlashInferBackend(SegmentAttentionBackend, FlashInferAttnBackend):
    """``FlashInferAttnBackend`` that scores prompts for eviction and attends over compressed nodes."""

    _graph_body = False  # the segments graph's body runs (its capture): set per forward by the metadata hooks
    _graph_asked: tuple = (None, None)  # (forward batch, its ForwardRequests or None): the last one asked about
    # (the batch chosen for a segments graph, filled before its replay, or None; the graph's label)
    _replay: tuple[Optional[ForwardRequests], str] = (None, STOCK)
    _graph_cells_per_sequence = 0  # the bound of the segments graph captured or replayed (its split count)

    def __init__(self, model_runner, **kwargs):
        super().__init__(model_runner, **kwargs)
        problems = [
            (self.dispatch_reason == WrapperDispatch.CROSS_ATTENTION, "cross-attention models"),
            (self.use_sliding_window_kv_pool, "hybrid SWA KV pools (local layers in a pool of their own)"),
            (self.page_size != 1, f"page size {self.page_size}"),
            (
                self.prefill_uses_dequant_workspace
                or self.decode_uses_dequant_workspace
                or model_runner.kv_cache_dtype not in _UNQUANTISED_KV_DTYPES,
                f"KV cache dtype {model_runner.kv_cache_dtype} (quantised KV)",
            ),
        ]
        refused = [reason for failed, reason in problems if failed]
        if refused:
            raise NotImplementedError(
                f"sgl-kvevict FlashInfer segment attention does not support: {'; '.join(refused)}"
            )
        self._shape = AttentionShape.of(model_runner, self.token_to_kv_pool)
        self._window_keys = WindowKeysCache()

    # This forward's, set by ``_init_segment_metadata`` before any layer reads them. Wrapper indices are
    # SGLang's (``_get_wrapper_idx``): 0 alone, or with local layers 0 for them and 1 for global layers.
    _layouts: dict[int, tuple[PagedLayout, int]]  # wrapper index -> (its DenseLayout or WindowLayout, its window_left)
    _planned_scales: dict[int, float]  # wrapper index -> the scale it is planned with
    window_keys: Optional[WindowKeys] = None  # the local layers' keys (a model with them)

    def _init_segment_metadata(self, forward_batch, segments: SegmentMetadata) -> None:
        """Plan once per forward, with the model's attention scale (every layer of the supported models shares
        it; a layer with another scale re-plans, ``_wrapper``): the global layers' dense part, and with local
        layers their windows (``WindowLayout``)."""
        forward, to_token = segments.forward, self.req_to_token_pool.req_to_token
        global_index = self.num_wrappers - 1
        self._layouts = {global_index: (DenseLayout.of(forward, to_token), -1)}
        engine = self.engine
        local = None if engine is None else engine.local_layers
        self.window_keys = None
        if local is not None:
            self.window_keys = self._window_keys.of(
                forward_batch.rids, forward, to_token, self.cell_space, local, forward_batch.out_cache_loc, every_request=True
            )  # fmt: skip
            self._layouts[0] = (WindowLayout.of(forward, self.window_keys, local.window), local.window - 1)
        self._planned_scales = {}
        for index in self._layouts:
            self._plan(index, self._shape.scaling)

    def _plan(self, index: int, scaling: float) -> None:
        (layout, window_left), shape = self._layouts[index], self._shape
        self.prefill_wrappers_paged[index].plan(
            layout.qo_indptr,
            *layout.paged_kv(shape),
            head_dim_vo=shape.v_head_dim,
            causal=True,
            sm_scale=scaling,
            window_left=window_left,
            q_data_type=shape.q_dtype,
            kv_data_type=shape.kv_dtype,
        )
        self._planned_scales[index] = scaling

    def _wrapper(self, layer):
        """SGLang's paged prefill wrapper of ``layer`` (local or global), planned over its layout for the
        layer's scale."""
        index = int(self._get_wrapper_idx(layer))
        if self._planned_scales[index] != layer.scaling:
            self._plan(index, layer.scaling)
        return self.prefill_wrappers_paged[index]

    def _layer_inputs(self, q, k, v, layer, forward_batch, save_kv_cache):
        """This forward's K/V written; returns the queries ``[N, H_q, D]`` and the layer's paged cache as
        FlashInfer reads it (NHD, page size 1: ``[slots, 1, H_kv, D]`` each)."""
        if layer.logit_cap:
            raise NotImplementedError("sgl-kvevict segment attention has no logit soft-capping")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)  # [slots, H_kv, D] each
        queries = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return queries, (k_cache.unsqueeze(1), v_cache.unsqueeze(1))

    def _forward_with_segments(self, q, k, v, layer, forward_batch, save_kv_cache, segments: SegmentMetadata):
        queries, paged_cache = self._layer_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        if local_window(layer) is not None:  # every key it reads is in its gathered window: nothing to merge
            window = WindowLayout.gathered(self.window_keys, layer.layer_id, *self.cell_rows)
            return self._wrapper(layer).run(queries, window).view(-1, layer.tp_q_head_num * layer.v_head_dim)
        out, lse_base2 = self._wrapper(layer).run(queries, paged_cache, return_lse=True)
        compressed_out, compressed_lse = self._compressed_attention(segments, queries, layer)
        rows = segments.query_rows
        merged, _ = merge_states_base2(out[rows], lse_base2[rows], compressed_out, compressed_lse * LOG2_E)
        out[rows] = merged
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    # ---- decode CUDA graphs: SGLang's DecodeCudaGraphRunner with the variants of engine.decode_graph ----

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        super().init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf)
        self.init_segment_graph_state(max_bs)

    def init_segment_graph_state(self, max_bs: int) -> None:
        """The ``segments`` graphs' buffers, for batches up to ``max_bs`` requests: a batch may read every
        cell of the pool once, within ``GRAPH_CELL_INDEX_BYTES`` (one that reads more, a compressed prefix
        shared by many requests, decodes eagerly), a (layer, request, KV head) up to the model's context
        length of cells. The cell views are the pool's, as the tree's (``CellSpace``), which does not
        exist yet when SGLang captures."""
        if self.dispatch_reason == WrapperDispatch.SLIDING_WINDOW:
            raise NotImplementedError(
                "sgl-kvevict decode CUDA graphs have no windowed part for local attention layers; pass "
                "--cuda-graph-backend-decode disabled for this model"
            )
        if not self._shape.one_scaling:
            raise NotImplementedError(
                "sgl-kvevict decode CUDA graphs need one attention scale for every layer (the graph's dense "
                "part is planned once per replay); pass --cuda-graph-backend-decode disabled for this model"
            )
        self.cell_space = space = cell_space_of(self.token_to_kv_pool)  # the pool's now (it refuses bad layouts)
        cell_id_bound = space.k_rows.shape[0]
        capacity = GraphCapacity(
            max_batch=max_bs,
            cells=cell_index_capacity(space.cells_per_slot * space.num_slots, cell_id_bound),
            cells_per_sequence=self.max_context_len,
        )
        self._decode_graph = DecodeGraphState(capacity, space.num_layers, space.num_kv_heads, space.device, cell_id_bound)
        self._graph_variants = SegmentGraphVariants(self.select_graph_variant, segment_graph_limits(self.max_context_len))
        self._graph_dense_wrappers = {}  # batch size -> its graph-mode decode wrapper (fixed buffers)

    def graph_variants(self) -> SegmentGraphVariants:
        return self._graph_variants

    def graph_can_replay(self, forward_batch) -> bool:
        """Whether a decode batch the runner could replay fits the ``segments`` buffers (always, without a
        compressed request); one that does not runs eagerly, counted in ``decode_graph_fallbacks``."""
        forward = self._graph_forward(forward_batch)
        why = FITS if forward is None else self._decode_graph.check(forward)
        if why:
            self.engine.stats.count("decode_graph_fallbacks")
            logger.debug("decode batch runs eagerly: %s", why)
        return not why

    def select_graph_variant(self, forward_batch) -> str:
        """The graph a decode batch replays (SGLang asks before its replay metadata,
        ``init_forward_metadata_out_graph``, which then fills the ``segments`` buffers for this batch):
        ``stock`` without a compressed request, else the ``segments`` graph bounded by its longest
        sequence (the kernel's split count follows that bound)."""
        forward = self._graph_forward(forward_batch)
        label = STOCK if forward is None else self._graph_variants.segments_for(longest_sequence(forward))
        self._replay = (forward, label)
        return label

    def _graph_forward(self, forward_batch) -> Optional[ForwardRequests]:
        """The decode batch as the engine sees it when it holds a compressed request (None otherwise, and
        before the tree exists); built once per batch, which the runner asks about several times."""
        asked_of, forward = self._graph_asked
        if asked_of is not forward_batch:
            forward = None
            coordinator = self.coordinator
            if coordinator is not None and forward_batch.forward_mode.is_decode():
                forward = coordinator.forward_begin(forward_batch, self.req_to_token_pool.req_to_token)
                forward = forward if forward.compressed else None
            self._graph_asked = (forward_batch, forward)
        return forward

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a decode graph's capture or replay (outside the graph). A ``segments`` graph: the
        compressed part's buffers filled and the dense part's graph-mode decode wrapper planned over every
        request's dense positions (a padded request: slot 0); the ``stock`` graph: SGLang's metadata."""
        if in_capture:  # a batch of padded requests
            label = get_capture_attention_variant()
            forward = None if label == STOCK else ForwardRequests(True, ())
        else:
            (forward, label), self._replay = self._replay, (None, STOCK)
            if forward is not None:
                self.engine.stats.count("graph_decodes")
        self.segments, self._graph_body = None, forward is not None
        if forward is None:
            return super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._graph_cells_per_sequence = self._graph_variants.bound_of(label)  # what the body is captured with
        batch_size, shape = forward_batch.batch_size, self._shape
        if in_capture:
            self._graph_dense_wrappers[batch_size] = self._create_decode_wrappers(batch_size, batch_size)[0]
        self._graph_dense = self._graph_dense_wrappers[batch_size]
        fits = self._decode_graph.fill(forward, batch_size)
        assert fits == FITS, fits  # graph_can_replay let only fitting batches replay
        layout = DenseLayout.of(forward, self.req_to_token_pool.req_to_token, batch_size)
        self._graph_dense.plan(
            *layout.paged_kv(shape),
            q_data_type=shape.q_dtype,
            kv_data_type=shape.kv_dtype,
            sm_scale=shape.scaling,
            non_blocking=True,
            disable_split_kv=self.disable_cuda_graph_kv_split,  # as SGLang plans its graph wrappers
        )

    def init_forward_metadata(self, forward_batch):
        self._graph_body = False  # an eager forward
        super().init_forward_metadata(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self._graph_body:
            return self._graph_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _graph_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        """The ``segments`` graph's body: every request's dense part (the decode wrapper planned before the
        replay) merged with its compressed part (``DecodeGraphState``); static shapes, no host read."""
        queries, paged_cache = self._layer_inputs(q, k, v, layer, forward_batch, save_kv_cache)
        dense_out, dense_lse_base2 = self._graph_dense.run(queries, paged_cache, return_lse=True)
        merged = self._decode_graph.attend_with_dense(
            queries, layer, *self.cell_rows, self._graph_cells_per_sequence, dense_out, dense_lse_base2 * LN_2
        )
        return merged.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def create_backend(runner) -> KVEvictFlashInferBackend:
    """The ``flashinfer`` attention backend factory (``contacts.CONTACTS``)."""
    if runner.use_mla_backend:
        raise NotImplementedError("sgl-kvevict: MLA models (FlashInfer MLA backend) are not supported")
    return KVEvictFlashInferBackend(runner, init_new_workspace=runner.init_new_workspace)
