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

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from local_layer_batch import (
    GROUP, HEAD_DIM, KV_HEADS, LOCAL, PATH_CHANGES, WINDOW, Batch, change_path, gemma_batch, local_layer,
)  # fmt: skip

from sgl_kvevict.engine.adapter import sync_probe
from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend
from sgl_kvevict.engine.batch import ForwardRequests, RequestSlice, SegmentMetadata, WindowKeys


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
        expected = batch.windowed_formula(layer, queries.view(-1, KV_HEADS * GROUP, HEAD_DIM), forward)
        torch.testing.assert_close(out.view_as(expected).double(), expected, atol=2e-5, rtol=1e-5)
    backend.window_keys = cached


def test_cached_window_keys_decode_as_rebuilding_them_every_step_through_path_changes(backend):
    batch = gemma_batch()
    backend = backend(batch)
    builds = []
    for step in range(40):  # every request decodes past its window
        change_path(batch, step)
        forward, forward_batch = decode_step(backend, batch)
        assert_cached_is_the_rebuild(backend, batch, forward, forward_batch)
        builds.append(backend._window_keys.builds)
    # Built on the first step and on each change of the batch; every other step slid the last keys.
    assert tuple(step for step in range(1, 40) if builds[step] != builds[step - 1]) == PATH_CHANGES
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

