"""The attention backend: SGLang's ``TorchNativeAttnBackend`` plus scoring capture and segment attention.

Registered in place of the stock ``torch_native`` factory (``plugin.py``), so the backend name and
every stock gate keyed on it stay the same. Until the compressed radix cache installs its
``EngineState`` (and for every request without compressed nodes on its path) it is the stock
backend, call for call.

* **Scoring capture** (extend): after a layer's attention, for each span compressed after this
  forward (the request's own span, or each block ending in it), the span's last ``w`` post-RoPE
  query rows and the keys and values up to its end (``ScoringJob.window_stats``: dense slots read
  through ``req_to_token``, plus the cells of spans reused compressed) give the policy's
  ``WindowStats``, passed to ``compressor.observe(layer, stats)``. The plans are built by the tree's
  checkpoint after the forward.
* **Segment attention** (extend and decode): for a request whose path holds compressed nodes, the
  output is the log-sum-exp merge of (a) attention over the arena cells of those nodes, one
  pseudo-sequence per (request, KV head) with the GQA group as its query heads
  (``kernels.segment_attention``), and (b) causal attention over the dense positions (everything
  outside the compressed spans, new tokens included). RoPE is in the stored keys, so kept keys keep
  their original positions and queries stay at logical positions. Other requests of the batch take
  the stock per-request path.

The dispatch (plain batch -> stock backend, compressed requests -> segment attention, scoring
after the extend) lives in ``SegmentAttentionBackend`` and is shared with the CUDA backend
(``flashinfer_backend.py``), as are ``observe_window`` and ``compressed_attention``. On CPU the
kernels dispatch to their torch twins.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_kvevict.engine.batch import ForwardPlan, RequestSlice, ScoringJob
from sgl_kvevict.engine.state import current
from sgl_kvevict.kernels import merge_attention_states, segment_attention

_QUERY_CHUNK = 512  # bounds the [chunk, H_q, L] fp32 logits of the dense part


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by logical position, with its log-sum-exp, in fp32.

    q ``[T, H_q, D]``; keys ``[L, H_kv, D]``, values ``[L, H_kv, D_v]``; query_positions ``[T]``,
    key_positions ``[L]``: query ``t`` sees key ``p`` iff ``key_positions[p] <= query_positions[t]``.
    Returns out ``[T, H_q, D_v]`` (q's dtype) and natural-log lse fp32 ``[T, H_q]`` (``-inf`` without keys).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    keys, values = keys.float(), values.float()
    out = torch.empty(num_tokens, num_q_heads, values.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, _QUERY_CHUNK):
        end = min(start + _QUERY_CHUNK, num_tokens)
        queries = q[start:end].float().view(end - start, num_kv_heads, group, head_dim)
        logits = torch.einsum("tkgd,lkd->tkgl", queries, keys) * scaling
        visible = key_positions[None, :] <= query_positions[start:end, None]  # [T, L]
        logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
        chunk_lse = torch.logsumexp(logits, dim=-1)  # [T, H_kv, G]
        probs = torch.exp(logits - chunk_lse.masked_fill(chunk_lse == float("-inf"), 0.0)[..., None])
        out[start:end] = torch.einsum("tkgl,lkd->tkgd", probs, values).reshape(end - start, num_q_heads, -1)
        lse[start:end] = chunk_lse.reshape(end - start, num_q_heads)
    return out, lse


def observe_window(job: ScoringJob, q: torch.Tensor, layer, plan: ForwardPlan, req_to_token, kv_pool) -> None:
    """Scoring capture of one request and layer: its window's ``WindowStats`` to its compressor.

    q ``[N, H_q * D]`` (this forward's post-RoPE queries); req_to_token ``[rows, max_len]``; the KV of
    the request (prefix and this extend) must already be in ``kv_pool``.
    """
    request = job.request
    queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    q_window = queries[request.q_end - job.window : request.q_end].transpose(0, 1)  # [H_q, w, D]
    arena = plan.engine.arena
    stats = job.window_stats(
        q_window, kv_pool.get_key_buffer(layer.layer_id), kv_pool.get_value_buffer(layer.layer_id),
        req_to_token[request.row], arena.k[layer.layer_id], arena.v[layer.layer_id], layer.layer_id,
        layer.scaling, plan.engine.stats_request,
    )  # fmt: skip
    job.compressor.observe(layer.layer_id, stats)


def compressed_attention(
    plan: ForwardPlan, queries: torch.Tensor, layer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of the compressed requests' queries over their arena cells (``kernels.segment_attention``).

    queries ``[N, H_q, D]`` (every query of the forward). Returns ``rows`` int64 ``[N_c]`` (the compressed
    requests' query rows, request-major), out ``[N_c, H_q, D_v]`` and natural-log lse fp32 ``[N_c, H_q]``
    (``-inf`` and out 0 for a KV head without cells).
    """
    device = queries.device
    rows = plan.compressed_query_rows(device)
    kv_indptr, kv_indices = plan.compressed_cells(layer.layer_id, device)
    arena = plan.engine.arena
    out, lse = segment_attention(
        queries[rows],
        arena.k[layer.layer_id],
        arena.v[layer.layer_id],
        plan.compressed_qo_indptr(device),
        kv_indptr,
        kv_indices,
        layer.tp_k_head_num,
        layer.scaling,
        max(r.num_queries for r in plan.compressed),
    )
    return rows, out, lse


class SegmentAttentionBackend:
    """Mixin over a stock SGLang attention backend: the per-forward plan and the dispatch.

    A forward without compressed requests is the stock backend's, call for call; with some, every
    request of the batch goes through ``_forward_with_segments`` (stock metadata would read the
    placeholder slots of compressed spans). Extends then feed the scoring jobs. Subclasses provide
    ``_init_segment_metadata`` and ``_forward_with_segments``; the stock base provides
    ``req_to_token_pool`` and ``token_to_kv_pool``.
    """

    forward_plan: ForwardPlan | None = None

    def init_forward_metadata(self, forward_batch):
        engine = current()
        self.forward_plan = None if engine is None else ForwardPlan.build(engine, forward_batch)
        if self.forward_plan is None or not self.forward_plan.compressed:
            super().init_forward_metadata(forward_batch)
        else:
            self._init_segment_metadata(forward_batch, self.forward_plan)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        plan = self.forward_plan
        if plan is None or not plan.compressed:
            out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        else:
            out = self._forward_with_segments(q, k, v, layer, forward_batch, save_kv_cache, plan)
        if plan is not None:
            for job in plan.scoring:
                observe_window(job, q, layer, plan, self.req_to_token_pool.req_to_token, self.token_to_kv_pool)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        plan = self.forward_plan
        if plan is None or not plan.compressed:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_with_segments(q, k, v, layer, forward_batch, save_kv_cache, plan)

    def _init_segment_metadata(self, forward_batch, plan: ForwardPlan) -> None:
        raise NotImplementedError

    def _forward_with_segments(self, q, k, v, layer, forward_batch, save_kv_cache, plan: ForwardPlan):
        """Attention output ``[N, H_q * D_v]`` of every request of a forward that has compressed ones."""
        raise NotImplementedError


class KVEvictTorchBackend(SegmentAttentionBackend, TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` that scores prompts for eviction and attends over compressed nodes."""

    def _init_segment_metadata(self, forward_batch, plan: ForwardPlan) -> None:
        TorchNativeAttnBackend.init_forward_metadata(self, forward_batch)  # per-request SDPA needs nothing planned

    def _forward_with_segments(self, q, k, v, layer, forward_batch, save_kv_cache, plan: ForwardPlan):
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        num_q_heads, head_dim, v_head_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        queries = q.reshape(-1, num_q_heads, head_dim)
        out = q.new_empty(queries.shape[0], num_q_heads, v_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        for request in plan.requests:
            if request.view is None:
                self._stock_request(request, queries, out, k_cache, v_cache, layer, forward_batch)

        rows, compressed_out, compressed_lse = compressed_attention(plan, queries, layer)
        dense = [self._dense_part(request, queries, k_cache, v_cache, layer) for request in plan.compressed]
        dense_out = torch.cat([part[0] for part in dense])
        dense_lse = torch.cat([part[1] for part in dense])
        merged, _ = merge_attention_states(compressed_out, compressed_lse, dense_out, dense_lse)
        out[rows] = merged
        return out.view(-1, num_q_heads * v_head_dim)

    def _dense_part(self, request: RequestSlice, queries, k_cache, v_cache, layer):
        device = queries.device
        positions = request.dense_positions(device)
        slots = self.req_to_token_pool.req_to_token[request.row, positions].long()
        return dense_attention(
            queries[request.q_start : request.q_end],
            k_cache[slots],
            v_cache[slots],
            request.query_positions(device),
            positions,
            layer.scaling,
        )

    def _stock_request(self, request: RequestSlice, queries, out, k_cache, v_cache, layer, forward_batch):
        """The stock per-request SDPA of ``TorchNativeAttnBackend`` on this request's rows only."""
        one = slice(request.index, request.index + 1)
        rows = slice(request.q_start, request.q_end)
        common = dict(scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
        to_token = self.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            self._run_sdpa_forward_decode(
                queries[rows], out[rows], k_cache, v_cache, to_token, forward_batch.req_pool_indices[one],
                forward_batch.seq_lens[one], causal=False, **common,
            )  # fmt: skip
        else:
            self._run_sdpa_forward_extend(
                queries[rows], out[rows], k_cache, v_cache, to_token, forward_batch.req_pool_indices[one],
                forward_batch.seq_lens[one], forward_batch.extend_prefix_lens[one],
                forward_batch.extend_seq_lens[one], causal=True, **common,
            )  # fmt: skip
