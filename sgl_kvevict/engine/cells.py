"""CellSpace: SGLang's KV pool addressed one (layer, slot, KV head) vector at a time.

One slot of SGLang's token pool holds every layer's K and V of one token: ``k_buffer[l][slot]`` is
``[H_kv, D]``. A *cell* is one of those vectors, (layer l, slot s, head h), and can hold any layer's
kept entry, because the engine makes every layer's buffer a view of one allocation
(``engine.adapter.pool``): K of all layers is one tensor, so ``k_rows`` (``[rows, D]``) addresses every cell by
one integer and kernels read and write cells in place, one launch over all layers.

Cell id of (l, s, h) is ``l * layer_stride + s * H_kv + h`` (rows of the flat K view); ``v_rows`` is a
view of the same storage shifted so that ``v_rows[c]`` is the V vector of cell ``c``. A compressed
entry's own layer is recorded by its segment, not by its cell: the cells of a borrowed slot are one
flat pool for all layers, so layers with more kept entries (PyramidKV, LAVa) take more of them and
none sits idle.

Torch only: nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvevict.kernels import copy_kv_rows


@dataclass(frozen=True)
class CellSpace:
    """k_rows ``[rows, D]``, v_rows ``[rows_v, D_v]``: flat views of every layer's K and V vectors.

    num_layers, num_kv_heads: the pool's shape. layer_stride: rows between layer ``l`` and ``l + 1``
    in ``k_rows`` (and ``v_rows``). num_slots: slots per layer (SGLang's pool size plus its padding
    page; slot 0 is its dummy slot and is never borrowed).
    """

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    num_layers: int
    num_kv_heads: int
    num_slots: int
    layer_stride: int

    @property
    def cells_per_slot(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.k_rows.device

    def cells_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 ``[n_slots, cells_per_slot]``: the cell ids of each slot, layer-major then head."""
        layers = torch.arange(self.num_layers, device=slots.device) * self.layer_stride
        heads = torch.arange(self.num_kv_heads, device=slots.device)
        base = slots.to(torch.int64).view(-1, 1, 1) * self.num_kv_heads
        return (base + layers.view(1, -1, 1) + heads.view(1, 1, -1)).view(len(slots), -1)

    def slot_of(self, cells: torch.Tensor) -> torch.Tensor:
        """int64: the slot each cell belongs to."""
        return (cells % self.layer_stride) // self.num_kv_heads

    def index_in_slot(self, cells: torch.Tensor) -> torch.Tensor:
        """int64: each cell's index among its slot's cells (the order of ``cells_of_slots``)."""
        return (cells // self.layer_stride) * self.num_kv_heads + cells % self.num_kv_heads

    def copy(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy the K and V of cells ``sources`` into cells ``targets`` (int64; none of the targets may be
        a source), one launch for every layer."""
        device = self.device
        copy_kv_rows(self.k_rows, self.v_rows, self.k_rows, self.v_rows, sources.to(device), targets.to(device))

    def entry_rows(self, layers: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """int64: the rows of the dense entries (layer, slot, head) in ``k_rows``/``v_rows``."""
        return layers.to(torch.int64) * self.layer_stride + slots.to(torch.int64) * self.num_kv_heads + heads

    @classmethod
    def of_buffers(cls, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> "CellSpace":
        """The cell space of per-layer ``[slots, H_kv, D]`` buffers that are equally spaced views of one
        storage (``engine.adapter.pool`` allocates them so); ``ValueError`` otherwise."""
        first_k, first_v = k_buffers[0], v_buffers[0]
        num_slots, num_kv_heads, head_dim = first_k.shape
        head_dim_v = first_v.shape[2]
        if not all(b.is_contiguous() for b in (*k_buffers, *v_buffers)):
            raise ValueError("the KV pool's layer buffers are not contiguous")
        layer_stride = _layer_stride_rows(k_buffers, head_dim * first_k.element_size())
        v_stride = _layer_stride_rows(v_buffers, head_dim_v * first_v.element_size())
        if layer_stride is None or v_stride != layer_stride or layer_stride % num_kv_heads or layer_stride < num_slots * num_kv_heads:
            raise ValueError(
                "the KV pool's layers are not equally spaced views of one allocation (a KV cache layout or "
                "dtype the compressed-KV engine does not support)"
            )
        num_layers = len(k_buffers)
        k_rows = _rows_view(first_k, (num_layers - 1) * layer_stride + num_slots * num_kv_heads, head_dim)
        v_rows = _rows_view(first_v, (num_layers - 1) * layer_stride + num_slots * num_kv_heads, head_dim_v)
        return cls(k_rows, v_rows, num_layers, num_kv_heads, num_slots, layer_stride)


def _layer_stride_rows(buffers: list[torch.Tensor], row_bytes: int) -> int | None:
    """The distance between consecutive layers' buffers in rows of ``row_bytes``, if it is one constant."""
    if len(buffers) == 1:
        return buffers[0].shape[0] * buffers[0].shape[1]
    strides = {b.data_ptr() - a.data_ptr() for a, b in zip(buffers, buffers[1:])}
    if len(strides) != 1:
        return None
    stride = strides.pop()
    return stride // row_bytes if stride > 0 and stride % row_bytes == 0 else None


def _rows_view(first: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``rows`` rows of ``width`` elements starting at ``first``'s storage offset (one storage)."""
    return first.as_strided((rows, width), (width, 1), first.storage_offset())
