"""Prometheus export of the compression counters, beside SGLang's own series (``--enable-metrics``).

SGLang runs ``prometheus_client`` in multiprocess mode: the engine sets ``PROMETHEUS_MULTIPROC_DIR``
before it spawns the scheduler, every process writes its metric values to files there, and the
HTTP server's ``/metrics`` (``add_prometheus_middleware``) merges those files with a
``MultiProcessCollector``. A custom collector registered in the scheduler process would never reach
``/metrics``; values have to be written as ordinary ``Counter``/``Gauge`` metrics in the process
where the tree lives, as SGLang's ``RadixCacheMetricsCollector`` does.

A daemon thread copies the engine's stats snapshot (thread-safe) into them every ``interval``
seconds, so the scheduler's loop carries no metrics code: levels become gauges
(``multiprocess_mode="mostrecent"``, like SGLang's scheduler gauges), running totals become counters
increased by their change since the last copy. Series carry SGLang's radix-cache labels
(``cache_type``, ``tp_rank``, ``pp_rank``, ``dp_rank`` and any ``--extra-metric-labels``) so they
line up with its ``sglang:*`` cache series.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

logger = logging.getLogger(__name__)

PREFIX = "kvevict_"
# Levels: what the tree and the pools hold now (they fall on eviction and /flush_cache).
GAUGES = {
    "compressed_nodes": "Compressed radix-tree nodes currently cached.",
    "compressed_tokens": "Logical prompt tokens covered by the cached compressed nodes.",
    "kept_cells": "Cells held by cached compressed nodes (one cell: one KV head's K and V of one layer and token).",
    "kv_slots_total": "SGLang's KV pool in token slots, shared by dense and compressed KV.",
    "kv_slots_free": "KV token slots free in SGLang's allocator now.",
    "arena_slots_borrowed": "KV token slots the compressed-KV arena holds now.",
    "arena_cells_used": "Cells of the borrowed slots in use.",
    "arena_cells_free": "Cells of the borrowed slots free (reclaimable by moving cells).",
    "deferred_nodes": "Dense radix nodes holding the plan they are compressed with under memory pressure (--kv-evict-when pressure).",
    "deferred_plan_bytes": "Host memory the plans of deferred nodes take.",
}
# Running totals since the server started (prometheus_client appends _total to the names).
COUNTERS = {
    "requests_compressed": "Requests whose prompt was compressed into a compressed node.",
    "reuse_hits": "Prefix matches that reused at least one compressed node made by another request.",
    "reused_tokens": "Logical prompt tokens served from compressed nodes instead of being prefilled again.",
    "compressed_nodes_evicted": "Compressed nodes evicted under memory pressure (/flush_cache not counted).",
    "dense_nodes_evicted": "Dense radix nodes evicted under memory pressure (/flush_cache not counted).",
    "nodes_compressed_under_pressure": "Dense radix nodes compressed in place when SGLang asked for KV slots (--kv-evict-when pressure).",
    "slots_freed_under_pressure": "KV token slots those compressions gave back to SGLang's allocator.",
    "compressed_at_checkpoint_under_pressure": "Segments compressed at their checkpoint under --kv-evict-when pressure (in the 64 checkpoints after SGLang asked for room the pool did not have free).",
    "prompts_admitted_compressed": "Prompts SGLang admitted by their compressed footprint under --kv-evict-when pressure while the pool was full.",
    "pressure_from_waiting_queue": "Times the waiting requests' new tokens exceeded the KV pool's free room and put the tree under pressure (--kv-evict-when pressure).",
    "arena_cells_moved": "Cells moved to give whole slots back to SGLang's allocator.",
    "chunked_prefills": "Requests whose prompt took more than one prefill forward (chunked prefill).",
    "chunked_prefills_aborted": "Requests released between two prefill forwards of their prompt (aborted between chunks).",
    "overlap_waits": "Batches the overlap schedule formed only after the previous batch's checkpoints stored compressed segments or KVzip work ran.",
    "overlap_waits_prefill": "Overlap waits because a request-scope prompt's compressed segment was ready to store.",
    "overlap_waits_block": "Overlap waits because a block-scope block was ready to store.",
    "overlap_waits_kvzip": "Overlap waits because KVzip reconstruction work was queued.",
    "graph_decodes": "Decode batches with compressed requests replayed in a CUDA graph.",
    "decode_graph_fallbacks": "Decode batches with compressed requests run eagerly: their cells exceed the CUDA graph's buffers.",
}
DEFAULT_INTERVAL_SECONDS = 1.0


class StatsExporter:
    """The kvevict_* metrics of one scheduler process and the copy from a stats snapshot into them."""

    def __init__(self, labels: Mapping[str, object]):
        # Imported here: prometheus_client reads PROMETHEUS_MULTIPROC_DIR when it is first imported,
        # which SGLang has set by the time the scheduler builds its tree.
        from prometheus_client import Counter, Gauge

        names = list(labels)
        values = {name: str(value) for name, value in labels.items()}
        self.gauges = {
            field: Gauge(PREFIX + field, doc, labelnames=names, multiprocess_mode="mostrecent").labels(**values)
            for field, doc in GAUGES.items()
        }
        self.counters = {
            field: Counter(PREFIX + field, doc, labelnames=names).labels(**values) for field, doc in COUNTERS.items()
        }
        self._exported_totals = dict.fromkeys(COUNTERS, 0)

    def update(self, stats: Mapping[str, object]) -> None:
        for field, gauge in self.gauges.items():
            gauge.set(stats[field])
        for field, counter in self.counters.items():
            increase = stats[field] - self._exported_totals[field]
            if increase > 0:  # totals never fall; a smaller value would only be a torn read
                counter.inc(increase)
                self._exported_totals[field] = stats[field]


def export_metrics(
    snapshot: Callable[[], Mapping[str, object]],
    labels: Mapping[str, object],
    interval: float = DEFAULT_INTERVAL_SECONDS,
) -> StatsExporter:
    """Create the metrics, write the first values now and start the copying thread."""
    exporter = StatsExporter(labels)
    exporter.update(snapshot())

    def copy_forever() -> None:
        while True:  # a daemon thread: it ends with the scheduler process
            time.sleep(interval)
            try:
                exporter.update(snapshot())
            except Exception:  # monitoring must never take the scheduler down
                logger.exception("sgl-kvevict: updating the kvevict_* metrics failed")

    threading.Thread(target=copy_forever, name="kvevict-metrics", daemon=True).start()
    logger.info("sgl-kvevict: exporting kvevict_* Prometheus metrics every %.1f s", interval)
    return exporter
