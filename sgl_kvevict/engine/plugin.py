"""Entry point of the ``sglang.srt.plugins`` group: runs in every SGLang process (scheduler included).

SGLang spawns its processes, so registries filled in the launcher do not reach the scheduler; this
entry point is how ours get there (docs/sglang.md#processes-and-plugin-loading). With a policy set (the launcher's
``KVEVICT_SERVING``) it registers:

* the ``sgl_kvevict`` radix-cache backend (the launcher passes ``--radix-cache-backend sgl_kvevict``);
* a KV pool whose layers are views of one allocation (``engine.pool``), so compressed cells live in it;
* our attention backends *in place of* the stock ``torch_native`` (CPU) and ``flashinfer`` (CUDA)
  factories, so the backend names and every SGLang gate keyed on them stay the stock ones. The
  stock backends must never serve a compressed request: they would read its placeholder slots;
* hooks through SGLang's ``HookRegistry`` (applied by its plugin loader; SGLang's source is not
  patched): AFTER the scheduler's ``process_batch_result``, the coordinator runs one piece of queued
  KVzip reconstruction work (``CompressionCoordinator.between_batches``), as work of its own between
  batches; AROUND ``Scheduler.get_next_batch_to_run``, under the overlap schedule, the last batch's
  results are processed before the next batch is formed when its checkpoints store compressed spans
  (``CompressionCoordinator.settles_before_next_batch``); and the three hooks of
  compress-while-prefilling (``engine.admission``) on the longest prompt SGLang accepts, on its prefill
  admission and on the answer length it allows; and two on SGLang's decode CUDA graph runner: AROUND its
  ``capture``, the backend's graph variants (``engine.decode_graph``: a ``stock`` and a ``segments``
  graph per batch size) are installed; AROUND its ``can_run_graph``, a batch whose cells exceed the
  ``segments`` graph's buffers runs eagerly.

Everything heavy is imported inside the factories, which run only in the scheduler process.
"""

from __future__ import annotations

import os

from sgl_kvevict.engine import sync_probe
from sgl_kvevict.limits import (
    METADATA_GLUE_GRAPH_ENV,
    METADATA_GLUE_GRAPH_REASON,
    check_sglang_version,
    metadata_glue_graph_enabled,
)
from sgl_kvevict.serving import RADIX_CACHE_BACKEND, ServingConfig

# Called once per scheduler batch, after its results (and the checkpoints of its requests) are processed.
SCHEDULER_BATCH_DONE = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
# Forms the next batch; under the overlap schedule the last batch's results are still unprocessed then.
NEXT_BATCH = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
# Compress while prefilling (engine.admission): the longest prompt SGLang accepts, its admission, and
# the answer length it allows a prompt.
WORKER_INFO = "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info"
PREFILL_BUDGET_CHECK = "sglang.srt.managers.schedule_policy.PrefillAdder._check_prefill_budget"
ANSWER_CLIP = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.max_new_tokens_for_memory"
# SGLang's decode CUDA graphs: their capture (per batch size and attention variant), and whether a batch replays.
_DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
DECODE_GRAPH_CAPTURE = f"{_DECODE_GRAPH_RUNNER}.capture"
DECODE_GRAPH_CHECK = f"{_DECODE_GRAPH_RUNNER}.can_run_graph"


def register() -> None:
    sync_probe.install()  # a debug probe, only with KVEVICT_SYNC_PROBE set (stock servers included)
    if not ServingConfig.from_env().enabled:
        return
    check_sglang_version()  # the engine hooks into one SGLang version's internals
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_kvevict.engine.admission import admit_by_footprint, clip_answer_by_footprint, raise_length_limits
    from sgl_kvevict.engine.pool import install_contiguous_kv_buffers

    install_contiguous_kv_buffers()
    if RADIX_CACHE_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_CACHE_BACKEND, _create_radix_cache)
    ATTENTION_BACKENDS["torch_native"] = _create_torch_backend
    ATTENTION_BACKENDS["flashinfer"] = _create_flashinfer_backend
    HookRegistry.register(SCHEDULER_BATCH_DONE, _after_batch, HookType.AFTER)
    HookRegistry.register(NEXT_BATCH, _settle_before_next_batch, HookType.AROUND)
    HookRegistry.register(WORKER_INFO, raise_length_limits, HookType.AFTER)
    HookRegistry.register(PREFILL_BUDGET_CHECK, admit_by_footprint, HookType.AROUND)
    HookRegistry.register(ANSWER_CLIP, clip_answer_by_footprint, HookType.AROUND)
    HookRegistry.register(DECODE_GRAPH_CAPTURE, capture_graph_variants, HookType.AROUND)
    HookRegistry.register(DECODE_GRAPH_CHECK, replays_only_fitting_batches, HookType.AROUND)


def _after_batch(_result, scheduler, *args, **kwargs) -> None:
    from sgl_kvevict.engine.radix_cache import CompressedRadixCache

    tree = scheduler.tree_cache
    if isinstance(tree, CompressedRadixCache):
        tree.coordinator.between_batches()


def _settle_before_next_batch(original, scheduler, *args, **kwargs):
    """SGLang's overlap loop forms batch N + 1 before it processes batch N's results. When N's checkpoints
    store compressed spans (or KVzip work is queued), process them first, as the serial loop does: N + 1
    then decodes those requests over their compressed prefixes and leaves out the ones N finished.
    Processing them at launch instead (SGLang's ``is_disable_overlap_for_batch`` route) would release
    requests N + 1 still holds: its decode would write into slots a checkpoint may have just lent to
    compressed cells."""
    from sgl_kvevict.engine.radix_cache import CompressedRadixCache

    last_batch = kwargs["last_batch"] if "last_batch" in kwargs else args[1]
    queue = getattr(scheduler, "result_queue", None)  # the overlap loop's unprocessed results
    tree = scheduler.tree_cache
    settle = (  # why N is processed first (``coordinator.SETTLED_FOR_*``), or a false value
        bool(queue) and last_batch is not None and isinstance(tree, CompressedRadixCache)
        and tree.coordinator.settles_before_next_batch(last_batch)
    )  # fmt: skip
    if settle:
        tree.coordinator.stats.overlap_wait(settle)
        scheduler.process_batch_result(*queue.popleft())
    plan = original(scheduler, *args, **kwargs)
    if settle:
        scheduler.last_batch = None  # processed: the loop has nothing left to process for it
    return plan


def capture_graph_variants(original, runner, *args, **kwargs):
    """SGLang captures a decode graph per batch size and per variant of ``runner.attention_graph_variants``
    (None: one graph). With our backend it captures ours: a batch with a compressed request must replay
    the ``segments`` graph, whose body reads its cells. Models that bring variants of their own (DSA) are
    not among those the plugin runs (hybrid and MLA models are refused). SGLang's metadata glue graph is
    refused here: it would capture the replay preparation the ``segments`` graphs need on the host."""
    from sgl_kvevict.engine.attention import SegmentAttentionBackend

    backend = runner.attn_backend
    if isinstance(backend, SegmentAttentionBackend) and runner.capture_forward_mode.is_decode():
        if metadata_glue_graph_enabled(os.environ):  # the launcher refuses it too; this is for servers without it
            raise NotImplementedError(f"sgl-kvevict: {METADATA_GLUE_GRAPH_ENV} is set: {METADATA_GLUE_GRAPH_REASON}")
        if runner.attention_graph_variants is not None:
            raise NotImplementedError("sgl-kvevict: decode CUDA graphs of a model with its own graph variants")
        runner.attention_graph_variants = backend.graph_variants()
    return original(runner, *args, **kwargs)


def replays_only_fitting_batches(original, runner, forward_batch, *args, **kwargs) -> bool:
    """SGLang's check that a batch can replay a captured graph, and ours: its cells fit the ``segments``
    graph's buffers (``KVEvictFlashInferBackend.graph_can_replay``); otherwise the batch runs eagerly."""
    from sgl_kvevict.engine.decode_graph import SegmentGraphVariants

    replays = original(runner, forward_batch, *args, **kwargs)
    if replays and isinstance(runner.attention_graph_variants, SegmentGraphVariants):
        replays = runner.attn_backend.graph_can_replay(forward_batch)
    return replays


def _create_radix_cache(ctx):
    from sgl_kvevict.engine.factory import create_compressed_radix_cache

    return create_compressed_radix_cache(ctx)


def _create_torch_backend(runner):
    from sgl_kvevict.engine.attention import KVEvictTorchBackend

    return KVEvictTorchBackend(runner)


def _create_flashinfer_backend(runner):
    if runner.use_mla_backend:
        raise NotImplementedError("sgl-kvevict: MLA models (FlashInfer MLA backend) are not supported")
    from sgl_kvevict.engine.flashinfer_backend import KVEvictFlashInferBackend

    return KVEvictFlashInferBackend(runner, init_new_workspace=runner.init_new_workspace)
