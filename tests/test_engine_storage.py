"""Where compressed KV lives, without a server: the cell space over SGLang's pool, the arena's ledger
(borrowing, adopting, freeing, moving cells), compressed segments and path views."""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict.engine.arena import Arena, ArenaError, SlotSource
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.segments import CompressedSegment, PathView
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.sharding import RankCounts, position_counts

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS = 3, 2, 4, 20
CELLS_PER_SLOT = NUM_LAYERS * NUM_KV_HEADS


def fused_buffers(head_dim_v: int = HEAD_DIM):
    """Per-layer K and V buffers laid out as ``engine.adapter.pool`` allocates them (one storage)."""
    if head_dim_v == HEAD_DIM:
        storage = torch.zeros(NUM_LAYERS, 2, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
        return [storage[layer, 0] for layer in range(NUM_LAYERS)], [storage[layer, 1] for layer in range(NUM_LAYERS)]
    k = torch.zeros(NUM_LAYERS, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    v = torch.zeros(NUM_LAYERS, NUM_SLOTS, NUM_KV_HEADS, head_dim_v)
    return list(k.unbind(0)), list(v.unbind(0))


@pytest.mark.parametrize("head_dim_v", [HEAD_DIM, 6])
def test_cell_ids_address_every_layer_slot_and_head_in_place(head_dim_v):
    k_buffers, v_buffers = fused_buffers(head_dim_v)
    space = CellSpace.of_buffers(k_buffers, v_buffers)
    assert space.cells_per_slot == CELLS_PER_SLOT
    cells = space.cells_of_slots(torch.tensor([3, 7]))
    assert cells.shape == (2, CELLS_PER_SLOT)
    for index, (layer, head) in enumerate((l, h) for l in range(NUM_LAYERS) for h in range(NUM_KV_HEADS)):
        k_buffers[layer][7, head] = 1.0 + index
        v_buffers[layer][7, head] = -1.0 - index
        assert space.slot_of(cells[1, index : index + 1]).item() == 7
        assert space.index_in_slot(cells[1, index : index + 1]).item() == index
    assert torch.equal(space.k_rows[cells[1]][:, 0], torch.arange(1.0, CELLS_PER_SLOT + 1))
    assert torch.equal(space.v_rows[cells[1]][:, 0], -torch.arange(1.0, CELLS_PER_SLOT + 1))
    space.copy(cells[1], cells[0])  # one copy over every layer, through the flat views
    assert torch.equal(k_buffers[2][3], k_buffers[2][7]) and torch.equal(v_buffers[0][3], v_buffers[0][7])


def test_a_pool_whose_layers_are_separate_allocations_is_refused():
    k_buffers = [torch.zeros(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    v_buffers = [torch.zeros(NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    with pytest.raises(ValueError, match="one allocation"):
        CellSpace.of_buffers(k_buffers, v_buffers)


class FakeAllocator:
    """SGLang's allocator contract the arena uses: alloc n (or None), free."""

    def __init__(self, slots: int):
        self.free_slots = list(range(1, slots))

    def borrow(self, count: int):
        if count > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        return torch.tensor(taken, dtype=torch.int64)

    def give_back(self, slots: torch.Tensor) -> None:
        assert not set(slots.tolist()) & set(self.free_slots), "double free into the allocator"
        self.free_slots += slots.tolist()


class Owner:
    """A minimal cell owner (a compressed segment's role)."""

    def __init__(self, arena: Arena, count: int):
        self.cells = torch.full((count,), -1, dtype=torch.int64)
        self.owner_id = arena.register(self)

    def relocate(self, indices, cells):
        self.cells[indices] = cells


def make_arena(slots: int = NUM_SLOTS):
    space = CellSpace.of_buffers(*fused_buffers())
    allocator = FakeAllocator(slots)
    return Arena(space, SlotSource(allocator.borrow, allocator.give_back, space.copy)), allocator, space


def test_arena_borrows_whole_slots_and_gives_empty_ones_back():
    arena, allocator, _ = make_arena()
    first = Owner(arena, CELLS_PER_SLOT + 1)
    assert arena.alloc(first, CELLS_PER_SLOT + 1) is not None
    assert arena.slots_borrowed == 2 and arena.cells_used == CELLS_PER_SLOT + 1 and len(allocator.free_slots) == 17
    assert len(set(first.cells.tolist())) == CELLS_PER_SLOT + 1
    second = Owner(arena, 3)
    arena.alloc(second, 3)
    assert arena.slots_borrowed == 2  # holes of the borrowed slots first
    arena.free(first, first.cells)  # one slot emptied: it stays borrowed until SGLang asks for room
    assert arena.slots_borrowed == 2 and arena.slots_reclaimable_by_moves == 1
    with pytest.raises(ArenaError):
        arena.free(first, first.cells[:1])  # double free
    with pytest.raises(ArenaError, match="does not own"):
        arena.free(first, second.cells[:1])  # another owner's cell
    arena.check_consistent()
    assert arena.release_slots(5) == 1 and arena.cells_moved == 0  # the empty slot, nothing moved
    assert arena.slots_borrowed == 1 and len(allocator.free_slots) == 18
    arena.free(second, second.cells)
    assert arena.release_slots(5) == 1 and arena.slots_borrowed == 0
    arena.check_consistent()


def test_arena_adopts_the_callers_slots_before_borrowing_and_refuses_what_does_not_fit():
    arena, allocator, _ = make_arena(slots=4)
    owner = Owner(arena, 2 * CELLS_PER_SLOT)
    adopted = arena.alloc(owner, 2 * CELLS_PER_SLOT, adoptable=torch.tensor([15, 16, 17]))
    assert adopted.tolist() == [15, 16] and len(allocator.free_slots) == 3  # nothing borrowed
    too_big = Owner(arena, 4 * CELLS_PER_SLOT)
    assert arena.alloc(too_big, 4 * CELLS_PER_SLOT) is None  # 3 free slots are not 4: nothing taken
    assert arena.cells_used == 2 * CELLS_PER_SLOT and len(allocator.free_slots) == 3
    arena.check_consistent()


def test_release_slots_moves_cells_into_holes_and_tells_their_owners():
    arena, allocator, space = make_arena()
    owners = [Owner(arena, CELLS_PER_SLOT) for _ in range(4)]
    for owner in owners:
        arena.alloc(owner, CELLS_PER_SLOT)
    space.k_rows[torch.cat([o.cells for o in owners])] = torch.arange(4 * CELLS_PER_SLOT, dtype=torch.float32)[:, None]
    kept = [(owner, owner.cells[:2].clone(), space.k_rows[owner.cells[:2]].clone()) for owner in owners]
    for owner in owners:  # every slot keeps two cells: four slots, 4 * (CELLS_PER_SLOT - 2) holes
        arena.free(owner, owner.cells[2:])
    generation = arena.generation
    assert arena.slots_borrowed == 4 and arena.slots_reclaimable_by_moves == 2
    assert arena.release_slots(10) == 2
    assert arena.slots_borrowed == 2 and arena.cells_moved == 4 and arena.generation > generation
    for owner, before, values in kept:
        assert torch.equal(space.k_rows[owner.cells[:2]], values)  # contents followed the moves
    assert sum(int((owner.cells[:2] != before).any()) for owner, before, _ in kept) == 2
    arena.check_consistent()


def test_locked_cells_are_what_no_eviction_can_give_back():
    arena, _, _ = make_arena()
    owner = Owner(arena, CELLS_PER_SLOT + 1)
    arena.alloc(owner, CELLS_PER_SLOT + 1)
    arena.lock(CELLS_PER_SLOT + 1)
    assert arena.slots_protected == 2
    arena.unlock(CELLS_PER_SLOT + 1)
    assert arena.slots_protected == 0
    with pytest.raises(ArenaError):
        arena.unlock(1)


def test_transfer_gives_cells_to_a_new_owner_without_moving_them():
    arena, _, _ = make_arena()
    whole = Owner(arena, 5)
    arena.alloc(whole, 5)
    part = Owner(arena, 2)
    arena.transfer(whole, torch.tensor([1, 3]), part, torch.tensor([0, 1]))
    assert part.cells.tolist() == whole.cells[[1, 3]].tolist()
    arena.free(part, part.cells)
    with pytest.raises(ArenaError):
        arena.free(whole, whole.cells)  # two of them are not its own any more
    arena.free(whole, whole.cells[[0, 2, 4]])
    assert arena.cells_used == 0
    arena.check_consistent()


def plan_of(start: int, end: int, heads: list[list[int]], num_layers: int = 2) -> CompressionPlan:
    layer = LayerPlan.from_heads([torch.tensor(h) for h in heads])
    return CompressionPlan(start, end, (layer,) * num_layers)


def test_a_restricted_plan_keeps_each_heads_positions_inside_the_segment():
    plan = plan_of(10, 20, [[10, 12, 18, 19], [11, 14, 18, 19]])
    kept = plan.restricted(12, 18)
    assert (kept.segment_start, kept.segment_end) == (12, 18)
    assert kept.layers[1].kept_positions.tolist() == [12, 14]
    assert kept.layers[1].head_indptr.tolist() == [0, 1, 2]


def segment_of(plan: CompressionPlan) -> CompressedSegment:
    return CompressedSegment.of_plan(plan, RankCounts.of_plan(plan))


def test_compressed_segment_lists_entries_layer_then_head_then_position_and_splits_by_position():
    segment = segment_of(plan_of(0, 10, [[1, 4, 7], [2, 3, 8, 9]]))
    assert segment.counts.tolist() == [[3, 4], [3, 4]]
    assert segment.layer_ids().tolist() == [0] * 7 + [1] * 7
    assert segment.head_ids().tolist() == [0, 0, 0, 1, 1, 1, 1] * 2
    split = segment.split(4)
    head, tail = split.parts
    assert head.counts.tolist() == [[1, 2], [1, 2]] and head.positions.tolist() == [1, 2, 3] * 2
    assert tail.counts.tolist() == [[2, 2], [2, 2]] and tail.positions.tolist() == [4, 7, 8, 9] * 2
    assert head.num_cells + tail.num_cells == segment.num_cells and split.extra == 0
    assert split.taken[0].tolist() == [0, 3, 4, 7, 10, 11]  # the entries before 4, in entry order


def test_a_segment_reserves_what_the_rank_keeping_most_keeps_on_each_side_of_a_split():
    # This rank keeps 6 entries of [0, 10), 3 of them before 5; another rank keeps 8: 7 before 5, 1 after.
    plan = plan_of(0, 10, [[1, 4, 7]], num_layers=2)
    other_rank = torch.zeros(10, dtype=torch.int64)
    other_rank[[0, 1, 2, 3]] = 2
    counts = RankCounts.of_positions(0, torch.stack([position_counts(plan), other_rank]), entries_per_position=4)
    segment = CompressedSegment.of_plan(plan, counts)
    assert (segment.num_entries, segment.num_cells) == (6, 8)  # two spare cells
    split = segment.split(5)
    head, tail = split.parts
    assert (head.num_entries, head.num_cells) == (4, 8) and (tail.num_entries, tail.num_cells) == (2, 2)
    assert split.taken[0].tolist() == [0, 1, 3, 4, 6, 7] and split.taken[1].tolist() == [2, 5]
    assert (split.missing(0), split.missing(1), split.extra) == (2, 0, 2)  # 10 cells reserved after, 8 before


def test_path_view_groups_cells_by_layer_and_head_over_segments_in_path_order():
    first = segment_of(plan_of(0, 8, [[1, 2], [3]]))
    first.cells = torch.tensor([50, 51, 52, 60, 61, 62])
    second = segment_of(plan_of(12, 16, [[12], [13, 14]]))
    second.cells = torch.tensor([70, 71, 72, 80, 81, 82])
    view = PathView.of([first, second], torch.device("cpu"))
    assert view.ranges == ((0, 8), (12, 16))
    assert view.counts.tolist() == [[3, 3], [3, 3]]
    assert view.layer_offsets == (0, 6, 12)
    # layer 0: head 0 of both segments in path order, then head 1; then layer 1 the same.
    assert view.cells.tolist() == [50, 51, 70, 52, 71, 72, 60, 61, 80, 62, 81, 82]
    assert view.positions.tolist() == [1, 2, 12, 3, 13, 14] * 2
    assert view.compressed_tokens == 12
    assert view.dense_ranges(18) == [(8, 12), (16, 18)]
    assert view.dense_ranges(10) == [(8, 10)]
