"""The hooks on SGLang's scheduler loop and decode CUDA graph runner (``contacts.CONTACTS``).

Each finds the engine of the scheduler's KV pool (``engine.registry``); without one (a stock tree, or
before the tree is built) it leaves SGLang's behaviour as it is.
"""

from __future__ import annotations

import os

from sgl_kvevict.engine.adapter.slots import engine_of
from sgl_kvevict.engine.registry import Engine
from sgl_kvevict.limits import METADATA_GLUE_GRAPH_ENV, METADATA_GLUE_GRAPH_REASON, metadata_glue_graph_enabled


def after_batch(_result, scheduler, *args, **kwargs) -> None:
    """After a batch's results: one piece of queued KVzip work; a request whose passes that finished
    after its prefill gets its plans stored now (the tree's checkpoint up to its prompt's end)."""
    engine: Engine = engine_of(scheduler.token_to_kv_pool_allocator)
    if engine is None:
        return
    req = engine.coordinator.between_batches()
    if req is not None:
        engine.tree.checkpoint(req, up_to=len(req.origin_input_ids))


def weigh_waiting_queue(scheduler, *args, **kwargs) -> None:
    """Before SGLang forms a prefill batch, under ``--kv-evict-when pressure`` while the tree is not under
    pressure yet: the waiting queue's demand for new KV against the pool's free room
    (``CompressedRadixCache.weigh_waiting``)."""
    engine: Engine = engine_of(scheduler.token_to_kv_pool_allocator)
    if engine is not None and engine.tree.defers and not engine.tree.under_pressure and scheduler.waiting_queue:
        engine.tree.weigh_waiting(scheduler.waiting_queue)


def settle_before_next_batch(original, scheduler, *args, **kwargs):
    """SGLang's overlap loop forms batch N + 1 before it processes batch N's results. When N's checkpoints
    store compressed segments (or KVzip work is queued), process them first, as the serial loop does: N + 1
    then decodes those requests over their compressed prefixes and leaves out the ones N finished.
    Processing them at launch instead (SGLang's ``is_disable_overlap_for_batch`` route) would release
    requests N + 1 still holds: its decode would write into slots a checkpoint may have just lent to
    compressed cells."""
    last_batch = kwargs["last_batch"] if "last_batch" in kwargs else args[1]
    queue = getattr(scheduler, "result_queue", None)  # the overlap loop's unprocessed results
    engine = engine_of(scheduler.token_to_kv_pool_allocator) if queue and last_batch is not None else None
    # why N is processed first (``coordinator.SETTLED_FOR_*``), or a false value
    settle = engine is not None and engine.coordinator.settles_before_next_batch(last_batch)
    if settle:
        engine.stats.overlap_wait(settle)
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
    from sgl_kvevict.engine.adapter.attention import SegmentAttentionBackend

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
