"""The torch backend's window keys (``engine.batch.WindowKeys``) kept across decode steps (``WindowKeysCache``).

A Gemma 3-shaped pool (three local layers with a 16-token window, then a global one, as
tests/test_engine_local_layers.py's model) holds a decode batch whose compressed nodes keep, in local
layers, the last window of every node in every KV head (``sgl_kvevict.local_layers``), their cells
copies of the dense keys they replace (whose slots are then NaN, as is the placeholder slot 0). Over
many decode steps, past the window, with windows that start inside compressed nodes, a node
compressed, a node split (its cells moved), requests leaving and joining, the cached keys are the
tensors a rebuild from the views gives, so each local layer's output is bit for bit the rebuild's; it
equals the float64 windowed formula over the dense keys; a cached step is built from nothing but the
device (no syncing call, ``engine.adapter.sync_probe``'s count), and only a changed batch is rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from segment_scenarios import HEAD_DIM, layer_of
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kvevict.engine.adapter import sync_probe
from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend
from sgl_kvevict.engine.batch import ForwardRequests, RequestSlice, SegmentMetadata, WindowKeys
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

    def step(self) -> tuple[ForwardRequests, SimpleNamespace]:
        """The next decode forward: each request one token longer, its new token's keys written (pool and
        truth) to a free slot; returns the forward and its forward batch."""
        slices, new_slots = [], []
        for index, request in enumerate(self.requests):
            slot = self.free_slots.pop()
            written = torch.randn(NUM_LAYERS, 2, KV_HEADS, HEAD_DIM, generator=self.generator)
            self.storage[:, :, slot], self.truth[:, :, slot] = written, written
            self.req_to_token[request.row, request.seq_len] = slot
            request.slots.append(slot)
            request.seq_len += 1
            new_slots.append(slot)
            slices.append(RequestSlice(index, index, index + 1, request.seq_len, request.row, request.view))
        forward = ForwardRequests(True, tuple(slices))
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, rids=[request.rid for request in self.requests], out_cache_loc=torch.tensor(new_slots),
            req_pool_indices=torch.tensor([r.row for r in self.requests]), seq_lens=torch.tensor([r.seq_len for r in self.requests]),
        )  # fmt: skip
        return forward, forward_batch

    def windowed_formula(self, layer, queries: torch.Tensor) -> torch.Tensor:
        """float64 ``[B, H_q, D]``: each request's newest query over the truth's keys of its window."""
        outs = []
        for index, request in enumerate(self.requests):
            slots = torch.tensor(request.slots[max(0, request.seq_len - WINDOW) :])
            heads = []
            for head in range(layer.tp_q_head_num):
                keys = self.truth[layer.layer_id, 0, slots, head // GROUP].double()
                values = self.truth[layer.layer_id, 1, slots, head // GROUP].double()
                weights = torch.softmax(keys @ queries[index, head].double() * layer.scaling, dim=0)
                heads.append(weights @ values)
            outs.append(torch.stack(heads))
        return torch.stack(outs)


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(KVEvictTorchBackend, "engine", property(lambda self: SimpleNamespace(local_layers=LOCAL)))

    def build(batch: Batch) -> KVEvictTorchBackend:
        runner = SimpleNamespace(
            device=torch.device("cpu"), req_to_token_pool=SimpleNamespace(req_to_token=batch.req_to_token),
            token_to_kv_pool=batch.pool,
        )  # fmt: skip
        built = KVEvictTorchBackend(runner)
        built.cell_space = batch.space
        return built

    return build


def local_layer(layer_id: int):
    return SimpleNamespace(**{**vars(layer_of(layer_id, KV_HEADS, GROUP)), "sliding_window_size": WINDOW - 1})


def decode_step(backend, batch: Batch) -> tuple[ForwardRequests, SimpleNamespace]:
    forward, forward_batch = batch.step()
    segments = SegmentMetadata.of(forward, torch.device("cpu"), backend._cell_batches)
    backend._init_segment_metadata(forward_batch, segments)
    backend.segments = segments
    return forward, forward_batch


def assert_cached_is_the_rebuild(backend, batch: Batch, forward, forward_batch) -> None:
    """The cached window keys are the tensors ``WindowKeys.of`` builds from the views, each local layer's
    output bit for bit the rebuild's, and close to the windowed formula's."""
    cached = backend.window_keys
    rebuilt = WindowKeys.of(forward.requests, batch.req_to_token, batch.space, LOCAL)
    for name in ("rows", "positions", "query_rows", "query_positions"):
        assert torch.equal(getattr(cached, name), getattr(rebuilt, name)), name
    assert cached.layer_rows == rebuilt.layer_rows
    queries = torch.randn(len(forward.requests), KV_HEADS * GROUP * HEAD_DIM, generator=batch.generator)
    for layer_id in LOCAL.layers:
        layer = local_layer(layer_id)
        backend.window_keys = cached
        out = backend.forward_decode(queries, None, None, layer, forward_batch, save_kv_cache=False)
        backend.window_keys = rebuilt
        assert torch.equal(out, backend.forward_decode(queries, None, None, layer, forward_batch, save_kv_cache=False))
        assert torch.isfinite(out).all()
        expected = batch.windowed_formula(layer, queries.view(-1, KV_HEADS * GROUP, HEAD_DIM))
        torch.testing.assert_close(out.view_as(expected).double(), expected, atol=2e-5, rtol=1e-5)
    backend.window_keys = cached


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


def test_cached_window_keys_decode_as_rebuilding_them_every_step_through_path_changes(backend):
    batch = gemma_batch()
    backend = backend(batch)
    builds = []
    for step in range(40):  # every request decodes past its window
        if step == 8:  # a node compressed between two steps: the two-node request's dense [50, 64)
            two_nodes = batch.requests[2]
            batch.compress(two_nodes, two_nodes.nodes + [(50, 64)])
        if step == 12:  # a split: [0, 24) at 12 (its head keeps its own window), cells moved
            inside = batch.requests[0]
            batch.compress(inside, [(0, 12), (12, 24)])
        if step == 20:  # the plain request leaves
            batch.requests.pop(1)
        if step == 25:  # one joins, whose window starts inside its node
            batch.add("joining", 5, 40, [(0, 30)])
        forward, forward_batch = decode_step(backend, batch)
        assert_cached_is_the_rebuild(backend, batch, forward, forward_batch)
        builds.append(backend._window_keys.builds)
    # Built on the first step and on each change of the batch; every other step slid the last keys.
    assert [step for step in range(1, 40) if builds[step] != builds[step - 1]] == [8, 12, 20, 25]
    assert builds[0] == 1


def test_a_request_back_in_another_row_or_after_a_gap_is_built_again(backend):
    batch = gemma_batch()
    backend = backend(batch)
    decode_step(backend, batch)
    forward, forward_batch = decode_step(backend, batch)
    assert backend._window_keys.builds == 1
    plain = batch.requests[1]  # retracted, admitted again in another row with its tokens in new slots
    old = torch.tensor(plain.slots)
    plain.slots = [batch.free_slots.pop() for _ in plain.slots]
    batch.storage[:, :, torch.tensor(plain.slots)] = batch.truth[:, :, old]
    batch.truth[:, :, torch.tensor(plain.slots)] = batch.truth[:, :, old]
    batch.storage[:, :, old] = float("nan")
    batch.req_to_token[plain.row] = 0
    plain.row = 9
    batch.req_to_token[plain.row, : plain.seq_len] = torch.tensor(plain.slots, dtype=torch.int32)
    forward, forward_batch = decode_step(backend, batch)
    assert backend._window_keys.builds == 2
    assert_cached_is_the_rebuild(backend, batch, forward, forward_batch)
    batch.step()  # a decode step the cache does not see (say, without compressed requests): a gap
    forward, forward_batch = decode_step(backend, batch)
    assert backend._window_keys.builds == 3
    assert_cached_is_the_rebuild(backend, batch, forward, forward_batch)


def syncing_calls(monkeypatch, run) -> int:
    """The host-synchronising calls ``run()`` makes, counted as ``sync_probe`` counts them in a server."""
    probe = sync_probe.SyncProbe(Path("unused"))
    with monkeypatch.context() as patch:
        for name in sync_probe.SYNCING_METHODS:
            patch.setattr(torch.Tensor, name, probe.counted(getattr(torch.Tensor, name)))
        stock_tensor = torch.tensor

        def tensor(data, *args, **kwargs):
            if isinstance(data, (list, tuple)):
                probe.calls += 1
            return stock_tensor(data, *args, **kwargs)

        patch.setattr(torch, "tensor", tensor)
        run()
    return probe.calls


def test_a_cached_decode_step_makes_no_syncing_call(backend, monkeypatch):
    batch = gemma_batch()
    backend = backend(batch)
    cache = backend._window_keys

    def window_keys_of(forward, forward_batch):
        return lambda: cache.of(forward_batch.rids, forward, batch.req_to_token, batch.space, LOCAL, forward_batch.out_cache_loc)

    first = batch.step()
    assert syncing_calls(monkeypatch, window_keys_of(*first)) > 0  # built from the views: the probe counts
    for _ in range(WINDOW + 2):  # past every request's window
        forward, forward_batch = batch.step()
        assert syncing_calls(monkeypatch, window_keys_of(forward, forward_batch)) == 0
    assert cache.builds == 1
    rebuilt = WindowKeys.of(forward.requests, batch.req_to_token, batch.space, LOCAL)
    assert torch.equal(cache._keys.rows, rebuilt.rows) and torch.equal(cache._keys.positions, rebuilt.positions)


def test_an_extend_is_built_from_the_views_and_leaves_the_decode_cache(backend):
    batch = gemma_batch()
    backend = backend(batch)
    decode_step(backend, batch)
    extend = ForwardRequests(False, tuple(RequestSlice(i, 3 * i, 3 * i + 3, r.seq_len, r.row, r.view) for i, r in enumerate(batch.requests)))
    keys = backend._window_keys.of([r.rid for r in batch.requests], extend, batch.req_to_token, batch.space, LOCAL, None)
    rebuilt = WindowKeys.of(extend.compressed, batch.req_to_token, batch.space, LOCAL)
    assert torch.equal(keys.rows, rebuilt.rows) and torch.equal(keys.query_rows, rebuilt.query_rows)
    forward, forward_batch = decode_step(backend, batch)  # the decode after it slides its last keys
    assert backend._window_keys.builds == 1
    assert_cached_is_the_rebuild(backend, batch, forward, forward_batch)

