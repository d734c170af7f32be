"""Attention over compressed arena cells, with log-sum-exp for merging: Triton kernel and torch twin.

Every (request, KV head) is its own key/value sequence (its kept cells); its queries are the GQA
group of that KV head for every query token of the request. Compressed keys precede every query, so
there is no mask (``causal=False``). The result is merged with the dense part of the context by
``merge_attention_states`` (design: sglang-0.5.23-hooks.md §8.5).

Shapes follow FlashInfer's ragged/paged conventions (NHD, indptr arrays, page size 1):

* ``q``          ``[N, H_q, D]``  query tokens of all requests, request-major (``N`` = sum of lengths).
* ``qo_indptr``  int ``[B + 1]``  request ``r``'s queries are ``q[qo_indptr[r]:qo_indptr[r + 1]]``;
  decode is ``arange(B + 1)``.
* ``kv_indptr``  int ``[B * H_kv + 1]`` and ``kv_indices`` int ``[nnz]``: sequence ``s = r * H_kv + g``
  (request-major, KV head minor) holds cells ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``.
* ``arena_k`` ``[num_cells, D]``, ``arena_v`` ``[num_cells, D_v]``.
* Returns ``out`` ``[N, H_q, D_v]`` in ``q``'s dtype and ``lse`` fp32 ``[N, H_q]``, the **natural-log**
  sum of ``exp(sm_scale * q.k)``. A sequence without cells gives ``out = 0`` and ``lse = -inf``.

FlashInfer equivalent: ``BatchPrefillWithPagedKVCacheWrapper`` planned with ``num_kv_heads=1``,
``num_qo_heads=G`` and ``qo_indptr`` over the (request, KV head) sequences, which needs ``q``
permuted to ``[(r, g, token), G, D]``; this kernel reads ``q`` in place instead. Note that FlashInfer
returns a base-2 LSE by default: multiply it by ln 2 before mixing it with the LSE here.

The Triton path is untested on CUDA hardware: it is verified only in Triton interpreter mode on CPU
(``tests/test_kernels_segment_attention.py``). It has no split over the cells (one program walks a
whole sequence), which is fine for the short compressed sequences of one node but leaves the GPU
under-occupied for small decode batches over long compressed contexts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_kvevict.kernels.runtime import dot, dot_block, upcast_dot_operands

_LOG2E = math.log2(math.e)
_LN2 = tl.constexpr(math.log(2.0))
_BLOCK_N = 32  # cells per block
_ROWS_PER_TILE = 64  # (query token, query head) rows per program
_TWIN_QUERY_CHUNK = 256  # query tokens per step of the torch twin: bounds its [B, T, H_q, cells] logits


@triton.jit
def _segment_attention_kernel(
    q_ptr, arena_k_ptr, arena_v_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, out_ptr, lse_ptr,
    num_kv_heads, group, sm_scale_log2,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: sequence ``program_id(0)``, ``BLOCK_T`` query tokens x its ``G`` query heads.

    Row ``r`` of the tile is query token ``r // BLOCK_G`` of the block, head ``r % BLOCK_G`` of the group.
    """
    sequence = tl.program_id(0)
    request = sequence // num_kv_heads
    kv_head = sequence % num_kv_heads
    q_start = tl.load(qo_indptr_ptr + request)
    q_len = tl.load(qo_indptr_ptr + request + 1) - q_start
    if tl.program_id(1) * BLOCK_T >= q_len:
        return

    rows = tl.arange(0, BLOCK_T * BLOCK_G)
    token = tl.program_id(1) * BLOCK_T + rows // BLOCK_G
    q_head = kv_head * group + rows % BLOCK_G
    row_valid = (token < q_len) & (rows % BLOCK_G < group)
    token_index = (q_start + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + (token_index * stride_q_token + q_head * stride_q_head)[:, None] + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)

    dims_v = tl.arange(0, BLOCK_DV)
    row_max = tl.full([BLOCK_T * BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_T * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_G, BLOCK_DV], tl.float32)
    kv_start = tl.load(kv_indptr_ptr + sequence)
    kv_end = tl.load(kv_indptr_ptr + sequence + 1)
    for block_start in range(kv_start, kv_end, BLOCK_N):
        entries = block_start + tl.arange(0, BLOCK_N)
        entry_valid = entries < kv_end
        cells = tl.load(kv_indices_ptr + entries, mask=entry_valid, other=0).to(tl.int64)
        k_mask = entry_valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(arena_k_ptr + cells[:, None] * HEAD_DIM + dims[None, :], mask=k_mask, other=0.0)
        logits = dot(q, tl.trans(k), UPCAST) * sm_scale_log2
        logits = tl.where(entry_valid[None, :], logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 1))  # finite: every block has a valid cell
        probs = tl.exp2(logits - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v_mask = entry_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V)
        v = tl.load(arena_v_ptr + cells[:, None] * HEAD_DIM_V + dims_v[None, :], mask=v_mask, other=0.0)
        acc = acc * rescale[:, None] + dot(probs.to(v.dtype), v, UPCAST)
        row_max = new_max

    has_cells = row_sum > 0.0
    denominator = tl.where(has_cells, row_sum, 1.0)  # an empty sequence leaves acc = 0
    out = acc / denominator[:, None]
    lse = tl.where(has_cells, (row_max + tl.log2(denominator)) * _LN2, float("-inf"))
    out_row = token_index * stride_out_token + q_head * stride_out_head
    out_ptrs = out_ptr + out_row[:, None] + dims_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V))
    tl.store(lse_ptr + token_index * (num_kv_heads * group) + q_head, lse, mask=row_valid)


def _check_inputs(q, arena_k, arena_v, qo_indptr, kv_indptr, num_kv_heads):
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if kv_indptr.numel() != (qo_indptr.numel() - 1) * num_kv_heads + 1:
        raise ValueError("kv_indptr must have B * H_kv + 1 entries (one sequence per request and KV head)")
    if q.shape[2] != arena_k.shape[1] or q.dtype != arena_k.dtype or arena_v.dtype != arena_k.dtype:
        raise ValueError("q and the arena must share head dim and dtype")


def segment_attention_triton(
    q: torch.Tensor,
    arena_k: torch.Tensor,
    arena_v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_heads: int,
    sm_scale: float,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the cells of each (request, KV head); shapes in the module docstring.

    max_q_len: at least the longest query run of one request (1 for decode); sizes the grid, so a
        smaller value silently drops queries. Computed with a device sync if None.
    """
    _check_inputs(q, arena_k, arena_v, qo_indptr, kv_indptr, num_kv_heads)
    num_tokens, num_q_heads, head_dim = q.shape
    head_dim_v = arena_v.shape[1]
    group = num_q_heads // num_kv_heads
    num_requests = qo_indptr.numel() - 1
    out = torch.zeros(num_tokens, num_q_heads, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_requests == 0:
        return out, lse
    if q.stride(2) != 1 or not (arena_k.is_contiguous() and arena_v.is_contiguous()):
        raise ValueError("q's head dim and the arena tensors must be contiguous")
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())

    block_g = triton.next_power_of_2(group)
    # Rows = tokens x group heads must reach 16 for tl.dot; decode (one token) pads with empty tokens.
    block_t = max(16 // block_g, min(triton.next_power_of_2(max_q_len), max(1, _ROWS_PER_TILE // block_g)))
    grid = (num_requests * num_kv_heads, triton.cdiv(max_q_len, block_t))
    _segment_attention_kernel[grid](
        q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, out, lse,
        num_kv_heads, group, sm_scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_N=_BLOCK_N,
        BLOCK_D=dot_block(head_dim), BLOCK_DV=dot_block(head_dim_v), UPCAST=upcast_dot_operands(q.dtype),
    )  # fmt: skip
    return out, lse


def segment_attention_torch(
    q: torch.Tensor,
    arena_k: torch.Tensor,
    arena_v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_heads: int,
    sm_scale: float,
    max_q_len: int | None = None,
    max_cells: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``segment_attention_triton`` (fp32 math): every request at once, queries and cells
    padded to ``max_q_len`` and ``max_cells`` (host ints the caller knows; computed with a sync if None),
    in chunks of queries. No Python loop over requests or heads and no host sync when both are given:
    the CPU serving path runs it once per layer."""
    _check_inputs(q, arena_k, arena_v, qo_indptr, kv_indptr, num_kv_heads)
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_requests = qo_indptr.numel() - 1
    out = torch.zeros(num_tokens, num_q_heads, arena_v.shape[1], dtype=q.dtype, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_requests == 0 or kv_indices.numel() == 0:
        return out, lse
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    if max_cells is None:
        max_cells = int((kv_indptr[1:] - kv_indptr[:-1]).max())
    device = q.device
    qo_indptr, kv_indptr = qo_indptr.to(device, torch.int64), kv_indptr.to(device, torch.int64)
    cell_offsets = torch.arange(max_cells, device=device)
    first_entry = kv_indptr[:-1].view(num_requests, num_kv_heads, 1)
    has_cell = cell_offsets < (kv_indptr[1:] - kv_indptr[:-1]).view(num_requests, num_kv_heads, 1)
    entries = torch.where(has_cell, first_entry + cell_offsets, 0)  # padding reads entry 0, masked below
    cells = kv_indices[entries].long()
    keys, values = arena_k[cells].float(), arena_v[cells].float()  # [B, H_kv, C, D]
    query_lengths = (qo_indptr[1:] - qo_indptr[:-1]).view(num_requests, 1)
    for chunk_start in range(0, max_q_len, _TWIN_QUERY_CHUNK):
        offsets = torch.arange(chunk_start, min(chunk_start + _TWIN_QUERY_CHUNK, max_q_len), device=device)
        rows = qo_indptr[:-1].view(num_requests, 1) + offsets  # [B, T]
        valid = offsets < query_lengths
        rows = torch.where(valid, rows, 0)
        queries = q[rows].float().view(num_requests, len(offsets), num_kv_heads, group, head_dim)
        logits = torch.einsum("btkgd,bkcd->btkgc", queries, keys) * sm_scale
        logits = logits.masked_fill(~has_cell[:, None, :, None, :], float("-inf"))
        chunk_lse = torch.logsumexp(logits, dim=-1)  # [B, T, H_kv, G]; -inf for heads without cells
        probs = torch.exp(logits - chunk_lse.masked_fill(chunk_lse == float("-inf"), 0.0)[..., None])
        chunk_out = torch.einsum("btkgc,bkcd->btkgd", probs, values).reshape(num_requests, len(offsets), num_q_heads, -1)
        out[rows[valid]] = chunk_out[valid].to(q.dtype)
        lse[rows[valid]] = chunk_lse.reshape(num_requests, len(offsets), num_q_heads)[valid]
    return out, lse
