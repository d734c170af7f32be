"""The overlap schedule's hook (``plugin._settle_before_next_batch``) on a stand-in scheduler.

SGLang's overlap loop keeps the last batch's result in ``result_queue`` while it forms the next batch.
The hook processes that result first exactly when the coordinator says the last batch's checkpoints
store compressed spans, and then tells the loop nothing is left to process for it (``last_batch``
None). End to end, every server test runs under the overlap schedule and the parity tests count the
waits (tests/test_engine_parity.py).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sgl_kvevict.engine.plugin import _settle_before_next_batch  # noqa: E402
from sgl_kvevict.engine.radix_cache import CompressedRadixCache  # noqa: E402
from sgl_kvevict.engine.stats import EngineStats  # noqa: E402


class Coordinator:
    """Settles exactly the batches named ``settling``."""

    def __init__(self, settling: str):
        self.settling = settling
        self.stats = EngineStats()

    def settles_before_next_batch(self, last_batch) -> bool:
        return last_batch == self.settling


def scheduler_with(queue, last_batch, settling: str = "prefill N", tree=None):
    calls = []
    if tree is None:
        tree = CompressedRadixCache.__new__(CompressedRadixCache)  # only its type and coordinator are read
        tree.coordinator = Coordinator(settling)
    scheduler = SimpleNamespace(tree_cache=tree, last_batch=last_batch, process_batch_result=lambda *result: calls.append(("process", *result)))
    if queue is not None:
        scheduler.result_queue = queue

    def form(_scheduler, running_batch, last_batch):
        calls.append(("form", last_batch))
        return "plan"

    return scheduler, form, calls


def test_a_batch_that_stores_spans_is_processed_before_the_next_is_formed():
    scheduler, form, calls = scheduler_with(deque([("copy of N", "result of N")]), "prefill N")
    assert _settle_before_next_batch(form, scheduler, running_batch="running", last_batch="prefill N") == "plan"
    assert calls == [("process", "copy of N", "result of N"), ("form", "prefill N")]  # N still merges into the next
    assert scheduler.last_batch is None and not scheduler.result_queue
    assert scheduler.tree_cache.coordinator.stats.overlap_waits == 1


def test_other_batches_the_serial_loop_and_stock_trees_are_left_to_sglang():
    stock_tree = SimpleNamespace(coordinator=Coordinator("prefill N"))  # not our tree (e.g. --kv-evict-policy none)
    for queue, last_batch, tree in (
        (deque([("copy of N", "result of N")]), "decode N", None),  # nothing to store: N overlaps
        (None, "prefill N", None),  # the serial loop: no result queue, N was processed already
        (deque(), None, None),  # the first batch
        (deque([("copy of N", "result of N")]), "prefill N", stock_tree),
    ):
        scheduler, form, calls = scheduler_with(queue, last_batch, tree=tree)
        assert _settle_before_next_batch(form, scheduler, running_batch="running", last_batch=last_batch) == "plan"
        assert calls == [("form", last_batch)] and scheduler.last_batch == last_batch
