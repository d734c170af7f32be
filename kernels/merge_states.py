"""Merge partial attention results by log-sum-exp: Triton kernels and torch twin.

Semantics of ``flashinfer.cascade.merge_state``: given attention of the same queries over two
disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, return attention over their union:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Shapes: ``out_*`` ``[N, H, D]``, ``lse_*`` fp32 ``[N, H]``, natural log (FlashInfer's own kernels
use base 2: convert before mixing). A side with ``lse = -inf`` (no keys) contributes nothing, and its
output is ignored whatever it holds (NaN included); both empty gives ``out = 0`` and ``lse = -inf``.
The merged output has ``out_a``'s dtype. ``merge_split_states_triton`` merges ``S`` such states at
once (the second pass of split-KV attention); both kernels share ``merge_state_pair``.

Tests: ``tests/test_kernels_segment_attention.py`` (interpreter and CUDA variants) and
``tests/test_kernels_compile.py``; where the Triton path has run: docs/gpu.md#what-ran-on-a-gpu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 16  # (token, head) rows per program


@triton.jit
def merge_state_pair(out_a, lse_a, out_b, lse_b):
    """Union of two disjoint key sets: fp32 outputs ``[rows, D]`` and natural-log LSEs ``[rows]`` in, same out.

    A side with ``lse = -inf`` (no keys) contributes nothing whatever its output holds; both empty give
    ``out = 0``, ``lse = -inf`` (never ``-inf - -inf``).
    """
    larger = tl.maximum(lse_a, lse_b)
    shift = tl.where(larger == float("-inf"), 0.0, larger)  # both empty: exp(-inf - 0) = 0, not NaN
    weight_a = tl.exp(lse_a - shift)
    weight_b = tl.exp(lse_b - shift)
    total = weight_a + weight_b
    nonempty = total > 0.0
    safe_total = tl.where(nonempty, total, 1.0)
    lse = tl.where(nonempty, shift + tl.log(safe_total), float("-inf"))
    scale_a = (weight_a / safe_total)[:, None]
    scale_b = (weight_b / safe_total)[:, None]
    out = tl.where(scale_a > 0.0, out_a * scale_a, 0.0) + tl.where(scale_b > 0.0, out_b * scale_b, 0.0)
    return out, lse


@triton.jit
def _merge_attention_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows are (token, head) pairs of contiguous ``[N * H, D]`` outputs and ``[N * H]`` LSEs."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    out, lse = merge_state_pair(
        tl.load(out_a_ptr + offsets, mask=mask, other=0.0).to(tl.float32),
        tl.load(lse_a_ptr + rows, mask=row_valid, other=float("-inf")),
        tl.load(out_b_ptr + offsets, mask=mask, other=0.0).to(tl.float32),
        tl.load(lse_b_ptr + rows, mask=row_valid, other=float("-inf")),
    )
    tl.store(lse_ptr + rows, lse, mask=row_valid)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr, num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows are (token, head) pairs; partials are contiguous fp32 ``[S, rows, D]`` and ``[S, rows]``."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    out = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    lse = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    for split in range(num_splits):
        split_rows = split * num_rows + rows.to(tl.int64)
        split_lse = tl.load(partial_lse_ptr + split_rows, mask=row_valid, other=float("-inf"))
        split_out = tl.load(partial_out_ptr + split_rows[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
        out, lse = merge_state_pair(out, lse, split_out, split_lse)
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(lse_ptr + rows, lse, mask=row_valid)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(out_a, lse_a, out_b, lse_b):
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
        shapes = [tuple(t.shape) for t in (out_a, lse_a, out_b, lse_b)]
        raise ValueError(f"states (out_a, lse_a, out_b, lse_b) of shapes {shapes} do not match")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise ValueError("lse must be fp32")


def merge_attention_states_triton(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, H, D], lse [N, H])`` of the union of two key sets; see the module docstring."""
    _check_inputs(out_a, lse_a, out_b, lse_b)
    num_tokens, num_heads, head_dim = out_a.shape
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out_a.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, lse
    _merge_attention_states_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS),)](
        out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous(), out, lse, num_rows,
        HEAD_DIM=head_dim, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out, lse


def merge_attention_states_torch(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``merge_attention_states_triton``."""
    _check_inputs(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    shift = lse.masked_fill(lse == float("-inf"), 0.0)
    scale_a = torch.exp(lse_a - shift).unsqueeze(-1)
    scale_b = torch.exp(lse_b - shift).unsqueeze(-1)
    zero = out_a.new_zeros((), dtype=torch.float32)
    out = torch.where(scale_a > 0, out_a.float() * scale_a, zero)
    out += torch.where(scale_b > 0, out_b.float() * scale_b, zero)
    return out.to(out_a.dtype), lse


def merge_split_states_triton(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge ``S`` partial states of the same queries over disjoint key sets into ``out``, ``lse``.

    partial_out fp32 ``[S, N, H, D]`` and partial_lse fp32 ``[S, N, H]`` (natural log), contiguous;
    out ``[N, H, D]`` (any float dtype) and lse fp32 ``[N, H]``, contiguous, written in place. Splits
    with ``lse = -inf`` contribute nothing (flash-decoding's second pass; ``segment_attention``).
    """
    num_splits, num_tokens, num_heads, head_dim = partial_out.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return
    _merge_splits_kernel[(triton.cdiv(num_rows, _BLOCK_ROWS),)](
        partial_out, partial_lse, out, lse, num_rows, num_splits,
        HEAD_DIM=head_dim, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
