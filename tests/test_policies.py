"""Policies end to end: budgets add up, sinks and windows are kept, short segments are untouched,
plans are deterministic, and each method keeps what its paper says (against scorer outputs ranked
in Python, LAVa's cascade, DBudgetKV's suffix-norm form, a brute-force global top-k)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest_policies import policy_config, random_stats, run_policy
from sgl_kvevict.budget import (
    adaptive_head_counts,
    entropy_layer_budgets,
    rank_candidates,
    reduced_attention_mass,
    score_entropy,
)
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies import SegmentSpec, registered_policies
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring import WindowStats
from sgl_kvevict.settings import ConfigError

WINDOW = 8
SPECS = [
    pytest.param(SegmentSpec(start=0, end=97, num_layers=3, num_kv_heads=3, num_q_heads=3), id="mha"),
    pytest.param(SegmentSpec(start=11, end=130, num_layers=4, num_kv_heads=2, num_q_heads=6), id="gqa-prefix"),
]
BUDGETS = ["0.3", "40t"]
# (policy, score, window): every policy with a fixed budget, and OBCache and question-agnostic
# scores where they apply.
FIXED_BUDGET = [
    ("snapkv", "attn", WINDOW),
    ("snapkv", "obc-joint", WINDOW),
    ("h2o", "attn", WINDOW),
    ("h2o", "obc-key", WINDOW),
    ("tova", "attn", 1),
    ("tova", "obc-value", 1),
    ("pyramidkv", "attn", WINDOW),
    ("ada-snapkv", "attn", WINDOW),
    ("ada-snapkv", "obc-value", WINDOW),
    ("ada-pyramidkv", "attn", WINDOW),
    ("ada-pyramidkv", "obc-key", WINDOW),
    ("lava", "attn", WINDOW),
    ("lava", "kvzip", WINDOW),
    ("lava", "learned", WINDOW),
    ("streaming", "attn", WINDOW),
    ("snapkv", "learned", WINDOW),
    ("pyramidkv", "kvzip", WINDOW),
    ("ada-snapkv", "kvzip", WINDOW),
    ("ada-snapkv", "learned", WINDOW),
    ("topk", "kvzip", WINDOW),
    ("topk", "learned", WINDOW),
    ("topk", "attn", WINDOW),
]
SAME_BUDGET_EVERY_LAYER = {"snapkv", "h2o", "tova", "ada-snapkv", "streaming"}
FIXED_IDS = [f"{policy}-{score}" for policy, score, _ in FIXED_BUDGET]


def candidate_mask(plan: CompressionPlan, layer: int, layout: SegmentLayout) -> torch.Tensor:
    """bool ``[H_kv, n_candidates]``: which candidates ``layer`` keeps."""
    return plan.keep_mask(layer)[:, layout.num_sinks : layout.num_sinks + layout.num_candidates]


def assert_sinks_and_window_kept(plan: CompressionPlan, sink_tokens: int, window: int) -> None:
    """Every (layer, KV head) keeps the positions ``< sink_tokens`` of the segment and its last ``window``."""
    sinks = max(min(sink_tokens, plan.segment_end) - plan.segment_start, 0)
    for layer in range(plan.num_layers):
        mask = plan.keep_mask(layer)
        assert torch.all(mask[:, :sinks]) and torch.all(mask[:, plan.segment_length - window :]), layer


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("policy, score, window", FIXED_BUDGET, ids=FIXED_IDS)
def test_budgets_add_up_and_sinks_and_windows_are_kept(spec, budget, policy, score, window, tmp_path):
    config = policy_config(policy, spec, tmp_path, budget=budget, score=score, window=window)
    plan = run_policy(config, spec)
    per_head = config.budget.per_head(spec.length)
    layout = SegmentLayout.of(spec, config)
    assert layout.compresses and window + layout.num_sinks < per_head < spec.length  # a real compression
    counts = plan.counts()
    assert counts.shape == (spec.num_layers, spec.num_kv_heads)
    assert plan.total_kept() == per_head * spec.num_layers * spec.num_kv_heads
    if policy in SAME_BUDGET_EVERY_LAYER:
        assert counts.sum(1).tolist() == [per_head * spec.num_kv_heads] * spec.num_layers
    assert_sinks_and_window_kept(plan, config.sink_tokens, window)
    for layer in plan.layers:
        assert torch.all((layer.kept_positions >= spec.start) & (layer.kept_positions < spec.end))


def every_policy_config(policy: str, spec: SegmentSpec, weights_dir, **options) -> EvictionConfig:
    """The policy at its defaults (its own default score) with ``options``; no budget for budgetless ones."""
    if policy in ("full", "dbudget"):
        options.pop("budget", None)
    return policy_config(policy, spec, weights_dir, **options)


@pytest.mark.parametrize("spec", [*SPECS, pytest.param(SegmentSpec(2, 90, 2, 2, 4), id="starts-among-sinks")])
@pytest.mark.parametrize("budget", ["0.05", "0.15", "0.3", "0.6", "0.9", "9t", "13t", "40t"])
@pytest.mark.parametrize("sink_tokens", [4, 7])
@pytest.mark.parametrize("policy", sorted(registered_policies()))
def test_every_policy_keeps_the_sinks_at_every_budget(policy, budget, sink_tokens, spec, tmp_path):
    """The sequence's first ``sink_tokens`` positions are never evicted, whatever the budget (also
    when it leaves nothing to select: the segment is then kept whole)."""
    config = every_policy_config(policy, spec, tmp_path, budget=budget, window=WINDOW, sink_tokens=sink_tokens)
    plan = run_policy(config, spec, seed=2)
    assert_sinks_and_window_kept(plan, sink_tokens, WINDOW)


@pytest.mark.parametrize("policy", sorted(set(registered_policies()) - {"full"}))
@pytest.mark.parametrize(
    "length, budget, compresses",
    [
        (37, "0.25", False),  # SmolLM2's "What is the capital of France?" chat at the default budget
        (100, "36t", False),  # budget = window 32 + 4 sinks: nothing left to select
        (100, "37t", True),  # one candidate per head
        (128, "0.25", False),  # 32 = the window alone
        (160, "0.25", True),  # 40 > 36
    ],
)
def test_a_budget_that_leaves_nothing_to_select_keeps_the_segment_whole(policy, length, budget, compresses):
    """Short prompts: a per-head budget at most window + sinks selects nothing, so the segment stays
    dense (it used to keep the window alone and evict the sinks)."""
    spec = SegmentSpec(0, length, 2, 2, 4)
    config = every_policy_config(policy, spec, None, budget=budget, window=32)
    expected = compresses or config.budget is None  # dbudget decides per input: it has candidates
    assert SegmentLayout.of(spec, config).compresses == expected
    if not expected:
        compressor = build_policy(config).start(spec)
        assert not compressor.needs_stats and compressor.plan().total_kept() == length * 2 * 2


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("policy", sorted(registered_policies()))
def test_plans_are_deterministic(spec, policy):
    config = EvictionConfig.for_policy(policy, **({} if policy in ("full", "dbudget") else {"budget": "0.3"}))
    first, second = run_policy(config, spec, seed=3), run_policy(config, spec, seed=3)
    for a, b in zip(first.layers, second.layers):
        assert torch.equal(a.kept_positions, b.kept_positions) and torch.equal(a.head_indptr, b.head_indptr)


@pytest.mark.parametrize("policy", ["snapkv", "ada-snapkv", "lava", "pyramidkv"])
def test_tied_scores_give_a_deterministic_spread_plan(policy):
    """All-equal statistics: every candidate ties; the plan is still deterministic and exact."""
    spec = SegmentSpec(0, 60, 2, 2, 4)
    config = EvictionConfig.for_policy(policy, budget="20t", window=WINDOW)
    built = build_policy(config)
    plans = []
    for _ in range(2):
        compressor = built.start(spec)
        for layer in range(spec.num_layers):
            uniform = torch.full((spec.num_q_heads, spec.end), 1.0)
            value_l1 = torch.ones(spec.num_kv_heads, spec.end)
            compressor.observe(layer, WindowStats(window=WINDOW, attn_sum=uniform, value_l1=value_l1))
        plans.append(compressor.plan())
    assert plans[0].total_kept() == 20 * 2 * 2
    assert [layer.kept_positions.tolist() for layer in plans[0].layers] == [
        layer.kept_positions.tolist() for layer in plans[1].layers
    ]


SHORT_SEGMENT_CASES = {
    "budget-equals-length": (40, "40t", 0),
    "budget-exceeds-length": (30, "64t", 0),
    "only-window": (WINDOW, "0.5", 0),
    "shorter-than-window": (5, "0.5", 0),
    "below-min-length": (100, "0.3", 101),
}


def short_segment_cases():
    """(policy, case) pairs; dbudget has no budget, so only the cases without candidates apply to it."""
    for policy in sorted(registered_policies()):
        for case_id, (length, budget, min_segment_length) in SHORT_SEGMENT_CASES.items():
            if policy == "dbudget" and length > WINDOW and min_segment_length == 0:
                continue
            yield pytest.param(policy, length, budget, min_segment_length, id=f"{policy}-{case_id}")


@pytest.mark.parametrize("policy, length, budget, min_segment_length", list(short_segment_cases()))
def test_short_segments_are_kept_whole(policy, length, budget, min_segment_length):
    options = {"window": WINDOW, "min_segment_length": min_segment_length}
    if policy not in ("full", "dbudget"):
        options["budget"] = budget
    spec = SegmentSpec(start=7, end=7 + length, num_layers=2, num_kv_heads=2, num_q_heads=4)
    compressor = build_policy(EvictionConfig.for_policy(policy, **options)).start(spec)
    assert not compressor.needs_stats
    plan = compressor.plan()  # no observe: nothing is needed
    assert plan.total_kept() == length * 2 * 2
    assert plan.layers[0].head_positions(1).tolist() == list(range(7, 7 + length))


def test_plan_before_every_layer_is_observed_raises():
    spec = SegmentSpec(0, 100, 3, 2, 2)
    policy = build_policy(EvictionConfig.for_policy("snapkv", budget="0.3", window=WINDOW))
    compressor = policy.start(spec)
    compressor.observe(0, random_stats(spec, WINDOW, policy.stats_request(), seed=0)[0])
    with pytest.raises(RuntimeError, match=r"layers \[1, 2\]"):
        compressor.plan()


# ---- what each method keeps ------------------------------------------------------------------------


def observed_scores(config: EvictionConfig, spec: SegmentSpec, seed: int = 0):
    """The policy's own scorer outputs per layer (``[H_kv, n]``), the layout, and the plan."""
    policy = build_policy(config)
    layout = SegmentLayout.of(spec, config)
    stats = random_stats(spec, config.window, policy.stats_request(), seed)
    compressor = policy.start(spec)
    for layer, layer_stats in enumerate(stats):
        compressor.observe(layer, layer_stats)
    scores = [policy.scorer(s, layout.candidate_columns, spec.num_kv_heads, layer) for layer, s in enumerate(stats)]
    return scores, layout, compressor.plan()


def top_entries(scores: torch.Tensor, count: int) -> set[tuple[int, int]]:
    """The ``count`` best (head, offset) pairs of ``[H, n]`` scores, ranked in Python."""
    entries = [(float(scores[h, p]), h, p) for h in range(scores.shape[0]) for p in range(scores.shape[1])]
    return {(h, p) for _, h, p in sorted(entries, key=lambda e: -e[0])[:count]}


def kept_entries(mask: torch.Tensor) -> set[tuple[int, int]]:
    return {(h, p) for h, p in mask.nonzero().tolist()}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "pyramidkv"])
def test_uniform_head_policies_keep_each_heads_top_scores(spec, policy):
    scores, layout, plan = observed_scores(EvictionConfig.for_policy(policy, budget="0.3", window=WINDOW), spec)
    for layer, layer_scores in enumerate(scores):
        mask = candidate_mask(plan, layer, layout)
        counts = mask.sum(1)
        assert int(counts.max() - counts.min()) <= 1  # uniform over heads
        for head in range(spec.num_kv_heads):
            expected = top_entries(layer_scores[head : head + 1], int(counts[head]))
            assert {p for _, p in expected} == set(mask[head].nonzero().flatten().tolist())


@pytest.mark.parametrize("spec", SPECS)
def test_pyramid_layer_budgets_decrease_with_depth(spec):
    plan = run_policy(EvictionConfig.for_policy("pyramidkv", budget="0.3", window=WINDOW), spec)
    per_layer = plan.counts().sum(1).tolist()
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("score", ["attn", "obc-joint"])
def test_ada_kv_without_safeguard_keeps_the_layer_wise_top_k(spec, score):
    """Ada-KV Algorithm 1 (alpha = 0): the layer keeps its best entries over all KV heads."""
    config = EvictionConfig.for_policy("ada-snapkv", budget="0.3", window=WINDOW, alpha=0.0, score=score)
    scores, layout, plan = observed_scores(config, spec, seed=1)
    for layer, layer_scores in enumerate(scores):
        budget = spec.num_kv_heads * layout.selected_per_head
        assert kept_entries(candidate_mask(plan, layer, layout)) == top_entries(layer_scores, budget)


@pytest.mark.parametrize("spec", SPECS)
def test_ada_kv_safeguard_floor(spec):
    config = EvictionConfig.for_policy("ada-snapkv", budget="0.3", window=WINDOW, alpha=0.5)
    _, layout, plan = observed_scores(config, spec, seed=2)
    floor = int(0.5 * layout.selected_per_head)
    assert int(plan.counts().min()) >= floor + WINDOW


def lava_cascade(config: EvictionConfig, spec: SegmentSpec, seed: int) -> tuple[list[torch.Tensor], int]:
    """LAVa Algorithm 2 as the paper runs it: after each prefilled layer, re-split the whole budget
    over the layers so far by entropy and re-compress each lower layer from what it still holds,
    with the same scores (a layer never grows back). Returns the final candidate masks and how many
    re-compressions happened."""
    policy = build_policy(config)
    layout = SegmentLayout.of(spec, config)
    num_heads, num_candidates = spec.num_kv_heads, layout.num_candidates
    total = spec.num_layers * num_heads * layout.selected_per_head
    scores, kept, recompressions = [], [], 0
    for layer, stats in enumerate(random_stats(spec, config.window, policy.stats_request(), seed)):
        scores.append(policy.scorer(stats, layout.candidate_columns, num_heads, layer))
        kept.append(torch.ones(num_heads, num_candidates, dtype=torch.bool))
        budgets = entropy_layer_budgets([score_entropy(s) for s in scores], total, num_heads * num_candidates)
        for lower, budget in enumerate(budgets.tolist()):
            if budget >= int(kept[lower].sum()):
                continue
            sorted_scores, ranked = rank_candidates(scores[lower].masked_fill(~kept[lower], float("-inf")))
            counts = adaptive_head_counts(sorted_scores, budget, config.alpha)
            shrunk = torch.zeros_like(kept[lower])
            for head, count in enumerate(counts.tolist()):
                shrunk[head, ranked[head, :count]] = True
            assert torch.all(kept[lower] | ~shrunk)  # nested: only evicts
            kept[lower] = shrunk
            recompressions += 1
    return kept, recompressions


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_lava_one_shot_equals_its_cascade(spec, seed, alpha):
    config = EvictionConfig.for_policy("lava", budget="0.3", window=WINDOW, alpha=alpha)
    cascade, recompressions = lava_cascade(config, spec, seed)
    assert recompressions >= spec.num_layers  # the cascade really shrank lower layers
    plan = run_policy(config, spec, seed)
    layout = SegmentLayout.of(spec, config)
    for layer, mask in enumerate(cascade):
        assert torch.equal(candidate_mask(plan, layer, layout), mask), layer


def test_lava_moves_budget_between_layers_and_heads():
    spec = SegmentSpec(0, 200, 4, 2, 4)
    plan = run_policy(EvictionConfig.for_policy("lava", budget="0.2", window=WINDOW), spec, seed=5)
    counts = plan.counts()
    assert plan.total_kept() == 40 * 4 * 2
    assert len(set(counts.sum(1).tolist())) > 1 and len(set(counts.flatten().tolist())) > 2


def test_tova_keeps_what_the_last_query_attends_to():
    spec = SegmentSpec(0, 80, 2, 2, 4)
    config = EvictionConfig.for_policy("tova", budget="0.25")
    policy = build_policy(config)
    stats = random_stats(spec, 1, policy.stats_request(), seed=4)
    compressor = policy.start(spec)
    for layer, layer_stats in enumerate(stats):
        compressor.observe(layer, layer_stats)
    plan = compressor.plan()
    for layer, layer_stats in enumerate(stats):
        last_row = layer_stats.tail_attn[:, -1, 4:79].view(2, 2, 75).mean(1)  # candidates: after the 4 sinks
        for head in range(2):
            best = {4 + p for _, p in top_entries(last_row[head : head + 1], 15)}  # 20 - 4 sinks - 1 window
            expected = {0, 1, 2, 3} | best | {79}
            assert set(plan.layers[layer].head_positions(head).tolist()) == expected


def test_streaming_keeps_sinks_and_recent_tokens():
    config = EvictionConfig.for_policy("streaming", budget="20t", window=WINDOW)
    first = run_policy(config, SegmentSpec(0, 100, 2, 2, 2))
    assert first.layers[1].head_positions(1).tolist() == [0, 1, 2, 3] + list(range(84, 100))
    later = run_policy(config, SegmentSpec(2, 100, 2, 2, 2))
    assert later.layers[0].head_positions(0).tolist() == [2, 3] + list(range(82, 100))


# ---- DBudgetKV -------------------------------------------------------------------------------------


def slow_dbudget_kept(mass: list[float], start: int, end: int, window: int, sinks: int, threshold: float) -> list[int]:
    """Algorithm 1 with Eq. 2 as printed (suffix norms, ``Max(Where(ratio <= t))``), the guard, and
    the positional ranking; positions outside the segment or in the window are never evicted."""
    attention = [m**0.5 for m in mass]  # k = 1, one query head: mass = a^2
    order = list(range(max(start, sinks), end - window))
    ascending = order + [p for p in range(end) if p not in order]
    full = sum(a * a for a in attention) ** 0.5
    stop = max(
        i for i in range(len(ascending) + 1) if 1 - sum(attention[p] ** 2 for p in ascending[i:]) ** 0.5 / full <= threshold
    )
    evicted = set(order[: min(stop, len(order))])
    return [p for p in range(start, end) if p not in evicted]


@pytest.mark.parametrize("start, threshold", [(0, 0.01), (0, 0.2), (10, 0.05)])
def test_dbudget_keeps_sinks_and_a_suffix_per_layer(start, threshold):
    spec = SegmentSpec(start, 90, 5, 1, 1)
    config = EvictionConfig.for_policy("dbudget", dbudget_threshold=threshold)
    policy = build_policy(config)
    stats = random_stats(spec, config.window, policy.stats_request(), seed=6)
    compressor = policy.start(spec)
    for layer, layer_stats in enumerate(stats):
        compressor.observe(layer, layer_stats)
    plan = compressor.plan()
    for layer in range(spec.num_layers):
        kept = plan.layers[layer].head_positions(0).tolist()
        if layer in config.dbudget_frozen_layers:
            assert kept == list(range(start, 90))
        else:
            mass = reduced_attention_mass(stats[layer].tail_attn).tolist()
            assert kept == slow_dbudget_kept(mass, start, 90, config.window, config.sink_tokens, threshold)


def test_dbudget_sinks_never_reach_past_the_segment():
    plan = run_policy(EvictionConfig.for_policy("dbudget", dbudget_frozen_layers=()), SegmentSpec(0, 3, 2, 1, 1))
    assert plan.layers[1].head_positions(0).tolist() == [0, 1, 2]


def test_dbudget_heads_share_one_stop_and_larger_thresholds_evict_more():
    spec = SegmentSpec(0, 120, 4, 2, 4)
    kept = []
    for threshold in (0.005, 0.05, 0.3):
        plan = run_policy(EvictionConfig.for_policy("dbudget", dbudget_threshold=threshold), spec, seed=8)
        counts = plan.counts()
        assert torch.all(counts[:, 0:1] == counts)  # every KV head of a layer keeps the same positions
        assert counts[:2].tolist() == [[120, 120], [120, 120]]  # frozen layers 0 and 1
        kept.append(plan.total_kept())
    assert kept[0] >= kept[1] >= kept[2] and kept[0] > kept[2]


# ---- question-agnostic scores: KVzip's global top-k, LAVa's layer budgets -------------------------


def global_ranking(scores: list[torch.Tensor]) -> list[tuple[float, int, int, int]]:
    """(-score, layer, head, offset) of every candidate, best first (ties: earlier layer, head, offset)."""
    return sorted((-float(s[h, p]), layer, h, p) for layer, s in enumerate(scores) for h in range(s.shape[0]) for p in range(s.shape[1]))


def floored_top_k_naively(entries: list[tuple[float, int, int, int]], layers: list[int], total: int, floor: int) -> set[tuple[int, int, int]]:
    """(layer, head, offset) kept of ``layers`` (``entries`` from ``global_ranking``): each layer's best
    ``floor`` entries, then the best of those layers' other entries up to ``total`` in all."""
    ranked = [tuple(entry) for _, *entry in entries if entry[0] in layers]
    floors = {entry for layer in layers for entry in [e for e in ranked if e[0] == layer][:floor]}
    rest = [entry for entry in ranked if entry not in floors]
    return floors | set(rest[: total - len(floors)])


def standardised_naively(scores: torch.Tensor) -> list[list[float]]:
    """``[H, n]`` -> (score - mean) / population standard deviation over the whole layer, in Python floats."""
    values = [float(v) for v in scores.flatten()]
    mean = sum(values) / len(values)
    deviation = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [[(float(v) - mean) / deviation for v in row] for row in scores]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("score", ["kvzip", "learned"])
@pytest.mark.parametrize("budget", ["0.3", "40t"])
@pytest.mark.parametrize("layer_scale, layer_floor", [("raw", 0.0), ("standardised", 0.0), ("raw", 0.5), ("standardised", 0.7), ("raw", 1.0)])
def test_topk_keeps_the_global_top_k_over_every_layer_and_head(spec, score, budget, layer_scale, layer_floor, tmp_path):
    """KVzip's allocation: the kept candidates are the best ``L * H_kv * selected`` (layer, head,
    position) entries of the whole segment, found here by brute force over Python tuples; compared as
    they are (``raw``) or after each layer's scores were standardised over the layer. With a layer
    floor every layer first keeps its own best ``floor(layer_floor * H_kv * selected)`` and the rest
    are the best of what remains."""
    config = policy_config("topk", spec, tmp_path, budget=budget, score=score, window=WINDOW, layer_scale=layer_scale, layer_floor=layer_floor)
    scores, layout, plan = observed_scores(config, spec, seed=4)
    compared = [torch.tensor(standardised_naively(s), dtype=torch.float64) for s in scores] if layer_scale == "standardised" else scores
    entries = global_ranking(compared)
    total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
    floor = math.floor(layer_floor * spec.num_kv_heads * layout.selected_per_head)
    expected = floored_top_k_naively(entries, list(range(spec.num_layers)), total, floor)
    kept = {(layer, h, p) for layer in range(spec.num_layers) for h, p in kept_entries(candidate_mask(plan, layer, layout))}
    assert kept == expected
    per_layer = [sum(1 for entry in kept if entry[0] == layer) for layer in range(spec.num_layers)]
    assert min(per_layer) >= floor
    if layer_floor < 1.0:
        assert len(set(per_layer)) > 1  # the budget really moved between layers
    else:
        assert set(per_layer) == {total // spec.num_layers}  # a whole floor is the even split


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("budget", ["0.3", "0.6"])
@pytest.mark.parametrize("whole_layers, layer_floor", [((0,), 0.0), ((1, 0), 0.5), ((0, 99), 0.0)])
def test_topk_whole_layers_keep_every_candidate_and_the_others_share_the_rest(spec, budget, whole_layers, layer_floor, tmp_path):
    """Layers kept whole count in the budget: the kept candidates are every candidate of those layers
    (in the listed order while the budget lasts) and, of the others, each one's floor then the best of
    what remains, by brute force over Python tuples; indices past the last layer are ignored."""
    config = policy_config("topk", spec, tmp_path, budget=budget, score="kvzip", window=WINDOW,
                           whole_layers=whole_layers, layer_floor=layer_floor)  # fmt: skip
    scores, layout, plan = observed_scores(config, spec, seed=4)
    total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
    entries = global_ranking(scores)
    whole = [layer for layer in whole_layers if layer < spec.num_layers]
    expected = set()
    for layer in whole:
        own = [tuple(entry) for _, *entry in entries if entry[0] == layer][:total]
        expected |= set(own)
        total -= len(own)
    others = [layer for layer in range(spec.num_layers) if layer not in whole]
    floor = min(math.floor(layer_floor * spec.num_kv_heads * layout.selected_per_head), total // len(others))
    expected |= floored_top_k_naively(entries, others, total, floor)
    kept = {(layer, h, p) for layer in range(spec.num_layers) for h, p in kept_entries(candidate_mask(plan, layer, layout))}
    assert kept == expected
    assert len(kept) == spec.num_layers * spec.num_kv_heads * layout.selected_per_head  # the budget, exactly


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("score", ["kvzip", "learned", "attn"])
@pytest.mark.parametrize("quantile", [0.05, 0.15, 0.6])
def test_a_score_threshold_keeps_what_scores_above_it_under_the_budget_cap(spec, score, quantile, tmp_path):
    """topk with ``score_threshold``: the candidates at or above the threshold (rounded down to a whole
    number per (layer, KV head)), never more than the budget keeps (its plan on raw scores: a threshold
    compares raw scores); brute force over Python tuples."""
    plain = policy_config("topk", spec, tmp_path, budget="0.3", score=score, window=WINDOW, layer_scale="raw")
    scores, layout, capped_plan = observed_scores(plain, spec, seed=4)
    ranking = global_ranking(scores)
    threshold = -ranking[int(quantile * len(ranking))][0]
    config = policy_config("topk", spec, tmp_path, budget="0.3", score=score, window=WINDOW, score_threshold=threshold)
    plan = observed_scores(config, spec, seed=4)[2]
    heads = spec.num_layers * spec.num_kv_heads
    above = sum(1 for negated, *_ in ranking if -negated >= threshold)
    total = min(layout.selected_per_head, above // heads) * heads
    expected = {tuple(entry) for _, *entry in ranking[:total]}
    kept = {(layer, h, p) for layer in range(spec.num_layers) for h, p in kept_entries(candidate_mask(plan, layer, layout))}
    assert kept == expected and all(-negated >= threshold for negated, *_ in ranking[:total])
    if above // heads >= layout.selected_per_head:  # the cap binds: the budget's own plan
        assert all(torch.equal(a.kept_positions, b.kept_positions) for a, b in zip(plan.layers, capped_plan.layers))
    assert_sinks_and_window_kept(plan, 4, WINDOW)


@pytest.mark.parametrize("spec", SPECS)
def test_a_score_threshold_sets_how_many_a_balanced_policy_keeps_not_where(spec):
    """snapkv keeps as many candidates as score above the threshold, spread evenly over its heads, each
    head its own best; a threshold above every score keeps the sinks and the window only."""
    scores, layout, _ = observed_scores(EvictionConfig.for_policy("snapkv", budget="0.3", window=WINDOW), spec)
    threshold = float(torch.cat([s.flatten() for s in scores]).quantile(0.9))
    config = EvictionConfig.for_policy("snapkv", budget="0.3", window=WINDOW, score_threshold=threshold)
    plan = observed_scores(config, spec)[2]
    heads = spec.num_layers * spec.num_kv_heads
    per_head = sum(int((s >= threshold).sum()) for s in scores) // heads
    assert 0 < per_head < layout.selected_per_head
    for layer, layer_scores in enumerate(scores):
        mask = candidate_mask(plan, layer, layout)
        assert mask.sum(1).tolist() == [per_head] * spec.num_kv_heads
        for head in range(spec.num_kv_heads):
            assert {p for _, p in top_entries(layer_scores[head : head + 1], per_head)} == set(mask[head].nonzero().flatten().tolist())
    above_all = EvictionConfig.for_policy("snapkv", budget="0.3", window=WINDOW, score_threshold=1e9)
    nothing = observed_scores(above_all, spec)[2]
    assert nothing.total_kept() == heads * (layout.window + layout.num_sinks)
    assert not build_policy(config).plans_each_head_alone()  # tensor parallelism exchanges the scores


@pytest.mark.parametrize("policy", ["streaming", "dbudget", "full"])
def test_a_score_threshold_is_refused_where_nothing_ranks_by_score_under_a_budget(policy):
    with pytest.raises(ConfigError, match="score threshold"):
        EvictionConfig.for_policy(policy, score_threshold=-6.0)


@pytest.mark.parametrize("spec", SPECS)
def test_lava_with_learned_scores_splits_layers_by_the_entropy_of_their_exponential(spec, tmp_path):
    """Learned scores are log KVzip scores: LAVa's layer entropy is that of ``exp(s)`` normalised,
    the same distribution a KVzip score gives (computed here with an explicit exp)."""
    config = policy_config("lava", spec, tmp_path, budget="0.3", score="learned", window=WINDOW)
    scores, layout, plan = observed_scores(config, spec, seed=5)
    entropies = []
    for layer_scores in scores:
        probabilities = layer_scores.double().exp().flatten()
        probabilities = probabilities / probabilities.sum()
        entropies.append(float(-(probabilities * probabilities.log()).sum()))
    total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
    expected = entropy_layer_budgets(entropies, total, spec.num_kv_heads * layout.num_candidates)
    kept_per_layer = [int(candidate_mask(plan, layer, layout).sum()) for layer in range(spec.num_layers)]
    assert kept_per_layer == expected.tolist()


@pytest.mark.parametrize("policy", ["topk", "lava", "ada-snapkv"])
def test_learned_scores_in_pieces_plan_as_one_piece(policy, tmp_path):
    """A chunked prefill hands a learned scorer's hidden states over one forward at a time: scoring each
    piece and pooling at the end keeps exactly what one piece keeps (max pooling crosses the cuts)."""
    spec = SegmentSpec(0, 180, num_layers=3, num_kv_heads=2, num_q_heads=4)
    config = policy_config(policy, spec, tmp_path, score="learned", budget="0.3", pooling="max")
    layers = random_stats(spec, config.window, build_policy(config).stats_request(), seed=3)

    def plan_with_cuts(cuts: list[int]):
        compressor = build_policy(config).start(spec)
        for layer, stats in enumerate(layers):
            for start, end in zip([0, *cuts], [*cuts, spec.end]):
                piece = dataclasses.replace(stats, hidden_states=stats.hidden_states[start:end], hidden_start=start)
                compressor.observe(layer, piece)
        return compressor.plan()

    whole = plan_with_cuts([])
    for cuts in ([64], [3, 90, 150], [150, 170]):  # inside the sinks, the candidates and the window
        chunked = plan_with_cuts(cuts)
        for ours, theirs in zip(chunked.layers, whole.layers):
            assert torch.equal(ours.kept_positions, theirs.kept_positions) and torch.equal(ours.head_indptr, theirs.head_indptr)
    compressor = build_policy(config).start(spec)
    late = dataclasses.replace(layers[0], hidden_states=layers[0].hidden_states[90:], hidden_start=90)
    with pytest.raises(ValueError, match="out of order"):
        compressor.observe(0, late)
