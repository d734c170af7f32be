"""Window-statistics kernel (Triton: interpreter, or compiled on CUDA) against its torch twin, the
reference ``window_stats`` on the position-indexed cache, and a naive float64 per-row formula."""

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
    no_host_sync,
    on_kernel_devices,
    random_kv_buffer,
    requires_interpreter,
    scattered_slots,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sgl_kvevict.kernels.window_scores import CompressedCells, window_stats_torch, window_stats_triton
from sgl_kvevict.scoring.window import COLUMN_STATS, StatsRequest, WindowStats, window_stats

test_in_interpreter_process = interpreter_process_test(__file__)

EVERY_STAT = StatsRequest(
    attn_sum=True, attn_max=True, tail_rows=3, obc_value=True, obc_key=True, obc_joint=True, value_l1=True
)
# Statistics that go through the window outputs o_i = P @ V (P rounded to the KV dtype).
VIA_OUTPUTS = {"obc_key", "obc_joint"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A request without compressed prefix: dense keys at positions ``0 .. L - 1``."""

    num_kv_heads: int
    group: int
    head_dim: int
    context_len: int  # L; the kernels use 32-key blocks
    window: int
    head_dim_v: int = 0  # 0: head_dim

    @property
    def value_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    def __str__(self) -> str:
        dims = f"d{self.head_dim}" + (f"-dv{self.head_dim_v}" if self.head_dim_v else "")
        return f"kv{self.num_kv_heads}-g{self.group}-{dims}-L{self.context_len}-w{self.window}"


SHAPES = [
    Shape(num_kv_heads=2, group=1, head_dim=64, context_len=45, window=8),
    Shape(num_kv_heads=1, group=3, head_dim=64, context_len=70, window=5),  # 3 key splits, padded group
    Shape(num_kv_heads=2, group=4, head_dim=128, context_len=33, window=16),
    Shape(num_kv_heads=1, group=8, head_dim=64, context_len=40, window=32),  # 4 head blocks of 2
    Shape(num_kv_heads=1, group=3, head_dim=128, context_len=12, window=12),  # the window is the context
    Shape(num_kv_heads=2, group=4, head_dim=64, context_len=1, window=1),  # a single key
    Shape(num_kv_heads=2, group=2, head_dim=128, context_len=50, window=40, head_dim_v=64),  # w > a key block
    Shape(num_kv_heads=1, group=2, head_dim=256, context_len=20, window=4),  # Gemma's head size
]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A request reusing a compressed prefix: positions in ``compressed`` segments are no dense keys; KV
    head ``g`` keeps ``cells_per_head[g]`` of them as cells. ``cells_after_context`` extra cells per
    head lie at positions ``>= L`` (a caller passing a layer's whole path): they must change nothing."""

    num_kv_heads: int
    group: int
    head_dim: int
    head_dim_v: int
    context_len: int
    window: int
    compressed: tuple[tuple[int, int], ...]
    cells_per_head: tuple[int, ...]
    cells_after_context: int = 0

    def __str__(self) -> str:
        segments = "+".join(f"{start}-{end}" for start, end in self.compressed)
        cells = "-".join(map(str, self.cells_per_head))
        after = f"-after{self.cells_after_context}" if self.cells_after_context else ""
        return (
            f"kv{self.num_kv_heads}-g{self.group}-d{self.head_dim}-dv{self.head_dim_v}-L{self.context_len}"
            f"-w{self.window}-gaps{segments}-cells{cells}{after}"
        )


LAYOUTS = [
    # G = 1; a head without cells, a head with one, a head with many
    Layout(3, 1, 64, 64, context_len=90, window=8, compressed=((4, 50),), cells_per_head=(0, 1, 30)),
    # two gaps, a window longer than a key block, D_v != D, cells of positions after L
    Layout(2, 3, 128, 64, 75, 40, compressed=((0, 10), (20, 30)), cells_per_head=(12, 5), cells_after_context=3),
    # many cells: several cell blocks and key splits per head
    Layout(1, 4, 64, 128, context_len=150, window=16, compressed=((10, 120),), cells_per_head=(70,)),
    # everything before the window compressed: one head keeps it all, the other nothing but the window
    Layout(2, 8, 64, 64, context_len=50, window=5, compressed=((0, 45),), cells_per_head=(45, 0)),
]
# A KVzip reconstruction chunk: hundreds of window queries (several query blocks and chunks of the
# reference) over a context with a compressed prefix.
RECONSTRUCTION = Layout(1, 2, 64, 64, context_len=520, window=300, compressed=((16, 180),), cells_per_head=(40,))


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of one layer, as the kernels read it and as the reference sees it."""

    q_window: torch.Tensor  # [H_q, w, D]
    k_buffer: torch.Tensor  # [slots, H_kv, D], NaN outside the request's slots
    v_buffer: torch.Tensor
    kv_indices: torch.Tensor  # [n]
    key_positions: torch.Tensor | None  # [n]
    context_length: int
    cells: CompressedCells | None
    scaling: float
    keys: torch.Tensor  # [H_kv, L, D]: the logical cache, the reference's input
    values: torch.Tensor
    kept: torch.Tensor | None  # bool [H_kv, L]

    def kernel_args(self, device: str = "cpu") -> tuple:
        def to(t):
            return None if t is None else t.to(device)

        cells = None
        if self.cells is not None:
            cells = CompressedCells(*(to(getattr(self.cells, f.name)) for f in dataclasses.fields(CompressedCells)))
        return (
            to(self.q_window), to(self.k_buffer), to(self.v_buffer), to(self.kv_indices), self.scaling
        ), dict(key_positions=to(self.key_positions), context_length=self.context_length, cells=cells)

    def run(self, impl, request: StatsRequest, device: str = "cpu") -> WindowStats:
        args, kwargs = self.kernel_args(device)
        return impl(*args, request, **kwargs)

    def reference(self, request: StatsRequest) -> WindowStats:
        return window_stats(self.q_window, self.keys, self.values, self.scaling, request, kept=self.kept)


def plain_request(shape: Shape, dtype: torch.dtype, seed: int = 0) -> Request:
    """Random queries, NaN-padded KV buffers ``[slots, H_kv, D]`` and the request's slot list ``[L]``."""
    generator = torch.Generator().manual_seed(seed)
    num_slots = 2 * shape.context_len + 7
    kv_indices = scattered_slots(shape.context_len, num_slots, generator)
    k_buffer, _ = random_kv_buffer(num_slots, shape.num_kv_heads, shape.head_dim, dtype, generator, kv_indices)
    v_buffer, _ = random_kv_buffer(num_slots, shape.num_kv_heads, shape.value_dim, dtype, generator, kv_indices)
    num_q_heads = shape.num_kv_heads * shape.group
    q_window = torch.randn(num_q_heads, shape.window, shape.head_dim, generator=generator).to(dtype)
    keys, values = (buffer[kv_indices.long()].transpose(0, 1) for buffer in (k_buffer, v_buffer))
    return Request(
        q_window, k_buffer, v_buffer, kv_indices, None, shape.context_len, None, 1 / math.sqrt(shape.head_dim),
        keys, values, None,
    )  # fmt: skip


def compressed_request(layout: Layout, dtype: torch.dtype, seed: int = 0) -> Request:
    """The logical cache first (keys, values ``[H_kv, L, D]`` and the kept mask), then where an engine
    holds it: dense positions in scattered slots of NaN-padded buffers, each head's cells in shuffled
    order at random rows of a NaN-padded cell store."""
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads, length = layout.num_kv_heads, layout.context_len
    is_dense = torch.ones(length, dtype=torch.bool)
    for start, end in layout.compressed:
        is_dense[start:end] = False
    dense_positions = is_dense.nonzero().squeeze(1)
    compressed_positions = (~is_dense).nonzero().squeeze(1)
    keys = torch.randn(num_kv_heads, length, layout.head_dim, generator=generator).to(dtype)
    values = torch.randn(num_kv_heads, length, layout.head_dim_v, generator=generator).to(dtype)
    kept = is_dense.expand(num_kv_heads, length).clone()

    num_slots = 2 * len(dense_positions) + 5
    kv_indices = scattered_slots(len(dense_positions), num_slots, generator)
    k_buffer = torch.full((num_slots, num_kv_heads, layout.head_dim), float("nan"), dtype=dtype)
    v_buffer = torch.full((num_slots, num_kv_heads, layout.head_dim_v), float("nan"), dtype=dtype)
    k_buffer[kv_indices.long()] = keys[:, dense_positions].transpose(0, 1)
    v_buffer[kv_indices.long()] = values[:, dense_positions].transpose(0, 1)

    head_positions, head_keys, head_values = [], [], []
    for head, count in enumerate(layout.cells_per_head):
        chosen = compressed_positions[torch.randperm(len(compressed_positions), generator=generator)[:count]]
        kept[head, chosen] = True
        after = length + torch.randperm(8, generator=generator)[: layout.cells_after_context]
        head_positions.append(torch.cat([chosen, after]))
        head_keys.append(torch.cat([keys[head, chosen], torch.randn(len(after), layout.head_dim).to(dtype)]))
        head_values.append(torch.cat([values[head, chosen], torch.randn(len(after), layout.head_dim_v).to(dtype)]))
    counts = torch.tensor([len(positions) for positions in head_positions])
    nnz = int(counts.sum())
    cell_ids = torch.randperm(nnz + 9, generator=generator)[:nnz]
    cell_k = torch.full((nnz + 9, layout.head_dim), float("nan"), dtype=dtype)
    cell_v = torch.full((nnz + 9, layout.head_dim_v), float("nan"), dtype=dtype)
    cell_k[cell_ids], cell_v[cell_ids] = torch.cat(head_keys), torch.cat(head_values)
    cells = CompressedCells(
        cell_k, cell_v, cell_ids, torch.cat(head_positions).to(torch.int32),
        torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32),
    )  # fmt: skip
    q_window = torch.randn(num_kv_heads * layout.group, layout.window, layout.head_dim, generator=generator)
    return Request(
        q_window.to(dtype), k_buffer, v_buffer, kv_indices, dense_positions, length, cells,
        1 / math.sqrt(layout.head_dim), keys, values, kept,
    )  # fmt: skip


def tail_rows_for(window: int) -> StatsRequest:
    return dataclasses.replace(EVERY_STAT, tail_rows=min(EVERY_STAT.tail_rows, window))


def naive_window_stats(request: Request, tail_rows: int) -> dict[str, torch.Tensor]:
    """The formulas of ``scoring/window.py`` row by row in float64 over the logical cache, distances in
    their unexpanded form; a query sees the kept keys at positions up to its own."""
    q_window, scaling = request.q_window.double(), request.scaling
    keys, values = request.keys.double(), request.values.double()
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, context, _ = keys.shape
    group = num_q_heads // num_kv_heads
    kept = torch.ones(num_kv_heads, context, dtype=torch.bool) if request.kept is None else request.kept
    stats = {name: torch.zeros(num_q_heads, context, dtype=torch.float64) for name in COLUMN_STATS}
    stats["tail_attn"] = torch.zeros(num_q_heads, tail_rows, context, dtype=torch.float64)
    stats["value_l1"] = values.abs().sum(-1) * kept
    for head in range(num_q_heads):
        for i in range(window):
            seen = kept[head // group] & (torch.arange(context) <= context - window + i)
            k, v = keys[head // group, seen], values[head // group, seen]
            z = scaling * (k @ q_window[head, i])
            a = torch.softmax(z, 0)
            o = a @ v
            stats["attn_sum"][head, seen] += a
            stats["attn_max"][head, seen] = torch.maximum(stats["attn_max"][head, seen], a)
            if i >= window - tail_rows:
                stats["tail_attn"][head, i - (window - tail_rows), seen] = a
            stats["obc_value"][head, seen] += a**2 * v.square().sum(-1)
            stats["obc_key"][head, seen] += a**2 * z**2 * (v - o).square().sum(-1)
            joint = (1 + z)[:, None] * v - z[:, None] * o
            stats["obc_joint"][head, seen] += a**2 * joint.square().sum(-1)
    return stats


def assert_stats_close(actual: WindowStats, expected: WindowStats | dict, dtype: torch.dtype) -> None:
    if isinstance(expected, WindowStats):
        expected = {name: getattr(expected, name) for name in COLUMN_STATS}
    fp32_math, via_outputs = TOLERANCE[dtype]
    # The OBCache key score is a difference of terms of the size of the value score (||v - o||^2 with
    # o close to v when one key dominates, exactly 0 for a single key): measure its error on that scale.
    obc_scale = float(expected["obc_value"].abs().max())
    for name in COLUMN_STATS:
        tolerance = via_outputs if name in VIA_OUTPUTS else fp32_math
        assert getattr(actual, name).dtype == torch.float32, name
        assert getattr(actual, name).shape == expected[name].shape, name
        scale = max(obc_scale, float(expected[name].abs().max())) if name in VIA_OUTPUTS else None
        assert_close(getattr(actual, name), expected[name], tolerance, scale)


@on_kernel_devices
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_plain_request_matches_twin_and_naive(shape: Shape, dtype: torch.dtype, device: str):
    request, stats_request = plain_request(shape, dtype), tail_rows_for(shape.window)
    triton_stats = request.run(window_stats_triton, stats_request, device)
    assert triton_stats.window == shape.window
    assert_stats_close(triton_stats, request.run(window_stats_torch, stats_request, device), dtype)
    assert_stats_close(triton_stats, naive_window_stats(request, stats_request.tail_rows), dtype)


@on_kernel_devices
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_compressed_prefix_matches_reference_on_the_logical_cache(layout: Layout, dtype: torch.dtype, device: str):
    request, stats_request = compressed_request(layout, dtype), tail_rows_for(layout.window)
    expected = request.reference(stats_request)
    assert_stats_close(request.run(window_stats_triton, stats_request, device), expected, dtype)
    assert_stats_close(request.run(window_stats_torch, stats_request, device), expected, torch.float32)


@requires_interpreter
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=str)
def test_compressed_prefix_matches_naive_formula(layout: Layout):
    request, stats_request = compressed_request(layout, torch.float32, seed=1), tail_rows_for(layout.window)
    expected = naive_window_stats(request, stats_request.tail_rows)
    assert_stats_close(request.run(window_stats_triton, stats_request), expected, torch.float32)
    attn_sum = request.run(window_stats_triton, StatsRequest(attn_sum=True)).attn_sum
    held = request.kept.repeat_interleave(layout.group, 0)
    assert torch.all(attn_sum[~held] == 0) and torch.all(attn_sum[held] > 0)  # gaps are exact zeros


@on_kernel_devices
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reconstruction_sized_window(dtype: torch.dtype, device: str):
    request = compressed_request(RECONSTRUCTION, dtype, seed=2)
    stats_request = StatsRequest(attn_sum=True, attn_max=True, tail_rows=2, obc_key=True, value_l1=True)
    actual = request.run(window_stats_triton, stats_request, device)
    expected = request.reference(stats_request)
    fp32_math, via_outputs = TOLERANCE[dtype]
    for name in ("attn_sum", "attn_max", "tail_attn", "value_l1"):
        assert_close(getattr(actual, name), getattr(expected, name), fp32_math)
    assert_close(actual.obc_key, expected.obc_key, via_outputs)
    # KVzip's score: every context position the reconstruction attends to gets its peak weight
    held = request.kept.repeat_interleave(RECONSTRUCTION.group, 0)
    assert torch.all(actual.attn_max.cpu()[held] > 0) and torch.all(actual.attn_max.cpu()[~held] == 0)


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    """What the engine calls once per layer, a compressed prefix with every statistic, never makes the
    host wait for the GPU (the first call compiles, outside the check)."""
    request = compressed_request(LAYOUTS[1], torch.bfloat16)
    request.run(window_stats_triton, EVERY_STAT, "cuda")
    args, kwargs = request.kernel_args("cuda")
    with no_host_sync():
        window_stats_triton(*args, EVERY_STAT, **kwargs)


@requires_interpreter
def test_only_requested_stats_are_computed():
    """A SnapKV-style request (no window outputs needed) skips the output pass and leaves the rest None."""
    shape = SHAPES[1]
    request = plain_request(shape, torch.float16)
    stats = request.run(window_stats_triton, StatsRequest(attn_sum=True))
    assert all(getattr(stats, name) is None for name in COLUMN_STATS if name != "attn_sum")
    expected = request.run(window_stats_torch, StatsRequest(attn_sum=True)).attn_sum
    assert_close(stats.attn_sum, expected, TOLERANCE[torch.float16][0])
    # every window query's attention sums to one over the keys it sees
    assert_close(stats.attn_sum.sum(-1), torch.full((shape.num_kv_heads * shape.group,), float(shape.window)), 1e-5)


@requires_interpreter
def test_attention_is_causal_inside_the_window():
    shape = SHAPES[0]
    stats = plain_request(shape, torch.float32).run(window_stats_triton, StatsRequest(tail_rows=shape.window))
    tail = stats.tail_attn  # [H_q, w, L]: row i sees keys p <= L - w + i
    first_invisible = shape.context_len - shape.window + 1 + torch.arange(shape.window)
    invisible = torch.arange(shape.context_len)[None, :] >= first_invisible[:, None]
    assert torch.all(tail[:, invisible] == 0)
    assert torch.all(tail[:, ~invisible] > 0)


@on_kernel_devices
def test_strided_queries_buffers_and_cell_stores(device: str):
    """Queries sliced from a [N, H_q, D] batch, KV buffers and cell stores that are column slices of wider
    rows (slot, head and cell strides all differ from the dense layout), int64 indices."""
    layout = LAYOUTS[1]
    request = compressed_request(layout, torch.float32)
    (q_window, k_buffer, v_buffer, kv_indices, scaling), kwargs = request.kernel_args(device)

    def widened(t: torch.Tensor) -> torch.Tensor:
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 24), float("nan"), dtype=t.dtype, device=device)
        wide[..., 8 : 8 + t.shape[-1]] = t
        return wide[..., 8 : 8 + t.shape[-1]]

    batch = torch.randn(layout.window + 3, q_window.shape[0], layout.head_dim, device=device)
    batch[3:] = q_window.transpose(0, 1)
    strided_q = batch[3:].transpose(0, 1)  # [H_q, w, D] view with strides (D, H_q * D, 1)
    cells = kwargs["cells"]
    strided_cells = dataclasses.replace(
        cells, cell_k=widened(cells.cell_k), cell_v=widened(cells.cell_v), cell_ids=cells.cell_ids.long()
    )
    strided_args = (strided_q, widened(k_buffer), widened(v_buffer), kv_indices.long(), scaling)
    assert not any(t.is_contiguous() for t in (*strided_args[:3], strided_cells.cell_k, strided_cells.cell_v))
    stats_request = tail_rows_for(layout.window)
    actual = window_stats_triton(*strided_args, stats_request, **{**kwargs, "cells": strided_cells})
    assert_stats_close(actual, request.reference(stats_request), torch.float32)
    twin = window_stats_torch(*strided_args, stats_request, **{**kwargs, "cells": strided_cells})
    assert_stats_close(twin, request.reference(stats_request), torch.float32)


class TensorsOffDevice(TorchDispatchMode):
    """Records every op that returns a tensor off ``device`` (an index put would silently accept one)."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.ops = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += [str(func) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type != self.device]
        return out


def test_twin_creates_every_tensor_on_the_inputs_device():
    """Every input on the meta device, every op of the twin watched: nothing it creates lands on the CPU."""
    request = compressed_request(LAYOUTS[1], torch.float32)
    with TensorsOffDevice("meta") as off_device:
        stats = request.run(window_stats_torch, EVERY_STAT, device="meta")
    assert off_device.ops == []
    for name in COLUMN_STATS:
        assert getattr(stats, name).device.type == "meta", name
    assert stats.attn_max.shape == (LAYOUTS[1].num_kv_heads * LAYOUTS[1].group, LAYOUTS[1].context_len)


def test_rejects_inputs_it_would_silently_misread():
    plain = plain_request(SHAPES[0], torch.float32)
    compressed = compressed_request(LAYOUTS[0], torch.float32)
    (q_window, k_buffer, v_buffer, kv_indices, scaling), kwargs = compressed.kernel_args()
    cells = kwargs["cells"]
    for window_stats_impl in (window_stats_triton, window_stats_torch):
        with pytest.raises(ValueError, match="dtype"):
            window_stats_impl(plain.q_window.half(), *plain.kernel_args()[0][1:], EVERY_STAT)
        with pytest.raises(ValueError, match="tail_rows"):
            too_many_rows = StatsRequest(tail_rows=SHAPES[0].window + 1)
            window_stats_impl(*plain.kernel_args()[0], too_many_rows)
        with pytest.raises(ValueError, match="need key_positions"):
            window_stats_impl(q_window, k_buffer, v_buffer, kv_indices, scaling, EVERY_STAT, cells=cells)
        with pytest.raises(ValueError, match="go together"):
            window_stats_impl(q_window, k_buffer, v_buffer, kv_indices, scaling, EVERY_STAT, key_positions=kv_indices)
        with pytest.raises(ValueError, match="head_indptr"):
            bad_cells = dataclasses.replace(cells, head_indptr=cells.head_indptr[:-1])
            bad_kwargs = {**kwargs, "cells": bad_cells}
            window_stats_impl(q_window, k_buffer, v_buffer, kv_indices, scaling, EVERY_STAT, **bad_kwargs)
