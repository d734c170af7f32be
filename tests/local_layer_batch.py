"""A Gemma 3-shaped KV pool stepped one forward at a time, for the local-layer attention tests.

Three local layers with a 16-token window, then a global one (as tests/test_engine_local_layers.py's
model). Compressed nodes keep, in local layers, the last window of every node in every KV head
(``sgl_kvevict.local_layers``), in the global layer a random part per head; their cells are copies of the
dense keys they replace (whose slots are then NaN, as is the placeholder slot 0). ``truth`` keeps every
position's keys as written, so the windowed formula can be computed whatever the pool holds. Shared by
tests/test_engine_window_keys.py (the torch backend) and tests/test_engine_flashinfer_local_layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from segment_scenarios import HEAD_DIM, layer_of
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kvevict.engine.batch import ForwardRequests, RequestSlice
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.segments import PathView
from sgl_kvevict.local_layers import LocalLayers

WINDOW, NUM_LAYERS, KV_HEADS, GROUP, NUM_SLOTS, ROWS = 16, 4, 2, 2, 1024, 64
LOCAL = LocalLayers(layers=(0, 1, 2), window=WINDOW)


@dataclass
class Request:
    """A request of the batch: its id, ``req_to_token`` row, length, compressed nodes ``(start, end)``,
    and ``slots``, the dense slot that holds (or held, before its node took it) each position's keys."""

    rid: str
    row: int
    seq_len: int
    nodes: list[tuple[int, int]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    view: PathView | None = None


class Batch:
    """A pool, its truth (every position's keys as written, kept when a node takes them) and the requests of
    a decode batch, stepped one token at a time."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        storage = torch.randn(NUM_LAYERS, 2, NUM_SLOTS, KV_HEADS, HEAD_DIM, generator=self.generator)
        storage[:, :, 0] = float("nan")  # the placeholder slot of compressed positions: never read
        self.truth = storage.clone()
        self.truth_space = CellSpace.of_buffers(list(self.truth[:, 0]), list(self.truth[:, 1]))
        self.pool = SimpleNamespace(
            k_buffer=[storage[layer, 0] for layer in range(NUM_LAYERS)], v_buffer=[storage[layer, 1] for layer in range(NUM_LAYERS)],
            dtype=torch.float32,
        )  # fmt: skip
        self.pool.get_key_buffer = lambda layer: self.pool.k_buffer[layer]
        self.pool.get_value_buffer = lambda layer: self.pool.v_buffer[layer]
        self.pool.get_kv_buffer = lambda layer: (self.pool.k_buffer[layer], self.pool.v_buffer[layer])
        self.storage = storage
        self.space = CellSpace.of_buffers(self.pool.k_buffer, self.pool.v_buffer)
        order = (torch.randperm(NUM_SLOTS - 1, generator=self.generator) + 1).tolist()
        self.free_slots = order[: NUM_SLOTS // 2]
        self.free_cells = self.space.cells_of_slots(torch.tensor(order[NUM_SLOTS // 2 :])).flatten().tolist()
        self.req_to_token = torch.zeros(ROWS, 256, dtype=torch.int32)
        self.requests: list[Request] = []

    def add(self, rid: str, row: int, seq_len: int, nodes=()) -> Request:
        request = Request(rid, row, seq_len, slots=[self.free_slots.pop() for _ in range(seq_len)])
        self.req_to_token[row, :seq_len] = torch.tensor(request.slots, dtype=torch.int32)
        self.requests.append(request)
        self.compress(request, list(nodes))
        return request

    def compress(self, request: Request, nodes: list[tuple[int, int]]) -> None:
        """``request``'s path becomes ``nodes``: a new view, its cells new ones holding the truth's keys; its old
        cells and the dense slots of its compressed positions NaN, ``req_to_token`` there the placeholder.
        Local layers keep each node's last window in every head (a split head its own window), the global
        layer a random part of it per head."""
        if request.view is not None:  # the arena moved or freed its cells
            self.space.k_rows.index_fill_(0, request.view.cells, float("nan"))
            self.space.v_rows.index_fill_(0, request.view.cells, float("nan"))
        request.nodes = nodes
        if not nodes:
            request.view = None
            return
        kept = []  # per (layer, head): positions, path order
        for layer in range(NUM_LAYERS):
            for _ in range(KV_HEADS):
                per_node = []
                for start, end in nodes:
                    if layer in LOCAL.layers:
                        per_node.append(torch.arange(max(start, end - WINDOW), end))
                    else:
                        count = int(torch.randint(0, end - start + 1, (1,), generator=self.generator))
                        per_node.append(start + torch.randperm(end - start, generator=self.generator)[:count].sort().values)
                kept.append(torch.cat(per_node))
        counts = torch.tensor([len(positions) for positions in kept]).view(NUM_LAYERS, KV_HEADS)
        positions = torch.cat(kept)
        cells = torch.tensor([self.free_cells.pop() for _ in range(len(positions))], dtype=torch.int64)
        layers = torch.arange(NUM_LAYERS).repeat_interleave(counts.sum(1))
        heads = torch.cat([torch.arange(KV_HEADS).repeat_interleave(counts[layer]) for layer in range(NUM_LAYERS)])
        sources = self.space.entry_rows(layers, torch.tensor(request.slots)[positions], heads)
        self.space.k_rows[cells], self.space.v_rows[cells] = self.truth_space.k_rows[sources], self.truth_space.v_rows[sources]
        request.view = PathView.of_entries(tuple(nodes), counts, cells, positions, len(cells))
        for start, end in nodes:
            dense = torch.tensor(request.slots[start:end])
            self.storage[:, :, dense] = float("nan")
            self.req_to_token[request.row, start:end] = 0

    def step(self, new_tokens: Optional[Sequence[int]] = None) -> tuple[ForwardRequests, SimpleNamespace]:
        """The next forward: a decode (``new_tokens`` None: each request one token longer) or an extend of
        ``new_tokens[i]`` tokens for request ``i``; the new tokens' keys written (pool and truth) to free
        slots. Returns the forward and its forward batch."""
        decode = new_tokens is None
        counts = [1] * len(self.requests) if decode else list(new_tokens)
        slices, new_slots, q_start = [], [], 0
        for index, (request, count) in enumerate(zip(self.requests, counts)):
            slots = [self.free_slots.pop() for _ in range(count)]
            written = torch.randn(NUM_LAYERS, 2, count, KV_HEADS, HEAD_DIM, generator=self.generator)
            self.storage[:, :, slots], self.truth[:, :, slots] = written, written
            self.req_to_token[request.row, request.seq_len : request.seq_len + count] = torch.tensor(slots, dtype=torch.int32)
            request.slots += slots
            request.seq_len += count
            new_slots += slots
            slices.append(RequestSlice(index, q_start, q_start + count, request.seq_len, request.row, request.view))
            q_start += count
        forward = ForwardRequests(decode, tuple(slices))
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, rids=[request.rid for request in self.requests],
            out_cache_loc=torch.tensor(new_slots), req_pool_indices=torch.tensor([r.row for r in self.requests]),
            seq_lens=torch.tensor([r.seq_len for r in self.requests]),
            extend_seq_lens=torch.tensor(counts), extend_prefix_lens=torch.tensor([r.seq_len for r in self.requests]) - torch.tensor(counts),
        )  # fmt: skip
        return forward, forward_batch

    def windowed_formula(self, layer, queries: torch.Tensor, forward: ForwardRequests) -> torch.Tensor:
        """float64 ``[N, H_q, D]``: each query of ``forward`` (its rows of ``queries`` ``[N, H_q, D]``, at the
        last positions of its request) over the truth's keys of its window."""
        outs = []
        for request, slice_ in zip(self.requests, forward.requests):
            for row, position in zip(range(slice_.q_start, slice_.q_end), range(slice_.first_query_position, slice_.seq_len)):
                slots = torch.tensor(request.slots[max(0, position + 1 - WINDOW) : position + 1])
                heads = []
                for head in range(layer.tp_q_head_num):
                    keys = self.truth[layer.layer_id, 0, slots, head // GROUP].double()
                    values = self.truth[layer.layer_id, 1, slots, head // GROUP].double()
                    weights = torch.softmax(keys @ queries[row, head].double() * layer.scaling, dim=0)
                    heads.append(weights @ values)
                outs.append(torch.stack(heads))
        return torch.stack(outs)


def local_layer(layer_id: int):
    return SimpleNamespace(**{**vars(layer_of(layer_id, KV_HEADS, GROUP)), "sliding_window_size": WINDOW - 1})


def gemma_batch() -> Batch:
    """Four requests: a window that starts inside a node (positions 14-23 of [0, 24) in the first query's
    window), a plain one shorter than the window, two nodes with the window's start in the second, and a
    request shorter than the window whose node it reads whole."""
    batch = Batch()
    batch.add("inside", 1, 29, [(0, 24)])
    batch.add("plain", 2, 9)
    batch.add("two-nodes", 3, 59, [(0, 20), (20, 50)])
    batch.add("short", 4, 4, [(0, 4)])
    return batch


# The decode steps at which ``change_path`` changes the batch of ``gemma_batch``.
PATH_CHANGES = (8, 12, 20, 25)


def change_path(batch: Batch, step: int) -> None:
    """Before decode step ``step`` of ``gemma_batch``: a node compressed between two steps (step 8: the
    two-node request's dense [50, 64)), a split (12: [0, 24) at 12, its head keeping its own window, cells
    moved), the plain request leaving (20), one joining whose window starts inside its node (25)."""
    if step == 8:
        two_nodes = batch.requests[2]
        batch.compress(two_nodes, two_nodes.nodes + [(50, 64)])
    if step == 12:
        batch.compress(batch.requests[0], [(0, 12), (12, 24)])
    if step == 20:
        batch.requests.pop(1)
    if step == 25:
        batch.add("joining", 5, 40, [(0, 30)])

