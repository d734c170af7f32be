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


def next_step(scenario, backend, seed: int, keep=None, views=None, join=()):
    """The next decode step of ``scenario``'s requests (only those at the indices ``keep``, each with its
    view from ``views`` where given, then the ``(request, rid)`` pairs ``join`` of an earlier step): each one
    token longer, its new token in a free slot; the backend's metadata built for it as
    ``init_forward_metadata`` would."""
    generator = torch.Generator().manual_seed(seed)
    old = scenario.segments.forward.requests
    keep = range(len(old)) if keep is None else keep
    views = views or {}
    stepping = [(dataclasses.replace(old[kept], view=views.get(kept, old[kept].view)), scenario.forward_batch.rids[kept]) for kept in keep]
    stepping += list(join)
    slots = free_slots(scenario)
    requests, new_slots = [], []
    for index, (request, _) in enumerate(stepping):
        slot = slots.pop()
        scenario.req_to_token[request.row, request.seq_len] = slot
        new_slots.append(slot)
        requests.append(dataclasses.replace(request, index=index, q_start=index, q_end=index + 1, seq_len=request.seq_len + 1))
    forward = ForwardRequests(True, tuple(requests))
    segments = SegmentMetadata.of(forward, torch.device("cpu"), backend._cell_batches)
    forward_batch = SimpleNamespace(
        **{
            **vars(scenario.forward_batch),
            "rids": [rid for _, rid in stepping],
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



def test_buckets_cover_every_sequence_once_each_padded_to_its_own_longest(monkeypatch):
    ends = torch.tensor([[5, 1900, 7, 1880, 6, 2000], [300] * 6])
    buckets = batch_module.key_buckets(ends)
    assert [(bucket.sequences, bucket.width) for bucket in buckets[1]] == [(None, 300)]  # one length: one call
    assert [(sorted(bucket.sequences.tolist()), bucket.width) for bucket in buckets[0]] == [([1, 3, 5], 2000), ([0, 2, 4], 7)]
    monkeypatch.setattr(batch_module, "BUCKET_OVERHEAD_KEYS", 0)  # every group of equal count its own call
    buckets = batch_module.key_buckets(ends)
    assert [(bucket.sequences.tolist(), bucket.width) for bucket in buckets[0]] == [([5], 2000), ([1], 1900), ([3], 1880), ([2], 7), ([4], 6), ([0], 5)]
    assert [(bucket.sequences, bucket.width) for bucket in buckets[1]] == [(None, 300)]


@pytest.mark.parametrize("overhead", [batch_module.BUCKET_OVERHEAD_KEYS, 0])
def test_decode_in_buckets_attends_as_the_formula(monkeypatch, overhead):
    """The padded SDPA path (``padded_sdpa_decode``, where the CPU kernel is not built): with no overhead
    every group of sequences is its own padded call (the scenario's heads keep different counts): each step
    must still give the formula's result."""
    monkeypatch.setattr(batch_module, "BUCKET_OVERHEAD_KEYS", overhead)
    scenario = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP)
    backend = torch_backend(scenario)
    backend._paged_decode = False
    assert_attends_as_the_formula(backend, scenario)
    most_calls = max(len(backend.decode_keys.layer_buckets(layer)) for layer in range(NUM_LAYERS))
    assert most_calls == 1 if overhead else most_calls > 2
    for step in (1, 2):  # appended to: the buckets are carried, each one key wider, and stay exact
        scenario = next_step(scenario, backend, seed=step)
        assert backend._decode_keys.builds == 1 and backend.decode_keys.buckets is not None
        assert_attends_as_the_formula(backend, scenario)
        assert_same_buckets(backend.decode_keys.buckets, batch_module.key_buckets(backend.decode_keys.ends))
    scenario = next_step(scenario, backend, seed=3, keep=[0, 2])  # carried over, appended to in part
    assert_attends_as_the_formula(backend, scenario)
    assert_same_buckets(backend.decode_keys.buckets, batch_module.key_buckets(backend.decode_keys.ends))


def assert_same_buckets(kept, fresh) -> None:
    as_lists = lambda layers: [[(None if b.sequences is None else b.sequences.tolist(), b.width) for b in layer] for layer in layers]  # noqa: E731
    assert as_lists(kept) == as_lists(fresh)


def recorded_builds(monkeypatch) -> list[list[int]]:
    """The rows of the requests each ``DecodeKeys.of`` call builds from their views (not carried)."""
    calls, build = [], batch_module.DecodeKeys.of.__func__

    def recording(cls, requests, req_to_token, space):
        calls.append([request.row for request in requests])
        return build(cls, requests, req_to_token, space)

    monkeypatch.setattr(batch_module.DecodeKeys, "of", classmethod(recording))
    return calls



def test_a_request_joining_carried_ones_is_built_alone_and_theirs_appended(monkeypatch):
    first = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP)
    backend = torch_backend(first)
    scenario = next_step(first, backend, seed=1, keep=[0, 2])  # request 1 left (retracted, say)
    builds = recorded_builds(monkeypatch)
    rejoining = (first.segments.forward.requests[1], first.forward_batch.rids[1])
    scenario = next_step(scenario, backend, seed=2, join=[rejoining])
    assert builds == [[rejoining[0].row]]  # the carried two were appended to, not built from their views
    assert_attends_as_the_formula(backend, scenario)
    scenario = next_step(scenario, backend, seed=3)
    assert builds == [[rejoining[0].row]]
    assert_attends_as_the_formula(backend, scenario)


def test_a_request_admitted_again_in_another_row_is_built_again(monkeypatch):
    """A retracted request that comes back with its id and length, in another ``req_to_token`` row whose
    slots hold its tokens again: keys carried by id alone would read the slots it freed (NaN here)."""
    scenario = build_scenario(DECODE, ForwardMode.DECODE, NUM_KV_HEADS, GROUP)
    backend = torch_backend(scenario)
    request, rid = scenario.segments.forward.requests[1], scenario.forward_batch.rids[1]  # the plain one
    old_slots = scenario.req_to_token[request.row, : request.seq_len].long()
    new_row = 0  # the one row no request of the scenario uses
    assert new_row not in {r.row for r in scenario.segments.forward.requests}
    new_slots = torch.tensor(free_slots(scenario)[: request.seq_len])
    for buffer in (*scenario.pool.k_buffer, *scenario.pool.v_buffer):
        buffer[new_slots] = buffer[old_slots]
        buffer[old_slots] = float("nan")
    scenario.req_to_token[new_row, : request.seq_len] = new_slots.to(torch.int32)
    scenario.req_to_token[request.row] = 0
    builds = recorded_builds(monkeypatch)
    scenario = next_step(scenario, backend, seed=1, keep=[0, 2], join=[(dataclasses.replace(request, row=new_row), rid)])
    assert builds == [[new_row]]
    assert_attends_as_the_formula(backend, scenario)

