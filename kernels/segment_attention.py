"""Attention over compressed cells, with log-sum-exp for merging: Triton kernel and torch twin.

Every (request, KV head) is its own key/value sequence (its kept cells); its queries are the GQA
group of that KV head for every query token of the request. Compressed keys precede every query, so
there is no mask (``causal=False``). The result is merged with the dense part of the context by
``merge_attention_states`` (docs/design.md#segment-attention).

Shapes follow FlashInfer's ragged/paged conventions (NHD, indptr arrays, page size 1):

* ``q``          ``[N, H_q, D]``  query tokens of all requests, request-major (``N`` = sum of lengths).
* ``qo_indptr``  int ``[B + 1]``  request ``r``'s queries are ``q[qo_indptr[r]:qo_indptr[r + 1]]``;
  decode is ``arange(B + 1)``.
* ``kv_indptr``  int ``[B * H_kv + 1]`` and ``kv_indices`` int ``[nnz]``: sequence ``s = r * H_kv + g``
  (request-major, KV head minor) holds cells ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``.
* ``k_rows`` ``[num_cells, D]``, ``v_rows`` ``[num_cells, D_v]``.
* Returns ``out`` ``[N, H_q, D_v]`` in ``q``'s dtype (or ``out_dtype``) and ``lse`` fp32 ``[N, H_q]``, the **natural-log**
  sum of ``exp(sm_scale * q.k)``. A sequence without cells gives ``out = 0`` and ``lse = -inf``.

FlashInfer equivalent: ``BatchPrefillWithPagedKVCacheWrapper`` planned with ``num_kv_heads=1``,
``num_qo_heads=G`` and ``qo_indptr`` over the (request, KV head) sequences, which needs ``q``
permuted to ``[(r, g, token), G, D]``; this kernel reads ``q`` in place instead. Note that FlashInfer
returns a base-2 LSE by default: multiply it by ln 2 before mixing it with the LSE here.

Split-KV (flash-decoding): one program per (sequence, query block) walking all of a sequence's cells
is ``B * H_kv`` programs at decode, ~8 for one request on a 132-SM GPU. With ``num_kv_splits = S > 1``
the grid gains a split axis: program ``(s, q block, split)`` walks its split of sequence ``s``'s cells
(``runtime.split_range``, from the sequence's own count on the device, so uneven sequences split
evenly) and writes a partial ``(out, lse)``; ``merge_states.merge_split_states_triton`` merges the
``S`` partials (an empty split has ``lse = -inf`` and drops out). ``segment_attention_triton`` picks
``S`` from host sizes only: the program count and ``max_cells_per_sequence``, an upper bound on the
cells of one sequence the caller knows on the host (the engine computes it once per forward); without
it there is no split and no host sync.

Tests: ``tests/test_kernels_segment_attention.py`` (interpreter and CUDA variants) and
``tests/test_kernels_compile.py``; where the Triton path has run and its timings:
docs/gpu.md#what-ran-on-a-gpu.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_kvevict.kernels.merge_states import merge_split_states_triton
from sgl_kvevict.kernels.runtime import dot, dot_block, split_range, upcast_dot_operands

_LOG2E = math.log2(math.e)
_LN2 = tl.constexpr(math.log(2.0))
_BLOCK_N = 32  # cells per block
_TWIN_QUERY_CHUNK = 256  # query tokens per step of the torch twin: bounds its [B, T, H_q, cells] logits
_ROWS_PER_TILE = 64  # (query token, query head) rows per program
_TARGET_PROGRAMS = 256  # ~2 waves on a 132-SM GPU; a heuristic, not tuned on hardware
_MIN_CELLS_PER_SPLIT = 256  # below this a split's partial write and merge cost more than its cells
# No split below this many cells in the longest sequence. Measured on an H100 (docs/gpu.md, batch 1, 8 KV
# heads): at 2048 cells per head the unsplit kernel (0.093 ms) beat an 8-way split (0.111 ms: partial
# writes and a merge launch on a kernel already near its launch floor); at 8192 a 32-way split won 2.99x.
# Public: the engine's decode graphs capture an unsplit graph for the sequences below it (engine.decode_graph).
MIN_CELLS_TO_SPLIT = 4096


@triton.jit
def _segment_attention_kernel(
    q_ptr, k_rows_ptr, v_rows_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, out_ptr, lse_ptr,
    num_kv_heads, group, num_splits, sm_scale_log2,
    stride_q_token, stride_q_head, stride_k_rows, stride_v_rows,
    stride_out_split, stride_out_token, stride_out_head, stride_lse_split,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: sequence ``program_id(0)``, ``BLOCK_T`` query tokens x its ``G`` query heads, split
    ``program_id(2)`` of its cells; writes ``(out, lse)`` at that split's offset (split 0 when unsplit).

    Row ``r`` of the tile is query token ``r // BLOCK_G`` of the block, head ``r % BLOCK_G`` of the group.
    """
    split = tl.program_id(2)
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
    kv_start, kv_end = split_range(
        split, num_splits, tl.load(kv_indptr_ptr + sequence), tl.load(kv_indptr_ptr + sequence + 1), BLOCK_N
    )
    for block_start in range(kv_start, kv_end, BLOCK_N):
        entries = block_start + tl.arange(0, BLOCK_N)
        entry_valid = entries < kv_end
        cells = tl.load(kv_indices_ptr + entries, mask=entry_valid, other=0).to(tl.int64)
        k_mask = entry_valid[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_rows_ptr + cells[:, None] * stride_k_rows + dims[None, :], mask=k_mask, other=0.0)
        logits = dot(q, tl.trans(k), UPCAST) * sm_scale_log2
        logits = tl.where(entry_valid[None, :], logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 1))  # finite: every block has a valid cell
        probs = tl.exp2(logits - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v_mask = entry_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V)
        v = tl.load(v_rows_ptr + cells[:, None] * stride_v_rows + dims_v[None, :], mask=v_mask, other=0.0)
        acc = acc * rescale[:, None] + dot(probs.to(v.dtype), v, UPCAST)
        row_max = new_max

    has_cells = row_sum > 0.0
    denominator = tl.where(has_cells, row_sum, 1.0)  # an empty sequence or split leaves acc = 0
    out = acc / denominator[:, None]
    lse = tl.where(has_cells, (row_max + tl.log2(denominator)) * _LN2, float("-inf"))
    out_row = split.to(tl.int64) * stride_out_split + token_index * stride_out_token + q_head * stride_out_head
    out_ptrs = out_ptr + out_row[:, None] + dims_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V))
    lse_row = split.to(tl.int64) * stride_lse_split + token_index * (num_kv_heads * group) + q_head
    tl.store(lse_ptr + lse_row, lse, mask=row_valid)


def _check_inputs(q, k_rows, v_rows, qo_indptr, kv_indptr, num_kv_heads):
    num_q_heads = q.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if kv_indptr.numel() != (qo_indptr.numel() - 1) * num_kv_heads + 1:
        raise ValueError("kv_indptr must have B * H_kv + 1 entries (one sequence per request and KV head)")
    if q.shape[2] != k_rows.shape[1] or q.dtype != k_rows.dtype or v_rows.dtype != k_rows.dtype:
        raise ValueError("q and the K rows must share head dim and dtype, the V rows that dtype")


def _query_tile(group: int, max_q_len: int) -> tuple[int, int]:
    """``(BLOCK_G, BLOCK_T)``: a program's query heads (the GQA group, padded) x query tokens."""
    block_g = triton.next_power_of_2(group)
    # Rows = tokens x group heads must reach 16 for tl.dot; decode (one token) pads with empty tokens.
    return block_g, max(16 // block_g, min(triton.next_power_of_2(max_q_len), max(1, _ROWS_PER_TILE // block_g)))


def chosen_kv_splits(
    num_requests: int, num_kv_heads: int, group: int, max_q_len: int, max_cells_per_sequence: int | None
) -> int:
    """The splits ``segment_attention_triton`` uses for these sizes when ``num_kv_splits`` is None."""
    query_blocks = triton.cdiv(max_q_len, _query_tile(group, max_q_len)[1])
    return kv_splits(num_requests * num_kv_heads * query_blocks, max_cells_per_sequence)


def kv_splits(num_programs: int, max_cells_per_sequence: int | None) -> int:
    """Splits per sequence so that ``num_programs x splits`` reaches ~2 waves of the GPU, each split
    keeping at least ``_MIN_CELLS_PER_SPLIT`` cells of the longest sequence; 1 without a cell bound or
    below ``MIN_CELLS_TO_SPLIT`` cells."""
    if max_cells_per_sequence is None or num_programs >= _TARGET_PROGRAMS or max_cells_per_sequence < MIN_CELLS_TO_SPLIT:
        return 1
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, num_programs)
    return max(1, min(by_occupancy, max_cells_per_sequence // _MIN_CELLS_PER_SPLIT))


def segment_attention_triton(
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
    num_kv_splits: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the cells of each (request, KV head); shapes in the module docstring.

    max_q_len: at least the longest query run of one request (1 for decode); sizes the grid, so a
        smaller value leaves the rows of later queries unwritten. Computed with a device sync if None.
        Every row of a query of some request is written: ``N`` must be ``qo_indptr[-1]``.
    max_cells_per_sequence: an upper bound on the cells of one (request, KV head), known on the host;
        lets ``kv_splits`` split long sequences (None: no split). A bound too small only splits less.
    num_kv_splits: overrides ``kv_splits`` (benchmarks, tests).
    out_dtype: ``out``'s dtype (None: ``q``'s); fp32 keeps a partial output unrounded until it is merged.
    """
    _check_inputs(q, k_rows, v_rows, qo_indptr, kv_indptr, num_kv_heads)
    num_tokens, num_q_heads, head_dim = q.shape
    head_dim_v = v_rows.shape[1]
    group = num_q_heads // num_kv_heads
    num_requests = qo_indptr.numel() - 1
    if num_tokens == 0 or num_requests == 0:
        out = torch.zeros(num_tokens, num_q_heads, head_dim_v, dtype=out_dtype or q.dtype, device=q.device)
        return out, torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if q.stride(2) != 1 or k_rows.stride(1) != 1 or v_rows.stride(1) != 1:
        raise ValueError("the head dims of q and of the K and V rows must be contiguous")
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())

    block_g, block_t = _query_tile(group, max_q_len)
    if num_kv_splits is None:
        num_kv_splits = chosen_kv_splits(num_requests, num_kv_heads, group, max_q_len, max_cells_per_sequence)
    # Every (split, token, head) row is written by the kernel (empty splits: out 0, lse -inf).
    out = torch.empty(num_tokens, num_q_heads, head_dim_v, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    # [S, N, H_q, D_v] and [S, N, H_q]: fp32 partials, or views of the outputs when unsplit.
    split_out = out.unsqueeze(0) if num_kv_splits == 1 else torch.empty(num_kv_splits, *out.shape, **f32)
    split_lse = lse.unsqueeze(0) if num_kv_splits == 1 else torch.empty(num_kv_splits, *lse.shape, **f32)
    _segment_attention_kernel[(num_requests * num_kv_heads, triton.cdiv(max_q_len, block_t), num_kv_splits)](
        q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, split_out, split_lse,
        num_kv_heads, group, num_kv_splits, sm_scale * _LOG2E, q.stride(0), q.stride(1),
        k_rows.stride(0), v_rows.stride(0), split_out.stride(0), split_out.stride(1), split_out.stride(2),
        split_lse.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_N=_BLOCK_N,
        BLOCK_D=dot_block(head_dim), BLOCK_DV=dot_block(head_dim_v), UPCAST=upcast_dot_operands(q.dtype),
    )  # fmt: skip
    if num_kv_splits > 1:
        merge_split_states_triton(split_out, split_lse, out, lse)
    return out, lse


def segment_attention_torch(
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
    num_kv_splits: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``segment_attention_triton`` (fp32 math). num_kv_splits is accepted for signature
    parity and unused (one softmax over all cells gives the split kernel's merged result).

    Decode (one query per request): every request at once, cells padded to ``max_cells_per_sequence``
    (a host int the caller knows; computed with a sync when None), no Python loop and no host sync:
    the CPU serving path runs it once per layer. An extend (``max_q_len`` > 1) goes one (request, KV
    head) at a time over exactly its cells: its queries are many and its heads' cell counts uneven
    (``topk`` keeps a whole block in one head and a few cells in the next), so padding every head to
    the longest would multiply the logits, and a loop over B x H_kv sequences costs little beside them."""
    _check_inputs(q, k_rows, v_rows, qo_indptr, kv_indptr, num_kv_heads)
    num_tokens, num_q_heads, _ = q.shape
    num_requests = qo_indptr.numel() - 1
    # One scratch row past the last token: the padded path's write target for a request without queries.
    out = torch.zeros(num_tokens + 1, num_q_heads, v_rows.shape[1], dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.full((num_tokens + 1, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_requests == 0 or kv_indices.numel() == 0:
        return out[:num_tokens], lse[:num_tokens]
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    sequences = (q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale)
    if max_q_len > 1:
        _attend_per_sequence(*sequences, out, lse)
    else:
        _attend_padded(*sequences, max_cells_per_sequence, out, lse)
    return out[:num_tokens], lse[:num_tokens]


def _attend_padded(
    q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale, max_cells_per_sequence, out, lse
) -> None:  # fmt: skip
    """At most one query per request (decode), every request at once, cells padded to
    ``max_cells_per_sequence``; writes ``out`` and ``lse`` ``[N + 1, ...]`` in place (row ``N``: scratch).
    No boolean indexing and no host read when the bound is given: the shapes depend on the batch size and
    the bound alone (a replayable body, ``engine.decode_graph``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_requests = qo_indptr.numel() - 1
    device = q.device
    qo_indptr, kv_indptr = qo_indptr.to(device, torch.int64), kv_indptr.to(device, torch.int64)
    cell_counts = (kv_indptr[1:] - kv_indptr[:-1]).view(num_requests, num_kv_heads, 1)
    if max_cells_per_sequence is None:
        max_cells_per_sequence = int(cell_counts.max())
    cell_offsets = torch.arange(max_cells_per_sequence, device=device)
    has_cell = cell_offsets < cell_counts  # [B, H_kv, C]
    starts = kv_indptr[:-1].view(num_requests, num_kv_heads, 1)
    # Padding re-reads the sequence's own first cell (weighted 0). A sequence without cells reads the
    # entry after it, which may be stale (a replayed graph's buffer) or past the end, hence the clamp
    # and its output zeroed below: 0 x NaN would be NaN.
    cells = kv_indices[torch.where(has_cell, starts + cell_offsets, starts.clamp(max=kv_indices.numel() - 1))].long()
    keys, values = k_rows[cells].float(), v_rows[cells].float()  # [B, H_kv, C, D]
    # A request without queries (the kernel's contract allows one) writes the scratch row.
    rows = torch.where(qo_indptr[1:] > qo_indptr[:-1], qo_indptr[:-1], num_tokens)
    queries = q[rows.clamp(max=num_tokens - 1)].float().view(num_requests, 1, num_kv_heads, group, head_dim)
    request_out, request_lse = _softmax_over_cells(queries, keys, values, has_cell, sm_scale)
    request_out = request_out.masked_fill((request_lse == float("-inf"))[..., None], 0.0)
    out[rows] = request_out[:, 0].to(out.dtype)
    lse[rows] = request_lse[:, 0]


def _softmax_over_cells(queries, keys, values, has_cell, sm_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """queries fp32 ``[B, T, H_kv, G, D]`` over keys, values ``[B, H_kv, C, D]`` where ``has_cell``
    ``[B, H_kv, C]``: out ``[B, T, H_q, D_v]`` and lse ``[B, T, H_q]`` (-inf for heads without cells)."""
    batch, tokens, num_kv_heads, group, _ = queries.shape
    logits = torch.einsum("btkgd,bkcd->btkgc", queries, keys) * sm_scale
    logits = logits.masked_fill(~has_cell[:, None, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, T, H_kv, G]
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = torch.einsum("btkgc,bkcd->btkgd", probs, values)
    return out.reshape(batch, tokens, num_kv_heads * group, -1), lse.reshape(batch, tokens, num_kv_heads * group)


def _attend_per_sequence(q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale, out, lse) -> None:
    """One (request, KV head) at a time over exactly its cells, in chunks of queries; writes ``out`` and
    ``lse`` in place (a sequence without cells keeps 0 and -inf)."""
    group = q.shape[1] // num_kv_heads
    query_bounds, cell_bounds = qo_indptr.tolist(), kv_indptr.tolist()
    for request in range(qo_indptr.numel() - 1):
        first_query, end_query = query_bounds[request], query_bounds[request + 1]
        for kv_head in range(num_kv_heads):
            sequence = request * num_kv_heads + kv_head
            cells = kv_indices[cell_bounds[sequence] : cell_bounds[sequence + 1]].long()
            if cells.numel() == 0 or first_query == end_query:
                continue
            keys, values = k_rows[cells].float(), v_rows[cells].float()  # [C, D]
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for chunk_start in range(first_query, end_query, _TWIN_QUERY_CHUNK):
                rows = slice(chunk_start, min(chunk_start + _TWIN_QUERY_CHUNK, end_query))
                logits = torch.matmul(q[rows, heads].float(), keys.T) * sm_scale  # [T, G, C]
                chunk_lse = torch.logsumexp(logits, dim=-1)  # [T, G]
                out[rows, heads] = torch.matmul(torch.exp(logits - chunk_lse[..., None]), values).to(out.dtype)
                lse[rows, heads] = chunk_lse
