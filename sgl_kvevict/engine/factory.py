"""The ``sgl_kvevict`` radix-cache backend factory: checks, then the engine's parts wired together.

Runs in the scheduler process when SGLang builds its tree (after the KV pool and the attention
backend exist). Every SGLang feature this version cannot honour with compressed nodes is refused
here with its reason; the launcher refuses them earlier, before the model loads, and this is the
safety net for servers started another way.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
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

from sgl_kvevict.engine.admission import chunk_size
from sgl_kvevict.engine.arena import Arena, SlotSource
from sgl_kvevict.engine.attention import SegmentAttentionBackend
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.compression import ScoringCapture, needs_reconstruction
from sgl_kvevict.engine.coordinator import CompressionCoordinator
from sgl_kvevict.engine.hidden_states import HiddenStateCapture
from sgl_kvevict.engine.metrics import export_metrics
from sgl_kvevict.engine.pool import UnsupportedKVPool, cell_space_of
from sgl_kvevict.engine.radix_cache import CompressedRadixCache
from sgl_kvevict.engine.reconstruction import Reconstructor
from sgl_kvevict.engine.setups import EvictionSetup, ModelShape, Setups
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.engine.stats_channel import serve_stats
from sgl_kvevict.engine.tensor_parallel import RankGroup, process_group_gather
from sgl_kvevict.limits import SetupFacts, violations
from sgl_kvevict.scoring.kvzip import ReconstructionPrompt
from sgl_kvevict.serving import RADIX_CACHE_BACKEND, ServingConfig
from sgl_kvevict.sharding import PADDING, HeadShard

logger = logging.getLogger(__name__)
# Tokens one reconstruction forward feeds when SGLang does not chunk prefills (its chunk size otherwise):
# a running request's decode waits at most that long for a KVzip pass (``engine.reconstruction``).
DEFAULT_RECONSTRUCTION_PIECE_TOKENS = 512


class UnsupportedSetup(ValueError):
    """A SGLang feature that cannot work with compressed radix nodes yet."""


def unsupported_features(ctx: TreeCacheBuildContext, attn_backend) -> list[str]:
    """One line per limit of ``sgl_kvevict.limits`` this SGLang set-up breaks (empty when all is well),
    from SGLang's resolved configuration and the graphs the model runner captured. The tree is built
    after the attention backends and graph capture (scheduler.py: init_model_worker, then
    build_kv_cache), so both are final here."""
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
        # SGLang sets a window for models with local layers in the one pool (Gemma 2/3) and hybrid SWA pools.
        sliding_window_layers=ctx.is_hybrid_swa or runner.sliding_window_size is not None,
        state_space_layers=ctx.is_hybrid_ssm,
    )
    return violations(facts)


def create_compressed_radix_cache(ctx: TreeCacheBuildContext) -> CompressedRadixCache:
    serving = ServingConfig.from_env()
    if not serving.enabled:
        raise UnsupportedSetup(f"--radix-cache-backend {RADIX_CACHE_BACKEND} needs an eviction policy (--kv-evict-policy)")
    runner = ctx.tp_worker.model_runner
    problems = unsupported_features(ctx, runner.attn_backend)
    if problems:
        raise UnsupportedSetup(f"KV eviction cannot run with: {'; '.join(problems)}")

    pool = runner.token_to_kv_pool
    allocator = ctx.params.token_to_kv_pool_allocator
    shape = ModelShape(
        num_layers=pool.layer_num,
        num_q_heads=runner.model_config.get_num_attention_heads(ctx.tp_size),
        num_kv_heads=pool.head_num,
    )
    ranks = _rank_group(runner.model_config, ctx.tp_size, shape)
    try:
        space = cell_space_of(pool)
    except UnsupportedKVPool as error:
        raise UnsupportedSetup(f"KV eviction cannot store compressed KV in this KV pool: {error}") from None
    arena = Arena(space, _slot_source(allocator, space))
    model_dir = Path(runner.model_config.model_path)
    stats = EngineStats()
    heads = ranks.shard.local_heads if ranks.shard.tp_size > 1 else None
    default_setup = EvictionSetup.of(serving.eviction, model_dir, heads)
    setups = Setups(
        default_setup, serving.request_allow_list, model_dir, heads, refused=lambda: stats.count("request_option_errors")
    )
    # Score sources: when the server's setup needs them, or requests may bring their own.
    request = default_setup.stats_request
    hidden_states = HiddenStateCapture(runner.model) if request.hidden_states or serving.per_request else None
    reconstructor = None
    if needs_reconstruction(request) or serving.per_request:
        # Passes run at positions after their span: rotary tables and req_to_token rows end here.
        position_limit = min(runner.model_config.context_len, runner.req_to_token_pool.req_to_token.shape[1])
        reconstructor = Reconstructor(runner, _reconstruction_prompt(model_dir), _piece_tokens(), position_limit)
    capture = ScoringCapture(space, pool, hidden_states)
    coordinator = CompressionCoordinator(
        setups, serving.scope, shape, capture, stats, reconstructor, chunk_size(), ranks
    )  # fmt: skip
    cache = CompressedRadixCache(ctx.params, coordinator, arena, stats)
    runner.attn_backend.attach_coordinator(coordinator, space)
    logger.info(
        "sgl-kvevict: %s; %d KV slots shared by dense and compressed KV (%d cells per slot)%s",
        serving.describe(), allocator.size, space.cells_per_slot, _describe_rank(ranks),
    )  # fmt: skip
    if ranks.shard.rank != 0:
        return cache  # every rank's memory is rank 0's (engine.tensor_parallel): rank 0 reports

    def snapshot() -> dict:
        return {
            **coordinator.describe(), **stats.snapshot(), **setups.counters(), **cache.memory_levels(),
            "tp_size": ranks.shard.tp_size, "tp_exchanges": ranks.exchanges, "tp_bytes_sent": ranks.bytes_sent,
        }  # fmt: skip

    serve_stats(snapshot)
    if cache.metrics_collector is not None:  # SGLang's --enable-metrics: export ours with its cache labels
        export_metrics(snapshot, cache.metrics_collector.labels)
    return cache


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


def _slot_source(allocator, space: CellSpace) -> SlotSource:
    """The arena's access to SGLang's allocator: slots move between them as int64 tensors."""

    def borrow(count: int):
        slots = allocator.alloc(count)
        return None if slots is None else slots.to("cpu", torch.int64)

    def give_back(slots) -> None:
        allocator.free(slots.to(allocator.device))

    return SlotSource(borrow=borrow, give_back=give_back, copy_cells=space.copy)
