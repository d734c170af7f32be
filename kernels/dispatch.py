"""Public kernel API: each op runs its Triton kernel on CUDA and its torch twin on CPU.

With ``TRITON_INTERPRET=1`` set before triton is first imported, CPU tensors run the Triton kernels
in the interpreter instead (how the tests check the kernels without a GPU; see ``runtime``). Shapes
and semantics are documented in the kernel modules; where the CUDA path has run:
docs/gpu.md#what-ran-on-a-gpu.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from sgl_kvevict.kernels.compaction import check_row_copy, copy_kv_rows_torch, copy_kv_rows_triton
from sgl_kvevict.kernels.merge_states import merge_attention_states_torch, merge_attention_states_triton
from sgl_kvevict.kernels.runtime import use_triton
from sgl_kvevict.kernels.segment_attention import segment_attention_torch, segment_attention_triton
from sgl_kvevict.kernels.window_scores import CompressedCells, window_stats_torch, window_stats_triton
from sgl_kvevict.scoring.window import StatsRequest, WindowStats

_Impl = TypeVar("_Impl", bound=Callable)


def _implementation(device: torch.device, triton_impl: _Impl, torch_impl: _Impl) -> _Impl:
    return triton_impl if use_triton(device) else torch_impl


def window_stats_paged(
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
    """``WindowStats`` of one request and layer, keys read where they live: dense slots and compressed cells.

    q_window ``[H_q, w, D]`` at positions ``L - w .. L - 1``; k_buffer ``[slots, H_kv, D]``, v_buffer
    ``[slots, H_kv, D_v]``; kv_indices int ``[n]``: the slot of each dense key. Plain case (no
    compressed prefix): positions ``0 .. n - 1``, ``L = n``. Otherwise key_positions int ``[n]``
    (ascending, the window's own positions among them), ``context_length`` ``L`` (a host int) and the
    request's ``CompressedCells`` of this layer (cells at positions ``>= L`` are ignored). Columns are
    positions ``[0, L)``, 0 where a head holds nothing. No host sync. See ``window_scores``.
    """
    impl = _implementation(q_window.device, window_stats_triton, window_stats_torch)
    return impl(q_window, k_buffer, v_buffer, kv_indices, scaling, request, key_positions, context_length, cells)


def copy_kv_rows(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """``dst_k[dst_rows] = src_k[src_rows]`` and the same for V, in one launch.

    K ``[rows, D]``, V ``[rows, D_v]`` (unit stride in the head dim); src_rows, dst_rows int ``[n]`` on
    the KV device. With every layer's KV buffer a view of one allocation, the flat
    ``[layers * slots * H_kv, D]`` view makes compaction of all layers, or moving cells, one call with
    global row ids. The rows written must not be rows read by the same call. See ``compaction``.
    """
    check_row_copy(src_k, src_v, dst_k, dst_v, src_rows, dst_rows)
    copy = _implementation(src_k.device, copy_kv_rows_triton, copy_kv_rows_torch)
    copy(src_k, src_v, dst_k, dst_v, src_rows, dst_rows)


def segment_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_heads: int,
    sm_scale: float,
    max_q_len: int | None = None,
    max_cells_per_sequence: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over compressed cells, one sequence per (request, KV head); returns ``(out, lse)``.

    q ``[N, H_q, D]``; k_rows ``[cells, D]``, v_rows ``[cells, D_v]`` (row stores, e.g. the flat cell
    space); qo_indptr ``[B + 1]``; kv_indptr ``[B * H_kv + 1]``; kv_indices ``[nnz]`` cell ids; out
    ``[N, H_q, D_v]``, lse fp32 ``[N, H_q]`` natural log. ``max_q_len`` (None: one host sync) and
    ``max_cells_per_sequence`` (None: no split-KV) are host ints; with both given there is no host sync.
    ``out_dtype``: out's dtype (None: q's).
    See ``segment_attention``.
    """
    impl = _implementation(q.device, segment_attention_triton, segment_attention_torch)
    return impl(
        q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale, max_q_len, max_cells_per_sequence,
        out_dtype=out_dtype,
    )


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashinfer.cascade.merge_state`` with natural-log LSE: out ``[N, H, D]``, lse fp32 ``[N, H]``."""
    impl = _implementation(out_a.device, merge_attention_states_triton, merge_attention_states_torch)
    return impl(out_a, lse_a, out_b, lse_b)
