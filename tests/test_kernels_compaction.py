"""Compaction kernel (Triton, interpreter mode): KV buffer -> arena cells and back, against torch twin and a loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_support import (
    DTYPES,
    interpreter_process_test,
    on_kernel_devices,
    random_kv_buffer,
    requires_interpreter,
    scattered_slots,
)

from sgl_kvevict.kernels import ArenaCellMap, copy_kv_rows, gather_kv_to_arena, scatter_arena_to_kv
from sgl_kvevict.kernels.compaction import copy_kv_rows_torch, copy_kv_rows_triton, kv_buffer_rows
from sgl_kvevict.plan import LayerPlan

test_in_interpreter_process = interpreter_process_test(__file__)

SEGMENT_START, SEGMENT_END = 5, 70
SENTINEL = -7.0  # arena cells outside the map keep it


@dataclasses.dataclass(frozen=True)
class Case:
    kept_per_head: tuple[int, ...]  # entries kept by each KV head (the kernel copies 32 rows per program)
    head_dim: int
    head_dim_v: int

    def __str__(self) -> str:
        return f"kept{'-'.join(map(str, self.kept_per_head))}-d{self.head_dim}-dv{self.head_dim_v}"


CASES = [
    Case(kept_per_head=(45,), head_dim=64, head_dim_v=64),
    Case(kept_per_head=(0, 1, 33), head_dim=128, head_dim_v=128),  # an empty head and a single entry
    Case(kept_per_head=(7, 0, 12, 3, 30, 1, 9, 20), head_dim=64, head_dim_v=128),
    Case(kept_per_head=(0, 0), head_dim=64, head_dim_v=64),  # nothing kept at all
]


def make_case(case: Case, dtype: torch.dtype, seed: int = 0):
    """KV buffers ``[slots, H_kv, D]``, a request row (position -> slot), a LayerPlan and its ArenaCellMap."""
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads = len(case.kept_per_head)
    num_slots = 2 * SEGMENT_END
    row = scattered_slots(SEGMENT_END, num_slots, generator)  # req_to_token[row, :SEGMENT_END]
    k_buffer, v_buffer = random_kv_buffer(num_slots, num_kv_heads, case.head_dim, dtype, generator)
    v_buffer = torch.randn(num_slots, num_kv_heads, case.head_dim_v, generator=generator).to(dtype)
    span = SEGMENT_END - SEGMENT_START
    plan = LayerPlan.from_heads(
        [SEGMENT_START + torch.randperm(span, generator=generator)[:kept] for kept in case.kept_per_head]
    )
    total = plan.kept_positions.numel()
    cell_ids = torch.randperm(total + 11, generator=generator)[:total]
    return k_buffer, v_buffer, row, plan, ArenaCellMap.from_layer_plan(plan, row, cell_ids), total + 11


def sentinel_arena(num_cells: int, head_dim: int, head_dim_v: int, dtype: torch.dtype):
    return (
        torch.full((num_cells, head_dim), SENTINEL, dtype=dtype),
        torch.full((num_cells, head_dim_v), SENTINEL, dtype=dtype),
    )


@requires_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gather_matches_twin_and_naive_loop(case: Case, dtype: torch.dtype):
    k_buffer, v_buffer, row, plan, cells, num_cells = make_case(case, dtype)
    arena_k, arena_v = sentinel_arena(num_cells, case.head_dim, case.head_dim_v, dtype)
    gather_kv_to_arena(k_buffer, v_buffer, arena_k, arena_v, cells)  # Triton: the interpreter is on

    twin_k, twin_v = sentinel_arena(num_cells, case.head_dim, case.head_dim_v, dtype)
    buffer_rows = cells.buffer_rows(len(case.kept_per_head))
    copy_kv_rows_torch(*kv_buffer_rows(k_buffer, v_buffer), twin_k, twin_v, buffer_rows, cells.cell_ids)
    assert torch.equal(arena_k, twin_k) and torch.equal(arena_v, twin_v)

    expected_k, expected_v = sentinel_arena(num_cells, case.head_dim, case.head_dim_v, dtype)
    for head in range(plan.num_kv_heads):
        start = int(plan.head_indptr[head])
        for offset, position in enumerate(plan.head_positions(head).tolist()):
            cell = int(cells.cell_ids[start + offset])
            expected_k[cell] = k_buffer[int(row[position]), head]
            expected_v[cell] = v_buffer[int(row[position]), head]
    assert torch.equal(arena_k, expected_k) and torch.equal(arena_v, expected_v)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES[1:3], ids=str)
def test_scatter_inverts_gather(case: Case, dtype: torch.dtype):
    k_buffer, v_buffer, _, _, cells, num_cells = make_case(case, dtype, seed=1)
    arena_k, arena_v = sentinel_arena(num_cells, case.head_dim, case.head_dim_v, dtype)
    gather_kv_to_arena(k_buffer, v_buffer, arena_k, arena_v, cells)
    restored_k, restored_v = torch.full_like(k_buffer, float("nan")), torch.full_like(v_buffer, float("nan"))
    scatter_arena_to_kv(arena_k, arena_v, restored_k, restored_v, cells)

    kept = torch.zeros(k_buffer.shape[:2], dtype=torch.bool)
    kept[cells.slots, cells.head_ids] = True
    assert torch.equal(restored_k[kept], k_buffer[kept]) and torch.equal(restored_v[kept], v_buffer[kept])
    assert restored_k[~kept].isnan().all() and restored_v[~kept].isnan().all()  # nothing else written

    twin_k, twin_v = torch.full_like(k_buffer, float("nan")), torch.full_like(v_buffer, float("nan"))
    buffer_rows = cells.buffer_rows(k_buffer.shape[1])
    copy_kv_rows_torch(arena_k, arena_v, *kv_buffer_rows(twin_k, twin_v), cells.cell_ids, buffer_rows)
    assert torch.equal(twin_k.nan_to_num(), restored_k.nan_to_num())
    assert torch.equal(twin_v.nan_to_num(), restored_v.nan_to_num())


@requires_interpreter
def test_row_copy_of_zero_rows_is_a_no_op():
    source = torch.randn(4, 64)
    destination = torch.zeros(4, 64)
    no_rows = torch.zeros(0, dtype=torch.int64)
    copy_kv_rows_triton(source, source, destination, destination, no_rows, no_rows)
    assert torch.equal(destination, torch.zeros(4, 64))


@on_kernel_devices
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_launch_compacts_every_layer_of_a_flat_pool(dtype: torch.dtype, device: str):
    """Every layer's k_buffer[l] is a view of one [layers, slots, H_kv, D] allocation; its flat
    [layers * slots * H_kv, D] view addresses (layer, slot, head) as row (l * slots + s) * H_kv + h.
    Kept entries of all layers move into free slots of the same pool (cells in place) in one call,
    then some cells move again (defragmentation): each equals the per-layer loop of the same copies."""
    generator = torch.Generator().manual_seed(4)
    num_layers, num_slots, num_kv_heads, head_dim, head_dim_v = 3, 40, 4, 64, 128
    pool_k = torch.randn(num_layers, num_slots, num_kv_heads, head_dim, generator=generator).to(dtype).to(device)
    pool_v = torch.randn(num_layers, num_slots, num_kv_heads, head_dim_v, generator=generator).to(dtype).to(device)
    flat_k, flat_v = pool_k.view(-1, head_dim), pool_v.view(-1, head_dim_v)
    assert all(pool_k[layer].data_ptr() == flat_k[layer * num_slots * num_kv_heads].data_ptr() for layer in range(3))

    # Dense entries live in slots 1..19; cells are rows of slots 20..39 (same layers, any head).
    kept = 50  # per layer
    layer_ids = torch.arange(num_layers).repeat_interleave(kept)
    dense_rows = (layer_ids * num_slots + torch.randint(1, 20, (len(layer_ids),), generator=generator)) * num_kv_heads
    dense_rows += torch.randint(0, num_kv_heads, (len(layer_ids),), generator=generator)
    cell_rows = (layer_ids * num_slots + 20) * num_kv_heads + torch.randperm(20 * num_kv_heads, generator=generator)[
        torch.arange(len(layer_ids)) % kept
    ]
    expected_k, expected_v = flat_k.clone(), flat_v.clone()
    for layer in range(num_layers):  # the per-layer loop the single launch replaces
        in_layer = layer_ids == layer
        rows = (dense_rows[in_layer].to(device), cell_rows[in_layer].to(device))
        copy_kv_rows_torch(expected_k, expected_v, expected_k, expected_v, *rows)
    copy_kv_rows(flat_k, flat_v, flat_k, flat_v, dense_rows.to(device), cell_rows.to(device))
    assert torch.equal(flat_k, expected_k) and torch.equal(flat_v, expected_v)

    moved_from = cell_rows[::3]
    moved_to = moved_from + 3 * num_slots * num_kv_heads  # rows of a larger store, past the source's size
    destination_k = torch.zeros(2 * flat_k.shape[0], head_dim, dtype=dtype, device=device)
    destination_v = torch.zeros(2 * flat_v.shape[0], head_dim_v, dtype=dtype, device=device)
    copy_kv_rows(flat_k, flat_v, destination_k, destination_v, moved_from.int().to(device), moved_to.to(device))
    assert torch.equal(destination_k[moved_to.to(device)], flat_k[moved_from.to(device)])
    assert torch.equal(destination_v[moved_to.to(device)], flat_v[moved_from.to(device)])
    untouched = torch.ones(destination_k.shape[0], dtype=torch.bool)
    untouched[moved_to] = False
    assert destination_k[untouched.to(device)].eq(0).all() and destination_v[untouched.to(device)].eq(0).all()


@requires_interpreter
def test_row_offsets_beyond_two_to_the_31_elements():
    """Row ids that fit int32 whose element offsets (id * D) do not: the engine's flat cell space of a
    large pool (32 layers x 65K slots x 8 heads x 128 dims passes 2^31). The 2-GiB store is virtual
    memory (torch.empty); only the pages of the rows touched are ever written."""
    head_dim = 64
    num_rows = 2**31 // head_dim + 64
    store = torch.empty(num_rows, head_dim, dtype=torch.int8)  # 1-byte elements: 2 GiB of address space
    src_rows = torch.tensor([num_rows - 1, 5, num_rows - 40], dtype=torch.int32)
    dst_rows = torch.tensor([3, num_rows - 2, num_rows - 50], dtype=torch.int32)
    payload = torch.arange(3 * head_dim, dtype=torch.int8).view(3, head_dim)
    store[src_rows.long()] = payload
    store[dst_rows.long()] = 0
    copy_kv_rows(store, store, store, store, src_rows, dst_rows)
    assert torch.equal(store[dst_rows.long()], payload)
    assert torch.equal(store[src_rows.long()], payload)


@requires_interpreter
def test_many_rows_in_one_launch():
    """20K rows: 626 programs of 32 rows, the last one partial."""
    generator = torch.Generator().manual_seed(5)
    num_rows, head_dim = 20_001, 16
    source = torch.randn(num_rows, head_dim, generator=generator)
    destination = torch.zeros(num_rows + 10, head_dim)
    dst_rows = torch.randperm(num_rows + 10, generator=generator)[:num_rows]
    src_rows = torch.randperm(num_rows, generator=generator)
    copy_kv_rows(source, source, destination, destination, src_rows, dst_rows)
    assert torch.equal(destination[dst_rows], source[src_rows])


def test_row_copy_rejects_stores_it_cannot_address():
    rows = torch.arange(3)
    store = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="2-D"):
        copy_kv_rows(store.view(4, 2, 32), store, store, store, rows, rows)
    with pytest.raises(ValueError, match="unit stride"):
        copy_kv_rows(store.t(), store, store, store, rows, rows)
    with pytest.raises(ValueError, match="dtypes"):
        copy_kv_rows(store, store, store.half(), store, rows, rows)
    with pytest.raises(ValueError, match="one length"):
        copy_kv_rows(store, store, store, store, rows, rows[:2])


def test_cell_map_follows_the_plan_csr_order():
    case = CASES[2]
    _, _, row, plan, cells, _ = make_case(case, torch.float32)
    assert torch.equal(cells.head_ids, plan.head_ids())
    assert torch.equal(cells.slots, row[plan.kept_positions].long())
    assert torch.equal(cells.buffer_rows(8), cells.slots * 8 + cells.head_ids)


def test_rejects_buffers_it_cannot_address_as_rows():
    case = CASES[1]
    k_buffer, v_buffer, _, _, cells, num_cells = make_case(case, torch.float32)
    arena_k, arena_v = sentinel_arena(num_cells, case.head_dim, case.head_dim_v, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        gather_kv_to_arena(k_buffer.half(), v_buffer.half(), arena_k, arena_v, cells)
    strided_k = torch.randn(k_buffer.shape[0], case.head_dim, k_buffer.shape[1]).transpose(1, 2)
    with pytest.raises(RuntimeError, match="view"):  # a silent copy would drop the writes of a scatter
        scatter_arena_to_kv(arena_k, arena_v, strided_k, v_buffer, cells)
