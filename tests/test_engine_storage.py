"""The arena's ledger and the compressed-span bookkeeping, without a server."""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict.engine.arena import Arena, ArenaError, arena_slot_equivalents
from sgl_kvevict.engine.segments import CompressedSegment, PathView, skip_plan_prefix, truncate_plan
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.serving import ServingConfig


def small_arena(cells_per_layer: int = 8) -> Arena:
    return Arena(num_layers=2, cells_per_layer=cells_per_layer, head_dim=4, v_head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def test_arena_allocates_per_layer_all_or_nothing_and_detects_double_free():
    arena = small_arena()
    cells = arena.alloc([3, 8])
    assert [len(c) for c in cells] == [3, 8] and arena.cells_used == 11
    assert arena.alloc([1, 1]) is None  # layer 1 is full: nothing is taken from layer 0 either
    assert arena.cells_free(0) == 5
    arena.free(cells)
    assert arena.cells_used == 0
    with pytest.raises(ArenaError):
        arena.free(cells)
    arena.check_consistent()
    arena.alloc([2, 2])
    arena.reset()
    assert arena.cells_used == 0 and arena.cells_free(1) == 8
    arena.check_consistent()


def test_arena_size_is_the_kv_memory_share_the_dense_pool_gave_up():
    assert arena_slot_equivalents(ServingConfig("snapkv", {}, 0.5), dense_slots=4096) == 4096
    assert arena_slot_equivalents(ServingConfig("snapkv", {}, 0.25), dense_slots=3000) == 1000
    launcher_sized = ServingConfig("snapkv", {}, 0.05, kv_pool_tokens=2600)
    assert arena_slot_equivalents(launcher_sized, dense_slots=launcher_sized.dense_slots) == 130


def plan_of(start: int, end: int, heads: list[list[int]]) -> CompressionPlan:
    layer = LayerPlan.from_heads([torch.tensor(h) for h in heads])
    return CompressionPlan(start, end, (layer, layer))


def test_truncate_plan_drops_the_window_per_head():
    plan = plan_of(10, 20, [[10, 12, 18, 19], [11, 18, 19]])
    kept = truncate_plan(plan, 18)
    assert kept.segment_end == 18
    assert kept.layers[0].kept_positions.tolist() == [10, 12, 11]
    assert kept.layers[0].head_indptr.tolist() == [0, 2, 3]


def test_skip_plan_prefix_drops_the_shared_positions_per_head():
    own = skip_plan_prefix(truncate_plan(plan_of(10, 20, [[10, 12, 18, 19], [11, 14, 15]]), 18), 12)
    assert (own.segment_start, own.segment_end) == (12, 18)
    assert own.layers[1].kept_positions.tolist() == [12, 14, 15]
    assert own.layers[1].head_indptr.tolist() == [0, 1, 3]


def test_compressed_segment_splits_its_cells_by_position_per_head():
    segment = CompressedSegment.of(plan_of(0, 10, [[1, 4, 7], [2, 3, 8, 9]]), [torch.arange(7), torch.arange(7, 14)])
    head, tail = segment.split(4)
    assert (head.start, head.length, tail.start, tail.length) == (0, 4, 4, 6)
    assert head.cells[0].tolist() == [0, 3, 4] and head.head_indptr[0].tolist() == [0, 1, 3]
    assert head.positions[1].tolist() == [1, 2, 3]
    assert tail.cells[1].tolist() == [8, 9, 12, 13] and tail.head_indptr[1].tolist() == [0, 2, 4]
    assert tail.positions[0].tolist() == [4, 7, 8, 9]
    assert head.num_cells + tail.num_cells == segment.num_cells


def test_path_view_groups_cells_by_head_over_spans_and_knows_the_dense_positions():
    first = CompressedSegment.of(truncate_plan(plan_of(0, 8, [[1, 2], [3]]), 8), [torch.tensor([5, 6, 7])] * 2)
    second = CompressedSegment.of(truncate_plan(plan_of(12, 16, [[12], [13, 14]]), 16), [torch.tensor([0, 1, 2])] * 2)
    view = PathView.of([first, second], num_layers=2, num_kv_heads=2)
    assert view.spans == ((0, 8), (12, 16))
    assert view.head_counts[0].tolist() == [3, 3]
    assert view.cells[1].tolist() == [5, 6, 0, 7, 1, 2]  # head 0: both spans in path order, then head 1
    assert view.compressed_tokens == 12
    assert view.dense_positions(18, torch.device("cpu")).tolist() == [8, 9, 10, 11, 16, 17]
