"""Window-statistics kernel (Triton, interpreter mode) against its torch twin and a naive per-row formula."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_kernels_support import (
    DTYPES,
    TOLERANCE,
    assert_close,
    interpreter_process_test,
    random_kv_buffer,
    requires_interpreter,
    scattered_slots,
)

from sgl_kvevict.kernels.window_scores import window_stats_torch, window_stats_triton
from sgl_kvevict.scoring.window import COLUMN_STATS, StatsRequest, WindowStats

test_in_interpreter_process = interpreter_process_test(__file__)

EVERY_STAT = StatsRequest(attn_sum=True, tail_rows=3, obc_value=True, obc_key=True, obc_joint=True, value_l1=True)
# attn_max (KVzip) is not in the Triton kernel yet.
STAT_NAMES = [name for name in COLUMN_STATS if name != "attn_max"]
# Statistics that go through the window outputs o_i = P @ V (P rounded to the KV dtype).
VIA_OUTPUTS = {"obc_key", "obc_joint"}


@dataclasses.dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    group: int
    head_dim: int
    context_len: int  # L; the kernels use 32-key blocks
    window: int

    def __str__(self) -> str:
        return f"kv{self.num_kv_heads}-g{self.group}-d{self.head_dim}-L{self.context_len}-w{self.window}"


SHAPES = [
    Shape(num_kv_heads=2, group=1, head_dim=64, context_len=45, window=8),
    Shape(num_kv_heads=1, group=3, head_dim=64, context_len=70, window=5),  # 3 key splits, padded group
    Shape(num_kv_heads=2, group=4, head_dim=128, context_len=33, window=16),
    Shape(num_kv_heads=1, group=8, head_dim=64, context_len=40, window=32),  # 4 head blocks of 2
    Shape(num_kv_heads=1, group=3, head_dim=128, context_len=12, window=12),  # the window is the context
    Shape(num_kv_heads=2, group=4, head_dim=64, context_len=1, window=1),  # a single key
]


def make_inputs(shape: Shape, dtype: torch.dtype, seed: int = 0):
    """q_window ``[H_q, w, D]``, NaN-padded KV buffers ``[slots, H_kv, D]`` and the request's slot list ``[L]``."""
    generator = torch.Generator().manual_seed(seed)
    num_slots = 2 * shape.context_len + 7
    kv_indices = scattered_slots(shape.context_len, num_slots, generator)
    k_buffer, v_buffer = random_kv_buffer(num_slots, shape.num_kv_heads, shape.head_dim, dtype, generator, kv_indices)
    num_q_heads = shape.num_kv_heads * shape.group
    q_window = torch.randn(num_q_heads, shape.window, shape.head_dim, generator=generator).to(dtype)
    return q_window, k_buffer, v_buffer, kv_indices, 1 / math.sqrt(shape.head_dim)


def request_for(shape: Shape) -> StatsRequest:
    return dataclasses.replace(EVERY_STAT, tail_rows=min(EVERY_STAT.tail_rows, shape.window))


def naive_window_stats(q_window, k_buffer, v_buffer, kv_indices, scaling, tail_rows) -> dict[str, torch.Tensor]:
    """The formulas of ``scoring/window.py`` row by row in float64, distances in their unexpanded form."""
    num_q_heads, window, _ = q_window.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    context = len(kv_indices)
    keys = torch.stack([k_buffer[int(slot)] for slot in kv_indices], 1).double()  # [H_kv, L, D]
    values = torch.stack([v_buffer[int(slot)] for slot in kv_indices], 1).double()
    stats = {name: torch.zeros(num_q_heads, context, dtype=torch.float64) for name in STAT_NAMES}
    stats["tail_attn"] = torch.zeros(num_q_heads, tail_rows, context, dtype=torch.float64)
    stats["value_l1"] = values.abs().sum(-1)
    for head in range(num_q_heads):
        k, v = keys[head // group], values[head // group]
        for i in range(window):
            visible = context - window + i + 1
            z = scaling * (k[:visible] @ q_window[head, i].double())
            a = torch.softmax(z, 0)
            o = a @ v[:visible]
            v_seen = v[:visible]
            stats["attn_sum"][head, :visible] += a
            if i >= window - tail_rows:
                stats["tail_attn"][head, i - (window - tail_rows), :visible] = a
            stats["obc_value"][head, :visible] += a**2 * v_seen.square().sum(-1)
            stats["obc_key"][head, :visible] += a**2 * z**2 * (v_seen - o).square().sum(-1)
            joint = (1 + z)[:, None] * v_seen - z[:, None] * o
            stats["obc_joint"][head, :visible] += a**2 * joint.square().sum(-1)
    return stats


def assert_stats_close(actual: WindowStats, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    fp32_math, via_outputs = TOLERANCE[dtype]
    # The OBCache key score is a difference of terms of the size of the value score (||v - o||^2 with
    # o close to v when one key dominates, exactly 0 for a single key): measure its error on that scale.
    obc_scale = float(expected["obc_value"].abs().max())
    for name in STAT_NAMES:
        tolerance = via_outputs if name in VIA_OUTPUTS else fp32_math
        assert getattr(actual, name).dtype == torch.float32, name
        assert getattr(actual, name).shape == expected[name].shape, name
        scale = max(obc_scale, float(expected[name].abs().max())) if name in VIA_OUTPUTS else None
        assert_close(getattr(actual, name), expected[name], tolerance, scale)


@requires_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_torch_twin(shape: Shape, dtype: torch.dtype):
    inputs = make_inputs(shape, dtype)
    triton_stats = window_stats_triton(*inputs, request_for(shape))
    torch_stats = window_stats_torch(*inputs, request_for(shape))
    assert triton_stats.window == torch_stats.window == shape.window
    assert_stats_close(triton_stats, {name: getattr(torch_stats, name) for name in STAT_NAMES}, dtype)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
def test_triton_matches_naive_formula(shape: Shape, dtype: torch.dtype):
    inputs = make_inputs(shape, dtype, seed=1)
    request = request_for(shape)
    expected = naive_window_stats(*inputs, tail_rows=request.tail_rows)
    assert_stats_close(window_stats_triton(*inputs, request), expected, dtype)


@requires_interpreter
def test_only_requested_stats_are_computed():
    """A SnapKV-style request (no window outputs needed) skips the output pass and leaves the rest None."""
    shape = SHAPES[1]
    inputs = make_inputs(shape, torch.float16)
    request = StatsRequest(attn_sum=True)
    stats = window_stats_triton(*inputs, request)
    assert all(getattr(stats, name) is None for name in STAT_NAMES if name != "attn_sum")
    assert_close(stats.attn_sum, window_stats_torch(*inputs, request).attn_sum, TOLERANCE[torch.float16][0])
    # every window query's attention sums to one over the keys it sees
    assert_close(stats.attn_sum.sum(-1), torch.full((shape.num_kv_heads * shape.group,), float(shape.window)), 1e-5)


@requires_interpreter
def test_attention_is_causal_inside_the_window():
    shape = SHAPES[0]
    stats = window_stats_triton(*make_inputs(shape, torch.float32), StatsRequest(tail_rows=shape.window))
    tail = stats.tail_attn  # [H_q, w, L]: row i sees keys p <= L - w + i
    first_invisible = shape.context_len - shape.window + 1 + torch.arange(shape.window)
    invisible = torch.arange(shape.context_len)[None, :] >= first_invisible[:, None]
    assert torch.all(tail[:, invisible] == 0)
    assert torch.all(tail[:, ~invisible] > 0)


@requires_interpreter
def test_strided_queries_and_int64_slots():
    """Window queries sliced out of a larger [N, H_q, D] batch (non-contiguous) and int64 slot lists."""
    shape = SHAPES[2]
    q_window, k_buffer, v_buffer, kv_indices, scaling = make_inputs(shape, torch.float32)
    batch = torch.randn(shape.window + 3, q_window.shape[0], shape.head_dim)
    batch[3:] = q_window.transpose(0, 1)
    strided = batch[3:].transpose(0, 1)  # [H_q, w, D] view with strides (D, H_q * D, 1)
    assert not strided.is_contiguous()
    request = request_for(shape)
    actual = window_stats_triton(strided, k_buffer, v_buffer, kv_indices.long(), scaling, request)
    expected = window_stats_torch(q_window, k_buffer, v_buffer, kv_indices, scaling, request)
    assert_stats_close(actual, {name: getattr(expected, name) for name in STAT_NAMES}, torch.float32)


def test_rejects_inputs_it_would_silently_misread():
    q_window, k_buffer, v_buffer, kv_indices, scaling = make_inputs(SHAPES[0], torch.float32)
    for window_stats_impl in (window_stats_triton, window_stats_torch):
        with pytest.raises(ValueError, match="dtype"):
            window_stats_impl(q_window.half(), k_buffer, v_buffer, kv_indices, scaling, EVERY_STAT)
        with pytest.raises(ValueError, match="tail_rows"):
            too_many_rows = StatsRequest(tail_rows=SHAPES[0].window + 1)
            window_stats_impl(q_window, k_buffer, v_buffer, kv_indices, scaling, too_many_rows)
