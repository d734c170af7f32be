"""Budget allocators: head splits, layer splits, exact apportionment, DBudgetKV's stopping rule.

Slow references are plain Python over (score, head, rank) tuples; properties are the ones the
papers prove or the library promises (exact totals, caps, nesting, optimality of the global top-k).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest_policies import SCALING, random_window_inputs
from sgl_kvevict.budget import (
    adaptive_head_counts,
    apportion,
    entropy_layer_budgets,
    evicted_prefix_length,
    global_top_k_layer_budgets,
    kept_offsets,
    pyramid_head_budgets,
    rank_candidates,
    reduced_attention_mass,
    score_entropy,
    standardised_per_layer,
    uniform_head_counts,
)
from sgl_kvevict.scoring import StatsRequest, window_stats


def random_scores(num_heads: int, num_candidates: int, seed: int, ties: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_heads, num_candidates, generator=generator) ** 3  # skewed like attention
    return (scores * 4).round() / 4 if ties else scores


def retained_mass(sorted_scores: torch.Tensor, counts) -> float:
    return sum(float(sorted_scores[head, :count].sum()) for head, count in enumerate(counts))


def random_split(total: int, num_heads: int, floor: int, cap: int, rng: random.Random) -> list[int]:
    """A uniformly random per-head split of ``total`` with every head in ``[floor, cap]``."""
    counts = [floor] * num_heads
    for _ in range(total - floor * num_heads):
        counts[rng.choice([h for h in range(num_heads) if counts[h] < cap])] += 1
    return counts


# ---- heads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, num_heads", [(0, 3), (7, 3), (9, 3), (10, 4), (1, 5)])
def test_uniform_head_counts_split_evenly(budget, num_heads):
    counts = uniform_head_counts(budget, num_heads)
    assert int(counts.sum()) == budget and int(counts.max() - counts.min()) <= 1
    assert counts.tolist() == sorted(counts.tolist(), reverse=True)


def test_rank_candidates_is_stable_and_kept_offsets_take_prefixes():
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.2], [0.3, 0.3, 0.3, 0.3]])
    sorted_scores, ranked = rank_candidates(scores)
    assert ranked.tolist() == [[1, 2, 3, 0], [0, 1, 2, 3]]
    assert [t.tolist() for t in kept_offsets(ranked, torch.tensor([2, 3]))] == [[1, 2], [0, 1, 2]]


def slow_adaptive_counts(scores: torch.Tensor, budget: int, alpha: float) -> list[int]:
    """Each head's top floor(alpha * budget / H), then the best remaining (score desc, rank, head)."""
    num_heads, num_candidates = scores.shape
    floor = math.floor(alpha * budget / num_heads)
    entries = []
    for head in range(num_heads):
        ranked = sorted(range(num_candidates), key=lambda p: (-float(scores[head, p]), p))
        entries += [(-float(scores[head, p]), rank, head) for rank, p in enumerate(ranked) if rank >= floor]
    counts = [floor] * num_heads
    for _, _, head in sorted(entries)[: budget - floor * num_heads]:
        counts[head] += 1
    return counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adaptive_head_counts_match_the_slow_global_top_k(seed, alpha):
    num_heads, num_candidates = 2 + seed % 3, 9 + seed
    budget = random.Random(seed).randint(0, num_heads * num_candidates)
    scores = random_scores(num_heads, num_candidates, seed, ties=seed % 2 == 1)
    sorted_scores, _ = rank_candidates(scores)
    counts = adaptive_head_counts(sorted_scores, budget, alpha)
    assert counts.dtype == torch.int64 and int(counts.sum()) == budget
    assert counts.tolist() == slow_adaptive_counts(scores, budget, alpha)


@pytest.mark.parametrize("seed", range(5))
def test_global_top_k_retains_at_least_the_mass_of_any_split(seed):
    """Ada-KV Theorem 3.3: with alpha = 0 no per-head split of the same total keeps more mass; with
    alpha > 0 none of the splits honouring the same floor does."""
    rng = random.Random(seed)
    num_heads, num_candidates = 4, 15
    sorted_scores, _ = rank_candidates(random_scores(num_heads, num_candidates, seed))
    for alpha in (0.0, 0.2):
        budget = rng.randint(1, num_heads * num_candidates - 1)
        floor = math.floor(alpha * budget / num_heads)
        best = retained_mass(sorted_scores, adaptive_head_counts(sorted_scores, budget, alpha).tolist())
        for _ in range(200):
            split = random_split(budget, num_heads, floor, num_candidates, rng)
            assert retained_mass(sorted_scores, split) <= best + 1e-6
        uniform = uniform_head_counts(budget, num_heads).tolist()
        assert retained_mass(sorted_scores, uniform) <= best + 1e-6


def test_adaptive_floor_is_guaranteed_even_to_a_head_with_no_mass():
    scores = torch.stack([torch.linspace(1.0, 0.5, 20), torch.zeros(20)])
    sorted_scores, _ = rank_candidates(scores)
    assert adaptive_head_counts(sorted_scores, 20, 0.0).tolist() == [20, 0]
    assert adaptive_head_counts(sorted_scores, 20, 0.2).tolist() == [18, 2]  # floor(0.2 * 20 / 2) = 2


def test_adaptive_ties_spread_over_heads():
    sorted_scores = torch.ones(3, 4)
    assert adaptive_head_counts(sorted_scores, 5, 0.0).tolist() == [2, 2, 1]


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_selection_is_nested_in_the_budget(seed):
    """Each head's count never shrinks when the layer budget grows (even as the floor grows): the
    property that makes LAVa's cascade equal its one-shot selection."""
    sorted_scores, _ = rank_candidates(random_scores(3, 12, seed, ties=seed % 2 == 0))
    previous = torch.zeros(3, dtype=torch.int64)
    for budget in range(3 * 12 + 1):
        counts = adaptive_head_counts(sorted_scores, budget, 0.2)
        assert torch.all(counts >= previous), budget
        previous = counts


# ---- apportion -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_apportion_is_exact_capped_and_proportional(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 9)
    weights = torch.tensor([rng.random() for _ in range(count)])
    caps = torch.tensor([rng.randint(0, 50) for _ in range(count)])
    total = rng.randint(0, int(caps.sum()))
    units = apportion(total, weights, caps)
    assert int(units.sum()) == total and torch.all(units <= caps) and torch.all(units >= 0)
    # Water-filling: items below their cap share in proportion to their weight, up to rounding.
    open_items = units < caps
    if open_items.any():
        rate = (total - int(units[~open_items].sum())) / float(weights[open_items].sum())
        assert torch.all((units[open_items] - weights[open_items] * rate).abs() < 1 + 1e-9)
        # a full item would have received at least its cap at that rate
        assert torch.all(weights[~open_items] * rate >= caps[~open_items] - 1 - 1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_apportion_never_gives_more_when_an_item_joins(seed):
    """Divisor rounding: adding an item with the same total never raises another item's units
    (largest remainder would: the new-states paradox)."""
    rng = random.Random(seed)
    weights = torch.tensor([rng.random() + 0.05 for _ in range(10)])
    caps = torch.tensor([rng.randint(20, 60) for _ in range(10)])
    total = rng.randint(10, int(caps[:1].sum()))
    previous = apportion(total, weights[:1], caps[:1])
    for count in range(2, 11):
        units = apportion(total, weights[:count], caps[:count])
        assert torch.all(units[: count - 1] <= previous), count
        previous = units


def test_apportion_zero_weights():
    caps = torch.tensor([5, 5, 5, 5])
    assert apportion(7, torch.tensor([1.0, 0.0, 3.0, 0.0]), caps).tolist() == [2, 0, 5, 0]
    assert apportion(13, torch.tensor([1.0, 0.0, 3.0, 0.0]), caps).tolist() == [5, 2, 5, 1]
    assert apportion(6, torch.zeros(4), caps).tolist() == [2, 2, 1, 1]


# ---- layers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base, num_layers, num_candidates, beta",
    [(96, 32, 1000, 20), (55, 4, 300, 20), (30, 7, 45, 5), (10, 1, 50, 20), (0, 3, 10, 20), (3, 9, 40, 20)],
)
def test_pyramid_budgets_add_up_and_decrease(base, num_layers, num_candidates, beta):
    budgets = pyramid_head_budgets(base, num_layers, num_candidates, beta)
    assert int(budgets.sum()) == num_layers * base
    assert budgets.tolist() == sorted(budgets.tolist(), reverse=True)
    assert int(budgets.max()) <= num_candidates
    if num_layers > 1 and 2 * base - base // beta <= num_candidates:
        assert abs(int(budgets[0]) - (2 * base - base // beta)) <= 1  # docs/methods/baselines.md#pyramidkv-schedule: max_num
        assert abs(int(budgets[-1]) - base // beta) <= 1  # min_num


def test_pyramid_first_layer_is_clamped_to_the_candidates():
    budgets = pyramid_head_budgets(30, 7, 45, 5)
    assert int(budgets[0]) == 45 and abs(int(budgets[-1]) - 15) <= 1  # min = 2 * 30 - 45


def test_score_entropy_matches_the_formula():
    scores = random_scores(3, 11, seed=4)
    probabilities = [float(x) / float(scores.sum()) for x in scores.flatten()]
    expected = -sum(p * math.log(p) for p in probabilities if p > 0)
    assert score_entropy(scores) == pytest.approx(expected, rel=1e-6)
    assert score_entropy(torch.ones(2, 8)) == pytest.approx(math.log(16))
    assert score_entropy(torch.zeros(2, 8)) == 0.0


def test_score_entropy_of_log_scores_is_the_entropy_of_their_exponential():
    """Learned scores are logs: their distribution is exp(s) normalised (a softmax), so a log score
    and its exponential have one entropy, and shifting log scores (scaling the scores) changes nothing."""
    scores = random_scores(3, 40, seed=4) + 1e-3
    probabilities = scores.double().flatten() / scores.double().sum()
    expected = float(-(probabilities * probabilities.log()).sum())
    assert score_entropy(scores.log(), log_scores=True) == pytest.approx(expected, rel=1e-9)
    assert score_entropy(scores.double().log() + 30.0, log_scores=True) == pytest.approx(expected, rel=1e-9)
    assert score_entropy(torch.full((2, 8), -50.0), log_scores=True) == pytest.approx(math.log(16))


@pytest.mark.parametrize("seed, ties", [(0, False), (1, True), (2, True)])
@pytest.mark.parametrize("total", [0, 1, 37, 120])
def test_global_top_k_layer_budgets_count_the_best_entries_of_each_layer(seed, ties, total):
    """Against a Python sort of (score, layer, head, position): ties go to the lower layer."""
    layer_scores = [random_scores(3, 10, seed=seed * 10 + layer, ties=ties) for layer in range(4)]
    entries = sorted(
        (-float(scores[h, p]), layer, h, p)
        for layer, scores in enumerate(layer_scores)
        for h in range(3)
        for p in range(10)
    )
    expected = [sum(1 for _, layer, _, _ in entries[:total] if layer == i) for i in range(4)]
    assert global_top_k_layer_budgets(layer_scores, total).tolist() == expected


@pytest.mark.parametrize("seed, ties", [(0, False), (1, True)])
@pytest.mark.parametrize("total, floor", [(40, 10), (40, 3), (37, 9), (120, 30), (0, 0)])
def test_a_layer_floor_keeps_each_layers_best_first_and_the_global_best_of_the_rest(seed, ties, total, floor):
    """Against Python sorts: every layer's ``floor`` best (score, head, position), then the best
    ``total - L floor`` of the remaining entries of all layers (ties to the lower layer)."""
    layer_scores = [random_scores(3, 10, seed=seed * 10 + layer, ties=ties) for layer in range(4)]
    own = [sorted((-float(s[h, p]), h, p) for h in range(3) for p in range(10)) for s in layer_scores]
    rest = sorted((entry[0], layer) for layer, ranking in enumerate(own) for entry in ranking[floor:])
    expected = [floor + sum(1 for _, layer in rest[: total - 4 * floor] if layer == i) for i in range(4)]
    budgets = global_top_k_layer_budgets(layer_scores, total, floor)
    assert budgets.tolist() == expected and int(budgets.sum()) == total and min(budgets.tolist()) >= floor
    if 4 * floor == total:
        assert budgets.tolist() == [floor] * 4  # a floor of the whole even share is the even split


def test_entropy_layer_budgets_are_proportional_exact_and_capped():
    budgets = entropy_layer_budgets([1.0, 2.0, 1.0], total=40, candidates_per_layer=100)
    assert budgets.tolist() == [10, 20, 10]
    capped = entropy_layer_budgets([1.0, 8.0, 1.0], total=60, candidates_per_layer=30)
    assert capped.tolist() == [15, 30, 15]  # the surplus of the capped layer goes to the others


# ---- DBudgetKV -------------------------------------------------------------------------------------


def slow_reduced_mass(tail_attn: torch.Tensor) -> list[float]:
    """Eq. 1 per head (mean over the last k rows that see p), heads joined by the Frobenius norm."""
    num_heads, rows, context = tail_attn.shape
    mass = []
    for p in range(context):
        total = 0.0
        for h in range(num_heads):
            seeing = [r for r in range(rows) if context - rows + r >= p]
            mean = sum(float(tail_attn[h, r, p]) for r in seeing) / len(seeing)
            total += mean**2
        mass.append(total)
    return mass


@pytest.mark.parametrize("rows", [1, 3])
def test_reduced_attention_mass_matches_eq_1(rows):
    q_window, keys, values = random_window_inputs(4, 2, 10, 4, seed=rows)
    tail = window_stats(q_window, keys, values, SCALING, StatsRequest(tail_rows=rows)).tail_attn
    assert reduced_attention_mass(tail).tolist() == pytest.approx(slow_reduced_mass(tail), rel=1e-5)


def slow_suffix_norm_stop(attention: list[float], eviction_order: list[int], threshold: float) -> int:
    """DBudgetKV Eq. 2 as printed: order positions by ascending importance, take the norm of every
    suffix, ``ratio[i] = 1 - ||suffix_i|| / ||a||``, ``I = max{i : ratio[i] <= t}``; guard: never past
    the evictable positions."""
    never_evicted = [p for p in range(len(attention)) if p not in eviction_order]
    ascending = eviction_order + never_evicted
    full_norm = math.sqrt(sum(x * x for x in attention))
    stop = 0
    for i in range(len(ascending) + 1):
        suffix_norm = math.sqrt(sum(attention[p] ** 2 for p in ascending[i:]))
        if 1 - suffix_norm / full_norm <= threshold:
            stop = i
    return min(stop, len(eviction_order))


@pytest.mark.parametrize("seed", range(40))
def test_dbudget_closed_form_equals_the_suffix_sum_form(seed):
    rng = random.Random(seed)
    context = rng.randint(6, 40)
    logits = torch.randn(context, generator=torch.Generator().manual_seed(seed)) * rng.choice([0.5, 2.0, 4.0])
    attention = torch.softmax(logits.double(), 0)
    start = rng.randint(0, context // 2)  # a prefix before the segment is never evicted
    window = rng.randint(1, 4)
    sinks = rng.choice([0, 4])
    eviction_order = list(range(max(start, sinks), context - window))
    threshold = rng.choice([0.01, 0.05, 0.2, 0.5])
    fast = evicted_prefix_length(attention.square(), torch.tensor(eviction_order, dtype=torch.int64), threshold)
    assert fast == slow_suffix_norm_stop(attention.tolist(), eviction_order, threshold)


def test_dbudget_threshold_is_monotone():
    attention = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)) * 0.5, 0)
    order = torch.arange(4, 49)
    stops = [evicted_prefix_length(attention.square(), order, t) for t in (0.001, 0.01, 0.1, 0.5, 0.99)]
    assert stops == sorted(stops) and stops[0] < stops[-1] == len(order)


def test_standardised_per_layer_scores_have_mean_0_and_deviation_1_and_keep_each_layer_order():
    """Per layer over every head and candidate; the order inside a layer is unchanged, so a layer's heads
    split its budget as before; a layer of equal scores becomes all 0 (no division by zero)."""
    layer_scores = [random_scores(3, 10, seed=layer) * (layer + 1) - 5 * layer for layer in range(3)]
    layer_scores.append(torch.full((3, 10), -7.0))
    scaled = standardised_per_layer(layer_scores)
    for raw, z in zip(layer_scores[:3], scaled[:3]):
        assert float(z.mean()) == pytest.approx(0.0, abs=1e-12)
        assert float(z.std(correction=0)) == pytest.approx(1.0, rel=1e-12)
        assert torch.equal(torch.argsort(raw.flatten(), stable=True), torch.argsort(z.flatten(), stable=True))
    assert torch.equal(scaled[3], torch.zeros(3, 10, dtype=torch.float64))
