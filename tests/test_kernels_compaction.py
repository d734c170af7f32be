"""Compaction kernel (Triton, interpreter mode): KV buffer -> arena cells and back, against torch twin and a loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_support import (
    DTYPES,
    interpreter_process_test,
    random_kv_buffer,
    requires_interpreter,
    scattered_slots,
)

from sgl_kvevict.kernels import ArenaCellMap, gather_kv_to_arena, scatter_arena_to_kv
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
