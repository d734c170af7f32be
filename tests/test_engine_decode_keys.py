"""The torch backend's decode keys (``engine.batch.DecodeKeys``), kept across decode steps.

A decode step of the same requests appends each one's new token to the keys of the step before; a
request that leaves, or whose cells moved (the arena's moves give its path a new ``PathView``), builds
them again; so does a batch out of room. Every step attends as the float64 formula does
(``segment_scenarios.naive_attention``: cells and dense positions, the placeholder slot 0 NaN).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from segment_scenarios import DECODE, NUM_LAYERS, NUM_SLOTS, build_scenario, layer_of, naive_attention, run_backend, torch_backend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kvevict.engine import batch as batch_module
from sgl_kvevict.engine.batch import ForwardRequests, SegmentMetadata
from sgl_kvevict.engine.segments import PathView

NUM_KV_HEADS, GROUP = 2, 2


def free_slots(scenario) -> list[int]:
    """Slots no dense position and no cell of the scenario uses (slot 0 excluded)."""
    used = set(scenario.req_to_token.flatten().tolist())
    for request in scenario.segments.forward.compressed:
        used |= set(scenario.space.slot_of(request.view.cells).tolist())
    return [slot for slot in range(1, NUM_SLOTS) if slot not in used]


def next_step(scenario, backend, seed: int, keep=None, views=None):
    """The next decode step of ``scenario``'s requests (only those at the indices ``keep``, each with its
    view from ``views`` where given): each one token longer, its new token in a free slot; the backend's
    metadata built for it as ``init_forward_metadata`` would."""
    generator = torch.Generator().manual_seed(seed)
    old = scenario.segments.forward.requests
    keep = range(len(old)) if keep is None else keep
    views = views or {}
    slots = free_slots(scenario)
    requests, new_slots = [], []
    for index, kept in enumerate(keep):
        request = old[kept]
        slot = slots.pop()
        scenario.req_to_token[request.row, request.seq_len] = slot
        new_slots.append(slot)
        requests.append(
            dataclasses.replace(request, index=index, q_start=index, q_end=index + 1, seq_len=request.seq_len + 1, view=views.get(kept, request.view))
        )  # fmt: skip
    forward = ForwardRequests(True, tuple(requests))
    segments = SegmentMetadata.of(forward, torch.device("cpu"), backend._cell_batches)
    forward_batch = SimpleNamespace(
        **{
            **vars(scenario.forward_batch),
            "rids": [scenario.forward_batch.rids[kept] for kept in keep],
            "out_cache_loc": torch.tensor(new_slots),
            "req_pool_indices": torch.tensor([request.row for request in requests]),
            "seq_lens": torch.tensor([request.seq_len for request in requests]),
        }
    )
    backend._init_segment_metadata(forward_batch, segments)
    q_heads = NUM_KV_HEADS * GROUP
    tokens = lambda heads: torch.randn(len(requests), heads * scenario.q.shape[1] // q_heads, generator=generator)  # noqa: E731
    return dataclasses.replace(
        scenario, segments=segments, forward_batch=forward_batch, q=tokens(q_heads), k=tokens(NUM_KV_HEADS), v=tokens(NUM_KV_HEADS)
    )  # fmt: skip


def assert_attends_as_the_formula(backend, scenario) -> None:
    for layer_id in range(NUM_LAYERS):  # the layers keep different cells per head
        layer = layer_of(layer_id, NUM_KV_HEADS, GROUP)
        out = run_backend(backend, scenario, layer)
        assert torch.isfinite(out).all()  # never the NaN placeholder slot 0
        torch.testing.assert_close(out.double(), naive_attention(scenario, layer), atol=2e-5, rtol=1e-5)


def test_decode_steps_of_the_same_requests_append_to_the_keys_until_out_of_room(monkeypatch):
    monkeypatch.setattr(batch_module, "DECODE_STEPS_OF_ROOM", 2)
    scenario = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP)
    backend = torch_backend(scenario)
    assert_attends_as_the_formula(backend, scenario)
    builds = []
    for step in range(1, 4):
        scenario = next_step(scenario, backend, seed=step)
        assert_attends_as_the_formula(backend, scenario)
        builds.append(backend._decode_keys.builds)
    assert builds == [1, 1, 2]  # two steps of room appended to the first keys; the third built them again


def moved(view: PathView, scenario, generator) -> PathView:
    """The view of the same entries after the arena moved every cell to a free one (contents copied), as
    ``PathViews.of`` gives it once the arena's generation changed: a new object."""
    free = scenario.space.cells_of_slots(torch.tensor(free_slots(scenario))).flatten()
    targets = free[torch.randperm(len(free), generator=generator)[: len(view.cells)]]
    scenario.space.copy(view.cells, targets)
    return PathView.of_entries(view.ranges, view.counts, targets, view.positions, view.reserved_cells)


def test_decode_keys_are_built_again_when_cells_move_or_a_request_leaves():
    scenario = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP)
    backend = torch_backend(scenario)
    assert_attends_as_the_formula(backend, scenario)
    first = scenario.segments.forward.requests[0]
    view = moved(first.view, scenario, torch.Generator().manual_seed(0))
    scenario.space.k_rows[first.view.cells] = float("nan")  # the old cells must no longer be read
    scenario = next_step(scenario, backend, seed=1, views={0: view})
    assert backend._decode_keys.builds == 2
    assert_attends_as_the_formula(backend, scenario)
    scenario = next_step(scenario, backend, seed=2, keep=[1, 2])  # the first request finished
    assert backend._decode_keys.builds == 3
    assert_attends_as_the_formula(backend, scenario)
    scenario = next_step(scenario, backend, seed=3)
    assert backend._decode_keys.builds == 3
    assert_attends_as_the_formula(backend, scenario)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_plain_request_beside_compressed_ones_attends_over_all_its_positions(dtype):
    scenario = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP, dtype=dtype)
    assert scenario.segments.forward.requests[1].view is None
    backend = torch_backend(scenario)
    for layer_id in range(NUM_LAYERS):
        layer = layer_of(layer_id, NUM_KV_HEADS, GROUP)
        out = run_backend(backend, scenario, layer)
        tolerance = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), naive_attention(scenario, layer), **tolerance)
