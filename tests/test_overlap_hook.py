"""The overlap schedule's hook (``scheduler_hooks.settle_before_next_batch``) on a stand-in scheduler.

SGLang's overlap loop keeps the last batch's result in ``result_queue`` while it forms the next batch.
The hook processes that result first exactly when the coordinator says the last batch's checkpoints
store compressed segments, and then tells the loop nothing is left to process for it (``last_batch``
None). End to end, every server test runs under the overlap schedule and the parity tests count the
waits (tests/test_engine_parity.py).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sgl_kvevict.engine.compression import Stage  # noqa: E402
from sgl_kvevict.engine.coordinator import (  # noqa: E402
    SETTLED_FOR_BLOCK,
    SETTLED_FOR_KVZIP,
    SETTLED_FOR_PREFILL,
    CompressionCoordinator,
)
from sgl_kvevict.engine.adapter.scheduler_hooks import settle_before_next_batch  # noqa: E402
from sgl_kvevict.engine.records import RequestRecord  # noqa: E402
from sgl_kvevict.engine.registry import engine_for, register_engine  # noqa: E402
from sgl_kvevict.engine.stats import EngineStats  # noqa: E402
from sgl_kvevict.scope import BlockScope, RequestScope  # noqa: E402


class Coordinator:
    """Settles exactly the batches named ``settling``, for ``reason``."""

    def __init__(self, settling: str, reason: str = SETTLED_FOR_PREFILL):
        self.settling, self.reason = settling, reason
        self.stats = EngineStats()

    def settles_before_next_batch(self, last_batch) -> str:
        return self.reason if last_batch == self.settling else ""


class Pool:
    """A KV pool: what the hook finds the engine by (``engine.registry``)."""


def engine_pool(coordinator: Coordinator) -> Pool:
    """A pool with an engine registered for it (``build_engine`` registers the real one so)."""
    pool = Pool()
    register_engine(pool, SimpleNamespace(coordinator=coordinator, stats=coordinator.stats))
    return pool


def scheduler_with(queue, last_batch, settling: str = "prefill N", pool=None):
    calls = []
    pool = engine_pool(Coordinator(settling)) if pool is None else pool
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=allocator, last_batch=last_batch,
        process_batch_result=lambda *result: calls.append(("process", *result)),
    )  # fmt: skip
    if queue is not None:
        scheduler.result_queue = queue

    def form(_scheduler, running_batch, last_batch):
        calls.append(("form", last_batch))
        return "plan"

    return scheduler, form, calls


def test_a_batch_that_stores_segments_is_processed_before_the_next_is_formed():
    scheduler, form, calls = scheduler_with(deque([("copy of N", "result of N")]), "prefill N")
    assert settle_before_next_batch(form, scheduler, running_batch="running", last_batch="prefill N") == "plan"
    assert calls == [("process", "copy of N", "result of N"), ("form", "prefill N")]  # N still merges into the next
    assert scheduler.last_batch is None and not scheduler.result_queue
    assert engine_for(scheduler.token_to_kv_pool_allocator.get_kvcache()).stats.overlap_waits == 1


def test_waits_are_counted_by_reason_and_served_with_the_stats():
    """Issue 34, finding 6: how often overlap is lost, and why, in ``/kvevict/stats`` (the snapshot)."""
    coordinator = Coordinator("N")
    pool = engine_pool(coordinator)
    for reason in (SETTLED_FOR_PREFILL, SETTLED_FOR_BLOCK, SETTLED_FOR_BLOCK, SETTLED_FOR_KVZIP):
        coordinator.reason = reason
        scheduler, form, _ = scheduler_with(deque([("copy of N", "result of N")]), "N", pool=pool)
        settle_before_next_batch(form, scheduler, running_batch="running", last_batch="N")
    scheduler, form, _ = scheduler_with(deque([("copy of M", "result of M")]), "M", pool=pool)  # overlaps
    settle_before_next_batch(form, scheduler, running_batch="running", last_batch="M")
    snapshot = coordinator.stats.snapshot()
    assert (snapshot["overlap_waits"], snapshot["overlap_waits_prefill"], snapshot["overlap_waits_block"],
            snapshot["overlap_waits_kvzip"]) == (4, 1, 2, 1)  # fmt: skip


def test_the_coordinator_names_why_a_batch_settles():
    ready = SimpleNamespace(kvevict=RequestRecord(None, compressions=[SimpleNamespace(stage=Stage.READY)]))
    scored = SimpleNamespace(kvevict=RequestRecord(None, compressions=[SimpleNamespace(stage=Stage.PREFILLING)]))
    coordinator = CompressionCoordinator.__new__(CompressionCoordinator)  # reads its scope and reconstructor only
    coordinator.reconstructor, coordinator.scope = None, RequestScope()
    assert coordinator.settles_before_next_batch(SimpleNamespace(reqs=[scored, SimpleNamespace()])) == ""
    assert coordinator.settles_before_next_batch(SimpleNamespace(reqs=[scored, ready])) == SETTLED_FOR_PREFILL
    coordinator.scope = BlockScope(64)
    assert coordinator.settles_before_next_batch(SimpleNamespace(reqs=[ready])) == SETTLED_FOR_BLOCK
    coordinator.reconstructor = SimpleNamespace(queue=["a pass"])
    assert coordinator.settles_before_next_batch(SimpleNamespace(reqs=[scored])) == SETTLED_FOR_KVZIP


def test_other_batches_the_serial_loop_and_stock_trees_are_left_to_sglang():
    stock_pool = Pool()  # no engine over it (e.g. --kv-evict-policy none)
    for queue, last_batch, pool in (
        (deque([("copy of N", "result of N")]), "decode N", None),  # nothing to store: N overlaps
        (None, "prefill N", None),  # the serial loop: no result queue, N was processed already
        (deque(), None, None),  # the first batch
        (deque([("copy of N", "result of N")]), "prefill N", stock_pool),
    ):
        scheduler, form, calls = scheduler_with(queue, last_batch, pool=pool)
        assert settle_before_next_batch(form, scheduler, running_batch="running", last_batch=last_batch) == "plan"
        assert calls == [("form", last_batch)] and scheduler.last_batch == last_batch
