"""Segment attention and LSE merge (Triton, interpreter mode) against torch twins and naive formulas."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from test_kernels_support import (
    DTYPES,
    TOLERANCE,
    assert_close,
    interpreter_process_test,
    no_host_sync,
    on_kernel_devices,
    requires_interpreter,
)

from sgl_kvevict.kernels.merge_states import (
    merge_attention_states_torch,
    merge_attention_states_triton,
    merge_split_states_triton,
)
from sgl_kvevict.kernels.segment_attention import (
    _attend_padded,
    kv_splits,
    segment_attention_torch,
    segment_attention_triton,
)

test_in_interpreter_process = interpreter_process_test(__file__)


@dataclasses.dataclass(frozen=True)
class Batch:
    num_kv_heads: int
    group: int
    head_dim: int
    q_lens: tuple[int, ...]  # query tokens per request (1 = decode)
    cell_counts: tuple[tuple[int, ...], ...]  # kept cells per (request, KV head); the kernel walks 32 per block

    def __str__(self) -> str:
        counts = "_".join("-".join(map(str, heads)) for heads in self.cell_counts)
        return f"kv{self.num_kv_heads}-g{self.group}-d{self.head_dim}-q{'-'.join(map(str, self.q_lens))}-c{counts}"


BATCHES = [
    # decode; an empty head, a single cell, 33 cells, and a request with no cells at all
    Batch(num_kv_heads=2, group=4, head_dim=128, q_lens=(1, 1, 1), cell_counts=((5, 0), (33, 1), (0, 0))),
    # extend with a padded GQA group; a request without query tokens
    Batch(num_kv_heads=1, group=3, head_dim=64, q_lens=(7, 0, 2), cell_counts=((40,), (3,), (1,))),
    Batch(num_kv_heads=4, group=1, head_dim=64, q_lens=(2, 3), cell_counts=((0, 17, 2, 9), (20, 1, 0, 6))),
    # G = 8: 8 query tokens per program, so 9 tokens take two programs
    Batch(num_kv_heads=1, group=8, head_dim=128, q_lens=(1, 9), cell_counts=((70,), (2,))),
    # G = 2 decode over long and uneven sequences: several blocks per split, splits of uneven size
    Batch(num_kv_heads=3, group=2, head_dim=64, q_lens=(1, 1), cell_counts=((300, 0, 1), (97, 64, 33))),
    # Gemma's and Qwen3-Next's head size
    Batch(num_kv_heads=1, group=2, head_dim=256, q_lens=(1, 3), cell_counts=((9,), (40,))),
]
# Cell splits per sequence: none; 3 (uneven, e.g. 33 cells -> 32 + 1 + 0); 8 (most splits empty).
KV_SPLITS = [1, 3, 8]


def make_batch(batch: Batch, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """q ``[N, H_q, D]``, k_rows and v_rows ``[cells, D]``, qo_indptr ``[B + 1]``, kv_indptr
    ``[B * H_kv + 1]``, kv_indices."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(batch.cell_counts).flatten()
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    num_cells = int(counts.sum()) + 9
    kv_indices = torch.randperm(num_cells, generator=generator)[: int(counts.sum())].to(torch.int32)
    qo_indptr = torch.tensor((0, *batch.q_lens)).cumsum(0).to(torch.int32)
    k_rows = torch.randn(num_cells, batch.head_dim, generator=generator).to(dtype)
    v_rows = torch.randn(num_cells, batch.head_dim, generator=generator).to(dtype)
    num_q_heads = batch.num_kv_heads * batch.group
    q = torch.randn(sum(batch.q_lens), num_q_heads, batch.head_dim, generator=generator).to(dtype)
    tensors = (t.to(device) for t in (q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices))
    return *tensors, batch.num_kv_heads, 1 / math.sqrt(batch.head_dim)


def naive_segment_attention(q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale):
    """Per query token and head, softmax over its (request, KV head) cells in float64."""
    q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices = (
        t.cpu() for t in (q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices)
    )
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, v_rows.shape[1], dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float64)
    for request in range(len(qo_indptr) - 1):
        for token in range(int(qo_indptr[request]), int(qo_indptr[request + 1])):
            for head in range(num_q_heads):
                sequence = request * num_kv_heads + head // group
                cells = kv_indices[int(kv_indptr[sequence]) : int(kv_indptr[sequence + 1])].long()
                if len(cells) == 0:
                    continue
                logits = sm_scale * (k_rows[cells].double() @ q[token, head].double())
                lse[token, head] = torch.logsumexp(logits, 0)
                out[token, head] = torch.softmax(logits, 0) @ v_rows[cells].double()
    return out, lse


def assert_attention_close(actual, expected, dtype: torch.dtype) -> None:
    fp32_math, via_p_at_v = TOLERANCE[dtype]
    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    assert_close(actual[0], expected[0], via_p_at_v)
    assert_close(actual[1], expected[1], fp32_math)


@on_kernel_devices
@pytest.mark.parametrize("num_kv_splits", KV_SPLITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_segment_attention_matches_twin_and_naive(batch: Batch, dtype: torch.dtype, num_kv_splits: int, device: str):
    inputs = make_batch(batch, dtype, device=device)
    out, lse = segment_attention_triton(*inputs, max_q_len=max(batch.q_lens), num_kv_splits=num_kv_splits)
    assert out.device.type == lse.device.type == device
    assert_attention_close((out, lse), segment_attention_torch(*inputs), dtype)
    assert_attention_close((out, lse), naive_segment_attention(*inputs), dtype)


@on_kernel_devices
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_an_fp32_out_is_the_same_attention_before_its_rounding(batch: Batch, device: str):
    """``out_dtype=torch.float32`` with bf16 inputs (the CPU extend merges two parts, then rounds once):
    the kernel and the twin give what they give in bf16, before its rounding."""
    inputs = make_batch(batch, torch.bfloat16, device=device)
    for implementation in (segment_attention_triton, segment_attention_torch):
        rounded, lse = implementation(*inputs, max(batch.q_lens))
        unrounded, same_lse = implementation(*inputs, max(batch.q_lens), out_dtype=torch.float32)
        assert unrounded.dtype == torch.float32 and rounded.dtype == torch.bfloat16
        assert torch.equal(lse, same_lse)
        # within one bf16 step of the rounded out (the interpreter's conversion may round toward zero)
        torch.testing.assert_close(rounded.float(), unrounded, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_torch_twin_matches_naive_on_both_of_its_paths(batch: Batch, dtype: torch.dtype):
    """The twin attends a decode padded (every request at once) and an extend one (request, KV head)
    at a time; both equal the naive formula. A decode padded to a larger cell bound (a replayed graph's
    capacity) gives the same."""
    inputs = make_batch(batch, dtype)
    out, lse = segment_attention_torch(*inputs)
    assert_attention_close((out, lse), naive_segment_attention(*inputs), dtype)
    if max(batch.q_lens) == 1:
        bound = max(max(heads) for heads in batch.cell_counts) + 7
        assert_attention_close(segment_attention_torch(*inputs, 1, bound), (out, lse), dtype)


def test_the_padded_path_leaves_the_rows_of_other_requests_to_them():
    """A request without queries beside one-query requests (the kernel's contract allows it): its row
    is a scratch row, so it never overwrites the next request's."""
    batch = Batch(num_kv_heads=1, group=2, head_dim=64, q_lens=(1, 0, 1), cell_counts=((3,), (5,), (2,)))
    inputs = make_batch(batch, torch.float32)
    padded = torch.zeros(3, 2, 64), torch.full((3, 2), float("-inf"))
    _attend_padded(*inputs, None, *padded)
    assert_attention_close((padded[0][:2], padded[1][:2]), naive_segment_attention(*inputs), torch.float32)


@on_kernel_devices
@pytest.mark.parametrize("num_kv_splits", KV_SPLITS)
def test_empty_sequences_give_zero_output_and_minus_inf_lse(num_kv_splits: int, device: str):
    """Heads without cells, whole requests without cells, and (split) partials of empty splits: no NaN."""
    batch = BATCHES[0]
    out, lse = segment_attention_triton(*make_batch(batch, torch.float16, device=device), num_kv_splits=num_kv_splits)
    out, lse = out.cpu(), lse.cpu()
    # token r belongs to request r (decode); query heads 4..7 belong to KV head 1
    empty = torch.tensor(batch.cell_counts).repeat_interleave(batch.group, dim=1) == 0  # [B, H_q]
    assert torch.all(lse[empty] == float("-inf")) and torch.all(out[empty] == 0)
    assert torch.all(lse[~empty].isfinite()) and torch.all(out.isfinite())


@pytest.mark.gpu
@pytest.mark.parametrize("max_cells_per_sequence", [None, 4096])
def test_no_host_sync_on_cuda(max_cells_per_sequence: int | None):
    """With ``max_q_len`` and the cell bound given as host ints, decode (split or not) and the merge
    never make the host wait for the GPU (the first call compiles, outside the check)."""
    batch = Batch(num_kv_heads=2, group=4, head_dim=128, q_lens=(1,), cell_counts=((3000, 700),))
    inputs = make_batch(batch, torch.bfloat16, device="cuda")
    attention = functools.partial(
        segment_attention_triton, *inputs, max_q_len=1, max_cells_per_sequence=max_cells_per_sequence
    )
    out, lse = attention()
    with no_host_sync():
        attention()
        merge_attention_states_triton(out, lse, out, lse)


def test_kv_splits_fill_the_gpu_only_where_sequences_are_long_and_few():
    assert kv_splits(num_programs=8, max_cells_per_sequence=32768) == 32  # batch 1, 8 KV heads: 256 programs
    assert kv_splits(num_programs=8, max_cells_per_sequence=8192) == 32  # splits of >= 256 cells
    assert kv_splits(num_programs=1, max_cells_per_sequence=5000) == 19
    assert kv_splits(num_programs=256, max_cells_per_sequence=32768) == 1  # batch 32 fills the GPU already
    # Measured on an H100: the unsplit kernel beats an 8-way split at 2048 cells per head (docs/gpu.md).
    assert kv_splits(num_programs=8, max_cells_per_sequence=2048) == 1
    assert kv_splits(num_programs=8, max_cells_per_sequence=None) == 1  # no host bound: no split


@requires_interpreter
def test_max_cells_per_sequence_selects_the_split_path():
    """A caller's cell bound alone splits a long single-sequence decode, with the naive result."""
    batch = Batch(num_kv_heads=1, group=4, head_dim=64, q_lens=(1,), cell_counts=((4200,),))
    inputs = make_batch(batch, torch.float32, seed=5)
    assert kv_splits(num_programs=1, max_cells_per_sequence=4200) == 16
    actual = segment_attention_triton(*inputs, max_q_len=1, max_cells_per_sequence=4200)
    assert_attention_close(actual, naive_segment_attention(*inputs), torch.float32)


@on_kernel_devices
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_strided_queries_and_kv_rows(num_kv_splits: int, device: str):
    """Queries as a view of a fused [N, H_q + 2 H_kv, D] qkv tensor, as attention backends receive them,
    and K/V rows that are slices of wider rows (a row stride other than D), int64 cell ids."""
    batch = BATCHES[1]
    q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, *rest = make_batch(batch, torch.float32, device=device)
    qkv = torch.randn(q.shape[0], q.shape[1] + 2 * batch.num_kv_heads, batch.head_dim, device=device)
    qkv[:, : q.shape[1]] = q
    strided_q = qkv[:, : q.shape[1]]
    wide_k, wide_v = (
        torch.full((t.shape[0], t.shape[1] + 16), float("nan"), device=device) for t in (k_rows, v_rows)
    )
    wide_k[:, 8 : 8 + batch.head_dim], wide_v[:, 8 : 8 + batch.head_dim] = k_rows, v_rows
    strided_k, strided_v = wide_k[:, 8 : 8 + batch.head_dim], wide_v[:, 8 : 8 + batch.head_dim]
    assert not any(t.is_contiguous() for t in (strided_q, strided_k, strided_v))
    actual = segment_attention_triton(
        strided_q, strided_k, strided_v, qo_indptr, kv_indptr, kv_indices.long(), *rest,
        max_q_len=max(batch.q_lens), num_kv_splits=num_kv_splits,
    )  # fmt: skip
    expected = segment_attention_torch(q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, *rest)
    assert_attention_close(actual, expected, torch.float32)


def random_states(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator):
    """Two (out, lse) states with every combination of empty sides: a empty, b empty, both, neither."""
    out_a, out_b = (torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(num_tokens, num_heads, generator=generator) for _ in range(2))
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")
    lse_a[2] = lse_b[2] = float("-inf")
    out_a[0] = float("nan")  # an empty side's output is ignored whatever it holds
    return out_a, lse_a, out_b, lse_b


def naive_merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64, element by element, the softmax-weighted sum of the states whose lse is finite."""
    out = torch.zeros(outs[0].shape, dtype=torch.float64)
    lse = torch.full(lses[0].shape, float("-inf"), dtype=torch.float64)
    for token in range(out.shape[0]):
        for head in range(out.shape[1]):
            states = [(o[token, head].cpu(), float(s[token, head])) for o, s in zip(outs, lses)]
            nonempty = [(o, s) for o, s in states if s != float("-inf")]
            if not nonempty:
                continue
            total = math.log(sum(math.exp(s) for _, s in nonempty))
            lse[token, head] = total
            out[token, head] = sum(o.double() * math.exp(s - total) for o, s in nonempty)
    return out, lse


@on_kernel_devices
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(5, 3, 64), (4, 8, 128), (3, 1, 64)])
def test_merge_matches_twin_and_naive(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(num_tokens)
    states = [t.to(device) for t in random_states(num_tokens, num_heads, head_dim, dtype, generator)]
    out, lse = merge_attention_states_triton(*states)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(lse[2].cpu(), torch.full((num_heads,), float("-inf"))) and torch.all(out[2] == 0)
    fp32_math, rounded_output = TOLERANCE[dtype]
    for expected in (merge_attention_states_torch(*states), naive_merge(states[0::2], states[1::2])):
        assert_close(out, expected[0], rounded_output)
        assert_close(lse, expected[1], fp32_math)


@on_kernel_devices
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_merge_of_splits_matches_naive_and_the_pairwise_merge(out_dtype: torch.dtype, device: str):
    """fp32 partials of 5 splits: two empty splits (NaN outputs, ignored), a row no split holds."""
    generator = torch.Generator().manual_seed(7)
    num_splits, num_tokens, num_heads, head_dim = 5, 4, 3, 64
    partial_out = torch.randn(num_splits, num_tokens, num_heads, head_dim, generator=generator)
    partial_lse = 3 * torch.randn(num_splits, num_tokens, num_heads, generator=generator)
    partial_lse[1:3] = float("-inf")
    partial_out[1] = float("nan")
    partial_lse[:, 0, 0] = float("-inf")
    partial_out, partial_lse = partial_out.to(device), partial_lse.to(device)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, device=device)
    merge_split_states_triton(partial_out, partial_lse, out, lse)
    fp32_math, rounded_output = TOLERANCE[out_dtype]
    expected = naive_merge(list(partial_out), list(partial_lse))
    assert_close(out, expected[0], rounded_output)
    assert_close(lse, expected[1], fp32_math)
    assert lse[0, 0] == float("-inf") and torch.all(out[0, 0] == 0)

    pair_out, pair_lse = torch.empty_like(out), torch.empty_like(lse)
    merge_split_states_triton(partial_out[3:], partial_lse[3:], pair_out, pair_lse)
    pairwise = merge_attention_states_triton(partial_out[3], partial_lse[3], partial_out[4], partial_lse[4])
    assert_close(pair_out, pairwise[0], rounded_output)
    assert_close(pair_lse, pairwise[1], fp32_math)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", BATCHES[1:3], ids=str)
def test_merged_halves_equal_attention_over_the_union(batch: Batch, dtype: torch.dtype):
    """Attention over every (request, head)'s cells = merge of attention over a split of them into two sets."""
    q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale = make_batch(batch, dtype, seed=3)
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    first_counts = counts // 3  # some sequences put every cell in the second set, none in the first
    in_first = torch.cat([torch.arange(int(n)) < int(f) for n, f in zip(counts, first_counts)])

    def sub_batch(mask: torch.Tensor, sub_counts: torch.Tensor):
        sub_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), sub_counts.cumsum(0)]).to(torch.int32)
        sub_cells = kv_indices[mask]
        return segment_attention_triton(q, k_rows, v_rows, qo_indptr, sub_indptr, sub_cells, num_kv_heads, sm_scale)

    first, second = sub_batch(in_first, first_counts), sub_batch(~in_first, counts - first_counts)
    merged = merge_attention_states_triton(*first, *second)
    whole = naive_segment_attention(q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale)
    fp32_math, via_p_at_v = TOLERANCE[dtype]
    assert_close(merged[0], whole[0], 2 * via_p_at_v)  # two rounded partial outputs, then a rounded merge
    assert_close(merged[1], whole[1], fp32_math)


def test_rejects_indptr_that_is_not_per_request_and_head():
    q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, *heads_and_scale = make_batch(BATCHES[0], torch.float32)
    for segment_attention_impl in (segment_attention_torch, segment_attention_triton):
        with pytest.raises(ValueError, match="B \\* H_kv \\+ 1"):
            segment_attention_impl(q, k_rows, v_rows, qo_indptr, kv_indptr[:-1], kv_indices, *heads_and_scale)
