"""The arena: compressed KV stored in cells of slots borrowed from SGLang's own token pool.

There is one KV memory, SGLang's pool. When compressed entries need room, the arena *borrows* whole
slots from SGLang's allocator (or *adopts* slots a compression is about to free) and hands out their
cells (``engine.cells``: any cell can hold any layer's entry). Slots go back to SGLang when it asks the
tree for room (``release_slots``, called by the tree's ``evict``), so a compressed server holds exactly
the bytes a stock server with the same ``--max-total-tokens`` does, and dense and compressed KV compete
for them through one eviction order (``engine.adapter.radix_cache``).

Fragmentation: freed cells leave holes in borrowed slots. ``release_slots`` returns slots on demand,
empty ones first, then by *moving* the live cells of the emptiest slots into holes of fuller ones
(``relocate``), so a slot's worth of free cells is always reclaimable. Freeing never gives a slot back
by itself: then how many slots the arena holds depends only on how many cells are in use, never on
where they lie, which is what keeps tensor-parallel ranks (whose cells lie differently) in step. Moves rewrite the owning segments' cell ids (each cell's
owner is recorded) and bump ``generation``, which invalidates every cached cell list (path views,
forward metadata); nothing else changes a live segment's cells.

Ledger: every cell of a borrowed slot is free or owned by exactly one (segment, index); a double free,
a foreign cell or a leak is an ``ArenaError`` at the call that does it, and ``check_consistent`` holds
after every operation. Costs: allocation and freeing are O(cells touched) plus O(slots touched), never
O(pool). Not thread-safe: the scheduler thread owns it; stats readers only load single counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from sgl_kvevict.engine.cells import CellSpace

FREE = -1


class ArenaError(RuntimeError):
    """A ledger violation: double free, foreign cell, or cells leaked."""


class CellOwner(Protocol):
    """What owns cells: a compressed segment, whose flat cell list the arena may rewrite."""

    owner_id: int
    cells: torch.Tensor

    def relocate(self, indices: torch.Tensor, cells: torch.Tensor) -> None:
        """Its entries ``indices`` now live in ``cells`` (int64, host)."""


@dataclass
class SlotSource:
    """How the arena gets and returns slots: ``borrow(n)`` takes ``n`` free slots from SGLang's allocator
    (int64 host tensor, or None if it has fewer), ``give_back(slots)`` frees them to it, and
    ``copy_cells(src, dst)`` copies the K and V of cells ``src`` into cells ``dst`` (device op)."""

    borrow: Callable[[int], Optional[torch.Tensor]]
    give_back: Callable[[torch.Tensor], None]
    copy_cells: Callable[[torch.Tensor, torch.Tensor], None]


class Arena:
    def __init__(self, space: CellSpace, source: SlotSource):
        self.space = space
        self.source = source
        self.cells_per_slot = space.cells_per_slot
        # One row of these tables per borrowed slot: each cell's owner (or FREE) and its entry index.
        self._row_of_slot = torch.full((space.num_slots,), -1, dtype=torch.int64)
        self._slot_of_row = torch.empty(0, dtype=torch.int64)  # -1: the row is unbound
        self._owner = torch.empty(0, self.cells_per_slot, dtype=torch.int64)
        self._index = torch.empty(0, self.cells_per_slot, dtype=torch.int64)
        self._used_in_row: list[int] = []
        self._unbound_rows: list[int] = []  # reused before the tables grow
        self._rows_with_room: set[int] = set()  # bound rows with a free cell
        self._owners: dict[int, CellOwner] = {}
        self._next_owner_id = 0
        self.cells_used = 0
        self.slots_borrowed = 0
        self.cells_locked = 0
        self.cells_moved = 0
        self.slots_given_back_by_moves = 0
        self.generation = 0

    # ---- counters ------------------------------------------------------------------------------

    @property
    def cells_free(self) -> int:
        """Free cells inside borrowed slots."""
        return self.slots_borrowed * self.cells_per_slot - self.cells_used

    @property
    def slots_protected(self) -> int:
        """Slots the locked cells need at the least: what no eviction or move can give back."""
        return math.ceil(self.cells_locked / self.cells_per_slot)

    @property
    def slots_reclaimable_by_moves(self) -> int:
        """Slots ``release_slots`` can give back without evicting anything."""
        return self.slots_borrowed - math.ceil(self.cells_used / self.cells_per_slot)

    def register(self, owner: CellOwner) -> int:
        """A new owner id; the arena tells the owner where its entries live (``relocate``)."""
        owner_id = self._next_owner_id
        self._next_owner_id += 1
        self._owners[owner_id] = owner
        return owner_id

    def forget(self, owner: CellOwner) -> None:
        """``owner`` holds no cells any more (freed, or its cells were handed to split parts)."""
        self._owners.pop(owner.owner_id, None)

    # ---- allocation ----------------------------------------------------------------------------

    def alloc(self, owner: CellOwner, count: int, adoptable: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Cells for ``owner``'s entries ``0..count-1``, reported through ``owner.relocate``. Returns the
        slots adopted from ``adoptable`` (int64 host, possibly empty), or None (nothing taken) when the
        cells do not fit.

        Free cells of borrowed slots go first, fullest slots first (fewer holes); then slots from
        ``adoptable`` (int64 host: slots the caller is about to free, handed over instead), then new
        slots borrowed from SGLang. Adopted slots must hold nothing the caller still needs once it has
        read its sources: it copies into the new cells only after reading every source.

        The cells are handed out in ascending cell id: an owner's entries are layer-major, then KV head, then
        position, and cell ids are layer-major too, so one (layer, head)'s entries land in neighbouring rows
        of the pool (adjacent slots of one layer), and a decode's gather of them reads runs of memory
        instead of one row per layer region (a slot's cells span every layer)."""
        missing = max(0, math.ceil((count - self.cells_free) / self.cells_per_slot))
        adopted = adoptable[:missing] if adoptable is not None else torch.empty(0, dtype=torch.int64)
        borrowed = torch.empty(0, dtype=torch.int64)
        if missing > len(adopted):
            borrowed = self.source.borrow(missing - len(adopted))
            if borrowed is None:
                return None
        self._bind_slots(torch.cat([adopted, borrowed]))
        cells = torch.sort(self._take_free_cells(count)).values
        self._assign(torch.full((count,), owner.owner_id), cells, torch.arange(count))
        return adopted

    def transfer(self, owner: CellOwner, indices: torch.Tensor, new_owner: CellOwner, new_indices: torch.Tensor):
        """Entries ``indices`` of ``owner`` become entries ``new_indices`` of ``new_owner`` (a split)."""
        cells = owner.cells[indices]
        rows, columns = self._locate(cells)
        if not bool((self._owner[rows, columns] == owner.owner_id).all()):
            raise ArenaError(f"owner {owner.owner_id} transfers cells it does not own")
        self._owner[rows, columns] = new_owner.owner_id
        self._index[rows, columns] = new_indices
        new_owner.relocate(new_indices, cells)

    def free(self, owner: CellOwner, cells: torch.Tensor) -> None:
        """Give back ``owner``'s cells. Slots left empty stay borrowed: ``release_slots`` gives them back
        first, without a move (see the module doc)."""
        rows, columns = self._locate(cells)
        if not bool((self._owner[rows, columns] == owner.owner_id).all()) or len(torch.unique(cells)) != len(cells):
            raise ArenaError(f"owner {owner.owner_id} frees cells it does not own (double free?)")
        self._owner[rows, columns] = FREE
        self.cells_used -= len(cells)
        for row, freed in zip(*(t.tolist() for t in torch.unique(rows, return_counts=True))):
            self._used_in_row[row] -= freed
            self._rows_with_room.add(row)

    def lock(self, cells: int) -> None:
        self.cells_locked += cells

    def unlock(self, cells: int) -> None:
        self.cells_locked -= cells
        if self.cells_locked < 0:
            raise ArenaError("more cells unlocked than locked")

    # ---- giving slots back ---------------------------------------------------------------------

    def release_slots(self, wanted: int) -> int:
        """Give up to ``wanted`` slots back to SGLang by moving the cells of the emptiest borrowed slots
        into holes of the others; returns the slots given back."""
        wanted = min(wanted, self.slots_reclaimable_by_moves)
        if wanted <= 0:
            return 0
        # Every slot with a hole is a candidate; enough of them exist (free cells >= wanted slots' worth).
        victims = sorted(self._rows_with_room, key=lambda row: self._used_in_row[row])[:wanted]
        victim_rows = torch.tensor(victims, dtype=torch.int64)
        in_use = self._owner[victim_rows] != FREE
        rows = victim_rows.view(-1, 1).expand_as(in_use)[in_use]
        columns = in_use.nonzero()[:, 1]
        sources = self._cells_at(rows, columns)
        owners, indices = self._owner[rows, columns], self._index[rows, columns]
        targets = self._take_free_cells(len(sources), exclude=set(victims))
        if len(sources):
            self.source.copy_cells(sources, targets)
        self._owner[rows, columns] = FREE
        self.cells_used -= len(sources)
        for row in victims:
            self._used_in_row[row] = 0
        self._assign(owners, targets, indices)
        self.cells_moved += len(sources)
        self.slots_given_back_by_moves += len(victims)
        self.generation += 1  # cells of live segments moved: cached cell lists are stale
        self._unbind_rows(victims)
        return len(victims)

    def paths_changed(self) -> None:
        """A dense radix node became compressed (``engine.deferred``): the cached cell lists of the paths
        through it are stale, though no live segment's cells moved."""
        self.generation += 1

    def reset(self) -> None:
        """Every cell free and no slot borrowed (flush_cache: SGLang resets its allocator too, so nothing
        is given back to it)."""
        self._row_of_slot.fill_(-1)
        self._slot_of_row = self._slot_of_row[:0]
        self._owner, self._index = self._owner[:0], self._index[:0]
        self._used_in_row.clear()
        self._unbound_rows.clear()
        self._rows_with_room.clear()
        self._owners.clear()
        self.cells_used = self.slots_borrowed = self.cells_locked = 0
        self.generation += 1

    # ---- internals -----------------------------------------------------------------------------

    def _bind_slots(self, slots: torch.Tensor) -> None:
        for slot in slots.tolist():
            if self._unbound_rows:
                row = self._unbound_rows.pop()
            else:
                row = len(self._used_in_row)
                self._used_in_row.append(0)
                self._grow_tables(row + 1)
            self._slot_of_row[row] = slot
            self._owner[row] = FREE
            self._used_in_row[row] = 0
            self._row_of_slot[slot] = row
            self._rows_with_room.add(row)
        self.slots_borrowed += len(slots)

    def _grow_tables(self, rows: int) -> None:
        if rows <= len(self._slot_of_row):
            return
        capacity = max(rows, 2 * len(self._slot_of_row), 16)
        old = len(self._slot_of_row)
        slot_of_row = torch.full((capacity,), -1, dtype=torch.int64)
        owner = torch.full((capacity, self.cells_per_slot), FREE, dtype=torch.int64)
        index = torch.zeros(capacity, self.cells_per_slot, dtype=torch.int64)
        slot_of_row[:old], owner[:old], index[:old] = self._slot_of_row, self._owner, self._index
        self._slot_of_row, self._owner, self._index = slot_of_row, owner, index

    def _unbind_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        row_ids = torch.tensor(rows, dtype=torch.int64)
        slots = self._slot_of_row[row_ids].clone()
        self._row_of_slot[slots] = -1
        self._slot_of_row[row_ids] = -1
        self._unbound_rows.extend(rows)
        self._rows_with_room.difference_update(rows)
        self.slots_borrowed -= len(rows)
        self.source.give_back(slots)

    def _take_free_cells(self, count: int, exclude: frozenset[int] | set[int] = frozenset()) -> torch.Tensor:
        """``count`` free cells, fullest slots first (not yet recorded as used)."""
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        candidates = sorted(self._rows_with_room - exclude, key=lambda row: -self._used_in_row[row])
        taken_rows, taken_columns, still = [], [], count
        for row in candidates:
            columns = (self._owner[row] == FREE).nonzero().squeeze(1)[:still]
            taken_rows.append(torch.full_like(columns, row))
            taken_columns.append(columns)
            still -= len(columns)
            if still == 0:
                break
        if still:
            raise ArenaError(f"{count} cells asked for, {count - still} free")
        return self._cells_at(torch.cat(taken_rows), torch.cat(taken_columns))

    def _assign(self, owner_ids: torch.Tensor, cells: torch.Tensor, indices: torch.Tensor) -> None:
        """Record ``cells`` as entries ``indices`` of ``owner_ids`` and tell each owner where they are."""
        if not len(cells):
            return
        rows, columns = self._locate(cells)
        if not bool((self._owner[rows, columns] == FREE).all()):
            raise ArenaError("assigning cells that are in use")
        self._owner[rows, columns] = owner_ids
        self._index[rows, columns] = indices
        for row, taken in zip(*(t.tolist() for t in torch.unique(rows, return_counts=True))):
            self._used_in_row[row] += taken
            if self._used_in_row[row] == self.cells_per_slot:
                self._rows_with_room.discard(row)
        self.cells_used += len(cells)
        for owner_id in torch.unique(owner_ids).tolist():
            mine = owner_ids == owner_id
            self._owners[owner_id].relocate(indices[mine], cells[mine])

    def _locate(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._row_of_slot[self.space.slot_of(cells)]
        if bool((rows < 0).any()):
            raise ArenaError("cells outside the borrowed slots")
        return rows, self.space.index_in_slot(cells)

    def _cells_at(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        layers, heads = columns // self.space.num_kv_heads, columns % self.space.num_kv_heads
        return self.space.entry_rows(layers, self._slot_of_row[rows], heads)

    def check_consistent(self) -> None:
        """Raise if the counters and the tables disagree."""
        bound = (self._slot_of_row >= 0).nonzero().squeeze(1)
        per_row = (self._owner[bound] != FREE).sum(1)
        used_in_row = torch.tensor(self._used_in_row, dtype=torch.int64)[bound] if len(bound) else per_row
        with_room = {row for row, used in zip(bound.tolist(), per_row.tolist()) if used < self.cells_per_slot}
        if len(bound) != self.slots_borrowed or int(per_row.sum()) != self.cells_used:
            raise ArenaError(
                f"arena ledger: {self.slots_borrowed} slots / {self.cells_used} cells counted, "
                f"{len(bound)} / {int(per_row.sum())} in the tables"
            )
        if not torch.equal(used_in_row, per_row) or with_room != self._rows_with_room:
            raise ArenaError("arena ledger: per-slot use counts disagree with the owner table")
