"""The replayable decode (``engine.decode_graph``): fixed buffers filled in place, a body with static shapes.

A graph-replay harness on CPU: one ``DecodeGraphState`` is filled batch after batch (requests finishing
and joining, batches padded to a captured size, plain requests beside compressed ones, heads without
cells) and its body is run as a replay would run it; each step equals the eager backend on the same
batch and the float64 formula. The body is then held to what a captured region needs: no host
synchronisation (the sync probe's calls, counted) and shapes that depend on the batch size alone
(traced by ``torch.compile(fullgraph=True)``, which refuses data-dependent shapes and host reads).
The same steps run through the Triton kernels: in the interpreter on CPU, and on CUDA
(``KVEVICT_GPU_TESTS=1``, docs/gpu.md) captured once in a real CUDA graph and replayed after each fill.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from segment_scenarios import (
    DECODE,
    HEAD_DIM,
    NUM_LAYERS,
    RequestSpec,
    build_scenario,
    layer_of,
    naive_attention,
    run_backend,
    torch_backend,
)
from sgl_kvevict.engine.batch import ForwardRequests
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.decode_graph import FITS, DecodeGraphState, GraphCapacity
from sgl_kvevict.engine.sync_probe import SYNCING_METHODS
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from test_kernels_support import interpreter_process_test, on_kernel_devices

test_in_interpreter_process = interpreter_process_test(__file__)

CAPACITY = GraphCapacity(max_batch=6, cells=200, cells_per_sequence=8, dense_keys=24)
GQA = [pytest.param(2, 2, id="kv2-g2"), pytest.param(1, 3, id="kv1-g3")]
# Decode steps served by one state: requests finish (the first two), a plain one joins, then a
# compressed one with more cells per head; each step padded to a captured size above it.
STEPS = (
    (DECODE, 4),
    ((DECODE[2], RequestSpec(12, 1)), 2),
    ((RequestSpec(12, 1), RequestSpec(20, 1, ((2, 10, ((7, 1), (0, 8))),)), DECODE[0]), 6),
)


def state_buffers(state: DecodeGraphState) -> tuple[torch.Tensor, ...]:
    return state.qo_indptr, state.cell_indptr, state.cell_indices, state.dense_indptr, state.dense_indices


def replay(state: DecodeGraphState, scenario, layer, batch_size: int) -> torch.Tensor:
    """What a replay computes for ``scenario``'s requests: the forward's K/V written, the body run on the
    batch padded to ``batch_size`` (padded queries are zero), the real rows returned ``[B, H_q * D]``."""
    batch = scenario.segments.forward
    scenario.pool.set_kv_buffer(layer, scenario.forward_batch, scenario.k, scenario.v)
    queries = torch.zeros(batch_size, layer.tp_q_head_num, layer.qk_head_dim, dtype=scenario.q.dtype)
    queries[: len(batch.requests)] = scenario.q.view(len(batch.requests), layer.tp_q_head_num, -1)
    k_cache, v_cache = scenario.pool.get_kv_buffer(layer.layer_id)
    out = state.attend(queries, layer, scenario.space.k_rows, scenario.space.v_rows, k_cache, v_cache)
    return out[: len(batch.requests)].reshape(len(batch.requests), -1)


def decode_scenario(specs, num_kv_heads: int, group: int, seed: int = 0):
    scenario = build_scenario(specs, ForwardMode.DECODE, num_kv_heads, group, seed=seed)
    scenario.forward_batch.loc = scenario.forward_batch.out_cache_loc  # set_kv_buffer's write location
    return scenario


@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_one_state_replays_every_step_as_the_eager_backend_computes_it(num_kv_heads, group):
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, num_kv_heads, torch.device("cpu"))
    buffers = [t.data_ptr() for t in state_buffers(state)]
    for seed, (specs, batch_size) in enumerate(STEPS):
        replayed, eager = decode_scenario(specs, num_kv_heads, group, seed), decode_scenario(specs, num_kv_heads, group, seed)
        assert state.fill(replayed.segments.forward, replayed.req_to_token, batch_size) == FITS
        cpu_backend = torch_backend(eager)
        for layer_id in range(NUM_LAYERS):  # the layers keep different cells per head
            layer = layer_of(layer_id, num_kv_heads, group)
            out = replay(state, replayed, layer, batch_size)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, run_backend(cpu_backend, eager, layer), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(out.double(), naive_attention(replayed, layer), atol=2e-5, rtol=1e-5)
    # Filled in place: a captured graph keeps reading the same memory.
    assert buffers == [t.data_ptr() for t in state_buffers(state)]


@pytest.mark.parametrize(
    "capacity, reason",
    [
        (GraphCapacity(6, 200, 4, 24), "cells, above 4"),  # DECODE's request 0 keeps 5 cells in one head
        (GraphCapacity(6, 20, 8, 24), "the batch holds"),
        (GraphCapacity(6, 200, 8, 8), "dense keys, above 8"),
    ],
)
def test_a_batch_beyond_a_bound_does_not_fit_and_leaves_the_buffers(capacity, reason):
    state = DecodeGraphState(capacity, NUM_LAYERS, 2, torch.device("cpu"))
    before = [t.clone() for t in state_buffers(state)]
    scenario = decode_scenario(DECODE, 2, 2)
    assert reason in state.fill(scenario.segments.forward, scenario.req_to_token, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, state_buffers(state)))


def test_capacity_bounds_are_validated():
    with pytest.raises(ValueError, match="cells_per_sequence=0"):
        GraphCapacity(4, 10, 0, 8)


def test_the_replayed_body_never_synchronises(monkeypatch):
    """Every host-reading tensor call the sync probe counts, counted while the body runs: none."""
    calls = []
    for name in SYNCING_METHODS:
        stock = getattr(torch.Tensor, name)

        @functools.wraps(stock)
        def counted(*args, _stock=stock, _name=name, **kwargs):
            calls.append(_name)
            return _stock(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, 2, torch.device("cpu"))
    scenario = decode_scenario(DECODE, 2, 2)
    state.fill(scenario.segments.forward, scenario.req_to_token, 4)
    calls.clear()  # filling may read the host (it runs before a replay, outside the graph)
    for layer_id in range(NUM_LAYERS):
        replay(state, scenario, layer_of(layer_id, 2, 2), 4)
    assert calls == []


@pytest.mark.torch_twins  # dynamo traces the torch twins; it does not trace Triton's interpreter
def test_the_replayed_body_traces_into_one_graph_of_static_shapes():
    """``fullgraph=True`` fails on any graph break: a data-dependent shape (boolean indexing, nonzero) or
    a host read of a device value. Two fills of different content replay through the one trace."""
    torch._dynamo.reset()
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, 2, torch.device("cpu"))
    compiled = torch.compile(state.attend, backend="eager", fullgraph=True, dynamic=False)
    for seed, specs in enumerate((DECODE, (RequestSpec(12, 1), DECODE[2], DECODE[0]))):
        scenario = decode_scenario(specs, 2, 2, seed)
        state.fill(scenario.segments.forward, scenario.req_to_token, 4)
        layer = layer_of(0, 2, 2)
        scenario.pool.set_kv_buffer(layer, scenario.forward_batch, scenario.k, scenario.v)
        queries = torch.zeros(4, 4, layer.qk_head_dim)
        queries[:3] = scenario.q.view(3, 4, -1)
        rows = (queries, layer, scenario.space.k_rows, scenario.space.v_rows, *scenario.pool.get_kv_buffer(0))
        torch.testing.assert_close(compiled(*rows)[:3], state.attend(*rows)[:3])


def pool_storage(scenario) -> torch.Tensor:
    """``[L, 2, slots, H_kv, D]``: the scenario's pool content, K then V per layer."""
    return torch.stack([torch.stack([k, v]) for k, v in zip(scenario.pool.k_buffer, scenario.pool.v_buffer)])


def requests_on(scenario, device: str) -> ForwardRequests:
    """The scenario's decode batch with its compressed paths on ``device``."""

    def moved(view):
        if view is None:
            return None
        return dataclasses.replace(view, cells=view.cells.to(device), positions=view.positions.to(device),
                                   head_indptr=view.head_indptr.to(device))  # fmt: skip

    requests = scenario.segments.forward.requests
    return ForwardRequests(True, tuple(dataclasses.replace(r, view=moved(r.view)) for r in requests))


def captured_in_a_cuda_graph(body):
    """``body`` captured once in a CUDA graph (a warm-up outside the capture compiles its kernels); the
    returned function replays the graph and returns the outputs it captured."""
    warm_up = torch.cuda.Stream()
    warm_up.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_up):
        body()
    torch.cuda.current_stream().wait_stream(warm_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()

    def replayed():
        graph.replay()
        return outputs

    return replayed


@on_kernel_devices
def test_the_triton_body_replays_every_step(device):
    """The body through the Triton kernels (the interpreter on CPU) for every step of ``STEPS``, all padded
    to the largest captured size, against the float64 formula. On CUDA the body of both layers is
    captured once in a CUDA graph, then each step is filled (its pool copied into the pool the graph
    reads) and replayed."""
    num_kv_heads, group = 2, 2
    scenarios = [decode_scenario(specs, num_kv_heads, group, seed) for seed, (specs, _) in enumerate(STEPS)]
    layers = [layer_of(layer_id, num_kv_heads, group) for layer_id in range(NUM_LAYERS)]
    for scenario in scenarios:  # each step's new tokens' K/V, written before its attention
        for layer in layers:
            scenario.pool.set_kv_buffer(layer, scenario.forward_batch, scenario.k, scenario.v)
    storage = pool_storage(scenarios[0]).to(device)  # the one pool the body reads
    k_buffers, v_buffers = list(storage[:, 0]), list(storage[:, 1])
    space = CellSpace.of_buffers(k_buffers, v_buffers)
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, num_kv_heads, torch.device(device))
    batch_size = CAPACITY.max_batch
    queries = torch.zeros(batch_size, num_kv_heads * group, HEAD_DIM, device=device)

    def body() -> list[torch.Tensor]:
        return [state.attend(queries, layer, space.k_rows, space.v_rows, k_buffers[layer.layer_id], v_buffers[layer.layer_id])
                for layer in layers]  # fmt: skip

    run_body = captured_in_a_cuda_graph(body) if device == "cuda" else body
    for scenario in scenarios:
        storage.copy_(pool_storage(scenario))
        forward = requests_on(scenario, device)
        assert state.fill(forward, scenario.req_to_token.to(device), batch_size) == FITS
        count = len(forward.requests)
        queries.zero_()
        queries[:count].copy_(scenario.q.view(count, num_kv_heads * group, HEAD_DIM))
        for layer, out in zip(layers, run_body()):
            actual = out[:count].reshape(count, -1).double().cpu()
            torch.testing.assert_close(actual, naive_attention(scenario, layer), atol=2e-5, rtol=1e-5)
