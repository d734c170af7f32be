"""SGLang's KV allocator and request table as the engine's slot sources: the arena's ``SlotSource``
(cells live in borrowed slots) and the reconstructor's ``SlotPool`` (a pass's temporary row and slots).
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_kvevict.engine.arena import SlotSource
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.registry import Engine, engine_for


def engine_of(allocator) -> Optional[Engine]:
    """The engine over SGLang's KV allocator's pool (None: none)."""
    return engine_for(allocator.get_kvcache())


def slot_source(allocator, space: CellSpace) -> SlotSource:
    """The arena's access to SGLang's allocator: slots move between them as int64 tensors."""

    def borrow(count: int):
        slots = allocator.alloc(count)
        return None if slots is None else slots.to("cpu", torch.int64)

    def give_back(slots) -> None:
        allocator.free(slots.to(allocator.device))

    return SlotSource(borrow=borrow, give_back=give_back, copy_cells=space.copy)


class SchedulerSlots:
    """``reconstruction.SlotPool`` over SGLang's ``ReqToTokenPool`` and KV allocator. When the allocator is
    short, the tree over its pool evicts first, as SGLang's ``alloc_token_slots`` does (the tree is found
    through ``engine.registry``: it is built after the reconstructor)."""

    def __init__(self, req_to_token_pool, allocator):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def alloc_row(self) -> Optional[int]:
        rows = self.req_to_token_pool.alloc_rows(1)
        return None if rows is None else rows[0]

    def free_row(self, row: int) -> None:
        self.req_to_token_pool.free_rows([row])

    def alloc_slots(self, count: int) -> Optional[torch.Tensor]:
        shortfall = count - self.allocator.available_size()
        if shortfall > 0:
            engine_of(self.allocator).tree.evict(EvictParams(num_tokens=shortfall))
        return self.allocator.alloc(count)

    def free_slots(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)
