"""The arena: head-granular storage for compressed KV, beside SGLang's dense token slots.

One *cell* holds one KV head's key and value vector of one layer of one token. SGLang's slots are
not head-granular (one slot = every head of every layer of a token), so entries kept per
(layer, KV head) by a policy are copied into cells and the dense slots they came from are freed.

Layout: per layer, ``k[layer]`` ``[cells_per_layer, D]`` and ``v[layer]`` ``[cells_per_layer, D_v]``
in the KV dtype, so a cell id is an index into its layer's tensors (the ``arena_k``/``arena_v`` of
``sgl_kvevict.kernels``). Each layer has its own free list: policies keep different numbers of
entries per layer (PyramidKV, LAVa), so layers fill at different rates.

Sizing (``arena_slot_equivalents``): the arena takes ``arena_fraction`` ``f`` of the KV memory of a
vanilla pool of ``S`` slots. The launcher gives SGLang ``S_dense = round((1 - f) * S)`` slots and
the arena gets the rest, ``S - S_dense`` slot-equivalents (``round(S_dense * f / (1 - f))`` when
SGLang was started without the launcher's ``S``), i.e. that many cells per (layer, KV head):
``cells_per_layer = slot_equivalents * H_kv``, each layer's cells the size of its share of those
slots. Arena + dense slots then hold exactly the bytes of the vanilla pool, which keeps "same
memory" comparisons honest.

The ledger (``allocated`` bitmap, ``cells_used``) makes a double free or a foreign cell id an error
at the call that does it, and ``cells_used == 0`` after a flush is the leak check of the tests.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sgl_kvevict.serving import ServingConfig


def arena_slot_equivalents(serving: ServingConfig, dense_slots: int) -> int:
    """Token slots' worth of memory the arena gets beside SGLang's ``dense_slots`` (module docstring)."""
    if serving.kv_pool_tokens is not None:
        return serving.arena_slot_equivalents
    fraction = serving.arena_fraction
    return round(dense_slots * fraction / (1.0 - fraction))


class ArenaError(RuntimeError):
    """A ledger violation: double free, foreign cell, or cells leaked."""


class Arena:
    """Per-layer cell tensors, free lists and ledger. Not thread-safe: the scheduler thread owns it."""

    def __init__(
        self,
        num_layers: int,
        cells_per_layer: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if cells_per_layer <= 0:
            raise ValueError(f"an arena needs at least one cell per layer, got {cells_per_layer}")
        self.num_layers = num_layers
        self.cells_per_layer = cells_per_layer
        # Never read before written (a cell is filled when allocated), so no need to zero gigabytes.
        self.k = [torch.empty(cells_per_layer, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(cells_per_layer, v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self._allocated = torch.zeros(num_layers, cells_per_layer, dtype=torch.bool)
        self._free: list[torch.Tensor] = []
        self.cells_used = 0
        self.reset()

    @property
    def cells_total(self) -> int:
        return self.num_layers * self.cells_per_layer

    def cells_free(self, layer: int) -> int:
        return len(self._free[layer])

    def can_alloc(self, counts: Sequence[int]) -> bool:
        return all(count <= len(free) for count, free in zip(counts, self._free))

    def alloc(self, counts: Sequence[int]) -> Optional[list[torch.Tensor]]:
        """``counts[layer]`` cells in every layer (int64 cpu ids), or None (nothing taken) if any layer lacks them."""
        if len(counts) != self.num_layers:
            raise ValueError(f"{len(counts)} counts for {self.num_layers} layers")
        if not self.can_alloc(counts):
            return None
        cells = []
        for layer, count in enumerate(counts):
            taken, self._free[layer] = self._free[layer][:count], self._free[layer][count:]
            self._allocated[layer, taken] = True
            cells.append(taken)
        self.cells_used += sum(counts)
        return cells

    def free(self, cells: Sequence[torch.Tensor]) -> None:
        """Give back cells from ``alloc`` (one id tensor per layer)."""
        for layer, ids in enumerate(cells):
            if not bool(self._allocated[layer, ids].all()) or len(torch.unique(ids)) != len(ids):
                raise ArenaError(f"layer {layer}: freeing cells that are not allocated (double free?)")
        for layer, ids in enumerate(cells):
            self._allocated[layer, ids] = False
            self._free[layer] = torch.cat([self._free[layer], ids])
            self.cells_used -= len(ids)

    def reset(self) -> None:
        """Every cell free (flush_cache): the tree that referenced them is gone."""
        self._allocated.zero_()
        self._free = [torch.arange(self.cells_per_layer, dtype=torch.int64) for _ in range(self.num_layers)]
        self.cells_used = 0

    def check_consistent(self) -> None:
        """Raise if the counters, the bitmap and the free lists disagree."""
        in_free_lists = sum(len(free) for free in self._free)
        allocated = int(self._allocated.sum())
        if allocated != self.cells_used or in_free_lists + allocated != self.cells_total:
            raise ArenaError(
                f"arena ledger: used counter {self.cells_used}, bitmap {allocated}, free lists {in_free_lists}, "
                f"total {self.cells_total}"
            )
