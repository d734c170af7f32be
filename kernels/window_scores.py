"""Observation-window statistics read straight from SGLang's KV buffer: Triton kernels and torch twin.

Computes the ``WindowStats`` of ``sgl_kvevict.scoring.window`` (the formulas and their meaning are
defined there) for one request of one layer, reading the request's keys and values through its slot
list instead of a gathered copy, and never writing the ``[H_q, w, L]`` attention matrix to memory.

Inputs (SGLang NHD layout, see sglang-0.5.23-hooks.md §2.2):

* ``q_window``  ``[H_q, w, D]``  post-RoPE queries of the last ``w`` positions ``L - w .. L - 1``;
  query head ``h`` belongs to KV head ``h // G`` with ``G = H_q // H_kv``.
* ``k_buffer``  ``[slots, H_kv, D]`` and ``v_buffer`` ``[slots, H_kv, D_v]``: one layer of the pool.
* ``kv_indices`` int32/int64 ``[L]``: ``kv_indices[p]`` is the slot of logical position ``p``
  (``req_to_token[row, :L]``).

Triton path, per layer and request:

1. ``_window_softmax_partials_kernel``, grid ``(H_kv * head_blocks, key_splits)``: flash-attention
   over one split of the keys for a tile of ``BLOCK_H`` query heads x ``w`` window queries (one GQA
   group shares every key load): per window row the running max, denominator and, when the OBCache
   key/joint scores need them, the unnormalised outputs. Splitting the keys keeps the GPU busy when
   ``H_kv`` is small and ``L`` long (flash-decoding); ``_combine_splits`` merges the splits in torch
   (tensors of size ``splits x H_q x w``), giving each row's log-sum-exp and output ``o_i``.
2. ``_window_stats_kernel``, grid ``(H_kv * head_blocks, key_blocks)``: recomputes the logits of one
   key block, normalises them with the row log-sum-exp and reduces over the window rows into the
   requested per-key statistics; every output element is written by exactly one program.

Accumulation is fp32 whatever the KV dtype; ``tl.dot`` operands are in the KV dtype (products exact
for fp16/bf16, IEEE for fp32). The CUDA path is untested on this hardware: it is verified only in
Triton interpreter mode on CPU (``tests/test_kernels_window.py``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_kvevict.kernels.runtime import dot, dot_block, upcast_dot_operands
from sgl_kvevict.scoring.window import StatsRequest, WindowStats, window_stats

_LOG2E = math.log2(math.e)
_BLOCK_N = 32  # keys per block
_ROWS_PER_TILE = 64  # query rows (heads x window) per program; bounds registers for w = 32, G = 8
_TARGET_PROGRAMS = 256  # ~2 waves on a 132-SM GPU; a heuristic, not tuned on hardware


@triton.jit
def _query_tile(tile_id, group, window, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """The query heads and rows of program ``tile_id``: ``BLOCK_H`` heads of one GQA group x ``BLOCK_W`` queries.

    Row ``r`` of the tile is head ``r // BLOCK_W`` of the tile and window query ``r % BLOCK_W``.
    Returns the KV head; the tile's query heads ``[BLOCK_H]`` and their validity; per row
    ``[BLOCK_H * BLOCK_W]`` the query head, the window query index and the validity.
    """
    head_blocks = tl.cdiv(group, BLOCK_H)
    kv_head = tile_id // head_blocks
    first_head_in_group = (tile_id % head_blocks) * BLOCK_H
    tile_heads_in_group = first_head_in_group + tl.arange(0, BLOCK_H)
    rows = tl.arange(0, BLOCK_H * BLOCK_W)
    row_head_in_group = first_head_in_group + rows // BLOCK_W
    row_query = rows % BLOCK_W
    row_valid = (row_head_in_group < group) & (row_query < window)
    tile_heads = kv_head * group + tile_heads_in_group
    return kv_head, tile_heads, tile_heads_in_group < group, kv_head * group + row_head_in_group, row_query, row_valid


@triton.jit
def _load_rows(base_ptr, row_offsets, row_valid, width, BLOCK_D: tl.constexpr):
    """``[rows, BLOCK_D]`` tile of rows at ``base_ptr + row_offsets``, zero outside ``row_valid`` and ``width``."""
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims[None, :] < width)
    return tl.load(base_ptr + row_offsets[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _key_block(kv_indices_ptr, block_start, block_end, BLOCK_N: tl.constexpr):
    """Positions ``[BLOCK_N]`` of a key block, their validity and their KV-buffer slots (int64)."""
    keys = block_start + tl.arange(0, BLOCK_N)
    key_valid = keys < block_end
    slots = tl.load(kv_indices_ptr + keys, mask=key_valid, other=0).to(tl.int64)
    return keys, key_valid, slots


@triton.jit
def _visible(row_valid, row_query, keys, key_valid, context_len, window):
    """``[rows, BLOCK_N]`` causal mask: window query ``i`` (position ``L - w + i``) sees keys ``p <= L - w + i``."""
    last_visible_key = context_len - window + row_query
    return row_valid[:, None] & key_valid[None, :] & (keys[None, :] <= last_visible_key[:, None])


@triton.jit
def _window_softmax_partials_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indices_ptr,
    partial_max_ptr, partial_sum_ptr, partial_out_ptr,
    context_len, window, group, num_q_heads, keys_per_split, qk_scale_log2,
    stride_q_head, stride_q_query, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NEED_OUTPUTS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Softmax partials of one key split; logits in log2 units (``exp2`` is the native instruction).

    partial_max, partial_sum: fp32 ``[splits, H_q, w]``; partial_out: fp32 ``[splits, H_q, w, D_v]``.
    """
    split = tl.program_id(1)
    kv_head, _, _, row_head, row_query, row_valid = _query_tile(tl.program_id(0), group, window, BLOCK_H, BLOCK_W)
    q = _load_rows(q_ptr, row_head * stride_q_head + row_query * stride_q_query, row_valid, HEAD_DIM, BLOCK_D)

    row_max = tl.full([BLOCK_H * BLOCK_W], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H * BLOCK_W], tl.float32)
    row_out = tl.zeros([BLOCK_H * BLOCK_W, BLOCK_DV], tl.float32)
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, context_len)
    for block_start in range(split_start, split_end, BLOCK_N):
        keys, key_valid, slots = _key_block(kv_indices_ptr, block_start, split_end, BLOCK_N)
        k = _load_rows(k_buffer_ptr + kv_head * stride_k_head, slots * stride_k_slot, key_valid, HEAD_DIM, BLOCK_D)
        logits = dot(q, tl.trans(k), UPCAST) * qk_scale_log2
        visible = _visible(row_valid, row_query, keys, key_valid, context_len, window)
        logits = tl.where(visible, logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 1))
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 keeps exp2 at 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(logits - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        if NEED_OUTPUTS:
            v_head_ptr = v_buffer_ptr + kv_head * stride_v_head
            v = _load_rows(v_head_ptr, slots * stride_v_slot, key_valid, HEAD_DIM_V, BLOCK_DV)
            row_out = row_out * rescale[:, None] + dot(probs.to(v.dtype), v, UPCAST)
        row_max = new_max

    partial_row = (split * num_q_heads + row_head) * window + row_query
    tl.store(partial_max_ptr + partial_row, row_max, mask=row_valid)
    tl.store(partial_sum_ptr + partial_row, row_sum, mask=row_valid)
    if NEED_OUTPUTS:
        dims = tl.arange(0, BLOCK_DV)
        out_ptrs = partial_out_ptr + partial_row[:, None] * HEAD_DIM_V + dims[None, :]
        tl.store(out_ptrs, row_out, mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM_V))


@triton.jit
def _sum_over_window(per_row, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_H * BLOCK_W, BLOCK_N]`` per window row -> ``[BLOCK_H, BLOCK_N]`` per query head."""
    return tl.sum(tl.reshape(per_row, (BLOCK_H, BLOCK_W, BLOCK_N)), axis=1)


@triton.jit
def _store_per_head(out_ptr, stat, tile_heads, tile_head_valid, keys, key_valid, context_len):
    """Store ``[BLOCK_H, BLOCK_N]`` into an fp32 ``[H, L]`` statistic."""
    ptrs = out_ptr + tile_heads[:, None].to(tl.int64) * context_len + keys[None, :]
    tl.store(ptrs, stat, mask=tile_head_valid[:, None] & key_valid[None, :])


@triton.jit
def _window_stats_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indices_ptr, row_lse_ptr, row_out_ptr,
    attn_sum_ptr, tail_attn_ptr, obc_value_ptr, obc_key_ptr, obc_joint_ptr, value_l1_ptr,
    context_len, window, group, tail_rows, scaling, qk_scale_log2,
    stride_q_head, stride_q_query, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
    ATTN_SUM: tl.constexpr, TAIL_ATTN: tl.constexpr, OBC_VALUE: tl.constexpr, OBC_KEY: tl.constexpr,
    OBC_JOINT: tl.constexpr, VALUE_L1: tl.constexpr,
):  # fmt: skip
    """Statistics of one key block for one query tile.

    row_lse: fp32 ``[H_q, w]`` log2-sum-exp2 of the scaled logits; row_out: fp32 ``[H_q, w, D_v]``
    window outputs ``o_i`` (read only for OBC key/joint). Outputs as in ``WindowStats``.
    """
    tile_id = tl.program_id(0)
    kv_head, tile_heads, tile_head_valid, row_head, row_query, row_valid = _query_tile(
        tile_id, group, window, BLOCK_H, BLOCK_W
    )
    keys, key_valid, slots = _key_block(kv_indices_ptr, tl.program_id(1) * BLOCK_N, context_len, BLOCK_N)
    q = _load_rows(q_ptr, row_head * stride_q_head + row_query * stride_q_query, row_valid, HEAD_DIM, BLOCK_D)
    k = _load_rows(k_buffer_ptr + kv_head * stride_k_head, slots * stride_k_slot, key_valid, HEAD_DIM, BLOCK_D)
    qk = dot(q, tl.trans(k), UPCAST)  # [rows, BLOCK_N]
    row_lse = tl.load(row_lse_ptr + row_head * window + row_query, mask=row_valid, other=0.0)
    visible = _visible(row_valid, row_query, keys, key_valid, context_len, window)
    probs = tl.exp2(tl.where(visible, qk * qk_scale_log2 - row_lse[:, None], float("-inf")))  # A

    if ATTN_SUM:
        attn_sum = _sum_over_window(probs, BLOCK_H, BLOCK_W, BLOCK_N)
        _store_per_head(attn_sum_ptr, attn_sum, tile_heads, tile_head_valid, keys, key_valid, context_len)
    if TAIL_ATTN:
        tail_row = row_query - (window - tail_rows)
        tail_offsets = (row_head * tail_rows + tail_row).to(tl.int64) * context_len
        tail_ptrs = tail_attn_ptr + tail_offsets[:, None] + keys[None, :]
        tl.store(tail_ptrs, probs, mask=(row_valid & (tail_row >= 0))[:, None] & key_valid[None, :])
    if VALUE_L1 or OBC_VALUE or OBC_KEY or OBC_JOINT:
        v = _load_rows(v_buffer_ptr + kv_head * stride_v_head, slots * stride_v_slot, key_valid, HEAD_DIM_V, BLOCK_DV)
        v = v.to(tl.float32)
        if VALUE_L1:
            # Every head block of a GQA group sees the same values: the first one writes them.
            if tile_id % tl.cdiv(group, BLOCK_H) == 0:
                tl.store(value_l1_ptr + kv_head * context_len + keys, tl.sum(tl.abs(v), 1), mask=key_valid)
        value_sq = tl.sum(v * v, 1)[None, :]  # ||v_p||^2, [1, BLOCK_N]
        probs_sq = probs * probs
        if OBC_VALUE:
            obc_value = _sum_over_window(probs_sq * value_sq, BLOCK_H, BLOCK_W, BLOCK_N)
            _store_per_head(obc_value_ptr, obc_value, tile_heads, tile_head_valid, keys, key_valid, context_len)
        if OBC_KEY or OBC_JOINT:
            row_out_offsets = (row_head * window + row_query) * HEAD_DIM_V
            out = _load_rows(row_out_ptr, row_out_offsets, row_valid, HEAD_DIM_V, BLOCK_DV)  # o_i, fp32
            out_sq = tl.sum(out * out, 1)[:, None]
            value_dot_out = dot(out, tl.trans(v), False)  # fp32 operands: IEEE products
            z = qk * scaling
            if OBC_KEY:
                distance_sq = value_sq + out_sq - 2.0 * value_dot_out  # ||v_p - o_i||^2
                obc_key = _sum_over_window(probs_sq * z * z * distance_sq, BLOCK_H, BLOCK_W, BLOCK_N)
                _store_per_head(obc_key_ptr, obc_key, tile_heads, tile_head_valid, keys, key_valid, context_len)
            if OBC_JOINT:
                joint = (1.0 + z) * (1.0 + z) * value_sq - 2.0 * z * (1.0 + z) * value_dot_out + z * z * out_sq
                obc_joint = _sum_over_window(probs_sq * joint, BLOCK_H, BLOCK_W, BLOCK_N)
                _store_per_head(obc_joint_ptr, obc_joint, tile_heads, tile_head_valid, keys, key_valid, context_len)


def _combine_splits(
    partial_max: torch.Tensor, partial_sum: torch.Tensor, partial_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge per-split softmax partials ``[S, H_q, w(, D_v)]`` into row log2-sum-exp2 ``[H_q, w]`` and ``o_i``.

    Every window row sees key 0, so the overall max is finite; splits a row cannot see have max -inf
    and weight exp2(-inf) = 0.
    """
    row_max = partial_max.amax(0)
    weights = torch.exp2(partial_max - row_max)  # [S, H_q, w]
    row_sum = (partial_sum * weights).sum(0)
    row_lse = row_max + torch.log2(row_sum)
    if partial_out is None:
        return row_lse, None
    row_out = (partial_out * weights.unsqueeze(-1)).sum(0) / row_sum.unsqueeze(-1)
    return row_lse, row_out


def _check_inputs(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    request: StatsRequest,
) -> None:
    num_q_heads, window, head_dim = q_window.shape
    num_kv_heads = k_buffer.shape[1]
    if num_q_heads % num_kv_heads or k_buffer.shape[2] != head_dim or v_buffer.shape[1] != num_kv_heads:
        raise ValueError(f"q_window {tuple(q_window.shape)} does not match k_buffer {tuple(k_buffer.shape)}")
    if q_window.dtype != k_buffer.dtype or v_buffer.dtype != k_buffer.dtype:
        raise ValueError("q_window, k_buffer and v_buffer must share a dtype (the model's KV dtype)")
    if not 0 < window <= kv_indices.numel():
        raise ValueError(f"window {window} must be in [1, context length {kv_indices.numel()}]")
    if request.tail_rows > window:
        raise ValueError(f"tail_rows {request.tail_rows} exceeds the window {window}")


def window_stats_triton(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    request: StatsRequest,
) -> WindowStats:
    """``WindowStats`` of one request and layer from the paged KV buffer (shapes: module docstring)."""
    _check_inputs(q_window, k_buffer, v_buffer, kv_indices, request)
    num_q_heads, window, head_dim = q_window.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    group = num_q_heads // num_kv_heads
    context_len = kv_indices.numel()
    if not (q_window.stride(2) == k_buffer.stride(2) == v_buffer.stride(2) == 1):
        raise ValueError("the head dimension of q_window, k_buffer and v_buffer must be contiguous")
    kv_indices = kv_indices.contiguous()
    device = q_window.device

    block_w = dot_block(window)
    block_h = min(triton.next_power_of_2(group), max(1, _ROWS_PER_TILE // block_w))
    tiles = num_kv_heads * triton.cdiv(group, block_h)
    key_blocks = triton.cdiv(context_len, _BLOCK_N)
    key_splits = min(key_blocks, max(1, triton.cdiv(_TARGET_PROGRAMS, tiles)))
    keys_per_split = triton.cdiv(key_blocks, key_splits) * _BLOCK_N
    key_splits = triton.cdiv(context_len, keys_per_split)
    qk_scale_log2 = scaling * _LOG2E
    strides = (
        q_window.stride(0), q_window.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
    )  # fmt: skip
    blocks = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_N=_BLOCK_N,
        BLOCK_D=dot_block(head_dim), BLOCK_DV=dot_block(head_dim_v), UPCAST=upcast_dot_operands(k_buffer.dtype),
    )  # fmt: skip

    f32 = dict(dtype=torch.float32, device=device)
    partial_max = torch.empty(key_splits, num_q_heads, window, **f32)
    partial_sum = torch.empty(key_splits, num_q_heads, window, **f32)
    partial_out = torch.empty(key_splits, num_q_heads, window, head_dim_v, **f32) if request.needs_outputs else None
    _window_softmax_partials_kernel[(tiles, key_splits)](
        q_window, k_buffer, v_buffer, kv_indices, partial_max, partial_sum, partial_out,
        context_len, window, group, num_q_heads, keys_per_split, qk_scale_log2, *strides,
        NEED_OUTPUTS=request.needs_outputs, **blocks,
    )  # fmt: skip
    row_lse, row_out = _combine_splits(partial_max, partial_sum, partial_out)

    def stat(wanted: bool, *shape: int) -> torch.Tensor | None:
        return torch.empty(*shape, **f32) if wanted else None

    outputs = dict(
        attn_sum=stat(request.attn_sum, num_q_heads, context_len),
        tail_attn=stat(request.tail_rows > 0, num_q_heads, request.tail_rows, context_len),
        obc_value=stat(request.obc_value, num_q_heads, context_len),
        obc_key=stat(request.obc_key, num_q_heads, context_len),
        obc_joint=stat(request.obc_joint, num_q_heads, context_len),
        value_l1=stat(request.value_l1, num_kv_heads, context_len),
    )
    _window_stats_kernel[(tiles, key_blocks)](
        q_window, k_buffer, v_buffer, kv_indices, row_lse, row_out, *outputs.values(),
        context_len, window, group, request.tail_rows, scaling, qk_scale_log2, *strides,
        ATTN_SUM=request.attn_sum, TAIL_ATTN=request.tail_rows > 0, OBC_VALUE=request.obc_value,
        OBC_KEY=request.obc_key, OBC_JOINT=request.obc_joint, VALUE_L1=request.value_l1, **blocks,
    )  # fmt: skip
    return WindowStats(window=window, **outputs)


def window_stats_torch(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    request: StatsRequest,
) -> WindowStats:
    """Torch twin: gather the request's keys and values, then the reference ``window_stats``.

    Materialises ``[H_q, w, L]`` (fine for the CPU path and tests, not for long contexts on GPU).
    """
    _check_inputs(q_window, k_buffer, v_buffer, kv_indices, request)
    slots = kv_indices.long()
    keys = k_buffer[slots].transpose(0, 1)  # [H_kv, L, D]
    values = v_buffer[slots].transpose(0, 1)  # [H_kv, L, D_v]
    return window_stats(q_window, keys, values, scaling, request)
