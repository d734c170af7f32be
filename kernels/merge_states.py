"""Merge two partial attention results by log-sum-exp: Triton kernel and torch twin.

Semantics of ``flashinfer.cascade.merge_state``: given attention of the same queries over two
disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, return attention over their union:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Shapes: ``out_*`` ``[N, H, D]``, ``lse_*`` fp32 ``[N, H]``, natural log (FlashInfer's own kernels
use base 2: convert before mixing). A side with ``lse = -inf`` (no keys) contributes nothing, and its
output is ignored whatever it holds (NaN included); both empty gives ``out = 0`` and ``lse = -inf``.
The merged output has ``out_a``'s dtype.

The Triton path is untested on CUDA hardware: it is verified only in Triton interpreter mode on CPU
(``tests/test_kernels_segment_attention.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 16  # (token, head) rows per program


@triton.jit
def _merge_attention_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows are (token, head) pairs of contiguous ``[N * H, D]`` outputs and ``[N * H]`` LSEs."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_valid = rows < num_rows
    lse_a = tl.load(lse_a_ptr + rows, mask=row_valid, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows, mask=row_valid, other=float("-inf"))
    larger = tl.maximum(lse_a, lse_b)
    shift = tl.where(larger == float("-inf"), 0.0, larger)  # both empty: exp(-inf - 0) = 0, not NaN
    weight_a = tl.exp(lse_a - shift)
    weight_b = tl.exp(lse_b - shift)
    total = weight_a + weight_b
    nonempty = total > 0.0
    safe_total = tl.where(nonempty, total, 1.0)
    tl.store(lse_ptr + rows, tl.where(nonempty, shift + tl.log(safe_total), float("-inf")), mask=row_valid)

    dims = tl.arange(0, BLOCK_D)
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    out_a = tl.load(out_a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out_b = tl.load(out_b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    scale_a = (weight_a / safe_total)[:, None]
    scale_b = (weight_b / safe_total)[:, None]
    merged = tl.where(scale_a > 0.0, out_a * scale_a, 0.0) + tl.where(scale_b > 0.0, out_b * scale_b, 0.0)
    tl.store(out_ptr + offsets, merged.to(out_ptr.dtype.element_ty), mask=mask)


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
