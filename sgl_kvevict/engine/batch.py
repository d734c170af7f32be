"""What one forward holds, as the engine sees it: the requests, their compressed paths, and the metadata
the attention backends build from them once per forward.

* ``ForwardRequests`` (built by the coordinator's ``forward_begin``): per request of the batch, its
  query rows, logical length, ``req_to_token`` row and ``PathView`` (None for a request without
  compressed nodes on its path, which the stock attention path serves).
* ``SegmentMetadata`` (built by a backend when a forward has compressed requests): their query rows
  and the ``CellBatch`` of their cells of every layer. The torch backend adds a ``DenseBatch`` in an
  extend and ``DecodeKeys`` in a decode; the FlashInfer backend plans its own dense layout. All read a
  request's dense keys through ``RequestSlice.dense_keys``.
* ``WindowKeys`` (the torch backend's, for a model with local attention layers): per request, the keys
  its local layers read, every position of its queries' windows; in a decode kept across steps
  (``WindowKeysCache``): a step slides each request's window by its new token.
* ``DecodeKeys`` (the torch backend's decode): every request's keys, cells and dense positions alike,
  as rows of the pool's cell space, kept across decode steps (``DecodeKeysCache``): a step appends each
  request's new token in place.

Nothing a layer runs loops over layers or KV heads in Python or syncs with the host: everything is
built here once per forward.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.host_copies import to_device
from sgl_kvevict.engine.segments import PathView, ranges_to_positions
from sgl_kvevict.local_layers import LocalLayers

# Decode steps a ``DecodeKeys`` has room for before it is built again (its padding past the longest sequence).
DECODE_STEPS_OF_ROOM = 64


@dataclass(frozen=True)
class RequestSlice:
    """One request of the forward: queries ``q[q_start:q_end]`` at logical positions
    ``[seq_len - (q_end - q_start), seq_len)``; ``row`` is its ``req_to_token`` row index."""

    index: int
    q_start: int
    q_end: int
    seq_len: int
    row: int
    view: Optional[PathView]

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def first_query_position(self) -> int:
        return self.seq_len - self.num_queries

    def dense_ranges(self) -> list[tuple[int, int]]:
        """The position ranges of ``[0, seq_len)`` read from dense slots (host ints)."""
        return [(0, self.seq_len)] if self.view is None else self.view.dense_ranges(self.seq_len)

    def dense_keys(self, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[n]`` positions and slots (on ``req_to_token``'s device) of the dense keys, ascending."""
        positions = ranges_to_positions(self.dense_ranges(), req_to_token.device)
        return positions, req_to_token[self.row, positions].to(torch.int64)

    def up_to(self, end: int) -> "RequestSlice":
        """This request as far as position ``end`` (inside this forward): its queries and context there."""
        return dataclasses.replace(self, q_end=self.q_end - (self.seq_len - end), seq_len=end)


@dataclass(frozen=True)
class ForwardRequests:
    """The requests of one forward, in batch order (``forward_batch.rids``)."""

    is_decode: bool
    requests: tuple[RequestSlice, ...]

    @property
    def compressed(self) -> tuple[RequestSlice, ...]:
        return tuple(request for request in self.requests if request.view is not None)


@dataclass(frozen=True)
class CellBatch:
    """The compressed requests' cells, every layer at once (device tensors).

    kv_indices int64 ``[n]``: cell ids, layer-major, then request, then KV head; kv_indptr int64
    ``[L, B_c * H_kv + 1]``: ``kv_indptr[l]`` are the pseudo-sequence offsets of layer ``l`` into
    ``kv_indices`` (sequence ``r * H_kv + h``). max_cells: the longest sequence (host int).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_cells: int

    @classmethod
    def of(cls, views: list[PathView], device: torch.device) -> "CellBatch":
        counts = torch.stack([view.counts for view in views], dim=1)  # [L, B_c, H_kv]
        num_layers = counts.shape[0]
        flat_counts = counts.flatten()
        ends = torch.cumsum(flat_counts, 0)
        starts = ends - flat_counts
        kv_indptr = torch.cat([starts.view(num_layers, -1), ends.view(num_layers, -1)[:, -1:]], dim=1)
        # The (layer, request) blocks are contiguous in each view's cells: one gather builds the index.
        view_bases = torch.cumsum(torch.tensor([0] + [len(view.cells) for view in views[:-1]]), 0)
        layer_starts = torch.tensor([view.layer_offsets[:-1] for view in views]).t()  # [L, B_c]
        block_sources = (layer_starts + view_bases).flatten()
        block_counts = counts.sum(2).flatten()
        block_targets = torch.cumsum(block_counts, 0) - block_counts
        total = int(block_counts.sum())
        gather = torch.repeat_interleave(block_sources - block_targets, block_counts, output_size=total)
        gather += torch.arange(total)
        cells = torch.cat([view.cells for view in views])
        return cls(to_device(kv_indptr, device), cells[to_device(gather, device)], int(flat_counts.max()))


class CellBatchCache:
    """The last forward's ``CellBatch`` and the views it was built from: decode steps of the same batch
    reuse it (a view is rebuilt whenever its path or the arena's placements change)."""

    def __init__(self):
        self._views: tuple[PathView, ...] = ()
        self._cells: Optional[CellBatch] = None
        self.builds = 0  # forwards whose CellBatch was built, not reused (tests)

    def of(self, views: tuple[PathView, ...], device: torch.device) -> CellBatch:
        same = self._cells is not None and len(self._views) == len(views)
        if not (same and all(a is b for a, b in zip(self._views, views))):
            self._views, self._cells = views, CellBatch.of(list(views), device)
            self.builds += 1
        return self._cells


@dataclass(frozen=True)
class SegmentMetadata:
    """A backend's per-forward metadata of the compressed requests (``forward.compressed``).

    query_rows int64 ``[N_c]``: their query rows in the forward, request-major; qo_indptr int64
    ``[B_c + 1]`` (device); cells: their ``CellBatch``, built on first use (the torch backend's decode
    reads its keys from ``DecodeKeys`` instead); max_queries: the most queries of one of them.
    """

    forward: ForwardRequests
    query_rows: torch.Tensor
    qo_indptr: torch.Tensor
    max_queries: int
    cell_cache: CellBatchCache
    device: torch.device

    @functools.cached_property
    def cells(self) -> CellBatch:
        return self.cell_cache.of(tuple(request.view for request in self.forward.compressed), self.device)

    @classmethod
    def of(cls, forward: ForwardRequests, device: torch.device, cell_cache: CellBatchCache) -> "SegmentMetadata":
        compressed = forward.compressed
        query_rows = torch.cat([torch.arange(r.q_start, r.q_end, device=device) for r in compressed])
        counts = torch.tensor([0] + [r.num_queries for r in compressed])
        return cls(
            forward, query_rows, to_device(torch.cumsum(counts, 0), device), max(r.num_queries for r in compressed), cell_cache, device
        )


@dataclass(frozen=True)
class DenseBatch:
    """The compressed requests' dense keys, padded to one batch (device tensors; the torch backend's).

    slots int64 ``[B_c, n]`` and positions int64 ``[B_c, n]``; a padded entry repeats a real slot of its
    request (never the placeholder slot 0, whose content is undefined) at a position past every query,
    so the causal mask hides it. query_positions ``[N_c]``: the position of each compressed query row
    (request-major, as ``SegmentMetadata.query_rows``).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    query_positions: torch.Tensor

    @classmethod
    def of(cls, requests: tuple[RequestSlice, ...], req_to_token: torch.Tensor) -> "DenseBatch":
        device = req_to_token.device
        keys = [request.dense_keys(req_to_token) for request in requests]
        widest = max(len(positions) for positions, _ in keys)
        padding = max(request.seq_len for request in requests)
        positions = torch.full((len(requests), widest), padding, dtype=torch.int64, device=device)
        slots = torch.zeros(len(requests), widest, dtype=torch.int64, device=device)
        for index, (request_positions, request_slots) in enumerate(keys):
            positions[index, : len(request_positions)] = request_positions
            slots[index] = request_slots[-1]  # the new token's slot: every request has one
            slots[index, : len(request_positions)] = request_slots
        return cls(slots, positions, query_positions(requests, device))


def query_positions(requests: tuple[RequestSlice, ...], device: torch.device) -> torch.Tensor:
    """int64 ``[N_r]``: the position of each query row of ``requests``, request-major."""
    return torch.cat([torch.arange(r.first_query_position, r.seq_len, device=device) for r in requests])


@dataclass(frozen=True)
class WindowKeys:
    """The keys local (sliding-window) layers read in one forward (the torch backend's, for a model with
    ``LocalLayers``): per request, every position from its first query's window start to its last query,
    dense slots and compressed cells alike, as rows of the pool's cell space. A compressed node keeps the
    same positions in every KV head of a local layer, its last ``window`` (``sgl_kvevict.local_layers``),
    so every position a local query reads is a dense slot or one of those cells.

    rows int64 ``[L_local, B, H_kv, K]``; positions int64 ``[B, K]``: a padded key repeats its request's
    last key at its request's length, past every query, so the causal mask hides it; layer_rows: a
    model layer's index into ``rows``; query_rows, query_positions int64 ``[N_r]``: the requests' query
    rows in the forward and their positions, request-major (built once, read by every local layer);
    layers int64 ``[L_local, 1, 1]``: the local layers (device), for the rows of a decode step's new tokens.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    layer_rows: dict[int, int]
    query_rows: torch.Tensor
    query_positions: torch.Tensor
    layers: torch.Tensor

    @classmethod
    def of(
        cls, requests: tuple[RequestSlice, ...], req_to_token: torch.Tensor, space: CellSpace, local: LocalLayers, width: int = 0
    ) -> "WindowKeys":
        """The keys of ``requests`` from their views and ``req_to_token``, padded to ``width`` keys or to the
        longest span, whichever is more."""
        device = req_to_token.device
        layers = torch.tensor(local.layers, device=device).view(-1, 1, 1)
        heads = torch.arange(space.num_kv_heads, device=device).view(1, -1, 1)
        spans = [window_span(request, local.window) for request in requests]
        width = max(width, *(end - start for start, end in spans))
        rows, positions = [], []
        for request, (start, end) in zip(requests, spans):
            own = torch.arange(start, end, device=device)
            request_rows = space.entry_rows(layers, req_to_token[request.row, own].to(torch.int64).view(1, 1, -1), heads)
            if request.view is not None:
                _read_compressed(request_rows, request.view, own, local.layers)
            padding = width - (end - start)
            rows.append(torch.cat([request_rows, request_rows[..., -1:].expand(-1, -1, padding)], dim=2))
            positions.append(torch.cat([own, torch.full((padding,), end, device=device)]))
        query_rows = torch.cat([torch.arange(request.q_start, request.q_end, device=device) for request in requests])
        return cls(
            torch.stack(rows, dim=1), torch.stack(positions), {layer: index for index, layer in enumerate(local.layers)},
            query_rows, query_positions(requests, device), layers,
        )  # fmt: skip

    def keys_of(self, layer_id: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of local layer ``layer_id`` gathered from the pool's cell rows (``CellSpace``):
        ``[B, K, H_kv, D]`` each, request ``b``'s key ``j`` at position ``positions[b, j]``."""
        rows = self.rows[self.layer_rows[layer_id]]  # [B, H_kv, K]
        batch, num_kv_heads, width = rows.shape
        flat = rows.reshape(-1)
        k = k_rows.index_select(0, flat).view(batch, num_kv_heads, width, -1).transpose(1, 2)
        v = v_rows.index_select(0, flat).view(batch, num_kv_heads, width, -1).transpose(1, 2)
        return k, v

    def decoded(
        self, new_slots: torch.Tensor, space: CellSpace, window: int, width: int, requests: Optional[torch.Tensor] = None
    ) -> "WindowKeys":
        """The keys of the next decode step of this decode batch's requests (``requests`` int64 ``[n]``, their
        indices here; None: all, in order), each one token longer: a request's window slides by one (its
        oldest key dropped once it spans ``window``) and its new token, written to ``new_slots`` int ``[n]``,
        becomes its last key; padded to ``width`` keys. The same tensors as ``of`` builds from the views,
        made on the device from these alone: no loop, no host read."""
        heads = torch.arange(space.num_kv_heads, device=new_slots.device).view(1, 1, -1)
        new_rows = space.entry_rows(self.layers, new_slots.view(1, -1, 1), heads)  # [L_local, n, H_kv]
        rows, positions, query_at = self.rows, self.positions, self.query_positions + 1  # [n]: each one's new query
        if requests is not None:
            rows, positions = rows.index_select(1, requests), positions.index_select(0, requests)
            query_at = query_at.index_select(0, requests)
        start = (query_at + 1 - window).clamp(min=0)
        shift = (start - (query_at - window).clamp(min=0)).view(-1, 1)  # 1 where the oldest key leaves the window
        last = (query_at - start).view(-1, 1)  # the new token's column
        columns = torch.arange(width, device=rows.device).view(1, -1)
        kept = (columns + shift).clamp(max=rows.shape[3] - 1)  # [n, K]: the column each key was in a step before
        gathered = rows.gather(3, kept.view(1, len(kept), 1, width).expand(rows.shape[0], -1, rows.shape[2], -1))
        # From its last column on, a request repeats its new token: the key, then padding past its query.
        carried = columns < last  # [n, K]
        new_rows = torch.where(carried.view(1, len(kept), 1, width), gathered, new_rows.unsqueeze(-1))
        new_positions = torch.where(carried, positions.gather(1, kept), query_at.view(-1, 1) + (columns > last))
        query_rows = torch.arange(len(query_at), device=rows.device)  # a decode batch: one query per request
        return WindowKeys(new_rows, new_positions, self.layer_rows, query_rows, query_at, self.layers)

    def joined(self, other: "WindowKeys", order: torch.Tensor) -> "WindowKeys":
        """The requests of this decode batch, then ``other``'s (as wide), as one decode batch: the ``i``-th of
        them at index ``order[i]`` (int64 ``[B]``)."""

        def placed(first: torch.Tensor, second: torch.Tensor, dim: int) -> torch.Tensor:
            both = torch.cat([first, second], dim)
            return torch.empty_like(both).index_copy_(dim, order, both)

        return WindowKeys(
            placed(self.rows, other.rows, 1), placed(self.positions, other.positions, 0), self.layer_rows,
            torch.arange(len(order), device=order.device), placed(self.query_positions, other.query_positions, 0), self.layers,
        )  # fmt: skip


def window_span(request: RequestSlice, window: int) -> tuple[int, int]:
    """The positions ``[start, end)`` a local layer's queries of ``request`` read, from its first query's window
    start (``window``: the keys a query reads, itself included) to its last query."""
    return max(0, request.first_query_position - window + 1), request.seq_len


def _read_compressed(rows: torch.Tensor, view: PathView, positions: torch.Tensor, local_layers: tuple[int, ...]) -> None:
    """Point ``rows`` ``[L_local, H_kv, n]`` at the cells of ``view`` wherever ``positions`` ``[n]`` fall in one
    of its compressed segments (every KV head of a local layer keeps the same positions there)."""
    inside = torch.zeros_like(positions, dtype=torch.bool)
    for start, end in view.ranges:
        inside |= (positions >= start) & (positions < end)
    wanted = positions[inside]
    if not len(wanted):
        return
    num_kv_heads = view.counts.shape[1]
    for index, layer in enumerate(local_layers):
        first, last = view.layer_offsets[layer], view.layer_offsets[layer + 1]
        cells = view.cells[first:last].view(num_kv_heads, -1)  # [H_kv, kept], the same positions per head
        kept = view.positions[first : first + cells.shape[1]]
        found = torch.searchsorted(kept, wanted).clamp(max=max(len(kept) - 1, 0))
        if not len(kept) or not torch.equal(kept[found], wanted):
            raise RuntimeError(f"layer {layer}: a local query's window reads a position its compressed node dropped")
        rows[index][:, inside] = cells[:, found]


# A bucket is a few tensor calls per layer whatever its size: on CPU their overhead is about that of
# attending this many more keys, so sequences of nearly one length share one padded call.
BUCKET_OVERHEAD_KEYS = 1024
# Before merging, a layer's sequences (sorted by key count) are cut into this many groups of equal size.
MOST_BUCKETS = 8


@dataclass(frozen=True)
class KeyBucket:
    """Sequences of one layer attended in one padded call: ``sequences`` int64 ``[n]`` (None: every sequence,
    in order) and ``width``, the most keys one of them has."""

    sequences: Optional[torch.Tensor]
    width: int


def key_buckets(ends: torch.Tensor) -> list[list[KeyBucket]]:
    """Per layer, its sequences grouped by key count, each group padded only to its own longest: the cost of a
    decode step's attention follows the keys kept (a global top-k keeps very different counts per layer and
    head), not the longest sequence of the batch.

    ends int64 ``[L, S]``: the keys of each sequence. A layer's sequences sorted by count are cut into
    ``MOST_BUCKETS`` groups of equal size; from the longest down, a group joins the bucket above it where the
    padding that adds costs no more than a bucket's own overhead (``BUCKET_OVERHEAD_KEYS``)."""
    num_layers, sequences = ends.shape
    counts, order = torch.sort(ends, dim=1, stable=True)  # ties in sequence order: the same groups every step
    groups = min(MOST_BUCKETS, sequences)
    bounds = [0] + [sequences * (group + 1) // groups for group in range(groups)]  # in sorted order
    widths = counts[:, [bound - 1 for bound in bounds[1:]]].tolist()  # [L, groups], host ints
    buckets = []
    for layer in range(num_layers):
        merged: list[list[int]] = []  # [start, end, width] in sorted order, the longest first
        for group in reversed(range(groups)):
            start, end, width = bounds[group], bounds[group + 1], widths[layer][group]
            if merged and (end - start) * (merged[-1][2] - width) <= BUCKET_OVERHEAD_KEYS:
                merged[-1][0] = start
            else:
                merged.append([start, end, width])
        if len(merged) == 1:
            buckets.append([KeyBucket(None, merged[0][2])])
        else:
            buckets.append([KeyBucket(order[layer, start:end], width) for start, end, width in merged])
    return buckets


@dataclass
class DecodeKeys:
    """Every request of a decode batch as ``B * H_kv`` key sequences in the pool's cell space (``CellSpace``),
    for one attention call per layer with the GQA group as each sequence's queries.

    Sequence ``r * H_kv + h`` holds request ``r``'s cells of KV head ``h`` (path order), then its dense
    positions ascending, the newest token last; a request without compressed nodes has dense positions
    only. The order of keys does not matter to attention, and none is masked for the query (the newest
    token) but padding.

    rows int64 ``[L, B * H_kv, W]``: the ``k_rows``/``v_rows`` row of each key of each layer; a padded
        entry repeats a real key of its sequence (never the pool's placeholder slot 0, whose content is
        undefined: NaN x 0 would be NaN).
    visible bool ``[L, B * H_kv, 1, 1, W]``: True for a key, False for padding (SDPA's mask, broadcast over
        the group's queries).
    ends int64 ``[L, B * H_kv]``: the keys of each sequence, i.e. where its next key goes.
    longest: per request, its longest sequence (host ints); ``W - max(longest)`` more steps fit.
    buckets: per layer, its sequences grouped by key count (``key_buckets``), computed when first asked for
        (a host read of ``ends``) and kept while every sequence grows by one key per step, so that a
        decode step of the same requests reads nothing back from the device.
    """

    rows: torch.Tensor
    visible: torch.Tensor
    ends: torch.Tensor
    longest: list[int]
    space: CellSpace
    buckets: Optional[list[list[KeyBucket]]] = None

    def layer_buckets(self, layer: int) -> list[KeyBucket]:
        """Layer ``layer``'s buckets (``key_buckets``)."""
        if self.buckets is None:
            self.buckets = key_buckets(self.ends)
        return self.buckets[layer]

    @property
    def room(self) -> int:
        """Decode steps ``append`` can still take."""
        return self.rows.shape[2] - max(self.longest)

    @classmethod
    def of(cls, requests: tuple[RequestSlice, ...], req_to_token: torch.Tensor, space: CellSpace) -> "DecodeKeys":
        """The keys of ``requests`` (a decode batch or part of one; ``index`` their order here), built from
        their views and ``req_to_token``: work in proportion to their keys."""
        device = req_to_token.device
        num_layers, num_kv_heads, batch = space.num_layers, space.num_kv_heads, len(requests)
        compressed = [request.index for request in requests if request.view is not None]
        cell_counts = torch.zeros(num_layers, batch, num_kv_heads, dtype=torch.int64)
        cell_starts = torch.zeros(num_layers, batch, num_kv_heads, dtype=torch.int64, device=device)
        cells = CellBatch.of([requests[i].view for i in compressed], device) if compressed else None
        if compressed:
            cell_counts[:, compressed] = torch.stack([requests[i].view.counts for i in compressed], dim=1)
            cell_starts[:, compressed] = cells.kv_indptr[:, :-1].view(num_layers, len(compressed), num_kv_heads)
        dense_slots = [request.dense_keys(req_to_token)[1] for request in requests]  # each ends with the new token
        dense_counts = torch.tensor([len(slots) for slots in dense_slots])
        lengths = cell_counts + dense_counts.view(1, batch, 1)  # [L, B, H_kv], host
        longest = lengths.amax(dim=(0, 2))
        width = int(longest.max()) + DECODE_STEPS_OF_ROOM
        offsets = torch.arange(width, device=device)
        cell_counts = cell_counts.to(device).unsqueeze(-1)  # [L, B, H_kv, 1]
        # The dense key each offset reads: past the cells, clamped to the last dense key (the padding).
        dense_entry = torch.minimum((offsets - cell_counts).clamp(min=0), (dense_counts.to(device) - 1).view(1, batch, 1, 1))
        padded_slots = torch.nn.utils.rnn.pad_sequence(dense_slots, batch_first=True)  # [B, most dense keys]
        dense_entry += torch.arange(batch, device=device).view(1, batch, 1, 1) * padded_slots.shape[1]
        slots = padded_slots.view(-1).index_select(0, dense_entry.view(-1)).view(dense_entry.shape)
        layers = torch.arange(num_layers, device=device).view(-1, 1, 1, 1)
        rows = space.entry_rows(layers, slots, torch.arange(num_kv_heads, device=device).view(1, 1, -1, 1))
        if compressed and cells.kv_indices.numel():
            entries = (cell_starts.unsqueeze(-1) + offsets).clamp(max=cells.kv_indices.numel() - 1)
            cell_rows = cells.kv_indices.index_select(0, entries.view(-1)).view(entries.shape)
            rows = torch.where(offsets < cell_counts, cell_rows, rows)
        sequences = batch * num_kv_heads
        ends = lengths.to(device).view(num_layers, sequences)
        return cls.of_rows(rows.view(num_layers, sequences, width), ends, longest.tolist(), space)

    @classmethod
    def of_rows(cls, rows: torch.Tensor, ends: torch.Tensor, longest: list[int], space: CellSpace) -> "DecodeKeys":
        """The keys ``rows`` ``[L, S, W]`` with ``ends`` ``[L, S]`` keys per sequence; ``visible`` from them."""
        num_layers, sequences, width = rows.shape
        visible = torch.arange(width, device=rows.device) < ends.view(num_layers, sequences, 1, 1, 1)
        return cls(rows, visible, ends, longest, space)

    @classmethod
    def joined(cls, parts: list[tuple["DecodeKeys", int]], space: CellSpace) -> "DecodeKeys":
        """The keys of the requests ``(keys, index)`` in this order (each request's keys copied from its
        ``keys``), with room for ``DECODE_STEPS_OF_ROOM`` more steps past the longest sequence."""
        longest = [keys.longest[index] for keys, index in parts]
        width = max(longest) + DECODE_STEPS_OF_ROOM
        heads = space.num_kv_heads
        blocks, ends = [], []
        for keys, index in parts:
            own = keys.rows[:, index * heads : (index + 1) * heads]  # [L, H_kv, W_own]
            # Past its own width a request repeats its last column: a key, or padding that repeats one.
            columns = torch.arange(width, device=own.device).clamp(max=own.shape[2] - 1)
            blocks.append(own.index_select(2, columns))
            ends.append(keys.ends[:, index * heads : (index + 1) * heads])
        return cls.of_rows(torch.cat(blocks, dim=1), torch.cat(ends, dim=1), longest, space)

    def append(self, new_slots: torch.Tensor, requests: Optional[list[int]] = None) -> None:
        """One more decode step of ``requests`` (batch indices; all when None): each one's new token
        (``new_slots`` int ``[n]``, the slots this forward writes) becomes the next key of each of its
        sequences, in every layer."""
        num_layers, sequences, width = self.rows.shape
        heads, device = self.space.num_kv_heads, self.rows.device
        requests = list(range(sequences // heads)) if requests is None else requests
        chosen = torch.arange(heads, device=device).repeat(len(requests))
        chosen += torch.tensor(requests, device=device).repeat_interleave(heads) * heads  # their sequences
        layers = torch.arange(num_layers, device=device).view(num_layers, 1)
        flat = layers * sequences + chosen  # [L, n * H_kv] into [L * S]
        entries = flat * width + self.ends.view(-1)[flat]
        slots = new_slots.to(torch.int64).repeat_interleave(heads)
        new_rows = self.space.entry_rows(layers, slots.view(1, -1), (chosen % heads).view(1, -1))
        self.rows.view(-1).index_copy_(0, entries.view(-1), new_rows.view(-1))
        self.visible.view(-1).index_fill_(0, entries.view(-1), True)
        self.ends.view(-1).index_add_(0, flat.view(-1), torch.ones_like(flat.view(-1)))
        for request in requests:
            self.longest[request] += 1
        if len(requests) * heads < sequences:
            self.buckets = None  # some sequences grew, others did not: grouped again when next asked
        elif self.buckets is not None:  # every sequence one key longer: each bucket's longest too
            self.buckets = [[dataclasses.replace(bucket, width=bucket.width + 1) for bucket in layer] for layer in self.buckets]


class DecodeSteps:
    """Which requests of a decode batch go on from the last decode batch, each one token longer. A request
    is the same one while its id, its ``req_to_token`` row and its view object are: a request retracted and
    admitted again (a new row), or a path that changed (a new compressed node, a split, or cells moved: the
    arena's generation gives the request a new view object), is not. Views are compared by identity, never
    by value: two equal-looking views of different placements must not share keys."""

    def __init__(self):
        self._requests: list[tuple] = []  # per request (rid, row, id(view))
        self._views: list[Optional[PathView]] = []  # held, so that no other view takes one of those ids
        self._seq_lens: list[int] = []

    def step(self, rids, forward: ForwardRequests) -> tuple[list[Optional[int]], bool]:
        """Per request of the decode batch ``forward`` (its requests' ids ``rids``), its index in the last one
        (None: new to it, or not the same request), and whether ``forward`` is the last batch one step on,
        every request in its place; ``forward`` becomes the last batch."""
        requests = [(rid, request.row, id(request.view)) for rid, request in zip(rids, forward.requests)]
        seq_lens = [request.seq_len for request in forward.requests]
        before = {request: (index, seq_len) for index, (request, seq_len) in enumerate(zip(self._requests, self._seq_lens))}
        carried = [before.get(request, (None, None)) for request in requests]
        carried = [index if old is not None and old + 1 == seq_len else None for (index, old), seq_len in zip(carried, seq_lens)]
        same = carried == list(range(len(self._requests)))
        self._requests, self._seq_lens = requests, seq_lens
        self._views = [request.view for request in forward.requests]
        return carried, same


class DecodeKeysCache:
    """The last decode forward's ``DecodeKeys``. The next decode step appends each request's new token to
    them; a request that joins, or is no longer the same one (``DecodeSteps``), is built from its view, the
    others' keys carried over; a batch out of room is built again."""

    def __init__(self):
        self._steps = DecodeSteps()
        self._keys: Optional[DecodeKeys] = None
        self.builds = 0  # decode forwards whose keys were not all appended to the last ones (tests)

    def of(self, rids, forward: ForwardRequests, req_to_token: torch.Tensor, space: CellSpace, new_slots: torch.Tensor) -> DecodeKeys:
        """The keys of the decode batch ``forward`` (its requests' ids ``rids``, the slots its new tokens are
        written to ``new_slots`` int ``[B]``)."""
        carried, same = self._steps.step(rids, forward)
        keys = self._keys
        if same and keys.room > 0:
            keys.append(new_slots)
        else:
            self.builds += 1
            joining = [request for request, index in zip(forward.requests, carried) if index is None]
            joining = tuple(dataclasses.replace(request, index=index) for index, request in enumerate(joining))
            built, fresh = (DecodeKeys.of(joining, req_to_token, space) if joining else None), iter(range(len(joining)))
            keys = DecodeKeys.joined([(keys, index) if index is not None else (built, next(fresh)) for index in carried], space)
            staying = [position for position, index in enumerate(carried) if index is not None]
            if staying:
                keys.append(new_slots[staying], staying)
        self._keys = keys
        return keys


class WindowKeysCache:
    """The last decode forward's ``WindowKeys``. The next decode step slides each request's window by its
    new token (``WindowKeys.decoded``: no loop over requests or layers, no host read); a request that
    joins, or is no longer the same one (``DecodeSteps``), is built from its view, the others' keys carried
    over. An extend is built every time: its queries are many, and its requests not one token on."""

    def __init__(self):
        self._steps = DecodeSteps()
        self._keys: Optional[WindowKeys] = None
        self.builds = 0  # decode forwards whose keys were not all slid from the last ones (tests)

    def of(
        self, rids, forward: ForwardRequests, req_to_token: torch.Tensor, space: CellSpace, local: LocalLayers,
        new_slots: torch.Tensor, every_request: bool = False,
    ) -> WindowKeys:  # fmt: skip
        """The window keys of ``forward``: in a decode (its requests' ids ``rids``, the slots its new tokens
        are written to ``new_slots`` int ``[B]``) every request's, in an extend the compressed ones' (with
        ``every_request``, the plain ones' too: the FlashInfer path attends every request itself)."""
        if not forward.is_decode:
            return WindowKeys.of(forward.requests if every_request else forward.compressed, req_to_token, space, local)
        carried, same = self._steps.step(rids, forward)
        width = max(min(request.seq_len, local.window) for request in forward.requests)  # a decode query's span
        if same:
            keys = self._keys.decoded(new_slots, space, local.window, width)
        else:
            self.builds += 1
            staying = [position for position, index in enumerate(carried) if index is not None]
            if not staying:
                keys = WindowKeys.of(forward.requests, req_to_token, space, local)
            else:
                device = req_to_token.device
                carried_from = torch.tensor([carried[position] for position in staying], device=device)
                keys = self._keys.decoded(new_slots[staying], space, local.window, width, carried_from)
                joining = [position for position, index in enumerate(carried) if index is None]
                if joining:
                    built = WindowKeys.of(tuple(forward.requests[p] for p in joining), req_to_token, space, local, width)
                    keys = keys.joined(built, torch.tensor(staying + joining, device=device))
        self._keys = keys
        return keys
