"""The engine's kept shares (``EngineStats``): per layer, of global layers and of all layers, kept exactly as
compressed nodes are added, split (a head gaining its local-layer window) and evicted; a scale-out launch's
aggregate leaves them out (a share does not add across workers). Pure, in-process."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.server.stats_aggregate import aggregate

# Four layers, the last global (Gemma 3's pattern, small), one KV head; a 100-token node keeps 25 of its
# positions in the global layer and the last 16 (the window) in each local one.
GLOBAL = (3,)


def segment(length: int, per_layer: list[int], heads: int = 1) -> SimpleNamespace:
    """What ``EngineStats`` reads of a ``CompressedSegment``: ``per_layer`` entries in each KV head of a layer."""
    counts = torch.tensor([[count] * heads for count in per_layer])
    entries = int(counts.sum())
    return SimpleNamespace(
        length=length, counts=counts, num_cells=entries, num_entries=entries,
        rank_counts=SimpleNamespace(per_rank=lambda: torch.tensor([entries])),
    )  # fmt: skip


def test_kept_shares_follow_nodes_added_split_and_evicted():
    stats = EngineStats(global_layers=GLOBAL)
    assert "kept_share_by_layer" not in stats.snapshot()  # no node: nothing to divide
    first = segment(100, [16, 16, 16, 25])
    stats.node_added(first)
    shares = stats.snapshot()
    assert shares["kept_share_by_layer"] == [0.16, 0.16, 0.16, 0.25]
    assert shares["kept_share_global_layers"] == 0.25 and shares["kept_share_all_layers"] == round(73 / 400, 4)
    stats.node_added(segment(200, [16, 16, 16, 100], heads=2))  # 2 heads: 400 dense slots a layer
    shares = stats.snapshot()
    assert shares["kept_share_global_layers"] == round((25 + 200) / 500, 4)
    stats.node_split(1, 0, segment(40, [9, 9, 9, 0]))  # the head of a split gains its window in local layers
    assert stats.snapshot()["kept_share_by_layer"][:3] == [round((16 + 32 + 9) / 500, 4)] * 3
    assert stats.kept_entries == 73 + 296 + 27
    stats.compressed_node_evicted(first)
    assert stats.snapshot()["kept_share_global_layers"] == 0.5


def test_a_model_without_local_layers_reports_shares_per_layer_only():
    stats = EngineStats()
    stats.node_added(segment(10, [5, 3]))
    shares = stats.snapshot()
    assert shares["kept_share_by_layer"] == [0.5, 0.3] and "kept_share_global_layers" not in shares
    stats.tree_cleared()
    assert "kept_share_by_layer" not in stats.snapshot()


def test_the_scale_out_aggregate_does_not_add_shares():
    worker = {"kept_entries": 10, "kept_share_global_layers": 0.25, "kept_share_by_layer": [0.5, 0.25]}
    total = aggregate({"http://a": worker, "http://b": worker})["total"]
    assert total["kept_entries"] == 20 and not any(name.startswith("kept_share") for name in total)
