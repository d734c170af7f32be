"""Compaction and cell moves: copy (layer, slot, KV head) vectors between rows of SGLang's KV pool.

SGLang keeps a layer's keys as ``k_buffer [slots, H_kv, D]`` (values ``[slots, H_kv, D_v]``),
contiguous, so ``k_buffer.view(slots * H_kv, D)`` addresses one (slot, head) vector per row: row
``slot * H_kv + head`` (docs/sglang.md#the-kv-pool). Copying kept entries into cells, or cells to
other cells, is therefore one operation, a row copy ``dst[dst_rows[i]] = src[src_rows[i]]`` applied to
K and V with the same row lists, which is what the kernel and its torch twin implement.

When every layer's buffer is a view of one allocation, the whole pool is one flat ``[rows, D]`` view
with row ``(layer * slots + slot) * H_kv + head``, and cells are rows of that same space
(``engine/cells.py``, ``CellSpace.k_rows``): compaction of all layers, or moving cells to defragment,
is one ``copy_kv_rows`` launch with global int64 row ids (element offsets beyond 2^31 are computed in
int64). The rows a call writes must not be rows it reads (programs run in any order), which a move
into free rows satisfies.

Tests: ``tests/test_kernels_compaction.py``; where the Triton path has run: docs/gpu.md#what-ran-on-a-gpu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 32


@triton.jit
def _copy_kv_rows_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_rows_ptr, dst_rows_ptr, num_rows,
    stride_src_k, stride_src_v, stride_dst_k, stride_dst_v,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    """``dst_k[dst_rows] = src_k[src_rows]`` and the same for V; each row a unit-stride vector."""
    entries = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    entry_valid = entries < num_rows
    src_rows = tl.load(src_rows_ptr + entries, mask=entry_valid, other=0).to(tl.int64)
    dst_rows = tl.load(dst_rows_ptr + entries, mask=entry_valid, other=0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = entry_valid[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(src_k_ptr + src_rows[:, None] * stride_src_k + dims[None, :], mask=mask)
    tl.store(dst_k_ptr + dst_rows[:, None] * stride_dst_k + dims[None, :], k, mask=mask)
    dims_v = tl.arange(0, BLOCK_DV)
    mask_v = entry_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V)
    v = tl.load(src_v_ptr + src_rows[:, None] * stride_src_v + dims_v[None, :], mask=mask_v)
    tl.store(dst_v_ptr + dst_rows[:, None] * stride_dst_v + dims_v[None, :], v, mask=mask_v)


def copy_kv_rows_triton(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """``dst_k[dst_rows] = src_k[src_rows]``, same for V (shapes: ``check_row_copy``)."""
    num_rows = src_rows.numel()
    if num_rows == 0:
        return
    head_dim, head_dim_v = src_k.shape[1], src_v.shape[1]
    _copy_kv_rows_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS),)](
        src_k, src_v, dst_k, dst_v, src_rows.contiguous(), dst_rows.contiguous(), num_rows,
        src_k.stride(0), src_v.stride(0), dst_k.stride(0), dst_v.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(head_dim_v), BLOCK_ROWS=_BLOCK_ROWS,
    )  # fmt: skip


def copy_kv_rows_torch(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Torch twin of ``copy_kv_rows_triton``."""
    dst_k[dst_rows] = src_k[src_rows]
    dst_v[dst_rows] = src_v[src_rows]


def check_row_copy(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """K ``[*, D]`` and V ``[*, D_v]`` row stores (2-D, unit stride in the head dim, any row stride);
    src_rows, dst_rows int ``[n]``. Host metadata only."""
    if any(t.dim() != 2 or t.stride(1) != 1 for t in (src_k, src_v, dst_k, dst_v)):
        raise ValueError("row copies take 2-D [rows, D] stores with a unit stride in the head dim")
    if src_k.dtype != dst_k.dtype or src_v.dtype != dst_v.dtype:
        raise ValueError("source and destination dtypes differ")
    if src_k.shape[1] != dst_k.shape[1] or src_v.shape[1] != dst_v.shape[1]:
        raise ValueError("source and destination head dims differ")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError("src_rows and dst_rows must be 1-D of one length")
