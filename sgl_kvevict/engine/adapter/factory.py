"""The engine's one assembly (``build_engine``), and the ``sgl_kvevict`` radix-cache backend that builds it.

Runs in the scheduler process when SGLang builds its tree (after the KV pool and the attention
backend exist). Every SGLang feature this version cannot honour with compressed nodes is refused
here with its reason; the launcher refuses them earlier, before the model loads, and this is the
safety net for servers started another way.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.registry import TreeCacheBuildContext
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.runtime_context import (
    get_disagg,
    get_exec,
    get_flags,
    get_memory,
    get_parallel,
    get_schedule,
    get_serving,
    get_spec,
)

from sgl_kvevict.engine.adapter.admission import chunk_size
from sgl_kvevict.engine.adapter.attention import SegmentAttentionBackend, local_window
from sgl_kvevict.engine.adapter.forward_batches import piece_forward
from sgl_kvevict.engine.adapter.hidden_states import HiddenStateCapture
from sgl_kvevict.engine.adapter.pool import UnsupportedKVPool, cell_space_of
from sgl_kvevict.engine.adapter.radix_cache import CompressedRadixCache
from sgl_kvevict.engine.adapter.slots import SchedulerSlots, slot_source
from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.compression import HiddenStates, ScoringCapture, needs_reconstruction
from sgl_kvevict.engine.coordinator import CompressionCoordinator, PlanListener
from sgl_kvevict.engine.deferred import PREFILL
from sgl_kvevict.engine.eviction import CompressedTreeOrder
from sgl_kvevict.engine.metrics import export_metrics
from sgl_kvevict.engine.paths import PathViews
from sgl_kvevict.engine.plan_dump import PlanDump
from sgl_kvevict.engine.reconstruction import PieceForward, Reconstructor
from sgl_kvevict.engine.registry import Engine, register_engine
from sgl_kvevict.engine.setups import EvictionSetup, ModelShape, Setups
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.engine.stats_channel import serve_stats
from sgl_kvevict.engine.tensor_parallel import RankGroup, process_group_gather
from sgl_kvevict.footprint import LocalShare
from sgl_kvevict.limits import SetupFacts, violations
from sgl_kvevict.local_layers import LocalLayers
from sgl_kvevict.scope import Scope
from sgl_kvevict.scoring.kvzip import ReconstructionPrompt
from sgl_kvevict.serving import RADIX_CACHE_BACKEND, ServingConfig
from sgl_kvevict.sharding import PADDING, HeadShard

logger = logging.getLogger(__name__)
# Tokens one reconstruction forward feeds when SGLang does not chunk prefills (its chunk size otherwise):
# a running request's decode waits at most that long for a KVzip pass (``engine.reconstruction``).
DEFAULT_RECONSTRUCTION_PIECE_TOKENS = 512


class UnsupportedSetup(ValueError):
    """A SGLang feature that cannot work with compressed radix nodes yet."""


def unsupported_features(ctx: TreeCacheBuildContext, attn_backend, local_layers: Optional[LocalLayers] = None) -> list[str]:
    """One line per limit of ``sgl_kvevict.limits`` this SGLang set-up breaks (empty when all is well),
    from SGLang's resolved configuration and the graphs the model runner captured. The tree is built
    after the attention backends and graph capture (scheduler.py: init_model_worker, then
    build_kv_cache), so both are final here. ``local_layers``: the model's local layers the plugin trims
    (Gemma 3), which both wrapped backends attend over, eagerly."""
    schedule, parallel, memory = get_schedule(), get_parallel(), get_memory()
    graphs = get_exec().graph.cuda_graph_config
    # graphs is never None once SGLang resolved its arguments (cuda_graph_config.py builds the default).
    runner = ctx.tp_worker.model_runner
    if runner.decode_cuda_graph_runner is None:
        decode_graphs = Backend.DISABLED
    else:  # captured: on CPU by SGLang's torch.compile runner
        decode_graphs = "cpu" if runner.device == "cpu" else graphs.decode.backend
    facts = SetupFacts(
        page_size=ctx.params.page_size,
        prefill_cuda_graphs=graphs.prefill.backend != Backend.DISABLED,
        decode_graphs=decode_graphs,
        torch_compile=get_flags().capture.enable_torch_compile,
        hierarchical_cache=ctx.enable_hierarchical_cache,
        kv_heads_replicated=runner.device != "cpu" and ctx.tp_size > total_kv_heads(runner.model_config),
        pp_size=parallel.pp_size,
        dp_size=parallel.dp_size,
        attention_dp=parallel.attn_dp_size > 1,
        radix_cache_disabled=ctx.disable_radix_cache,
        session_radix_cache=memory.enable_session_radix_cache,
        radix_eviction_policy=memory.radix_eviction_policy != "lru" or memory.radix_eviction_policy_config is not None,
        speculative=get_spec().speculative_algorithm is not None,
        mixed_chunk=schedule.enable_mixed_chunk,
        disaggregation=get_disagg().disaggregation_mode != "null",
        tokenizer_workers=get_serving().tokenizer_worker_num,
        attention_backend_wrapped=isinstance(attn_backend, SegmentAttentionBackend),
        mla_model=runner.use_mla_backend,
        # SGLang sets a window for models with local layers in the one pool (Gemma 2/3) and hybrid SWA pools;
        # Gemma 3's (``local_layers``) are served.
        sliding_window_layers=ctx.is_hybrid_swa or (runner.sliding_window_size is not None and local_layers is None),
        local_layer_decode_graphs=local_layers is not None and decode_graphs not in (Backend.DISABLED, "cpu"),
        state_space_layers=ctx.is_hybrid_ssm,
    )
    return violations(facts)


def sglang_local_windows(model) -> dict[int, int]:
    """SGLang's local attention layers of ``model`` (every ``RadixAttention`` with a ``sliding_window_size``)
    and their window as config.json counts it: SGLang's ``sliding_window_size`` is ``window - 1``."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return {
        module.layer_id: window + 1
        for module in model.modules()
        if isinstance(module, RadixAttention) and (window := local_window(module)) is not None
    }


def check_local_windows(local_layers: LocalLayers, windows: dict[int, int]) -> None:
    """The local layers the plugin trims (config.json, ``LocalLayers.of_model``) must be the layers SGLang's
    attention masks to a window (``windows``: ``sglang_local_windows``), with the same window: a layer only
    one of them calls local would be a global layer trimmed, or a window read past what the node keeps."""
    trimmed = {layer: local_layers.window for layer in local_layers.layers}
    differing = sorted(layer for layer in trimmed.keys() | windows.keys() if trimmed.get(layer) != windows.get(layer))
    if not differing:
        return

    def kind(window: Optional[int]) -> str:
        return "global" if window is None else f"window {window}"

    described = ", ".join(
        f"layer {layer} (config.json: {kind(trimmed.get(layer))}, SGLang: {kind(windows.get(layer))})" for layer in differing
    )
    raise UnsupportedSetup(
        f"KV eviction cannot run with: the model's config.json and SGLang's attention disagree on its local "
        f"layers: {described}"
    )


@dataclass(frozen=True)
class ModelParts:
    """What the model gives the engine where its setups need it: the attention inputs of every layer
    (learned scores), and KVzip's reconstruction passes (``Reconstruction``). None: not needed."""

    hidden_states: Optional[HiddenStates] = None
    reconstruction: Optional["Reconstruction"] = None


@dataclass(frozen=True)
class Reconstruction:
    """run_forward: one piece's forward through the model; the rest as ``Reconstructor``'s."""

    run_forward: Callable[[PieceForward], None]
    prompt: ReconstructionPrompt
    piece_tokens: int
    position_limit: int


def build_engine(
    setups: Setups,
    scope: Scope,
    shape: ModelShape,
    pools: CacheInitParams,
    *,
    model: ModelParts = ModelParts(),
    chunk_size: Optional[int] = None,
    ranks: Optional[RankGroup] = None,
    order: Optional[CompressedTreeOrder] = None,
    plan_listener: Optional[PlanListener] = None,
    local_layers: Optional[LocalLayers] = None,
    compress_when: str = PREFILL,
) -> Engine:
    """The engine over the pools of SGLang's ``CacheInitParams`` (the request table, the KV allocator and
    its pool; the tree keeps the rest of SGLang's settings: metrics, KV events), wired once, in
    dependency order, and registered for its KV pool (``engine.registry``): the attention backends and
    hooks find it there. Production (``radix_cache_factory``) and the tests' ``TreeHarness`` both build
    it here."""
    allocator = pools.token_to_kv_pool_allocator
    kv_pool = allocator.get_kvcache()
    try:
        space = cell_space_of(kv_pool)
    except UnsupportedKVPool as error:
        raise UnsupportedSetup(f"KV eviction cannot store compressed KV in this KV pool: {error}") from None
    arena = Arena(space, slot_source(allocator, space))
    paths = PathViews(arena, kv_pool.device)
    stats = EngineStats(global_layers=() if local_layers is None else local_layers.global_layers(shape.num_layers))
    reconstructor = None
    if model.reconstruction is not None:
        parts = model.reconstruction
        slots = SchedulerSlots(pools.req_to_token_pool, allocator)
        reconstructor = Reconstructor(
            slots, parts.run_forward, paths, parts.prompt, parts.piece_tokens, parts.position_limit
        )  # fmt: skip
    capture = ScoringCapture(space, kv_pool, model.hidden_states)
    local_share = None if local_layers is None else LocalShare(len(local_layers.layers), shape.num_layers, local_layers.window)
    coordinator = CompressionCoordinator(
        setups, scope, shape, capture, stats, paths, reconstructor, chunk_size, ranks, plan_listener, local_share
    )  # fmt: skip
    tree = CompressedRadixCache(pools, coordinator, arena, stats, order, local_layers, compress_when)
    engine = Engine(tree, coordinator, arena, space, setups, stats, local_layers)
    register_engine(kv_pool, engine)
    return engine


def radix_cache_factory(serving: ServingConfig):
    """The ``sgl_kvevict`` radix-cache backend for ``serving`` (``contacts.CONTACTS``)."""
    return functools.partial(create_compressed_radix_cache, serving=serving)


def create_compressed_radix_cache(ctx: TreeCacheBuildContext, serving: ServingConfig) -> CompressedRadixCache:
    if not serving.enabled:
        raise UnsupportedSetup(f"--radix-cache-backend {RADIX_CACHE_BACKEND} needs an eviction policy (--kv-evict-policy)")
    runner = ctx.tp_worker.model_runner
    model_dir = Path(runner.model_config.model_path)
    local_layers = LocalLayers.of_model(model_dir, serving.scope.window_stays_dense)
    problems = unsupported_features(ctx, runner.attn_backend, local_layers)
    if problems:
        raise UnsupportedSetup(f"KV eviction cannot run with: {'; '.join(problems)}")
    if local_layers is not None:
        check_local_windows(local_layers, sglang_local_windows(runner.model))
    kv_pool = runner.token_to_kv_pool
    shape = ModelShape(
        num_layers=kv_pool.layer_num,
        num_q_heads=runner.model_config.get_num_attention_heads(ctx.tp_size),
        num_kv_heads=kv_pool.head_num,
    )
    ranks = _rank_group(runner.model_config, ctx.tp_size, shape)
    heads = ranks.shard.local_heads if ranks.shard.tp_size > 1 else None
    default_setup = EvictionSetup.of(serving.eviction, model_dir, heads, local_layers)
    setups = Setups(default_setup, serving.request_allow_list, model_dir, heads, local_layers)
    # Score sources: when the server's setup needs them, or requests may bring their own.
    request = default_setup.stats_request
    hidden_states = HiddenStateCapture(runner.model) if request.hidden_states or serving.per_request else None
    reconstruction = None
    if needs_reconstruction(request) or serving.per_request:
        # Passes run at positions after their segment: rotary tables and req_to_token rows end here.
        position_limit = min(runner.model_config.context_len, runner.req_to_token_pool.req_to_token.shape[1])
        reconstruction = Reconstruction(
            piece_forward(runner), _reconstruction_prompt(model_dir), _piece_tokens(), position_limit
        )  # fmt: skip
    engine = build_engine(
        setups, serving.scope, shape, ctx.params, model=ModelParts(hidden_states, reconstruction), chunk_size=chunk_size(),
        ranks=ranks, plan_listener=PlanDump.from_env(ranks.shard), local_layers=local_layers,
        compress_when=serving.compress_when,
    )  # fmt: skip
    tree = engine.tree
    logger.info(
        "sgl-kvevict: %s; %d KV slots shared by dense and compressed KV (%d cells per slot)%s",
        serving.describe(), ctx.params.token_to_kv_pool_allocator.size, engine.space.cells_per_slot, _describe_rank(ranks),
    )  # fmt: skip
    if ranks.shard.rank != 0:
        return tree  # every rank's memory is rank 0's (engine.tensor_parallel): rank 0 reports

    def snapshot() -> dict:
        return {
            **engine.coordinator.describe(), **engine.stats.snapshot(), **setups.counters(), **tree.memory_levels(),
            "compress_when": serving.compress_when, "tp_size": ranks.shard.tp_size, "tp_exchanges": ranks.exchanges, "tp_bytes_sent": ranks.bytes_sent,
        }  # fmt: skip

    serve_stats(snapshot)
    if tree.metrics_collector is not None:  # SGLang's --enable-metrics: export ours with its cache labels
        export_metrics(snapshot, tree.metrics_collector.labels)
    return tree


def total_kv_heads(model_config) -> int:
    """The model's own KV heads: before SGLang's CPU padding for ranks that do not divide them."""
    return getattr(model_config.hf_config, "original_total_num_kv_heads", None) or model_config.get_total_num_kv_heads()


def _rank_group(model_config, tp_size: int, shape: ModelShape) -> RankGroup:
    """This rank's heads and its exchange with the other TP ranks (SGLang's TP group, its CPU side)."""
    tp_rank = get_parallel().tp_rank if tp_size > 1 else 0
    shard = HeadShard.of(total_kv_heads(model_config), tp_size, tp_rank)
    if len(shard.local_heads) != shape.num_kv_heads:
        raise UnsupportedSetup(
            f"KV eviction expects {len(shard.local_heads)} KV heads on TP rank {tp_rank} of {tp_size} "
            f"({shard.num_heads} in the model), SGLang's pool holds {shape.num_kv_heads}"
        )
    if tp_size == 1:
        return RankGroup(shard, shape.num_layers)
    from sglang.srt.distributed import get_tp_group

    return RankGroup(shard, shape.num_layers, process_group_gather(get_tp_group().cpu_group, tp_size))


def _describe_rank(ranks: RankGroup) -> str:
    shard = ranks.shard
    if shard.tp_size == 1:
        return ""
    heads = ", ".join("padding" if head == PADDING else str(head) for head in shard.local_heads)
    return f"; TP rank {shard.rank} of {shard.tp_size}, KV heads {heads} of {shard.num_heads}"


def _reconstruction_prompt(model_dir: Path) -> ReconstructionPrompt:
    from transformers import AutoTokenizer

    return ReconstructionPrompt.from_tokenizer(AutoTokenizer.from_pretrained(model_dir))


def _piece_tokens() -> int:
    return chunk_size() or DEFAULT_RECONSTRUCTION_PIECE_TOKENS
