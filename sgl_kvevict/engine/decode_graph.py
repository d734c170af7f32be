"""Decode in a replayable form: the segment attention's per-forward metadata in fixed-capacity buffers.

A CUDA graph replays the kernels it captured on the tensors it captured: same addresses, same
shapes. SGLang captures one decode graph per batch size and, before each replay, pads the batch to
that size and refreshes its own buffers in place (``init_forward_metadata_out_graph``); its
coordinators carry per-step state into the graph the same way (``hisparse_coordinator.num_real_reqs``,
a device tensor filled before replay). The segment attention's metadata takes that form here:

* ``GraphCapacity``: the bounds every buffer is sized by, once, for the largest captured batch.
* ``DecodeGraphState.fill`` (outside the graph, before a replay): writes one decode batch into the
  buffers in place and says whether it fits; a batch beyond a bound cannot replay and runs eagerly.
* ``DecodeGraphState.attend`` (the body a graph captures): one layer's attention of the batch, reading
  only those buffers; every shape it makes depends on the batch size alone, and it never reads a
  device value on the host.

In this form every request goes through the segment path: a request without compressed nodes has no
cells (its compressed part is empty, ``lse = -inf``, and merges away), so one captured body serves
any mix of compressed and plain requests. A padded request (the batch size rounded up to a captured
one) has no cells and one dense key, SGLang's padding slot 0; its row is computed and discarded.

Both parts are ``kernels.segment_attention`` (a fixed grid given the batch size and a cell bound; the
Triton kernel's split count follows from those host ints, so it is fixed per captured size): the
compressed part over each (request, KV head)'s cells, the dense part over each request's dense slots
read as rows of the layer's ``[slots * H_kv, D]`` cache (row ``slot * H_kv + head``), so the dense
index is the same for every layer. FlashInfer's decode wrapper in graph mode is the alternative for
the dense part (plan outside the graph, fixed indptr buffers); which is faster is a GPU measurement
(docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvevict.engine.batch import CellBatch, ForwardRequests
from sgl_kvevict.kernels import merge_attention_states, segment_attention

# What ``DecodeGraphState.fill`` returns for a batch that fits (for one that does not: why, in words).
FITS = ""


@dataclass(frozen=True)
class GraphCapacity:
    """Bounds of one forward in replayable form: ``max_batch`` requests; ``cells`` cell entries over every
    layer, request and KV head; ``cells_per_sequence`` cells of one (layer, request, KV head) (it sizes
    the compressed part's work per sequence: the Triton kernel's split-KV choice, the torch form's
    padding); ``dense_keys`` dense keys of one request (its context outside compressed spans)."""

    max_batch: int
    cells: int
    cells_per_sequence: int
    dense_keys: int

    def __post_init__(self):
        bounds = {name: getattr(self, name) for name in ("max_batch", "cells", "cells_per_sequence", "dense_keys")}
        bad = [f"{name}={value}" for name, value in bounds.items() if not isinstance(value, int) or value < 1]
        if bad:
            raise ValueError(f"graph capacity bounds must be positive integers: {', '.join(bad)}")


class DecodeGraphState:
    """The buffers of one model's replayable decode (device tensors, allocated once).

    qo_indptr int32 ``[max_batch + 1]``: one query per request (``arange``), never written again.
    cell_indptr int32 ``[L, max_batch * H_kv + 1]``: per layer, the (request, KV head) sequences' offsets
    into ``cell_indices`` int64 ``[cells]`` (layer-major, then request, then KV head: ``CellBatch``'s order).
    dense_indptr int32 ``[max_batch * H_kv + 1]`` and dense_indices int64 ``[max_batch * H_kv * dense_keys]``:
    the (request, KV head) sequences of dense keys, each key the row ``slot * H_kv + head``.
    """

    def __init__(self, capacity: GraphCapacity, num_layers: int, num_kv_heads: int, device: torch.device):
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        sequences = capacity.max_batch * num_kv_heads
        self.qo_indptr = torch.arange(capacity.max_batch + 1, dtype=torch.int32, device=device)
        self.cell_indptr = torch.zeros(num_layers, sequences + 1, dtype=torch.int32, device=device)
        self.cell_indices = torch.zeros(capacity.cells, dtype=torch.int64, device=device)
        self.dense_indptr = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
        self.dense_indices = torch.zeros(sequences * capacity.dense_keys, dtype=torch.int64, device=device)

    def fill(self, forward: ForwardRequests, req_to_token: torch.Tensor, batch_size: int) -> str:
        """Write the decode batch ``forward`` (its requests first, padded to ``batch_size`` requests) into the
        buffers in place. Returns ``FITS`` (empty), or why the batch is beyond the capacity (the buffers
        are then left as they were). Host work and host-to-device copies only; nothing the replayed body
        reads is reallocated."""
        capacity, requests, num_kv_heads = self.capacity, forward.requests, self.num_kv_heads
        assert forward.is_decode and len(requests) <= batch_size <= capacity.max_batch
        num_layers = self.cell_indptr.shape[0]
        counts = torch.zeros(num_layers, batch_size, num_kv_heads, dtype=torch.int64)
        for request in requests:
            if request.view is not None:
                counts[:, request.index] = request.view.counts
        if int(counts.max()) > capacity.cells_per_sequence:
            return f"a (layer, request, KV head) holds {int(counts.max())} cells, above {capacity.cells_per_sequence}"
        total = int(counts.sum())
        if total > capacity.cells:
            return f"the batch holds {total} cells, above {capacity.cells}"
        device = self.dense_indices.device
        # A padded request's one dense key: SGLang's padding slot 0 (where its padded token's K/V go).
        dense = [request.dense_keys(req_to_token)[1] for request in requests]
        dense += [torch.zeros(1, dtype=torch.int64, device=device)] * (batch_size - len(requests))
        longest = max(len(slots) for slots in dense)
        if longest > capacity.dense_keys:
            return f"a request has {longest} dense keys, above {capacity.dense_keys}"

        compressed = [request.view for request in requests if request.view is not None]
        if compressed:
            self.cell_indices[:total].copy_(CellBatch.of(compressed, device).kv_indices)
        ends = torch.cumsum(counts.view(num_layers, -1), 1)  # [L, B * H_kv], within each layer
        layer_starts = torch.cumsum(ends[:, -1:], 0) - ends[:, -1:]  # the cells of the layers before
        self.cell_indptr[:, : batch_size * num_kv_heads + 1].copy_(torch.cat([layer_starts, ends + layer_starts], 1))
        heads = torch.arange(num_kv_heads, device=device)
        rows = torch.cat([(slots[None, :] * num_kv_heads + heads[:, None]).flatten() for slots in dense])
        self.dense_indices[: len(rows)].copy_(rows)
        dense_counts = torch.tensor([len(slots) for slots in dense]).repeat_interleave(num_kv_heads)
        self.dense_indptr[1 : batch_size * num_kv_heads + 1].copy_(torch.cumsum(dense_counts, 0))
        return FITS

    def attend(
        self, q: torch.Tensor, layer, k_rows: torch.Tensor, v_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """One layer's attention of the filled batch (its size is ``q``'s first dimension): the compressed
        part over each (request, KV head)'s cells merged with the dense part over each request's dense
        keys. q ``[B, H_q, D]``; k_rows, v_rows: the pool's cells; k_cache, v_cache ``[slots, H_kv, D]``
        (contiguous: read as rows). Returns ``[B, H_q, D_v]``."""
        batch_size, num_kv_heads = q.shape[0], self.num_kv_heads
        sequences = batch_size * num_kv_heads + 1
        query_indptr = self.qo_indptr[: batch_size + 1]
        compressed_out, compressed_lse = segment_attention(
            q, k_rows, v_rows, query_indptr, self.cell_indptr[layer.layer_id, :sequences], self.cell_indices,
            num_kv_heads, layer.scaling, 1, self.capacity.cells_per_sequence,
        )  # fmt: skip
        dense_out, dense_lse = segment_attention(
            q, k_cache.view(-1, k_cache.shape[-1]), v_cache.view(-1, v_cache.shape[-1]), query_indptr,
            self.dense_indptr[:sequences], self.dense_indices, num_kv_heads, layer.scaling, 1, self.capacity.dense_keys,
        )  # fmt: skip
        merged, _ = merge_attention_states(compressed_out, compressed_lse, dense_out, dense_lse)
        return merged
