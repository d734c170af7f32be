"""Decode CUDA graphs with compressed requests (``engine.decode_graph``, the CUDA backend's graph hooks).

No GPU and no real FlashInfer here (what ran on a GPU: docs/gpu.md). Two levels:

* **The backend under SGLang's decode graph runner, replayed on CPU.** ``GraphRunner`` drives
  ``KVEvictFlashInferBackend`` the way SGLang 0.5.23's ``DecodeCudaGraphRunner`` does
  (``decode_cuda_graph_runner.py``): ``init_cuda_graph_state``; per captured batch size and per
  variant of ``graph_variants()`` (what the plugin's capture hook installs) the capture-time metadata
  (``init_forward_metadata_out_graph(in_capture=True)``) and the capture of every layer's decode; then
  per batch ``can_run_graph`` (our ``graph_can_replay``), the variant's ``select``, the inputs copied
  into the static buffers (padded requests: slot 0), SGLang's own ``build_replay_fb_view``, the replay
  metadata and the replay. The "graph" is the body traced once by dynamo (``fullgraph=True``, no
  graph break: no host read, no data-dependent shape) and replayed from that trace with recompilation
  forbidden, so a replay computes from the captured tensors, as a CUDA graph does, and any Python
  state the body read at capture that changed since fails the test. FlashInfer's graph-mode decode
  wrapper is ``tests/fake_flashinfer.py``'s, which reads its fixed buffers when it runs.
* **The compressed part alone** (``DecodeGraphState``): bounds, in-place fills, no host sync, and the
  Triton body in the interpreter and, on CUDA (``KVEVICT_GPU_TESTS=1``), captured in a real CUDA graph.
  A replay's preparation reuses the cell index across steps and copies to the device only from pinned
  memory, non-blocking: checked on the ``meta`` device standing for CUDA (issue 34, finding 1).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from segment_scenarios import (
    DECODE,
    HEAD_DIM,
    NUM_LAYERS,
    KVPool,
    RequestSpec,
    build_scenario,
    flashinfer_against_fake,
    layer_of,
    naive_attention,
    run_backend,
    torch_backend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_attention_variant
from test_kernels_support import interpreter_process_test, on_kernel_devices

from benchmarks.decode_graph import captured

from sgl_kvevict.engine import decode_graph, host_copies
from sgl_kvevict.engine.adapter import scheduler_hooks
from sgl_kvevict.engine.adapter.attention import compressed_attention
from sgl_kvevict.engine.batch import CellBatch, ForwardRequests, RequestSlice
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.decode_graph import (
    FITS,
    SEGMENTS,
    SEGMENTS_SPLIT,
    STOCK,
    DecodeGraphState,
    GraphCapacity,
    SegmentGraphVariants,
    cell_index_capacity,
    segment_graph_limits,
    segments_limit,
)
from sgl_kvevict.engine.adapter.pool import UnsupportedKVPool
from sgl_kvevict.kernels import MIN_CELLS_TO_SPLIT
from sgl_kvevict.kernels.segment_attention import chosen_kv_splits
from sgl_kvevict.engine.registry import forget_engine, register_engine
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.engine.adapter.sync_probe import SYNCING_METHODS, SyncProbe

test_in_interpreter_process = interpreter_process_test(__file__)

GQA = [pytest.param(2, 2, id="kv2-g2"), pytest.param(1, 3, id="kv1-g3")]
CAPTURE_BATCH_SIZES = (2, 4, 6)
CONTEXT_LEN = 64  # the model's context length: a (layer, request, KV head) holds at most this many cells
# Decode steps of one server: requests finish (the first two), a plain one joins, then a compressed one
# with more cells per head; each runs as the smallest captured size holding it.
STEPS = (
    DECODE,
    (DECODE[2], RequestSpec(12, 1)),
    (RequestSpec(12, 1), RequestSpec(20, 1, ((2, 10, ((7, 1), (0, 8))),)), DECODE[0]),
)


@pytest.fixture
def flashinfer_module(monkeypatch):
    yield from flashinfer_against_fake(monkeypatch)


def decode_scenario(specs, num_kv_heads: int, group: int, seed: int = 0):
    scenario = build_scenario(specs, ForwardMode.DECODE, num_kv_heads, group, seed=seed)
    scenario.forward_batch.loc = scenario.forward_batch.out_cache_loc  # set_kv_buffer's write location
    return scenario


class ScenarioEngine:
    """The engine's side of the graph path, registered for the scenario's pool as ``build_engine``
    registers the real one: ``forward_begin`` gives each batch's requests as its scenario built them
    (the engine's ``CompressionCoordinator.forward_begin``), and the engine's counters."""

    def __init__(self):
        self.stats = EngineStats()
        self.coordinator = self
        self.local_layers = None

    def forward_begin(self, forward_batch, req_to_token):
        return forward_batch.requests


class GraphRunner:
    """SGLang's ``DecodeCudaGraphRunner`` as the attention backend sees it (see the module docstring), over
    one KV pool and one ``req_to_token`` whose content each step replaces with its scenario's."""

    def __init__(self, module, num_kv_heads: int, group: int, context_len: int = CONTEXT_LEN):
        self.num_kv_heads, self.group = num_kv_heads, group
        self.layers = [layer_of(layer_id, num_kv_heads, group) for layer_id in range(NUM_LAYERS)]
        self.pool = KVPool(num_kv_heads, torch.float32, torch.Generator().manual_seed(0))
        self.req_to_token = torch.zeros(8, 64, dtype=torch.int32)
        self.backend = self._backend(module, context_len)
        max_bs = max(CAPTURE_BATCH_SIZES)
        self.backend.init_segment_graph_state(max_bs)
        self.variants = self.backend.graph_variants()
        # The runner's static inputs (DecodeInputBuffers) and the capture's forward batches.
        num_q_heads = num_kv_heads * group
        self.q = torch.zeros(NUM_LAYERS, max_bs, num_q_heads * HEAD_DIM)
        self.k = torch.zeros(NUM_LAYERS, max_bs, num_kv_heads * HEAD_DIM)
        self.v = torch.zeros_like(self.k)
        self.buffers = SimpleNamespace(
            input_ids=torch.zeros(max_bs, dtype=torch.int64), positions=torch.zeros(max_bs, dtype=torch.int64),
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.ones(max_bs, dtype=torch.int64),
            seq_lens_cpu=torch.ones(max_bs, dtype=torch.int64), out_cache_loc=torch.zeros(max_bs, dtype=torch.int64),
            encoder_lens=None, mamba_track_indices=None,
        )  # fmt: skip
        self.graphs = {}
        torch._dynamo.reset()  # one runner's captures per test: dynamo caches traces per code object
        for batch_size in reversed(CAPTURE_BATCH_SIZES):  # SGLang captures the largest first
            for label in self.variants.capture_labels:
                if label != STOCK:  # the stock graph is SGLang's own FlashInfer body (CUDA kernels only)
                    self.graphs[batch_size, label] = self._capture(batch_size, label)
        _set_capture_attention_variant(None)

    def _backend(self, module, context_len: int):
        """The backend without ``FlashInferAttnBackend.__init__`` (CUDA only): the attributes its graph
        path reads, stock's graph buffers as SGLang sizes them."""
        backend_class = module.backend.KVEvictFlashInferBackend
        backend = backend_class.__new__(backend_class)
        max_bs, layer = max(CAPTURE_BATCH_SIZES), self.layers[0]
        backend.req_to_token_pool = SimpleNamespace(req_to_token=self.req_to_token)
        backend.token_to_kv_pool = self.pool
        backend._shape = module.backend.AttentionShape(
            layer.tp_q_head_num, self.num_kv_heads, HEAD_DIM, HEAD_DIM, layer.scaling, torch.float32, torch.float32
        )
        backend.max_context_len = context_len
        backend.workspace_buffer = torch.empty(1 << 20, dtype=torch.uint8)
        backend.decode_backend, backend.decode_use_tensor_cores, backend.num_wrappers = "fa2", False, 1
        backend.dispatch_reason = None  # no local layers: SGLang's one wrapper set
        backend.kv_indptr = [torch.zeros(max_bs + 1, dtype=torch.int32)]
        backend.cuda_graph_kv_indices = [torch.zeros(max_bs * context_len, dtype=torch.int32)]
        backend.kv_last_page_len = torch.ones(max_bs, dtype=torch.int32)
        backend.disable_cuda_graph_kv_split = False
        register_engine(self.pool, ScenarioEngine())
        return backend

    def _static_batch(self, batch_size: int) -> SimpleNamespace:
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=batch_size, out_cache_loc=self.buffers.out_cache_loc[:batch_size],
            req_pool_indices=self.buffers.req_pool_indices[:batch_size], seq_lens=self.buffers.seq_lens[:batch_size],
            seq_lens_cpu=self.buffers.seq_lens_cpu[:batch_size], positions=self.buffers.positions[:batch_size],
        )  # fmt: skip

    def _capture(self, batch_size: int, label: str):
        _set_capture_attention_variant(label)
        static = self._static_batch(batch_size)
        self.backend.init_forward_metadata_out_graph(static, in_capture=True)

        def decode_step() -> list[torch.Tensor]:
            return [
                self.backend.forward_decode(self.q[i, :batch_size], self.k[i, :batch_size], self.v[i, :batch_size], layer, static)
                for i, layer in enumerate(self.layers)
            ]  # fmt: skip

        graph = torch.compile(decode_step, backend="eager", fullgraph=True, dynamic=False)
        graph()  # the capture
        return graph

    def batch(self, scenario, plain: bool = False) -> SimpleNamespace:
        """The forward batch SGLang hands the runner for ``scenario``'s decode (``plain``: its requests
        without their compressed paths)."""
        forward = scenario.segments.forward
        if plain:
            forward = ForwardRequests(True, tuple(dataclasses.replace(r, view=None) for r in forward.requests))
        seq_lens = torch.tensor([request.seq_len for request in forward.requests])
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=len(forward.requests), requests=forward,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens, seq_lens_sum=int(seq_lens.sum()), max_seq_len_host=None,
            req_pool_indices=scenario.forward_batch.req_pool_indices, out_cache_loc=scenario.forward_batch.out_cache_loc,
            out_cache_loc_virtual=None, kv_loc_plan=None, kv_loc_cols=None, max_seq_len_override=None,
            spec_info=None, lora_ids=None, can_run_decode_cuda_graph=True,
        )  # fmt: skip

    def load(self, scenario) -> None:
        """The server's state before ``scenario``'s decode: its pool (without this step's K/V, which the
        graph writes) and its ``req_to_token`` rows."""
        for mine, theirs in ((self.pool.k_buffer, scenario.pool.k_buffer), (self.pool.v_buffer, scenario.pool.v_buffer)):
            for buffer, source in zip(mine, theirs):
                buffer.copy_(source)
        self.req_to_token.zero_()
        self.req_to_token[: len(scenario.req_to_token)] = scenario.req_to_token

    def decode(self, scenario) -> list[torch.Tensor] | None:
        """One decode step: the real requests' attention output per layer ``[B, H_q * D]`` from the replayed
        graph, or None when the runner would run the batch eagerly."""
        forward_batch = self.batch(scenario)
        count = forward_batch.batch_size
        if not self.backend.graph_can_replay(forward_batch):
            return None
        batch_size = min(size for size in CAPTURE_BATCH_SIZES if size >= count)
        label = self.variants.select(forward_batch)
        for static, value in ((self.q, scenario.q), (self.k, scenario.k), (self.v, scenario.v)):
            static.zero_()
            static[:, :count] = value
        buffers = self.buffers
        buffers.out_cache_loc.zero_()  # padded tokens write slot 0, SGLang's padding slot
        buffers.out_cache_loc[:count] = forward_batch.out_cache_loc
        buffers.req_pool_indices[:count] = forward_batch.req_pool_indices
        buffers.seq_lens.fill_(1)
        buffers.seq_lens[:count] = forward_batch.seq_lens
        buffers.seq_lens_cpu.copy_(buffers.seq_lens)
        view = build_replay_fb_view(
            forward_batch=forward_batch, buffers=buffers, bs=batch_size, raw_bs=count, num_tokens=batch_size,
            global_num_tokens_cpu=None, seq_len_fill_value=1, capture_forward_mode=ForwardMode.DECODE,
            is_encoder_decoder=False,
        )  # fmt: skip
        self.backend.init_forward_metadata_out_graph(view)
        with torch.compiler.set_stance("fail_on_recompile"):  # a replay runs what was captured, nothing else
            outputs = self.graphs[batch_size, label]()
        return [out[:count] for out in outputs]

    def buffers_in_use(self) -> list[int]:
        state = self.backend._decode_graph
        wrappers = self.backend._graph_dense_wrappers.values()
        tensors = [state.qo_indptr, state.cell_indptr, state.cell_indices]
        tensors += [t for w in wrappers for t in (w._paged_kv_indptr_buf, w._paged_kv_indices_buf, w._paged_kv_last_page_len_buf)]
        return [t.data_ptr() for t in tensors]


def replays_as_eager(runner: GraphRunner, seed: int, specs) -> None:
    """One decode step of ``specs`` replayed through ``runner`` equals the eager backend and the formula."""
    num_kv_heads, group = runner.num_kv_heads, runner.group
    scenario, eager = decode_scenario(specs, num_kv_heads, group, seed), decode_scenario(specs, num_kv_heads, group, seed)
    runner.load(scenario)
    replayed = runner.decode(scenario)
    assert replayed is not None
    cpu_backend = torch_backend(eager)
    for layer, out in zip(runner.layers, replayed):
        scenario.pool.set_kv_buffer(layer, scenario.forward_batch, scenario.k, scenario.v)  # for the formula
        assert torch.isfinite(out).all()  # never the NaN placeholder slot 0
        torch.testing.assert_close(out, run_backend(cpu_backend, eager, layer), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), naive_attention(scenario, layer), atol=2e-5, rtol=1e-5)


@pytest.mark.torch_twins  # dynamo traces the torch twins; it does not trace Triton's interpreter
@pytest.mark.parametrize("num_kv_heads,group", GQA)
def test_every_decode_step_replays_the_segments_graph_as_attention_computes_it(flashinfer_module, num_kv_heads, group):
    runner = GraphRunner(flashinfer_module, num_kv_heads, group)
    assert runner.variants.capture_labels == (STOCK, SEGMENTS)  # a context below the split threshold: one bound
    captured = runner.buffers_in_use()
    for seed, specs in enumerate(STEPS):
        replays_as_eager(runner, seed, specs)
    assert runner.buffers_in_use() == captured  # filled in place: a captured graph reads the same memory
    assert runner.backend.engine.stats.graph_decodes == len(STEPS)
    assert runner.backend.engine.stats.decode_graph_fallbacks == 0


def test_the_segments_graphs_split_only_sequences_the_h100_measurement_splits():
    """Issue 34, finding 3: the split count of a replay follows the batch's longest sequence, not the
    model's context length: below ``MIN_CELLS_TO_SPLIT`` cells a batch replays a graph that never splits."""
    limits = segment_graph_limits(32768)
    assert limits == ((SEGMENTS, MIN_CELLS_TO_SPLIT - 1), (SEGMENTS_SPLIT, 32768))
    assert segment_graph_limits(64) == ((SEGMENTS, 64),)  # a context below the threshold: one graph
    # One request, 8 KV heads of 4 query heads (Llama-3-8B): 2048 cells unsplit, 8192 split 32 ways.
    for longest, label, splits in ((2048, SEGMENTS, 1), (MIN_CELLS_TO_SPLIT - 1, SEGMENTS, 1), (8192, SEGMENTS_SPLIT, 32)):
        chosen, bound = segments_limit(limits, longest)
        assert chosen == label and bound >= longest
        assert chosen_kv_splits(1, 8, 4, 1, bound) == splits


@pytest.mark.torch_twins
def test_each_batch_replays_the_segments_graph_bounded_by_its_longest_sequence(flashinfer_module, monkeypatch):
    """Both ``segments`` graphs captured per batch size; each step replays the one its longest sequence
    selects, with that graph's bound (the torch twin pads to it, so a bound below a sequence's cells would
    drop cells and differ from eager)."""
    monkeypatch.setattr(decode_graph, "MIN_CELLS_TO_SPLIT", 7)  # STEPS' longest sequences hold 6, 6 and 8 cells
    runner = GraphRunner(flashinfer_module, 2, 2)
    assert runner.variants.capture_labels == (STOCK, SEGMENTS, SEGMENTS_SPLIT)
    bounds = []
    for seed, specs in enumerate(STEPS):
        replays_as_eager(runner, seed, specs)
        bounds.append(runner.backend._graph_cells_per_sequence)
    assert bounds == [6, 6, CONTEXT_LEN]


@pytest.mark.torch_twins
def test_the_cell_index_holds_each_cell_of_the_pool_once_within_its_memory_bound(flashinfer_module, monkeypatch):
    """Issue 34, finding 2: the index is sized by the pool's cells (layers x slots x KV heads, K rows only;
    the flat K view spans the V halves too), at most ``GRAPH_CELL_INDEX_BYTES``; a batch beyond a capped
    index runs eagerly, counted."""
    runner = GraphRunner(flashinfer_module, 2, 2)
    space, state = runner.backend.cell_space, runner.backend._decode_graph
    assert state.capacity.cells == state.cell_indices.numel() == NUM_LAYERS * space.num_slots * 2
    # What it was sized by before: the flat K view, which spans the V half between two layers' K.
    assert len(space.k_rows) == (2 * NUM_LAYERS - 1) * space.num_slots * 2
    monkeypatch.setattr(decode_graph, "GRAPH_CELL_INDEX_BYTES", 80)
    assert cell_index_capacity(10**6, 2**31 - 1) == 20  # int32 ids
    assert cell_index_capacity(10**6, 2**31) == 10  # int64 ids
    assert cell_index_capacity(15, 2**31 - 1) == 15
    capped = GraphRunner(flashinfer_module, 2, 2)
    assert capped.backend._decode_graph.cell_indices.numel() == 20
    scenario = decode_scenario(DECODE, 2, 2)  # its requests reserve 24 cells
    capped.load(scenario)
    assert capped.decode(scenario) is None
    assert capped.backend.engine.stats.decode_graph_fallbacks == 1


@pytest.mark.torch_twins
def test_batches_without_compressed_requests_replay_the_stock_graph(flashinfer_module):
    runner = GraphRunner(flashinfer_module, 2, 2)
    plain = runner.batch(decode_scenario(DECODE, 2, 2), plain=True)
    assert runner.backend.graph_can_replay(plain) and runner.variants.select(plain) == STOCK
    assert runner.variants.select(runner.batch(decode_scenario(DECODE, 2, 2))) == SEGMENTS
    forget_engine(runner.backend.token_to_kv_pool)  # before SGLang builds the tree: nothing is compressed yet
    assert runner.variants.select(runner.batch(decode_scenario(DECODE, 2, 2))) == STOCK


@pytest.mark.torch_twins
def test_a_batch_beyond_the_graph_buffers_runs_eagerly_and_is_counted(flashinfer_module):
    runner = GraphRunner(flashinfer_module, 2, 2, context_len=4)  # DECODE's request 0 has 10 compressed tokens
    before = [tensor.clone() for tensor in (runner.backend._decode_graph.cell_indptr, runner.backend._decode_graph.cell_indices)]
    scenario = decode_scenario(DECODE, 2, 2)
    assert runner.decode(scenario) is None
    assert runner.backend.engine.stats.decode_graph_fallbacks == 1
    after = (runner.backend._decode_graph.cell_indptr, runner.backend._decode_graph.cell_indices)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert runner.backend.graph_can_replay(runner.batch(scenario, plain=True))  # no cells: always fits


@contextmanager
def counted_syncs():
    """The sync probe's counter over every host-reading tensor call it counts (``SyncProbe.calls``)."""
    probe = SyncProbe(Path(os.devnull))
    with pytest.MonkeyPatch.context() as patch:
        for name in SYNCING_METHODS:
            patch.setattr(torch.Tensor, name, probe.counted(getattr(torch.Tensor, name)))
        yield probe


@pytest.mark.torch_twins
def test_the_replayed_graph_never_synchronises(flashinfer_module):
    runner = GraphRunner(flashinfer_module, 2, 2)
    scenario = decode_scenario(DECODE, 2, 2)
    runner.load(scenario)
    graph = runner.graphs[4, SEGMENTS]
    runner.decode(scenario)  # the replay metadata may read the host: it runs before the replay
    with counted_syncs() as probe:
        with torch.compiler.set_stance("fail_on_recompile"):
            graph()
    assert probe.calls == 0


class StandInRunner:
    """The part of SGLang's ``DecodeCudaGraphRunner`` the plugin's two hooks read."""

    def __init__(self, backend, variants=None):
        self.attn_backend, self.attention_graph_variants = backend, variants
        self.capture_forward_mode = ForwardMode.DECODE
        self.captured_with = None

    def capture(self):
        self.captured_with = self.attention_graph_variants

    def can_run_graph(self, forward_batch):
        return forward_batch.batch_size <= 6


@pytest.mark.torch_twins
def test_the_plugin_hooks_capture_our_variants_and_replay_only_fitting_batches(flashinfer_module):
    runner = GraphRunner(flashinfer_module, 2, 2, context_len=4)
    stand_in = StandInRunner(runner.backend)
    scheduler_hooks.capture_graph_variants(StandInRunner.capture, stand_in)
    assert isinstance(stand_in.captured_with, SegmentGraphVariants)
    too_many_cells = runner.batch(decode_scenario(DECODE, 2, 2))
    assert not scheduler_hooks.replays_only_fitting_batches(StandInRunner.can_run_graph, stand_in, too_many_cells)
    plain = runner.batch(decode_scenario(DECODE, 2, 2), plain=True)
    assert scheduler_hooks.replays_only_fitting_batches(StandInRunner.can_run_graph, stand_in, plain)
    with pytest.raises(NotImplementedError, match="its own graph variants"):
        scheduler_hooks.capture_graph_variants(StandInRunner.capture, StandInRunner(runner.backend, variants=object()))
    # The CPU backend has no replayable form: capturing decode graphs with it is refused.
    with pytest.raises(NotImplementedError, match="need the flashinfer attention backend"):
        scheduler_hooks.capture_graph_variants(StandInRunner.capture, StandInRunner(torch_backend(decode_scenario(DECODE, 2, 2))))
    # A stock backend is left alone.
    stock = StandInRunner(object())
    scheduler_hooks.capture_graph_variants(StandInRunner.capture, stock)
    assert stock.captured_with is None


def test_capture_refuses_sglangs_metadata_glue_graph(monkeypatch):
    """Issue 34, finding 5: the glue graph would capture the replay preparation the segments graphs need
    on the host (the launcher refuses it from its environment too: tests/test_flags.py)."""
    stand_in = StandInRunner(torch_backend(decode_scenario(DECODE, 2, 2)))
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "true")
    with pytest.raises(NotImplementedError, match="SGLANG_ENABLE_METADATA_GLUE_GRAPH is set: it captures the preparation"):
        scheduler_hooks.capture_graph_variants(StandInRunner.capture, stand_in)
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "0")  # off: the backend's own answer (no graphs on CPU)
    with pytest.raises(NotImplementedError, match="need the flashinfer attention backend"):
        scheduler_hooks.capture_graph_variants(StandInRunner.capture, stand_in)


class HNDPool:
    """A KV pool in SGLang's HND layout, each layer its own allocation (the engine's pool keeps the stock
    allocation for every layout but NHD)."""

    kv_cache_layout, store_dtype = "hnd", torch.bfloat16

    def __init__(self):
        self.k_buffer = [torch.zeros(2, 8, HEAD_DIM) for _ in range(NUM_LAYERS)]
        self.v_buffer = [torch.zeros(2, 8, HEAD_DIM) for _ in range(NUM_LAYERS)]


@pytest.mark.torch_twins
def test_capture_over_an_unsupported_pool_layout_names_it_and_what_is_supported(flashinfer_module):
    """Issue 34, finding 5: not a bare ValueError about strides from deep inside the capture."""
    runner = GraphRunner(flashinfer_module, 2, 2)
    runner.backend.token_to_kv_pool = HNDPool()
    with pytest.raises(UnsupportedKVPool, match=r"HNDPool with layout 'hnd' .* supported: MHATokenToKVPool with the 'nhd' layout"):
        runner.backend.init_segment_graph_state(max(CAPTURE_BATCH_SIZES))


# ---- the compressed part alone -----------------------------------------------------------------

CAPACITY = GraphCapacity(max_batch=6, cells=200, cells_per_sequence=12)
CELL_ID_BOUND = 1024


@pytest.mark.parametrize(
    "capacity, reason",
    [
        (GraphCapacity(6, 200, 4), "compressed tokens, above 4"),  # DECODE's requests 0 and 2 have 10
        (GraphCapacity(6, 20, 12), "the batch reserves"),
        (GraphCapacity(2, 200, 12), "3 requests, above 2"),
    ],
)
def test_a_batch_beyond_a_bound_does_not_fit_and_leaves_the_buffers(capacity, reason):
    state = DecodeGraphState(capacity, NUM_LAYERS, 2, torch.device("cpu"), CELL_ID_BOUND)
    before = [t.clone() for t in (state.cell_indptr, state.cell_indices)]
    forward = decode_scenario(DECODE, 2, 2).segments.forward
    assert reason in state.check(forward)
    if capacity.max_batch >= len(forward.requests):
        assert reason in state.fill(forward, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, (state.cell_indptr, state.cell_indices)))


def test_capacity_bounds_are_validated_and_cell_ids_take_the_narrowest_index():
    with pytest.raises(ValueError, match="cells_per_sequence=0"):
        GraphCapacity(4, 10, 0)
    cpu = torch.device("cpu")
    assert DecodeGraphState(CAPACITY, 1, 1, cpu, 2**31 - 1).cell_indices.dtype == torch.int32
    assert DecodeGraphState(CAPACITY, 1, 1, cpu, 2**31).cell_indices.dtype == torch.int64


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


@on_kernel_devices
def test_the_compressed_part_replays_every_step(device):
    """The compressed part through the Triton kernels (the interpreter on CPU) for every step of ``STEPS``,
    all padded to the largest captured size, against the eager backend's compressed part. On CUDA the
    body of both layers is captured once in a CUDA graph, then each step is filled (its pool copied into
    the pool the graph reads) and replayed."""
    num_kv_heads, group = 2, 2
    scenarios = [decode_scenario(specs, num_kv_heads, group, seed) for seed, specs in enumerate(STEPS)]
    layers = [layer_of(layer_id, num_kv_heads, group) for layer_id in range(NUM_LAYERS)]
    storage = pool_storage(scenarios[0]).to(device)  # the one pool the body reads
    space = CellSpace.of_buffers(list(storage[:, 0]), list(storage[:, 1]))
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, num_kv_heads, torch.device(device), len(space.k_rows))
    batch_size = CAPACITY.max_batch
    queries = torch.zeros(batch_size, num_kv_heads * group, HEAD_DIM, device=device)

    def body() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [state.attend(queries, layer, space.k_rows, space.v_rows, CAPACITY.cells_per_sequence) for layer in layers]

    if device == "cuda":
        graph, outputs = captured(body)

        def run_body():
            graph.replay()
            return outputs

    else:
        run_body = body
    for scenario in scenarios:
        storage.copy_(pool_storage(scenario))
        forward = requests_on(scenario, device)
        assert state.fill(forward, batch_size) == FITS
        count = len(forward.requests)
        queries.zero_()
        queries[:count].copy_(scenario.q.view(count, num_kv_heads * group, HEAD_DIM))
        segments = scenario.segments
        for layer, (out, lse) in zip(layers, run_body()):
            expected_out, expected_lse = compressed_attention(
                segments, scenario.q.view(count, -1, HEAD_DIM), layer, scenario.space.k_rows, scenario.space.v_rows
            )
            rows = segments.query_rows.to(device)
            torch.testing.assert_close(out[rows].cpu(), expected_out, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(lse[rows].cpu(), expected_lse, atol=2e-5, rtol=1e-5)
            plain = [request.index for request in forward.requests if request.view is None] + list(range(count, batch_size))
            assert bool((lse[plain] == float("-inf")).all())  # no cells: the merge keeps the dense part


@contextmanager
def host_to_device_copies(monkeypatch, device: torch.device):
    """Every copy from the host to ``device`` (standing for CUDA) as ``(source, non_blocking, pinned)``,
    with pinned staging chosen for ``device`` and ``Tensor.pin_memory`` (CUDA only) a recorded copy."""
    pinned, copies = [], []
    monkeypatch.setattr(host_copies, "stages_in_pinned_memory", lambda target: target == device)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned.append(tensor.clone()) or pinned[-1])
    to, copy_ = torch.Tensor.to, torch.Tensor.copy_

    def recorded_to(tensor, *args, **kwargs):
        moved = to(tensor, *args, **kwargs)
        if tensor.device.type == "cpu" and moved.device == device:
            copies.append((tensor, kwargs.get("non_blocking", False)))
        return moved

    def recorded_copy(target, source, non_blocking=False):
        if source.device.type == "cpu" and target.device == device:
            copies.append((source, non_blocking))
        return copy_(target, source, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "to", recorded_to)
    monkeypatch.setattr(torch.Tensor, "copy_", recorded_copy)
    recorded: list[tuple[torch.Tensor, bool, bool]] = []
    yield recorded
    recorded += [(source, non_blocking, any(source is p for p in pinned)) for source, non_blocking in copies]


def test_staging_in_pinned_memory_is_chosen_for_cuda_only():
    assert host_copies.stages_in_pinned_memory(torch.device("cuda"))
    assert host_copies.stages_in_pinned_memory(torch.device("cuda", 1))
    assert not host_copies.stages_in_pinned_memory(torch.device("cpu"))
    host = torch.arange(4)
    assert host_copies.to_device(host, torch.device("cpu")) is host  # on CPU nothing is copied


def test_replay_preparation_reuses_the_cell_index_and_copies_only_from_pinned_memory(monkeypatch):
    """Issue 34, finding 1: decode steps of the same requests build their cell index once (a request's
    cells do not change between its decode steps), and every host-to-device copy of a fill is staged in
    pinned memory and non-blocking (a pageable copy would make the host wait for the running batch)."""
    device = torch.device("meta")  # a device the host copies to, standing for CUDA
    forward = requests_on(decode_scenario(DECODE, 2, 2), "meta")
    state = DecodeGraphState(CAPACITY, NUM_LAYERS, 2, device, CELL_ID_BOUND)
    builds = []
    build = CellBatch.of.__func__
    monkeypatch.setattr(CellBatch, "of", classmethod(lambda cls, views, on: builds.append(len(views)) or build(cls, views, on)))
    with host_to_device_copies(monkeypatch, device) as copies:
        for batch_size in (4, 4, 4, 6):  # three decode steps, then the batch runs as a larger captured size
            assert state.fill(forward, batch_size) == FITS
    assert builds == [2]  # DECODE's two compressed requests, built once
    assert copies and all(non_blocking and pinned for _, non_blocking, pinned in copies)


def test_a_fill_of_the_same_requests_in_other_places_reuses_their_index_and_moves_their_offsets():
    """A plain request joins in front: the compressed requests keep their views (no index built) but move
    in the batch, so the offsets follow; the buffers then equal a fresh fill of that batch."""
    forward = decode_scenario(DECODE, 2, 2).segments.forward
    joined = RequestSlice(0, 0, 1, 5, 7, None)
    moved = ForwardRequests(True, (joined, *(dataclasses.replace(r, index=r.index + 1) for r in forward.requests)))
    cpu = torch.device("cpu")
    state, fresh = (DecodeGraphState(CAPACITY, NUM_LAYERS, 2, cpu, CELL_ID_BOUND) for _ in range(2))
    assert state.fill(forward, 4) == FITS and state.fill(moved, 6) == FITS
    assert fresh.fill(moved, 6) == FITS
    assert state.cell_batches.builds == 1
    cells = sum(request.view.reserved_cells for request in forward.compressed)
    assert torch.equal(state.cell_indptr[:, : 6 * 2 + 1], fresh.cell_indptr[:, : 6 * 2 + 1])
    assert torch.equal(state.cell_indices[:cells], fresh.cell_indices[:cells])
