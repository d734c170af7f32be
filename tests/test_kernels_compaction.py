"""Row-copy kernel (compaction and cell moves): Triton in the interpreter or on CUDA, against its torch twin."""

from __future__ import annotations

import pytest
import torch
from test_kernels_support import interpreter_process_test, on_kernel_devices, requires_interpreter

from sgl_kvevict.kernels import copy_kv_rows
from sgl_kvevict.kernels.compaction import copy_kv_rows_torch, copy_kv_rows_triton

test_in_interpreter_process = interpreter_process_test(__file__)


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
