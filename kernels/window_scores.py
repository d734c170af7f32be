"""Observation-window statistics read from SGLang's KV buffer and compressed cells: Triton kernels, torch twin.

Computes the ``WindowStats`` of ``sgl_kvevict.scoring.window`` (the formulas and their meaning are
defined there) for one request of one layer, reading its keys and values where they live instead of
a gathered copy, and never writing the ``[H_q, w, L]`` attention matrix to memory. The same call
serves KVzip's reconstruction pass, whose "window" is a chunk of up to a few thousand queries.

Inputs (SGLang NHD layout, see docs/sglang.md#the-kv-pool), ``L`` = ``context_length``:

* ``q_window``  ``[H_q, w, D]``: post-RoPE queries at logical positions ``L - w .. L - 1``; query head
  ``h`` belongs to KV head ``h // G`` with ``G = H_q // H_kv``.
* dense keys, shared by every KV head: ``k_buffer`` ``[slots, H_kv, D]`` and ``v_buffer``
  ``[slots, H_kv, D_v]`` (one layer of the pool); ``kv_indices`` int ``[n]``, the slot of each dense
  key; ``key_positions`` int ``[n]``, their logical positions, ascending, the window's own positions
  ``L - w .. L - 1`` among them. ``key_positions=None`` is the plain case: positions ``0 .. n - 1``
  and ``L = n`` (``req_to_token[row, :L]``, no compressed prefix).
* compressed cells (optional, ``CompressedCells``): KV head ``g`` holds the cells
  ``cell_ids[head_indptr[g]:head_indptr[g + 1]]`` (rows of ``cell_k [num_cells, D]`` /
  ``cell_v [num_cells, D_v]``) at logical positions ``cell_positions`` (any order within a head,
  disjoint from the dense positions). Only head ``g``'s query heads see them.

Query ``i``, at position ``P = L - w + i``, sees every key (dense or one of its head's cells) at a
position ``<= P``; a cell at a position ``>= L`` is no key of this call and is ignored, so a caller may
pass every cell of a layer's path, also those after ``L``. The statistics' columns are the positions
``[0, L)``: a column that KV head ``g`` does not hold is 0 for ``g``'s query heads (``value_l1`` too).
This equals ``window_stats(q, keys, values, scaling, request, kept=kept)`` on the position-indexed
``[H_kv, L, D]`` cache and its ``kept`` mask, which is what the torch twin computes.

Triton path, per layer and request:

1. ``_window_softmax_partials_kernel``, grid ``(head tiles, key splits, query blocks)``: flash-attention
   of a tile of ``BLOCK_H`` query heads x ``BLOCK_W`` window queries (one GQA group shares every key
   load) over one split of the dense keys and one split of its KV head's cells: per window row the
   running max, denominator and, when the OBCache key/joint scores need them, the unnormalised outputs.
   Splitting the keys keeps the GPU busy when ``H_kv`` and ``w`` are small and ``L`` long
   (flash-decoding); each KV head's cells are split by its own count, read on the device.
   ``_combine_splits`` merges the splits in torch (tensors of size ``splits x H_q x w``), giving each
   row's log-sum-exp and output ``o_i``.
2. ``_window_stats_kernel``, grid ``(head tiles, key splits)``: for each key block of its split (dense
   keys, then its head's cells), recomputes the logits against the window one query block at a time,
   normalises them with the row log-sum-exp and reduces over the window rows into the requested
   per-key statistics. Every output element is written by exactly one program; columns nobody holds
   keep the zeros they were allocated with.

Global memory holds ``O(H_q w D_v)`` (the window outputs, only for OBCache key/joint) besides the
statistics themselves, whatever ``w``. Accumulation is fp32 whatever the KV dtype; ``tl.dot`` operands
are in the KV dtype (products exact for fp16/bf16, IEEE for fp32). No function here reads device data
on the host. Tests: ``tests/test_kernels_window.py`` (interpreter and CUDA variants) and
``tests/test_kernels_compile.py``; where the Triton path has run and its timings:
docs/gpu.md#what-ran-on-a-gpu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kvevict.kernels.runtime import dot, dot_block, split_range, upcast_dot_operands
from sgl_kvevict.scoring.window import StatsRequest, WindowStats, window_stats

_LOG2E = math.log2(math.e)
_BLOCK_N = 32  # keys per block
_ROWS_PER_TILE = 64  # query rows (heads x window queries) per tile; bounds registers for w = 32, G = 8
# The statistics pass of OBCache key/joint keeps fp32 [rows, D_v] tiles of o_i live: at D = 128, ptxas
# reports no register spills (sm_80, sm_90) only from 16 rows and 8 warps (tests/test_kernels_compile.py).
_OUTPUT_ROWS_PER_TILE = 16
_OUTPUT_NUM_WARPS = 8
_TARGET_PROGRAMS = 256  # ~2 waves on a 132-SM GPU; a heuristic, not tuned on hardware


@dataclass(frozen=True)
class CompressedCells:
    """One request's compressed cells of one layer, CSR over KV heads (shapes: module docstring).

    cell_k ``[num_cells, D]``, cell_v ``[num_cells, D_v]``: any row-addressable store (unit stride in
    the head dim), e.g. the flat ``[layers * slots * H_kv, D]`` view of every layer's KV buffer.
    cell_ids int ``[nnz]``, cell_positions int ``[nnz]``, head_indptr int ``[H_kv + 1]``, all on the KV
    device; nothing here is read on the host.
    """

    cell_k: torch.Tensor
    cell_v: torch.Tensor
    cell_ids: torch.Tensor
    cell_positions: torch.Tensor
    head_indptr: torch.Tensor

    def head_of_each_cell(self) -> torch.Tensor:
        """int64 ``[nnz]``: the KV head of every cell (no host sync: the output size is ``nnz``)."""
        num_kv_heads = self.head_indptr.numel() - 1
        heads = torch.arange(num_kv_heads, device=self.head_indptr.device)
        counts = self.head_indptr[1:] - self.head_indptr[:-1]
        return torch.repeat_interleave(heads, counts, output_size=self.cell_ids.numel())


@triton.jit
def _tile_heads(tile_id, group, BLOCK_H: tl.constexpr):
    """Tile ``tile_id`` holds ``BLOCK_H`` query heads of one GQA group.

    Returns its KV head, the index in the group of its first query head, and its query heads
    ``[BLOCK_H]`` with their validity (a group of 3 pads a tile of 4).
    """
    head_blocks = tl.cdiv(group, BLOCK_H)
    kv_head = tile_id // head_blocks
    first_head_in_group = (tile_id % head_blocks) * BLOCK_H
    heads_in_group = first_head_in_group + tl.arange(0, BLOCK_H)
    return kv_head, first_head_in_group, kv_head * group + heads_in_group, heads_in_group < group


@triton.jit
def _tile_rows(kv_head, first_head_in_group, query_start, group, window, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows ``[BLOCK_H * BLOCK_W]`` of a tile's query block: row ``r`` is the tile's head ``r // BLOCK_W``
    and window query ``query_start + r % BLOCK_W``. Returns per row the query head, query index and validity."""
    rows = tl.arange(0, BLOCK_H * BLOCK_W)
    head_in_group = first_head_in_group + rows // BLOCK_W
    query = query_start + rows % BLOCK_W
    return kv_head * group + head_in_group, query, (head_in_group < group) & (query < window)


@triton.jit
def _load_rows(base_ptr, row_offsets, row_valid, width, BLOCK_D: tl.constexpr):
    """``[rows, BLOCK_D]`` tile of rows at ``base_ptr + row_offsets``, zero outside ``row_valid`` and ``width``."""
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims[None, :] < width)
    return tl.load(base_ptr + row_offsets[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _indexed_block(index_ptr, block_start, block_end, BLOCK_N: tl.constexpr):
    """Entries ``[BLOCK_N]`` from ``block_start``, their validity (``< block_end``) and ``index[entry]`` as int64."""
    entries = block_start + tl.arange(0, BLOCK_N)
    valid = entries < block_end
    return entries, valid, tl.load(index_ptr + entries, mask=valid, other=0).to(tl.int64)


@triton.jit
def _dense_positions(key_positions_ptr, entries, valid, HAS_POSITIONS: tl.constexpr):
    """Logical positions of dense key entries: ``key_positions[entry]``, or the entry itself (plain case)."""
    if HAS_POSITIONS:
        positions = tl.load(key_positions_ptr + entries, mask=valid, other=0).to(tl.int64)
    else:
        positions = entries.to(tl.int64)
    return positions


@triton.jit
def _softmax_step(
    q, k_base, k_offsets, v_base, v_offsets, key_valid, visible, row_max, row_sum, row_out, qk_scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NEED_OUTPUTS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One key block of the online softmax; logits in log2 units (``exp2`` is the native instruction).

    k_offsets, v_offsets: int64 ``[BLOCK_N]`` element offsets of the block's rows from ``k_base`` / ``v_base``;
    visible ``[rows, BLOCK_N]``. Returns the updated running max, denominator and unnormalised outputs.
    """
    k = _load_rows(k_base, k_offsets, key_valid, HEAD_DIM, BLOCK_D)
    logits = tl.where(visible, dot(q, tl.trans(k), UPCAST) * qk_scale_log2, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(logits, 1))
    # A row that has seen no visible key yet keeps max -inf; subtracting 0 keeps exp2 at 0, not NaN.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(logits - shift[:, None])
    rescale = tl.exp2(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    if NEED_OUTPUTS:
        v = _load_rows(v_base, v_offsets, key_valid, HEAD_DIM_V, BLOCK_DV)
        row_out = row_out * rescale[:, None] + dot(probs.to(v.dtype), v, UPCAST)
    return new_max, row_sum, row_out


@triton.jit
def _window_softmax_partials_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indices_ptr, key_positions_ptr,
    cell_k_ptr, cell_v_ptr, cell_ids_ptr, cell_positions_ptr, head_indptr_ptr,
    partial_max_ptr, partial_sum_ptr, partial_out_ptr,
    num_keys, context_len, window, group, num_q_heads, num_splits, qk_scale_log2,
    stride_q_head, stride_q_query, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_cell_k, stride_cell_v,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
    NEED_OUTPUTS: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_CELLS: tl.constexpr,
):  # fmt: skip
    """Softmax partials of one key split for one query tile.

    partial_max, partial_sum: fp32 ``[splits, H_q, w]``; partial_out: fp32 ``[splits, H_q, w, D_v]``.
    """
    split = tl.program_id(1)
    query_start = tl.program_id(2) * BLOCK_W
    kv_head, first_head_in_group, _, _ = _tile_heads(tl.program_id(0), group, BLOCK_H)
    row_head, row_query, row_valid = _tile_rows(
        kv_head, first_head_in_group, query_start, group, window, BLOCK_H, BLOCK_W
    )
    row_position = context_len - window + row_query
    q = _load_rows(q_ptr, row_head * stride_q_head + row_query * stride_q_query, row_valid, HEAD_DIM, BLOCK_D)
    row_max = tl.full([BLOCK_H * BLOCK_W], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H * BLOCK_W], tl.float32)
    row_out = tl.zeros([BLOCK_H * BLOCK_W, BLOCK_DV], tl.float32)

    lo, hi = split_range(split, num_splits, 0, num_keys, BLOCK_N)
    # The dense positions ascend and end with the window's, so the block's last query sees the dense
    # keys up to entry num_keys - window + its index: skip the rest (the causal triangle of long windows).
    hi = tl.minimum(hi, num_keys - window + tl.minimum(query_start + BLOCK_W, window))
    k_head_ptr = k_buffer_ptr + kv_head * stride_k_head
    v_head_ptr = v_buffer_ptr + kv_head * stride_v_head
    for block_start in range(lo, hi, BLOCK_N):
        entries, key_valid, slots = _indexed_block(kv_indices_ptr, block_start, hi, BLOCK_N)
        positions = _dense_positions(key_positions_ptr, entries, key_valid, HAS_POSITIONS)
        visible = row_valid[:, None] & key_valid[None, :] & (positions[None, :] <= row_position[:, None])
        row_max, row_sum, row_out = _softmax_step(
            q, k_head_ptr, slots * stride_k_slot, v_head_ptr, slots * stride_v_slot, key_valid, visible,
            row_max, row_sum, row_out, qk_scale_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, NEED_OUTPUTS, UPCAST,
        )  # fmt: skip
    if HAS_CELLS:
        head_start = tl.load(head_indptr_ptr + kv_head)
        head_end = tl.load(head_indptr_ptr + kv_head + 1)
        lo, hi = split_range(split, num_splits, head_start, head_end, BLOCK_N)
        for block_start in range(lo, hi, BLOCK_N):
            entries, cell_valid, cells = _indexed_block(cell_ids_ptr, block_start, hi, BLOCK_N)
            positions = tl.load(cell_positions_ptr + entries, mask=cell_valid, other=0)
            visible = row_valid[:, None] & cell_valid[None, :] & (positions[None, :] <= row_position[:, None])
            row_max, row_sum, row_out = _softmax_step(
                q, cell_k_ptr, cells * stride_cell_k, cell_v_ptr, cells * stride_cell_v, cell_valid, visible,
                row_max, row_sum, row_out, qk_scale_log2, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, NEED_OUTPUTS,
                UPCAST,
            )  # fmt: skip

    partial_row = (split * num_q_heads + row_head) * window + row_query
    tl.store(partial_max_ptr + partial_row, row_max, mask=row_valid)
    tl.store(partial_sum_ptr + partial_row, row_sum, mask=row_valid)
    if NEED_OUTPUTS:
        dims = tl.arange(0, BLOCK_DV)
        out_ptrs = partial_out_ptr + partial_row.to(tl.int64)[:, None] * HEAD_DIM_V + dims[None, :]
        tl.store(out_ptrs, row_out, mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM_V))


@triton.jit
def _reduce_over_window(
    per_row, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, MAX: tl.constexpr
):
    """``[BLOCK_H * BLOCK_W, BLOCK_N]`` per window row -> ``[BLOCK_H, BLOCK_N]`` per query head (sum or max)."""
    per_head = tl.reshape(per_row, (BLOCK_H, BLOCK_W, BLOCK_N))
    if MAX:
        reduced = tl.max(per_head, axis=1)
    else:
        reduced = tl.sum(per_head, axis=1)
    return reduced


@triton.jit
def _store_per_head(out_ptr, stat, heads, head_valid, columns, column_valid, context_len):
    """Store ``[BLOCK_H, BLOCK_N]`` into columns ``[BLOCK_N]`` of an fp32 ``[H, L]`` statistic."""
    ptrs = out_ptr + heads[:, None].to(tl.int64) * context_len + columns[None, :]
    tl.store(ptrs, stat, mask=head_valid[:, None] & column_valid[None, :])


@triton.jit
def _key_block_stats(
    q_ptr, row_lse_ptr, row_out_ptr,
    attn_sum_ptr, attn_max_ptr, tail_attn_ptr, obc_value_ptr, obc_key_ptr, obc_joint_ptr, value_l1_ptr,
    k_base, k_offsets, v_base, v_offsets, key_valid, positions,
    kv_head, first_head_in_group, tile_heads, tile_head_valid,
    context_len, window, group, tail_rows, scaling, qk_scale_log2, stride_q_head, stride_q_query,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
    ATTN_SUM: tl.constexpr, ATTN_MAX: tl.constexpr, TAIL_ATTN: tl.constexpr, OBC_VALUE: tl.constexpr,
    OBC_KEY: tl.constexpr, OBC_JOINT: tl.constexpr, VALUE_L1: tl.constexpr, NEED_VALUES: tl.constexpr,
):  # fmt: skip
    """Every requested statistic of one key block (``[BLOCK_N]`` keys at ``positions``) for one head tile.

    row_lse: fp32 ``[H_q, w]`` log2-sum-exp2 of the scaled logits; row_out: fp32 ``[H_q, w, D_v]`` window
    outputs ``o_i`` (read only for OBC key/joint). Outputs as in ``WindowStats``.
    """
    column_valid = key_valid & (positions < context_len)  # a cell after the context is no key here
    k = _load_rows(k_base, k_offsets, column_valid, HEAD_DIM, BLOCK_D)
    if NEED_VALUES:
        v = _load_rows(v_base, v_offsets, column_valid, HEAD_DIM_V, BLOCK_DV).to(tl.float32)
        value_sq = tl.sum(v * v, 1)[None, :]  # ||v_p||^2, [1, BLOCK_N]
        if VALUE_L1:
            # Every head tile of a GQA group sees the same values: the first one writes them.
            if first_head_in_group == 0:
                l1_ptrs = value_l1_ptr + kv_head.to(tl.int64) * context_len + positions
                tl.store(l1_ptrs, tl.sum(tl.abs(v), 1), mask=column_valid)
    sum_acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    max_acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    value_acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    key_acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    joint_acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)

    # Window query i (position L - w + i) sees position p from i = p - (L - w) on: earlier blocks see none.
    first_query = tl.maximum(tl.min(tl.where(column_valid, positions, context_len)) - (context_len - window), 0)
    for query_start in range((first_query // BLOCK_W) * BLOCK_W, window, BLOCK_W):
        row_head, row_query, row_valid = _tile_rows(
            kv_head, first_head_in_group, query_start, group, window, BLOCK_H, BLOCK_W
        )
        q_offsets = row_head * stride_q_head + row_query * stride_q_query
        q = _load_rows(q_ptr, q_offsets, row_valid, HEAD_DIM, BLOCK_D)
        qk = dot(q, tl.trans(k), UPCAST)  # [rows, BLOCK_N]
        row_lse = tl.load(row_lse_ptr + row_head * window + row_query, mask=row_valid, other=0.0)
        row_position = context_len - window + row_query
        visible = row_valid[:, None] & column_valid[None, :] & (positions[None, :] <= row_position[:, None])
        probs = tl.exp2(tl.where(visible, qk * qk_scale_log2 - row_lse[:, None], float("-inf")))  # A
        if ATTN_SUM:
            sum_acc += _reduce_over_window(probs, BLOCK_H, BLOCK_W, BLOCK_N, MAX=False)
        if ATTN_MAX:
            max_acc = tl.maximum(max_acc, _reduce_over_window(probs, BLOCK_H, BLOCK_W, BLOCK_N, MAX=True))
        if TAIL_ATTN:
            tail_row = row_query - (window - tail_rows)
            tail_offsets = (row_head * tail_rows + tail_row).to(tl.int64) * context_len
            tail_mask = (row_valid & (tail_row >= 0))[:, None] & column_valid[None, :]
            tl.store(tail_attn_ptr + tail_offsets[:, None] + positions[None, :], probs, mask=tail_mask)
        if NEED_VALUES:
            probs_sq = probs * probs
            if OBC_VALUE:
                value_acc += _reduce_over_window(probs_sq * value_sq, BLOCK_H, BLOCK_W, BLOCK_N, MAX=False)
            if OBC_KEY or OBC_JOINT:
                out_offsets = (row_head * window + row_query).to(tl.int64) * HEAD_DIM_V
                out = _load_rows(row_out_ptr, out_offsets, row_valid, HEAD_DIM_V, BLOCK_DV)  # o_i, fp32
                out_sq = tl.sum(out * out, 1)[:, None]
                value_dot_out = dot(out, tl.trans(v), False)  # fp32 operands: IEEE products
                z = qk * scaling
                if OBC_KEY:
                    distance_sq = value_sq + out_sq - 2.0 * value_dot_out  # ||v_p - o_i||^2
                    key_acc += _reduce_over_window(probs_sq * z * z * distance_sq, BLOCK_H, BLOCK_W, BLOCK_N, MAX=False)
                if OBC_JOINT:
                    joint = (1.0 + z) * (1.0 + z) * value_sq - 2.0 * z * (1.0 + z) * value_dot_out + z * z * out_sq
                    joint_acc += _reduce_over_window(probs_sq * joint, BLOCK_H, BLOCK_W, BLOCK_N, MAX=False)

    if ATTN_SUM:
        _store_per_head(attn_sum_ptr, sum_acc, tile_heads, tile_head_valid, positions, column_valid, context_len)
    if ATTN_MAX:
        _store_per_head(attn_max_ptr, max_acc, tile_heads, tile_head_valid, positions, column_valid, context_len)
    if OBC_VALUE:
        _store_per_head(obc_value_ptr, value_acc, tile_heads, tile_head_valid, positions, column_valid, context_len)
    if OBC_KEY:
        _store_per_head(obc_key_ptr, key_acc, tile_heads, tile_head_valid, positions, column_valid, context_len)
    if OBC_JOINT:
        _store_per_head(obc_joint_ptr, joint_acc, tile_heads, tile_head_valid, positions, column_valid, context_len)


@triton.jit
def _window_stats_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indices_ptr, key_positions_ptr,
    cell_k_ptr, cell_v_ptr, cell_ids_ptr, cell_positions_ptr, head_indptr_ptr, row_lse_ptr, row_out_ptr,
    attn_sum_ptr, attn_max_ptr, tail_attn_ptr, obc_value_ptr, obc_key_ptr, obc_joint_ptr, value_l1_ptr,
    num_keys, context_len, window, group, num_splits, tail_rows, scaling, qk_scale_log2,
    stride_q_head, stride_q_query, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_cell_k, stride_cell_v,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_CELLS: tl.constexpr,
    ATTN_SUM: tl.constexpr, ATTN_MAX: tl.constexpr, TAIL_ATTN: tl.constexpr, OBC_VALUE: tl.constexpr,
    OBC_KEY: tl.constexpr, OBC_JOINT: tl.constexpr, VALUE_L1: tl.constexpr, NEED_VALUES: tl.constexpr,
):  # fmt: skip
    """Statistics of the key blocks of one split (dense keys, then the tile's head's cells) for one head tile."""
    split = tl.program_id(1)
    kv_head, first_head_in_group, tile_heads, tile_head_valid = _tile_heads(tl.program_id(0), group, BLOCK_H)
    lo, hi = split_range(split, num_splits, 0, num_keys, BLOCK_N)
    k_head_ptr = k_buffer_ptr + kv_head * stride_k_head
    v_head_ptr = v_buffer_ptr + kv_head * stride_v_head
    for block_start in range(lo, hi, BLOCK_N):
        entries, key_valid, slots = _indexed_block(kv_indices_ptr, block_start, hi, BLOCK_N)
        positions = _dense_positions(key_positions_ptr, entries, key_valid, HAS_POSITIONS)
        _key_block_stats(
            q_ptr, row_lse_ptr, row_out_ptr,
            attn_sum_ptr, attn_max_ptr, tail_attn_ptr, obc_value_ptr, obc_key_ptr, obc_joint_ptr, value_l1_ptr,
            k_head_ptr, slots * stride_k_slot, v_head_ptr, slots * stride_v_slot, key_valid, positions,
            kv_head, first_head_in_group, tile_heads, tile_head_valid,
            context_len, window, group, tail_rows, scaling, qk_scale_log2, stride_q_head, stride_q_query,
            HEAD_DIM, HEAD_DIM_V, BLOCK_H, BLOCK_W, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST,
            ATTN_SUM, ATTN_MAX, TAIL_ATTN, OBC_VALUE, OBC_KEY, OBC_JOINT, VALUE_L1, NEED_VALUES,
        )  # fmt: skip
    if HAS_CELLS:
        head_start = tl.load(head_indptr_ptr + kv_head)
        head_end = tl.load(head_indptr_ptr + kv_head + 1)
        lo, hi = split_range(split, num_splits, head_start, head_end, BLOCK_N)
        for block_start in range(lo, hi, BLOCK_N):
            entries, cell_valid, cells = _indexed_block(cell_ids_ptr, block_start, hi, BLOCK_N)
            positions = tl.load(cell_positions_ptr + entries, mask=cell_valid, other=0).to(tl.int64)
            _key_block_stats(
                q_ptr, row_lse_ptr, row_out_ptr,
                attn_sum_ptr, attn_max_ptr, tail_attn_ptr, obc_value_ptr, obc_key_ptr, obc_joint_ptr, value_l1_ptr,
                cell_k_ptr, cells * stride_cell_k, cell_v_ptr, cells * stride_cell_v, cell_valid, positions,
                kv_head, first_head_in_group, tile_heads, tile_head_valid,
                context_len, window, group, tail_rows, scaling, qk_scale_log2, stride_q_head, stride_q_query,
                HEAD_DIM, HEAD_DIM_V, BLOCK_H, BLOCK_W, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST,
                ATTN_SUM, ATTN_MAX, TAIL_ATTN, OBC_VALUE, OBC_KEY, OBC_JOINT, VALUE_L1, NEED_VALUES,
            )  # fmt: skip


def _combine_splits(
    partial_max: torch.Tensor, partial_sum: torch.Tensor, partial_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge per-split softmax partials ``[S, H_q, w(, D_v)]`` into row log2-sum-exp2 ``[H_q, w]`` and ``o_i``.

    Every window row sees its own key, so the overall max is finite; splits a row cannot see have max
    -inf and weight exp2(-inf) = 0.
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
    key_positions: Optional[torch.Tensor],
    context_length: Optional[int],
    cells: Optional[CompressedCells],
) -> int:
    """Shape and dtype checks (host metadata only, no device reads); returns the context length ``L``."""
    num_q_heads, window, head_dim = q_window.shape
    num_kv_heads = k_buffer.shape[1]
    num_keys = kv_indices.numel()
    if num_q_heads % num_kv_heads or k_buffer.shape[2] != head_dim or v_buffer.shape[1] != num_kv_heads:
        raise ValueError(f"q_window {tuple(q_window.shape)} does not match k_buffer {tuple(k_buffer.shape)}")
    if q_window.dtype != k_buffer.dtype or v_buffer.dtype != k_buffer.dtype:
        raise ValueError("q_window, k_buffer and v_buffer must share a dtype (the model's KV dtype)")
    if not 0 < window <= num_keys:
        raise ValueError(f"window {window} must be in [1, dense keys {num_keys}] (the window's own keys are dense)")
    if request.tail_rows > window:
        raise ValueError(f"tail_rows {request.tail_rows} exceeds the window {window}")
    if key_positions is None:
        if cells is not None or context_length not in (None, num_keys):
            raise ValueError("cells or a context_length other than len(kv_indices) need key_positions")
        return num_keys
    if context_length is None or key_positions.shape != kv_indices.shape or context_length < num_keys:
        raise ValueError(f"key_positions [{num_keys}] and a context_length >= {num_keys} go together")
    if cells is not None:
        if cells.head_indptr.numel() != num_kv_heads + 1 or cells.cell_ids.shape != cells.cell_positions.shape:
            raise ValueError(f"cells: head_indptr must have {num_kv_heads + 1} entries and one position per cell id")
        if cells.cell_k.dtype != k_buffer.dtype or cells.cell_v.dtype != k_buffer.dtype:
            raise ValueError("cells must have the KV buffer's dtype")
        if cells.cell_k.shape[1] != head_dim or cells.cell_v.shape[1] != v_buffer.shape[2]:
            raise ValueError("cells must have the KV buffer's head dims")
    return context_length


@dataclass(frozen=True)
class _KernelArguments:
    """What both kernels take about the queries and the key sources, in their parameter order."""

    tensors: tuple
    strides: tuple
    constexprs: dict


def _key_source_arguments(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    key_positions: Optional[torch.Tensor],
    cells: Optional[CompressedCells],
) -> _KernelArguments:
    """Absent sources are ``None`` pointers behind a false ``HAS_POSITIONS`` / ``HAS_CELLS``."""
    cell_stores = (cells.cell_k, cells.cell_v) if cells is not None else ()
    if any(t.stride(-1) != 1 for t in (q_window, k_buffer, v_buffer, *cell_stores)):
        raise ValueError("the head dimension of q_window, the KV buffers and the cell stores must be contiguous")
    cell_indices = (
        (cells.cell_ids.contiguous(), cells.cell_positions.contiguous(), cells.head_indptr.contiguous())
        if cells is not None
        else (None, None, None)
    )
    positions = None if key_positions is None else key_positions.contiguous()
    head_dim, head_dim_v = k_buffer.shape[2], v_buffer.shape[2]
    return _KernelArguments(
        tensors=(
            q_window, k_buffer, v_buffer, kv_indices.contiguous(), positions, *(cell_stores or (None, None)),
            *cell_indices,
        ),  # fmt: skip
        strides=(
            q_window.stride(0), q_window.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), *(t.stride(0) for t in cell_stores or (k_buffer, v_buffer)),
        ),  # fmt: skip
        constexprs=dict(
            HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_N=_BLOCK_N, BLOCK_D=dot_block(head_dim),
            BLOCK_DV=dot_block(head_dim_v), UPCAST=upcast_dot_operands(k_buffer.dtype),
            HAS_POSITIONS=key_positions is not None, HAS_CELLS=cells is not None,
        ),  # fmt: skip
    )


def _tile_shape(window: int, group: int, rows: int) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_W)``: query heads of one GQA group x window queries per tile, at most ``rows``
    rows unless the window alone needs 16 (``tl.dot``'s minimum)."""
    block_w = min(dot_block(window), rows)
    return min(triton.next_power_of_2(group), max(1, rows // block_w)), block_w


def window_stats_triton(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    request: StatsRequest,
    key_positions: Optional[torch.Tensor] = None,
    context_length: Optional[int] = None,
    cells: Optional[CompressedCells] = None,
) -> WindowStats:
    """``WindowStats`` of one request and layer from dense slots and compressed cells (module docstring)."""
    context_len = _check_inputs(q_window, k_buffer, v_buffer, kv_indices, request, key_positions, context_length, cells)
    launch = _key_source_arguments(q_window, k_buffer, v_buffer, kv_indices, key_positions, cells)
    f32 = dict(dtype=torch.float32, device=q_window.device)
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, group = k_buffer.shape[1], num_q_heads // k_buffer.shape[1]
    num_keys, head_dim_v = kv_indices.numel(), v_buffer.shape[2]
    qk_scale_log2 = scaling * _LOG2E
    # Keys per KV head: the dense keys plus the mean cell count (the host knows nnz, not each head's).
    mean_cells = triton.cdiv(cells.cell_ids.numel(), num_kv_heads) if cells is not None else 0
    key_blocks = triton.cdiv(num_keys + mean_cells, _BLOCK_N)

    block_h, block_w = _tile_shape(window, group, _ROWS_PER_TILE)
    head_tiles, query_blocks = num_kv_heads * triton.cdiv(group, block_h), triton.cdiv(window, block_w)
    softmax_splits = min(key_blocks, max(1, triton.cdiv(_TARGET_PROGRAMS, head_tiles * query_blocks)))
    partial_max = torch.empty(softmax_splits, num_q_heads, window, **f32)
    partial_sum = torch.empty(softmax_splits, num_q_heads, window, **f32)
    partial_out = torch.empty(softmax_splits, num_q_heads, window, head_dim_v, **f32) if request.needs_outputs else None
    _window_softmax_partials_kernel[(head_tiles, softmax_splits, query_blocks)](
        *launch.tensors, partial_max, partial_sum, partial_out,
        num_keys, context_len, window, group, num_q_heads, softmax_splits, qk_scale_log2, *launch.strides,
        BLOCK_H=block_h, BLOCK_W=block_w, NEED_OUTPUTS=request.needs_outputs, **launch.constexprs,
    )  # fmt: skip
    row_lse, row_out = _combine_splits(partial_max, partial_sum, partial_out)

    # In the plain case every column is a key of every head and gets written; otherwise gaps stay 0.
    allocate = torch.empty if key_positions is None else torch.zeros

    def stat(wanted: bool, *shape: int) -> torch.Tensor | None:
        return allocate(*shape, **f32) if wanted else None

    outputs = dict(
        attn_sum=stat(request.attn_sum, num_q_heads, context_len),
        attn_max=stat(request.attn_max, num_q_heads, context_len),
        tail_attn=stat(request.tail_rows > 0, num_q_heads, request.tail_rows, context_len),
        obc_value=stat(request.obc_value, num_q_heads, context_len),
        obc_key=stat(request.obc_key, num_q_heads, context_len),
        obc_joint=stat(request.obc_joint, num_q_heads, context_len),
        value_l1=stat(request.value_l1, num_kv_heads, context_len),
    )
    flags = dict(
        ATTN_SUM=request.attn_sum, ATTN_MAX=request.attn_max, TAIL_ATTN=request.tail_rows > 0,
        OBC_VALUE=request.obc_value, OBC_KEY=request.obc_key, OBC_JOINT=request.obc_joint,
        VALUE_L1=request.value_l1, NEED_VALUES=request.value_l1 or request.obc_value or request.needs_outputs,
    )  # fmt: skip
    rows, num_warps = (_OUTPUT_ROWS_PER_TILE, _OUTPUT_NUM_WARPS) if request.needs_outputs else (_ROWS_PER_TILE, 4)
    block_h, block_w = _tile_shape(window, group, rows)
    _window_stats_kernel[(num_kv_heads * triton.cdiv(group, block_h), key_blocks)](
        *launch.tensors, row_lse, row_out, *outputs.values(),
        num_keys, context_len, window, group, key_blocks, request.tail_rows, scaling, qk_scale_log2,
        *launch.strides, BLOCK_H=block_h, BLOCK_W=block_w, **launch.constexprs, **flags, num_warps=num_warps,
    )  # fmt: skip
    return WindowStats(window=window, **outputs)


def position_indexed_cache(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    key_positions: torch.Tensor,
    context_length: int,
    cells: Optional[CompressedCells],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each KV head holds of positions ``[0, L)``: keys ``[H_kv, L, D]``, values ``[H_kv, L, D_v]``
    (zero where not held) and the kept mask bool ``[H_kv, L]``.

    Scattered without host syncs: a cell at a position ``>= L`` lands in a spare column ``L``, cut off.
    """
    num_kv_heads = k_buffer.shape[1]
    device = k_buffer.device
    keys = k_buffer.new_zeros(num_kv_heads, context_length + 1, k_buffer.shape[2])
    values = v_buffer.new_zeros(num_kv_heads, context_length + 1, v_buffer.shape[2])
    kept = torch.zeros(num_kv_heads, context_length + 1, dtype=torch.bool, device=device)
    slots, positions = kv_indices.long(), key_positions.long()
    keys[:, positions] = k_buffer[slots].transpose(0, 1)
    values[:, positions] = v_buffer[slots].transpose(0, 1)
    kept[:, positions] = True
    if cells is not None:
        heads = cells.head_of_each_cell()
        columns = cells.cell_positions.long().clamp(max=context_length)
        ids = cells.cell_ids.long()
        keys[heads, columns] = cells.cell_k[ids]
        values[heads, columns] = cells.cell_v[ids]
        kept[heads, columns] = True
    return keys[:, :context_length], values[:, :context_length], kept[:, :context_length]


def window_stats_torch(
    q_window: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    request: StatsRequest,
    key_positions: Optional[torch.Tensor] = None,
    context_length: Optional[int] = None,
    cells: Optional[CompressedCells] = None,
) -> WindowStats:
    """Torch twin: the reference ``window_stats`` on the request's position-indexed cache.

    Temporaries: the ``[H_q, L, D]`` cache in fp32 and ``[H_q, QUERY_CHUNK, L]`` per query chunk
    (``scoring.window``), whatever ``w``; no Python loop over heads, no host sync.
    """
    context_len = _check_inputs(q_window, k_buffer, v_buffer, kv_indices, request, key_positions, context_length, cells)
    if key_positions is None:
        slots = kv_indices.long()
        keys = k_buffer[slots].transpose(0, 1)  # [H_kv, L, D]
        values = v_buffer[slots].transpose(0, 1)  # [H_kv, L, D_v]
        return window_stats(q_window, keys, values, scaling, request)
    keys, values, kept = position_indexed_cache(k_buffer, v_buffer, kv_indices, key_positions, context_len, cells)
    return window_stats(q_window, keys, values, scaling, request, kept=kept)
