"""Local attention layers (Gemma 3) without a server: what a trimmed plan keeps, what a split head gains,
which configs have them, how a segment merges what a split head gains, and admission's count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest_policies import random_stats
from sgl_kvevict.architectures import local_layers_of_config, model_facts
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.engine.segments import CompressedSegment
from sgl_kvevict.footprint import LocalShare, PrefillFootprint
from sgl_kvevict.local_layers import LocalLayers, WindowedLocalLayers
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import SegmentSpec
from sgl_kvevict.scope import BlockScope
from sgl_kvevict.sharding import RankCounts

LOCAL = LocalLayers(layers=(0, 1, 3), window=16, observation_window_dense=False)  # as block scope trims
SPEC = SegmentSpec(start=10, end=110, num_layers=4, num_kv_heads=2, num_q_heads=4)


def snapkv_plans(local):
    """The plan of snapkv at 0.3 over random statistics, alone and wrapped by ``local``."""
    config = EvictionConfig.for_policy("snapkv", budget=0.3, window=8)
    plans = []
    for policy in (build_policy(config), WindowedLocalLayers.wrap(build_policy(config), local)):
        compressor = policy.start(SPEC)
        for layer, stats in enumerate(random_stats(SPEC, 8, policy.stats_request(), seed=3)):
            compressor.observe(layer, stats)
        plans.append(compressor.plan())
    return plans


def test_a_wrapped_policy_keeps_its_plan_in_global_layers_and_the_last_window_in_local_ones():
    plain, trimmed = snapkv_plans(LOCAL)
    for layer in range(SPEC.num_layers):
        if layer in LOCAL.layers:
            for head in range(SPEC.num_kv_heads):
                assert trimmed.layers[layer].head_positions(head).tolist() == list(range(SPEC.end - 16, SPEC.end))
        else:
            assert torch.equal(trimmed.layers[layer].kept_positions, plain.layers[layer].kept_positions)
    whole = LocalLayers(LOCAL.layers, LOCAL.window, trim=False)
    _, kept_whole = snapkv_plans(whole)
    assert kept_whole.counts()[list(LOCAL.layers)].eq(SPEC.end - SPEC.start).all()
    full = build_policy(EvictionConfig.for_policy("full"))
    assert WindowedLocalLayers.wrap(full, None) is full  # a model without local layers


def test_full_on_a_model_with_local_layers_keeps_global_layers_whole_and_a_window_of_local_ones():
    policy = WindowedLocalLayers.wrap(build_policy(EvictionConfig.for_policy("full")), LOCAL)
    plan = policy.start(SPEC).plan()
    assert plan.counts().tolist() == [[16, 16], [16, 16], [100, 100], [16, 16]]
    short = SegmentSpec(0, 12, 4, 2, 4)
    assert policy.start(short).plan().counts().eq(12).all()  # shorter than the window: kept whole
    # Request scope: the node ends where the observation window (full's: 32) begins, which stays dense; its
    # local layers keep the 16 positions before that, and the window itself.
    request_scope = dataclasses.replace(LOCAL, observation_window_dense=True)
    plan = WindowedLocalLayers.wrap(build_policy(EvictionConfig.for_policy("full")), request_scope).start(SPEC).plan()
    assert plan.layers[0].head_positions(0).tolist() == list(range(SPEC.end - 32 - 16, SPEC.end))
    assert plan.restricted(SPEC.start, SPEC.end - 32).counts()[0].tolist() == [16, 16]


def test_a_split_head_gains_the_window_it_lacks_before_the_divergence():
    # A node [10, 110) trimmed keeps [94, 110) in local layers; split at 100, its head [10, 100) holds [94, 100).
    gained = LOCAL.window_before(10, 100, torch.arange(94, 100), num_layers=4, num_kv_heads=2)
    assert gained.counts().tolist() == [[10, 10], [10, 10], [0, 0], [10, 10]]
    assert gained.layers[0].head_positions(1).tolist() == list(range(84, 94))
    assert LOCAL.window_before(10, 100, torch.arange(84, 100), 4, 2) is None  # it lacks nothing
    assert LOCAL.window_before(10, 20, torch.arange(10, 20), 4, 2) is None  # shorter than the window


def test_a_merged_segment_orders_entries_by_layer_head_and_position_and_says_where_each_went():
    head = CompressionPlan(10, 100, (LayerPlan.from_heads([torch.tensor([94, 95]), torch.tensor([99])]),
                                     LayerPlan.from_heads([torch.tensor([11]), torch.tensor([])])))  # fmt: skip
    gained = CompressionPlan(10, 100, (LayerPlan.from_heads([torch.tensor([90, 96]), torch.tensor([98])]),
                                       LayerPlan.from_heads([torch.tensor([]), torch.tensor([])])))  # fmt: skip
    first = CompressedSegment.of_plan(head, RankCounts.of_plan(head))
    second = CompressedSegment.of_plan(gained, RankCounts.of_plan(gained))
    merged, from_first, from_second = first.merged(second)
    assert merged.positions.tolist() == [90, 94, 95, 96, 98, 99, 11]
    assert merged.counts.tolist() == [[4, 2], [1, 0]]
    assert merged.positions[from_first].tolist() == first.positions.tolist()
    assert merged.positions[from_second].tolist() == second.positions.tolist()
    assert int(merged.rank_counts.per_rank().sum()) == 7


def test_gemma_3_configs_have_local_layers_and_other_models_none():
    text = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 512,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}  # fmt: skip
    assert local_layers_of_config(text) == ((0, 1, 2), 512)
    hub = {"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6}
    assert local_layers_of_config(hub) == ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 1024)  # as transformers derives them
    multimodal = {"model_type": "gemma3", "text_config": {**hub, "model_type": "gemma3_text"}}
    assert local_layers_of_config(multimodal) == local_layers_of_config(hub)
    assert not model_facts(multimodal)["sliding_window_layers"]  # served
    gpt_oss = {"model_type": "gpt_oss", "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}
    assert local_layers_of_config(gpt_oss) is None and model_facts(gpt_oss)["sliding_window_layers"]
    assert local_layers_of_config({"model_type": "llama", "num_hidden_layers": 2}) is None


@pytest.mark.parametrize("budget, expected", [(None, -(-(2 * 512 + 4 * 256) // 6)), ("0.25", -(-(2 * 128 + 4 * 256) // 6))])
def test_admission_counts_a_blocks_local_layers_as_their_window(budget, expected):
    """Gemma-3-1B's pattern in six layers (four local, window 256), 512-token blocks: ``full`` is counted too."""
    config = EvictionConfig.for_policy("full" if budget is None else "snapkv", **({} if budget is None else {"budget": budget}))
    share = LocalShare(local=4, layers=6, window=256)
    footprint = PrefillFootprint.of(config, BlockScope(512), chunk_size=256, local=share)
    assert footprint.kept_per_block == expected
    assert (PrefillFootprint.of(config, BlockScope(512), 256) is None) == (budget is None)  # without local layers


# Gemma 3's pattern in six layers: four local (window 16), global layers 2 and 5.
SIX_LOCAL = LocalLayers(layers=(0, 1, 3, 4), window=16, observation_window_dense=False)
SIX = SegmentSpec(start=0, end=200, num_layers=6, num_kv_heads=2, num_q_heads=4)


def wrapped_plan(config: EvictionConfig, spec: SegmentSpec = SIX, local: LocalLayers = SIX_LOCAL, seed: int = 5):
    policy = WindowedLocalLayers.wrap(build_policy(config), local)
    compressor = policy.start(spec)
    for layer, stats in enumerate(random_stats(spec, config.common.window, policy.stats_request(), seed=seed)):
        if compressor.observes(layer):
            compressor.observe(layer, stats)
    return compressor, compressor.plan()


@pytest.mark.parametrize("name", ["topk", "snapkv", "ada-snapkv", "lava", "pyramidkv", "ada-pyramidkv", "h2o", "tova"])
def test_the_budget_is_the_global_layers_share_and_local_layers_keep_their_window(name):
    """At 0.25 every policy keeps a quarter of the global layers' KV, however it moves budget between them
    (before, a policy spread it over every layer and local layers' part went to their window)."""
    compressor, plan = wrapped_plan(EvictionConfig.for_policy(name, budget=0.25, window=8))
    counts = plan.counts()
    assert counts[list(SIX_LOCAL.layers)].eq(16).all()
    assert int(counts[[2, 5]].sum()) == 2 * SIX.num_kv_heads * 50  # 25% of 200 per (global layer, KV head)
    assert [compressor.observes(layer) for layer in range(6)] == [False, False, True, False, False, True]


def test_topk_shares_its_budget_between_global_layers_only_and_names_model_layers():
    """topk's one top-k over the global layers; its whole layer (model layer 5) is kept whole, a local whole
    layer is ignored (it keeps its window)."""
    _, plan = wrapped_plan(EvictionConfig.for_policy("topk", budget=0.25, window=8, score="attn"))
    assert int(plan.counts()[[2, 5]].sum()) == 200
    _, whole = wrapped_plan(EvictionConfig.for_policy("topk", budget=0.75, window=8, score="attn", whole_layers=(5, 1)))
    # 0.75 of 2 x 2 x 200: layer 5's 400 whole, layer 2 the other 200 (split over its heads by their scores)
    assert whole.counts()[5].eq(200).all() and int(whole.counts()[2].sum()) == 200 and whole.counts()[1].eq(16).all()


def test_settings_naming_layers_are_renumbered_to_the_layers_a_policy_sees():
    topk = build_policy(EvictionConfig.for_policy("topk", budget=0.25, score="attn", whole_layers=(5, 1, 2)))
    assert topk.for_layers((2, 5)).knobs.whole_layers == (1, 0)  # the listed order kept
    assert topk.for_layers((0, 1, 2, 3, 4, 5)) is topk
    dbudget = build_policy(EvictionConfig.for_policy("dbudget"))
    assert dbudget.for_layers((1, 2)).knobs.dbudget_frozen_layers == (0,)  # model layer 1; layer 0 is not seen


def test_learned_weights_on_global_layers_are_those_layers_maps(tmp_path):
    from conftest_policies import learned_weights_file
    from sgl_kvevict.scoring.learned import LearnedWeights

    path = learned_weights_file(tmp_path, num_layers=6, num_kv_heads=2)
    policy = build_policy(EvictionConfig.for_policy("topk", budget=0.25, score="learned", learned_weights=str(path)))
    on_global = policy.for_layers((2, 5))
    weights = LearnedWeights.load(path)
    assert torch.equal(on_global.scorer.weights.weight, weights.weight[[2, 5]])
    assert torch.equal(on_global.scorer.weights.bias, weights.bias[[2, 5]])
    _, plan = wrapped_plan(EvictionConfig.for_policy("topk", budget=0.25, score="learned", learned_weights=str(path)))
    assert int(plan.counts()[[2, 5]].sum()) == 200 and plan.counts()[list(SIX_LOCAL.layers)].eq(16).all()


@pytest.mark.parametrize("name, knobs", [("full", {}), ("snapkv", {"budget": 0.25}), ("lava", {"budget": 0.25}),
                                         ("topk", {"budget": 0.25, "score": "attn", "whole_layers": (5,)}),
                                         ("topk", {"budget": 0.25, "score": "attn", "whole_layers": (0,)})])  # fmt: skip
def test_admission_counts_at_least_what_a_block_holds_on_a_gemma_3_shape(name, knobs):
    """A 200-token block of the six-layer shape holds no more slots than admission counts for it, for
    policies that move budget between layers too (topk with a whole global layer, or a local one)."""
    config = EvictionConfig.for_policy(name, window=8, **knobs)
    _, plan = wrapped_plan(config)
    held = -(-plan.total_kept() // (SIX.num_layers * SIX.num_kv_heads))
    share = LocalShare(local=len(SIX_LOCAL.layers), layers=SIX.num_layers, window=SIX_LOCAL.window)
    footprint = PrefillFootprint.of(config, BlockScope(SIX.length), chunk_size=64, local=share)
    assert held <= footprint.kept_per_block <= held + 1
