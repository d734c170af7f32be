"""Segment attention and LSE merge (Triton, interpreter mode) against torch twins and naive formulas."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_kernels_support import DTYPES, TOLERANCE, assert_close, interpreter_process_test, requires_interpreter

from sgl_kvevict.kernels.merge_states import merge_attention_states_torch, merge_attention_states_triton
from sgl_kvevict.kernels.segment_attention import segment_attention_torch, segment_attention_triton

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
]


def make_batch(batch: Batch, dtype: torch.dtype, seed: int = 0):
    """q ``[N, H_q, D]``, arena ``[cells, D]``, qo_indptr ``[B + 1]``, kv_indptr ``[B * H_kv + 1]``, kv_indices."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(batch.cell_counts).flatten()
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    num_cells = int(counts.sum()) + 9
    kv_indices = torch.randperm(num_cells, generator=generator)[: int(counts.sum())].to(torch.int32)
    qo_indptr = torch.tensor((0, *batch.q_lens)).cumsum(0).to(torch.int32)
    arena_k = torch.randn(num_cells, batch.head_dim, generator=generator).to(dtype)
    arena_v = torch.randn(num_cells, batch.head_dim, generator=generator).to(dtype)
    num_q_heads = batch.num_kv_heads * batch.group
    q = torch.randn(sum(batch.q_lens), num_q_heads, batch.head_dim, generator=generator).to(dtype)
    return q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, batch.num_kv_heads, 1 / math.sqrt(batch.head_dim)


def naive_segment_attention(q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale):
    """Per query token and head, softmax over its (request, KV head) cells in float64."""
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, arena_v.shape[1], dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float64)
    for request in range(len(qo_indptr) - 1):
        for token in range(int(qo_indptr[request]), int(qo_indptr[request + 1])):
            for head in range(num_q_heads):
                sequence = request * num_kv_heads + head // group
                cells = kv_indices[int(kv_indptr[sequence]) : int(kv_indptr[sequence + 1])].long()
                if len(cells) == 0:
                    continue
                logits = sm_scale * (arena_k[cells].double() @ q[token, head].double())
                lse[token, head] = torch.logsumexp(logits, 0)
                out[token, head] = torch.softmax(logits, 0) @ arena_v[cells].double()
    return out, lse


def assert_attention_close(actual, expected, dtype: torch.dtype) -> None:
    fp32_math, via_p_at_v = TOLERANCE[dtype]
    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    assert_close(actual[0], expected[0], via_p_at_v)
    assert_close(actual[1], expected[1], fp32_math)


@requires_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_segment_attention_matches_twin_and_naive(batch: Batch, dtype: torch.dtype):
    inputs = make_batch(batch, dtype)
    out, lse = segment_attention_triton(*inputs)
    assert_attention_close((out, lse), segment_attention_torch(*inputs), dtype)
    assert_attention_close((out, lse), naive_segment_attention(*inputs), dtype)


@requires_interpreter
def test_empty_sequences_give_zero_output_and_minus_inf_lse():
    batch = BATCHES[0]
    out, lse = segment_attention_triton(*make_batch(batch, torch.float16))
    # token r belongs to request r (decode); query heads 4..7 belong to KV head 1
    empty = torch.tensor(batch.cell_counts).repeat_interleave(batch.group, dim=1) == 0  # [B, H_q]
    assert torch.all(lse[empty] == float("-inf")) and torch.all(out[empty] == 0)
    assert torch.all(lse[~empty].isfinite()) and torch.all(out.isfinite())


@requires_interpreter
def test_strided_queries_and_given_max_q_len():
    """Queries as a view of a fused [N, H_q + 2 H_kv, D] qkv tensor, as attention backends receive them."""
    batch = BATCHES[1]
    q, *rest = make_batch(batch, torch.float32)
    qkv = torch.randn(q.shape[0], q.shape[1] + 2 * batch.num_kv_heads, batch.head_dim)
    qkv[:, : q.shape[1]] = q
    strided_q = qkv[:, : q.shape[1]]
    assert not strided_q.is_contiguous()
    actual = segment_attention_triton(strided_q, *rest, max_q_len=max(batch.q_lens))
    assert_attention_close(actual, segment_attention_torch(q, *rest), torch.float32)


def random_states(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator):
    """Two (out, lse) states with every combination of empty sides: a empty, b empty, both, neither."""
    out_a, out_b = (torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(num_tokens, num_heads, generator=generator) for _ in range(2))
    lse_a[0], lse_b[1] = float("-inf"), float("-inf")
    lse_a[2] = lse_b[2] = float("-inf")
    out_a[0] = float("nan")  # an empty side's output is ignored whatever it holds
    return out_a, lse_a, out_b, lse_b


def naive_merge(out_a, lse_a, out_b, lse_b):
    """Float64, element by element, the two-term softmax-weighted sum."""
    out = torch.zeros(out_a.shape, dtype=torch.float64)
    lse = torch.full(lse_a.shape, float("-inf"), dtype=torch.float64)
    for token in range(out_a.shape[0]):
        for head in range(out_a.shape[1]):
            both = ((out_a[token, head], float(lse_a[token, head])), (out_b[token, head], float(lse_b[token, head])))
            sides = [(o, s) for o, s in both if s != float("-inf")]
            if not sides:
                continue
            total = math.log(sum(math.exp(s) for _, s in sides))
            lse[token, head] = total
            out[token, head] = sum(o.double() * math.exp(s - total) for o, s in sides)
    return out, lse


@requires_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(5, 3, 64), (4, 8, 128), (3, 1, 64)])
def test_merge_matches_twin_and_naive(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype):
    states = random_states(num_tokens, num_heads, head_dim, dtype, torch.Generator().manual_seed(num_tokens))
    out, lse = merge_attention_states_triton(*states)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(lse[2], torch.full((num_heads,), float("-inf"))) and torch.all(out[2] == 0)
    fp32_math, rounded_output = TOLERANCE[dtype]
    for expected in (merge_attention_states_torch(*states), naive_merge(*states)):
        assert_close(out, expected[0], rounded_output)
        assert_close(lse, expected[1], fp32_math)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", BATCHES[1:3], ids=str)
def test_merged_halves_equal_attention_over_the_union(batch: Batch, dtype: torch.dtype):
    """Attention over every (request, head)'s cells = merge of attention over a split of them into two sets."""
    q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale = make_batch(batch, dtype, seed=3)
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    first_counts = counts // 3  # some sequences put every cell in the second set, none in the first
    in_first = torch.cat([torch.arange(int(n)) < int(f) for n, f in zip(counts, first_counts)])

    def sub_batch(mask: torch.Tensor, sub_counts: torch.Tensor):
        sub_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), sub_counts.cumsum(0)]).to(torch.int32)
        sub_cells = kv_indices[mask]
        return segment_attention_triton(q, arena_k, arena_v, qo_indptr, sub_indptr, sub_cells, num_kv_heads, sm_scale)

    first, second = sub_batch(in_first, first_counts), sub_batch(~in_first, counts - first_counts)
    merged = merge_attention_states_triton(*first, *second)
    whole = naive_segment_attention(q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, num_kv_heads, sm_scale)
    fp32_math, via_p_at_v = TOLERANCE[dtype]
    assert_close(merged[0], whole[0], 2 * via_p_at_v)  # two rounded partial outputs, then a rounded merge
    assert_close(merged[1], whole[1], fp32_math)


def test_rejects_indptr_that_is_not_per_request_and_head():
    q, arena_k, arena_v, qo_indptr, kv_indptr, kv_indices, *heads_and_scale = make_batch(BATCHES[0], torch.float32)
    for segment_attention_impl in (segment_attention_torch, segment_attention_triton):
        with pytest.raises(ValueError, match="B \\* H_kv \\+ 1"):
            segment_attention_impl(q, arena_k, arena_v, qo_indptr, kv_indptr[:-1], kv_indices, *heads_and_scale)
