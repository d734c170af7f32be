"""The attention backend: SGLang's ``TorchNativeAttnBackend`` plus scoring capture and segment attention.

Registered in place of the stock ``torch_native`` factory (``contacts.CONTACTS``), so the backend name
and every stock gate keyed on it stay the same. SGLang builds it before the tree: it finds the engine
of its KV pool per forward (``engine.registry``). Until one exists, and for every forward without
compressed requests, it is the stock backend, call for call.

A plan/run reader of per-forward metadata it builds itself: ``init_forward_metadata`` asks the
coordinator for the forward's requests (``forward_begin``) and builds the ``SegmentMetadata`` of the
compressed ones; each layer runs on it, then tells the coordinator the layer is done
(``attention_end``: the scoring capture of segments compressed after this forward,
``engine.compression``).
* **Segment attention** (extend and decode): for a request whose path holds compressed nodes, the
  output is the log-sum-exp merge of (a) attention over the cells of those nodes, one pseudo-sequence
  per (request, KV head) with the GQA group as its query heads (``kernels.segment_attention``, reading
  the cells in place in SGLang's pool), and (b) causal attention over the dense positions (everything
  outside the compressed segments, new tokens included). RoPE is in the stored keys, so kept keys keep
  their original positions and queries stay at logical positions.
* **The torch backend's decode** needs no merge: one query per request sees every key, so each
  (request, KV head) is one sequence of its cells and its dense positions together (``DecodeKeys``,
  kept across decode steps), attended in one batched call per layer for every request of the batch,
  plain ones included (on CPU a C++ kernel that reads each key in place, ``kernels.paged_decode``). Its
  extend merges the two parts as above.

The dispatch lives in ``SegmentAttentionBackend`` and is shared with the CUDA backend
(``flashinfer_backend.py``), as is ``compressed_attention``. Everything a layer runs indexes tensors
built once per forward (``engine.batch``). On CPU the kernels dispatch to their torch twins.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

from sgl_kvevict.engine.batch import (
    CellBatchCache,
    DecodeKeys,
    DecodeKeysCache,
    DenseBatch,
    RequestSlice,
    SegmentMetadata,
    WindowKeys,
    WindowKeysCache,
)
from sgl_kvevict.engine.adapter.pool import cell_space_of
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.coordinator import CompressionCoordinator
from sgl_kvevict.engine.registry import Engine, engine_for
from sgl_kvevict.kernels import merge_attention_states, segment_attention
from sgl_kvevict.kernels.paged_decode import paged_decode, paged_decode_available

# Bounds an extend's dense part per request: its fp32 mask [chunk * G, L] (the formula's logits, off CPU:
# [chunk * H_q, L]).
_QUERY_CHUNK = 512


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    window_left: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by logical position, with its log-sum-exp, in fp32; batched over requests.

    q ``[B, T, H_q, D]``; keys ``[B, L, H_kv, D]``, values ``[B, L, H_kv, D_v]``; query_positions ``[B, T]``,
    key_positions ``[B, L]``: query ``t`` of request ``b`` sees key ``p`` iff
    ``key_positions[b, p] <= query_positions[b, t]``, and, with ``window_left`` (a local layer's, SGLang's
    ``sliding_window_size``), ``key_positions[b, p] >= query_positions[b, t] - window_left``. Returns out fp32 ``[B, T, H_q, D_v]`` (rounded only
    once merged with the cells' part, as stock's SDPA rounds once) and natural-log lse fp32 ``[B, T, H_q]``
    (``-inf``, out 0, without keys). On CPU through ATen's flash kernel (``_flash_chunk``), elsewhere the
    formula (``_formula_chunk``: the torch backend runs on any device)."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    keys, values = keys.float().transpose(1, 2), values.float().transpose(1, 2)  # [B, H_kv, L, D]
    attend = _flash_chunk if q.device.type == "cpu" else _formula_chunk
    out = torch.empty(batch, num_tokens, num_q_heads, values.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, _QUERY_CHUNK):
        end = min(start + _QUERY_CHUNK, num_tokens)
        queries = q[:, start:end].float().view(batch, end - start, num_kv_heads, group, head_dim)
        visible = key_positions[:, None, :] <= query_positions[:, start:end, None]  # [B, T, L]
        if window_left is not None:
            visible &= key_positions[:, None, :] >= query_positions[:, start:end, None] - window_left
        chunk_out, chunk_lse = attend(queries, keys, values, visible, scaling)
        out[:, start:end] = chunk_out.reshape(batch, end - start, num_q_heads, -1)
        lse[:, start:end] = chunk_lse.reshape(batch, end - start, num_q_heads)
    return out, lse


# ATen's CPU flash attention (what ``scaled_dot_product_attention`` runs on CPU), called directly for the
# log-sum-exp it computes anyway and the public function drops: fp32 in, fp32 out and natural-log lse.
_FLASH_ATTENTION_WITH_LSE = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_chunk(queries, keys, values, visible, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk of ``dense_attention`` through ATen's CPU flash kernel: a KV head's ``G`` query heads are
    ``G`` more query rows of it (row ``t * G + g``), so its keys are read once, and no ``[T, H_q, L]`` logits
    are materialised (a 512-query chunk over 1.4K keys: 26 ms against the formula's 93, equal to 1e-6).

    queries fp32 ``[B, T, H_kv, G, D]``; keys, values fp32 ``[B, H_kv, L, D]``; visible ``[B, T, L]``. Returns
    out ``[B, T, H_kv, G, D_v]`` and lse ``[B, T, H_kv, G]``."""
    batch, num_tokens, num_kv_heads, group, head_dim = queries.shape
    rows = queries.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_tokens * group, head_dim)
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))
    mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)  # [B, 1, T * G, L], broadcast over the KV heads
    out, lse = _FLASH_ATTENTION_WITH_LSE(rows, keys, values, 0.0, False, attn_mask=mask, scale=scaling)
    out = out.view(batch, num_kv_heads, num_tokens, group, -1).transpose(1, 2)
    lse = lse.view(batch, num_kv_heads, num_tokens, group).transpose(1, 2)
    # The kernel gives a query without keys out 0 and lse 0: lse -inf, so that a merge weighs it 0.
    return out, lse.masked_fill(~visible.any(-1)[:, :, None, None], float("-inf"))


def _formula_chunk(queries, keys, values, visible, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """``_flash_chunk``'s result by the formula, on any device (its ``[B, T, H_kv, G, L]`` logits in memory)."""
    logits = torch.einsum("btkgd,bkld->btkgl", queries, keys) * scaling
    logits = logits.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, T, H_kv, G]
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.einsum("btkgl,bkld->btkgd", probs, values), lse


def compressed_attention(
    segments: SegmentMetadata, queries: torch.Tensor, layer, k_rows: torch.Tensor, v_rows: torch.Tensor, out_dtype=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the compressed requests' queries over their cells (``kernels.segment_attention``).

    queries ``[N, H_q, D]`` (every query of the forward); k_rows, v_rows: the pool's cells
    (``CellSpace``). Returns out ``[N_c, H_q, D_v]`` and natural-log lse fp32 ``[N_c, H_q]`` for
    ``segments.query_rows`` (``-inf`` and out 0 for a KV head without cells); out in ``out_dtype``
    (None: the queries').
    """
    cells = segments.cells
    return segment_attention(
        queries[segments.query_rows], k_rows, v_rows, segments.qo_indptr, cells.kv_indptr[layer.layer_id],
        cells.kv_indices, layer.tp_k_head_num, layer.scaling, segments.max_queries, cells.max_cells, out_dtype,
    )  # fmt: skip


class SegmentAttentionBackend:
    """Mixin over a stock SGLang attention backend: the per-forward metadata and the dispatch.

    A forward without compressed requests is the stock backend's, call for call; with some, every
    request of the batch goes through ``_forward_with_segments`` (stock metadata would read the
    placeholder slots of compressed segments). Subclasses provide ``_init_segment_metadata`` and
    ``_forward_with_segments``; the stock base provides ``req_to_token_pool`` and ``token_to_kv_pool``.
    """

    segments: SegmentMetadata | None = None
    _coordinator: CompressionCoordinator | None = None  # the current forward's

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cell_batches = CellBatchCache()

    @property
    def engine(self) -> Optional[Engine]:
        """The engine of this backend's KV pool (None before SGLang builds the tree, and for a stock tree)."""
        return engine_for(self.token_to_kv_pool)

    @property
    def coordinator(self) -> Optional[CompressionCoordinator]:
        engine = self.engine
        return None if engine is None else engine.coordinator

    @functools.cached_property
    def cell_space(self) -> CellSpace:
        """The pool's cells, where compressed entries are read (views of the tree's, ``CellSpace``)."""
        return cell_space_of(self.token_to_kv_pool)

    @property
    def cell_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's flat K and V cell views (``CellSpace.k_rows``, ``v_rows``)."""
        return self.cell_space.k_rows, self.cell_space.v_rows

    def init_forward_metadata(self, forward_batch):
        self.segments = None
        self._coordinator = coordinator = self.coordinator  # this forward's, for its layers
        if coordinator is not None:
            forward = coordinator.forward_begin(forward_batch, self.req_to_token_pool.req_to_token)
            if forward.compressed:
                device = self.req_to_token_pool.req_to_token.device
                self.segments = SegmentMetadata.of(forward, device, self._cell_batches)
        if self.segments is None:
            super().init_forward_metadata(forward_batch)
        else:
            self._init_segment_metadata(forward_batch, self.segments)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        segments = self.segments
        if segments is None:
            out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        else:
            out = self._forward_with_segments(q, k, v, layer, forward_batch, save_kv_cache, segments)
        if self._coordinator is not None:
            self._coordinator.attention_end(q, layer)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        segments = self.segments
        if segments is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_with_segments(q, k, v, layer, forward_batch, save_kv_cache, segments)

    def graph_variants(self):
        """The decode graphs this backend captures per batch size (SGLang's ``AttentionGraphVariants``), so
        that a batch with compressed requests never replays a stock graph (which would read their
        placeholder slots). Only the CUDA backend has them (``flashinfer_backend.py``)."""
        raise NotImplementedError(
            f"sgl-kvevict: decode CUDA graphs with compression need the flashinfer attention backend, "
            f"not {type(self).__name__}"
        )

    def _compressed_attention(self, segments: SegmentMetadata, queries: torch.Tensor, layer, out_dtype=None):
        return compressed_attention(segments, queries, layer, *self.cell_rows, out_dtype)

    def _init_segment_metadata(self, forward_batch, segments: SegmentMetadata) -> None:
        raise NotImplementedError

    def _forward_with_segments(self, q, k, v, layer, forward_batch, save_kv_cache, segments: SegmentMetadata):
        """Attention output ``[N, H_q * D_v]`` of every request of a forward that has compressed ones."""
        raise NotImplementedError


def local_window(layer) -> Optional[int]:
    """A local attention layer's window past the query (SGLang's ``sliding_window_size``: a query at ``p``
    reads ``[p - window, p]``); None for a global layer."""
    window = layer.sliding_window_size
    return window if window is not None and window > -1 else None


def padded_sdpa_decode(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, keys: DecodeKeys, layer_id: int, scale: float
) -> torch.Tensor:
    """The decode attention of ``keys``' sequences in layer ``layer_id`` through ATen's SDPA (any device, any
    pool dtype): a layer's sequences go in buckets of similar key counts (``key_buckets``), each gathered,
    padded to its own longest and attended in one call. q ``[S, G, D]``; returns ``[S, G, D_v]`` in q's dtype."""
    rows, visible = keys.rows[layer_id], keys.visible[layer_id]  # [S, W], [S, 1, 1, W]
    sequences, group = q.shape[0], q.shape[1]
    q = q.unsqueeze(1)  # [S, 1, G, D]
    out = None
    for bucket in keys.layer_buckets(layer_id):
        chosen, width = bucket.sequences, bucket.width
        bucket_rows, bucket_visible, bucket_q = rows[:, :width], visible[..., :width], q
        if chosen is not None:
            bucket_rows, bucket_visible, bucket_q = (t.index_select(0, chosen) for t in (bucket_rows, bucket_visible, q))
        # index_select, not k_rows[rows]: advanced indexing by a 2-D index is several times slower on CPU.
        flat = bucket_rows.reshape(-1)
        k = k_rows.index_select(0, flat).view(len(bucket_q), 1, width, -1).to(q.dtype)
        v = v_rows.index_select(0, flat).view(len(bucket_q), 1, width, -1).to(q.dtype)
        attended = scaled_dot_product_attention(bucket_q, k, v, attn_mask=bucket_visible, scale=scale)  # [n, 1, G, D_v]
        if chosen is None:
            out = attended
        else:
            out = q.new_empty(sequences, 1, group, v.shape[-1]) if out is None else out
            out.index_copy_(0, chosen, attended)
    return out.squeeze(1)


class KVEvictTorchBackend(SegmentAttentionBackend, TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` that scores prompts for eviction and attends over compressed nodes.

    A local attention layer (Gemma 3's, ``sgl_kvevict.local_layers``) reads, for every request of a forward
    with compressed ones, the positions of its queries' windows (``WindowKeys``: dense slots and the cells
    of compressed nodes, which keep their last window there; kept across decode steps, ``WindowKeysCache``)
    under a causal and window mask by position; the plain requests of a mixed extend keep stock's windowed
    SDPA."""

    dense: DenseBatch | None = None
    decode_keys: DecodeKeys | None = None
    window_keys: WindowKeys | None = None

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._decode_keys = DecodeKeysCache()
        self._window_keys = WindowKeysCache()
        # Built (or loaded from its cache) here, at start-up, not on the first decode step of a request.
        self._paged_decode = torch.device(self.device).type == "cpu" and paged_decode_available()

    def _init_segment_metadata(self, forward_batch, segments: SegmentMetadata) -> None:
        TorchNativeAttnBackend.init_forward_metadata(self, forward_batch)  # per-request SDPA needs nothing planned
        forward, to_token = segments.forward, self.req_to_token_pool.req_to_token
        if forward.is_decode:
            self.decode_keys = self._decode_keys.of(
                forward_batch.rids, forward, to_token, self.cell_space, forward_batch.out_cache_loc
            )
        else:
            self.dense = DenseBatch.of(forward.compressed, to_token)
        engine = self.engine
        local = None if engine is None else engine.local_layers
        self.window_keys = None
        if local is not None:
            self.window_keys = self._window_keys.of(
                forward_batch.rids, forward, to_token, self.cell_space, local, forward_batch.out_cache_loc
            )

    def _forward_with_segments(self, q, k, v, layer, forward_batch, save_kv_cache, segments: SegmentMetadata):
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        num_q_heads, head_dim, v_head_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        queries = q.reshape(-1, num_q_heads, head_dim)
        forward, window_left = segments.forward, local_window(layer)
        if forward.is_decode:
            if window_left is not None:
                return self._window_attention(queries, layer, forward.requests, window_left).view(-1, num_q_heads * v_head_dim)
            return self._decode_attention(queries, layer).view(-1, num_q_heads * v_head_dim)
        out = q.new_empty(queries.shape[0], num_q_heads, v_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        # Stock SDPA for the plain requests of a mixed batch (it loops over them, as the stock backend does).
        for request in forward.requests:
            if request.view is None:
                self._stock_request(request, queries, out, k_cache, v_cache, layer, forward_batch)
        if window_left is not None:
            out[segments.query_rows] = self._window_attention(queries, layer, forward.compressed, window_left)
            return out.view(-1, num_q_heads * v_head_dim)
        # Both parts stay fp32 until merged: the output is rounded to the KV dtype once, as stock's SDPA does.
        compressed_out, compressed_lse = self._compressed_attention(segments, queries, layer, torch.float32)
        dense_out, dense_lse = self._dense_part(segments, queries, k_cache, v_cache, layer)
        merged, _ = merge_attention_states(compressed_out, compressed_lse, dense_out, dense_lse)
        out[segments.query_rows] = merged.to(out.dtype)
        return out.view(-1, num_q_heads * v_head_dim)

    def _decode_attention(self, queries: torch.Tensor, layer) -> torch.Tensor:
        """Every request of a decode batch, plain ones included, in one pass over each (request, KV head)'s
        keys (``DecodeKeys``: its cells and its dense positions), the GQA group as the queries of its KV
        head: no merge of two parts, no loop over requests. queries ``[B, H_q, D]``; returns ``[B, H_q, D_v]``.

        On CPU the compiled kernel (``kernels.paged_decode``) reads each sequence's rows in place and stops
        at its own end, so the work follows the keys kept; where it is not built, or the pool's dtype is not
        the queries', ``padded_sdpa_decode``. Both accumulate QK, the softmax and PV in fp32 for bf16 inputs
        and round the output once, as stock's per-request SDPA does."""
        keys, (k_rows, v_rows) = self.decode_keys, self.cell_rows
        sequences = keys.rows.shape[1]  # B * H_kv
        q = queries.reshape(sequences, layer.tp_q_head_num // layer.tp_k_head_num, -1)  # head h * G + g: [S, G, D]
        if self._paged_decode and k_rows.dtype == q.dtype:
            rows, ends = keys.rows[layer.layer_id], keys.ends[layer.layer_id]
            out = paged_decode(q.contiguous(), k_rows, v_rows, rows, ends, layer.scaling)
        else:
            out = padded_sdpa_decode(q, k_rows, v_rows, keys, layer.layer_id, layer.scaling)
        return out.view(queries.shape[0], layer.tp_q_head_num, -1)

    def _window_attention(self, queries: torch.Tensor, layer, requests, window_left: int) -> torch.Tensor:
        """A local layer's attention for ``requests`` (the ``WindowKeys`` of this forward, in that order) over
        their windows' keys, masked by position: queries ``[N, H_q, D]``; returns ``[N_r, H_q, D_v]`` for their
        query rows, request-major. A decode batch is one batched call, an extend one call per request."""
        keys = self.window_keys
        k, v = keys.keys_of(layer.layer_id, *self.cell_rows)  # [B, K, H_kv, D]
        batch = k.shape[0]
        if len(keys.query_rows) == batch:  # one query per request: a decode batch
            out, _ = dense_attention(
                queries.index_select(0, keys.query_rows).unsqueeze(1), k, v, keys.query_positions.unsqueeze(1),
                keys.positions, layer.scaling, window_left,
            )  # fmt: skip
            return out.squeeze(1).to(queries.dtype)
        parts, first = [], 0
        for index, request in enumerate(requests):
            # A request's query rows are contiguous: a view of them, not a gather.
            last = first + request.num_queries
            out, _ = dense_attention(
                queries[request.q_start : request.q_end].unsqueeze(0), k[index : index + 1], v[index : index + 1],
                keys.query_positions[first:last].unsqueeze(0), keys.positions[index : index + 1], layer.scaling, window_left,
            )  # fmt: skip
            parts.append(out[0])
            first = last
        return torch.cat(parts).to(queries.dtype)

    def _run_sdpa_forward_extend(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
        extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
        sliding_window_size=None,
    ):  # fmt: skip
        """Stock's per-request SDPA extend, without its padding: stock pads a request's queries to its
        whole length, so each chunk of a chunked prefill (and each cached-prefix hit) redoes attention
        over the prefix, [P + E]^2 instead of E x [P + E]. Here the E new queries attend to the P + E keys
        under a causal mask offset by P (the same result, bit for bit on CPU). Encoder-decoder and
        sliding-window calls keep the stock path.

        query, output ``[N, H_q, D]``; k_cache, v_cache ``[pool, H_kv, D]``; the rest per request ``[B]``."""
        if encoder_lens is not None or not causal or (sliding_window_size is not None and sliding_window_size > -1):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        start = 0
        for pool_index, length, prefix, new in zip(
            req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist()
        ):
            slots = req_to_token[pool_index, :length]
            keys, values = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)  # [H_kv, P + E, D]
            queries = query[start : start + new].movedim(0, 1)  # [H_q, E, D]
            visible = None
            if prefix:
                key_positions = torch.arange(length, device=query.device)
                visible = key_positions[None, :] <= (prefix + torch.arange(new, device=query.device))[:, None]
            attended = scaled_dot_product_attention(
                queries.unsqueeze(0), keys.to(queries.dtype).unsqueeze(0), values.to(queries.dtype).unsqueeze(0),
                attn_mask=visible, is_causal=not prefix, scale=scaling, enable_gqa=enable_gqa,
            )  # fmt: skip
            output[start : start + new] = attended.squeeze(0).movedim(1, 0)
            start += new
        return output

    def _dense_part(self, segments: SegmentMetadata, queries, k_cache, v_cache, layer):
        """The compressed requests' attention over their dense positions in an extend, request by request
        (their keys are long, their queries many)."""
        dense = self.dense
        parts, first_row = [], 0
        for index, request in enumerate(segments.forward.compressed):
            slots, positions = dense.slots[index], dense.positions[index : index + 1]
            query_positions = dense.query_positions[first_row : first_row + request.num_queries]
            parts.append(
                dense_attention(
                    queries[request.q_start : request.q_end].unsqueeze(0), k_cache.index_select(0, slots).unsqueeze(0),
                    v_cache.index_select(0, slots).unsqueeze(0), query_positions.unsqueeze(0), positions, layer.scaling,
                )  # fmt: skip
            )
            first_row += request.num_queries
        return torch.cat([out[0] for out, _ in parts]), torch.cat([lse[0] for _, lse in parts])

    def _stock_request(self, request: RequestSlice, queries, out, k_cache, v_cache, layer, forward_batch):
        """The stock per-request SDPA extend of ``TorchNativeAttnBackend`` on this request's rows only."""
        one = slice(request.index, request.index + 1)
        rows = slice(request.q_start, request.q_end)
        self._run_sdpa_forward_extend(
            queries[rows], out[rows], k_cache, v_cache, self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices[one], forward_batch.seq_lens[one], forward_batch.extend_prefix_lens[one],
            forward_batch.extend_seq_lens[one], scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=True, sliding_window_size=local_window(layer),
        )  # fmt: skip
