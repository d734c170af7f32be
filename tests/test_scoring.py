"""Window statistics and scorers against slow loop implementations of the papers' formulas.

Loops run in float64 over (query head, window query, key position); the library runs vectorised
in fp32. Shapes are odd on purpose, MHA and GQA, with the window at the end of a longer context
and covering the whole context, and candidates that start after a prefix.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest_policies import SCALING, random_window_inputs
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.scoring import (
    LastQueryScorer,
    LavaScorer,
    OBCacheScorer,
    Reduction,
    StatsRequest,
    WindowAttentionScorer,
    scorer_for,
    window_stats,
)

ALL = StatsRequest(attn_sum=True, attn_max=True, tail_rows=2, obc_value=True, obc_key=True, obc_joint=True, value_l1=True)

# (H_q, H_kv, context L, window w)
SHAPES = [
    pytest.param(3, 3, 13, 5, id="mha"),
    pytest.param(6, 2, 17, 4, id="gqa"),
    pytest.param(4, 2, 6, 6, id="window-is-whole-context"),
    pytest.param(5, 1, 11, 2, id="mqa-short-window"),
]


def slow_attention(q_window, keys, values, scaling):
    """Loop form of A, Z (0 where masked) and o_i, float64: ``[H_q, w, L]``, ``[H_q, w, L]``, ``[H_q, w, D]``."""
    q, k, v = q_window.double(), keys.double(), values.double()
    num_q_heads, window, _ = q.shape
    num_kv_heads, context, _ = k.shape
    group = num_q_heads // num_kv_heads
    probs = torch.zeros(num_q_heads, window, context, dtype=torch.float64)
    logits = torch.zeros_like(probs)
    outputs = torch.zeros(num_q_heads, window, q.shape[-1], dtype=torch.float64)
    for h in range(num_q_heads):
        g = h // group
        for i in range(window):
            visible = context - window + i + 1  # query at position L - w + i sees keys 0 .. L - w + i
            z = [scaling * float(q[h, i] @ k[g, p]) for p in range(visible)]
            top = max(z)
            exps = [math.exp(value - top) for value in z]
            total = sum(exps)
            for p in range(visible):
                probs[h, i, p] = exps[p] / total
                logits[h, i, p] = z[p]
                outputs[h, i] += probs[h, i, p] * v[g, p]
    return probs, logits, outputs


def slow_stats(q_window, keys, values, scaling, tail_rows):
    """The papers' formulas, one (h, p) at a time; OBCache joint in its additive form (Eq. 6)."""
    probs, logits, outputs = slow_attention(q_window, keys, values, scaling)
    v = values.double()
    num_q_heads, window, context = probs.shape
    group = num_q_heads // v.shape[0]
    stats = {
        name: torch.zeros(num_q_heads, context, dtype=torch.float64)
        for name in ("attn_sum", "obc_value", "obc_key", "obc_joint")
    }
    for h in range(num_q_heads):
        for p in range(context):
            vp = v[h // group, p]
            for i in range(window):
                a, z, o = probs[h, i, p], logits[h, i, p], outputs[h, i]
                stats["attn_sum"][h, p] += a
                stats["obc_value"][h, p] += a**2 * vp.square().sum()
                stats["obc_key"][h, p] += a**2 * z**2 * (vp - o).square().sum()
                stats["obc_joint"][h, p] += 2 * a**2 * z * (vp.square().sum() - vp @ o)
            stats["obc_joint"][h, p] += stats["obc_value"][h, p] + stats["obc_key"][h, p]
    stats["tail_attn"] = probs[:, window - tail_rows :]
    stats["attn_max"] = probs.amax(1)
    stats["value_l1"] = torch.tensor(
        [[float(v[g, p].abs().sum()) for p in range(context)] for g in range(v.shape[0])], dtype=torch.float64
    )
    return stats


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window", SHAPES)
def test_window_stats_match_the_paper_formulas(num_q_heads, num_kv_heads, context, window):
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=context)
    stats = window_stats(q_window, keys, values, SCALING, ALL)
    expected = slow_stats(q_window, keys, values, SCALING, tail_rows=2)
    for name, slow in expected.items():
        fast = getattr(stats, name)
        assert fast.dtype == torch.float32, name
        scale = slow.abs().max()
        torch.testing.assert_close(fast.double(), slow, rtol=1e-4, atol=1e-5 * float(scale), msg=name)


def test_window_stats_are_causal_inside_the_window():
    q_window, keys, values = random_window_inputs(4, 2, 12, 5, seed=3)
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(tail_rows=5))
    rows = stats.tail_attn  # [H_q, 5, 12]: every window query
    for i in range(5):
        own_position = 12 - 5 + i
        assert torch.all(rows[:, i, own_position + 1 :] == 0)
        assert torch.all(rows[:, i, : own_position + 1] > 0)
    torch.testing.assert_close(rows.sum(-1), torch.ones(4, 5))


def test_window_stats_in_query_chunks_equal_one_pass(monkeypatch):
    """Chunking the queries (a reconstruction pass has thousands) changes memory, not the result."""
    from sgl_kvevict.scoring import window as window_module

    q_window, keys, values = random_window_inputs(6, 2, 23, 9, seed=5)
    kept = torch.rand(2, 23, generator=torch.Generator().manual_seed(1)) < 0.6
    kept[:, -9:] = True
    one_pass = window_stats(q_window, keys, values, SCALING, ALL, kept=kept)
    monkeypatch.setattr(window_module, "QUERY_CHUNK", 2)
    chunked = window_stats(q_window, keys, values, SCALING, ALL, kept=kept)
    for name in window_module.COLUMN_STATS:
        torch.testing.assert_close(getattr(chunked, name), getattr(one_pass, name), rtol=1e-5, atol=1e-6, msg=name)


def test_window_stats_create_every_tensor_on_the_inputs_device():
    """The engines call this on CUDA tensors: on the meta device, any tensor made on the CPU by mistake
    (a torch.arange without device=) meets a meta tensor and raises."""
    q_window, keys, values = (t.to("meta") for t in random_window_inputs(4, 2, 12, 5, seed=3))
    kept = torch.ones(2, 12, dtype=torch.bool, device="meta")
    stats = window_stats(q_window, keys, values, SCALING, ALL, kept=kept)
    assert stats.attn_sum.device.type == stats.tail_attn.device.type == "meta"


def test_window_stats_compute_only_what_is_requested():
    q_window, keys, values = random_window_inputs(2, 1, 9, 3, seed=1)
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(obc_key=True))
    assert stats.obc_key is not None
    assert stats.attn_sum is None and stats.obc_value is None and stats.obc_joint is None and stats.tail_attn is None


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(3, 3), (6, 2)])
def test_obcache_value_score_is_the_exact_output_error_of_zeroing_the_value(num_q_heads, num_kv_heads):
    """OBCache Prop. 3.3: O is linear in V, so sum_i A^2 ||v_p||^2 is ||dO||_F^2 exactly; with GQA
    (Eq. 33) the group's summed error is the KV head's score."""
    context, window = 15, 4
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=7)
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(obc_value=True))
    scores = OBCacheScorer("obc-value", Reduction(gqa="sum", pooling="none"))(stats, slice(0, context), num_kv_heads)

    _, _, outputs = slow_attention(q_window, keys, values, SCALING)
    group = num_q_heads // num_kv_heads
    for g in range(num_kv_heads):
        for p in range(context):
            pruned = values.clone()
            pruned[g, p] = 0
            _, _, pruned_outputs = slow_attention(q_window, keys, pruned, SCALING)
            error = (pruned_outputs - outputs)[g * group : (g + 1) * group].square().sum()
            assert float(scores[g, p]) == pytest.approx(float(error), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("score, perturb_values", [("obc-key", False), ("obc-joint", True)])
def test_obcache_key_and_joint_scores_are_the_second_order_output_error(score, perturb_values):
    """OBCache Prop. 3.4/3.5: shrinking k_p (and v_p) by a factor 1 - eps changes the window outputs
    by eps^2 * S_p to second order."""
    num_q_heads, num_kv_heads, context, window, eps = 4, 2, 11, 3, 1e-3
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=5)
    keys, values = keys.double(), values.double()
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(**{score.replace("-", "_"): True}))
    scores = OBCacheScorer(score, Reduction(gqa="sum", pooling="none"))(stats, slice(0, context), num_kv_heads)

    _, _, outputs = slow_attention(q_window, keys, values, SCALING)
    group = num_q_heads // num_kv_heads
    errors = torch.zeros(num_kv_heads, context, dtype=torch.float64)
    for g in range(num_kv_heads):
        for p in range(context):
            keys_shrunk, values_shrunk = keys.clone(), values.clone()
            keys_shrunk[g, p] *= 1 - eps
            if perturb_values:
                values_shrunk[g, p] *= 1 - eps
            _, _, shrunk = slow_attention(q_window, keys_shrunk, values_shrunk, SCALING)
            errors[g, p] = (shrunk - outputs)[g * group : (g + 1) * group].square().sum() / eps**2
    torch.testing.assert_close(scores.double(), errors, rtol=2e-2, atol=2e-2 * float(errors.max()))


def assert_scores_close(fast: torch.Tensor, slow: torch.Tensor) -> None:
    """fp32 library scores against float64 loops."""
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast.double(), slow, rtol=1e-4, atol=1e-6 * float(slow.abs().max()))


def slow_pool(row: list[float], how: str, kernel: int) -> list[float]:
    half = kernel // 2
    pooled = []
    for p in range(len(row)):
        neighbours = [row[j] for j in range(p - half, p + half + 1) if 0 <= j < len(row)]
        # avg_pool1d counts the zero padding (as kvpress does), so edges divide by the full kernel
        pooled.append(max(neighbours) if how == "max" else sum(neighbours) / kernel)
    return pooled


def slow_reduce(per_query_head: list[list[float]], num_kv_heads: int, how: str) -> list[list[float]]:
    group = len(per_query_head) // num_kv_heads
    reduce = {"mean": lambda xs: sum(xs) / len(xs), "max": max, "sum": sum}[how]
    positions = range(len(per_query_head[0]))
    return [
        [reduce([per_query_head[h][p] for h in range(g * group, (g + 1) * group)]) for p in positions]
        for g in range(num_kv_heads)
    ]


def slow_kv_scores(per_query_head, num_kv_heads, gqa, pooling, kernel) -> torch.Tensor:
    """GQA reduction, then pooling per KV head (the Ada-KV code's order)."""
    reduced = slow_reduce(per_query_head, num_kv_heads, gqa)
    if pooling != "none":
        reduced = [slow_pool(row, pooling, kernel) for row in reduced]
    return torch.tensor(reduced, dtype=torch.float64)


# (H_q, H_kv, context, window, candidate start): candidates are [start, L - w)
SEGMENTS = [
    pytest.param(3, 3, 19, 4, 0, id="mha-no-prefix"),
    pytest.param(6, 2, 23, 5, 7, id="gqa-prefix"),
    pytest.param(4, 1, 14, 3, 9, id="mqa-two-candidates"),
]


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window, start", SEGMENTS)
@pytest.mark.parametrize("gqa, pooling, kernel", [("mean", "max", 7), ("max", "avg", 3), ("sum", "none", 7)])
def test_window_attention_scorer(num_q_heads, num_kv_heads, context, window, start, gqa, pooling, kernel):
    """SnapKV/H2O/Ada-KV: mean over the window queries of A[h, i, p], GQA-reduced, pooled."""
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=start)
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(attn_sum=True))
    scores = WindowAttentionScorer(Reduction(gqa, pooling, kernel))(stats, slice(start, context - window), num_kv_heads)

    probs, _, _ = slow_attention(q_window, keys, values, SCALING)
    per_query_head = [
        [sum(float(probs[h, i, p]) for i in range(window)) / window for p in range(start, context - window)]
        for h in range(num_q_heads)
    ]
    assert scores.shape == (num_kv_heads, context - window - start)
    assert_scores_close(scores, slow_kv_scores(per_query_head, num_kv_heads, gqa, pooling, kernel))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window, start", SEGMENTS)
def test_last_query_scorer(num_q_heads, num_kv_heads, context, window, start):
    """TOVA: the attention of the most recent query only."""
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=1 + start)
    stats = window_stats(q_window, keys, values, SCALING, StatsRequest(tail_rows=1))
    scores = LastQueryScorer(Reduction("mean", "none"))(stats, slice(start, context - window), num_kv_heads)

    probs, _, _ = slow_attention(q_window, keys, values, SCALING)
    candidates = range(start, context - window)
    per_query_head = [[float(probs[h, window - 1, p]) for p in candidates] for h in range(num_q_heads)]
    assert_scores_close(scores, slow_kv_scores(per_query_head, num_kv_heads, "mean", "none", 1))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window, start", SEGMENTS)
@pytest.mark.parametrize("gqa, pooling", [("max", "max"), ("mean", "max"), ("mean", "avg")])
def test_lava_scorer(num_q_heads, num_kv_heads, context, window, start, gqa, pooling):
    """LAVa Eq. 5: pool(mean_i A) per query head, times the KV head's max L1 value norm over the
    candidates, then GQA (pooling before GQA: with gqa=mean this order is observable)."""
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=2 + start)
    stats = window_stats(q_window, keys, values, SCALING, LavaScorer.request)
    scores = LavaScorer(Reduction(gqa, pooling, 7))(stats, slice(start, context - window), num_kv_heads)

    probs, _, _ = slow_attention(q_window, keys, values, SCALING)
    group = num_q_heads // num_kv_heads
    candidates = range(start, context - window)
    max_value_norm = [max(float(values[g, p].abs().sum()) for p in candidates) for g in range(num_kv_heads)]
    per_query_head = []
    for h in range(num_q_heads):
        mean_attention = [sum(float(probs[h, i, p]) for i in range(window)) / window for p in candidates]
        per_query_head.append([x * max_value_norm[h // group] for x in slow_pool(mean_attention, pooling, 7)])
    assert_scores_close(scores, torch.tensor(slow_reduce(per_query_head, num_kv_heads, gqa), dtype=torch.float64))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window, start", SEGMENTS)
@pytest.mark.parametrize("score", ["obc-value", "obc-key", "obc-joint"])
def test_obcache_scorer_sums_the_group_then_pools(num_q_heads, num_kv_heads, context, window, start, score):
    """OBCache Eq. 33-35 (GQA-aware sum over the group), max-pooled as in SnapKV."""
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=3 + start)
    stats = window_stats(q_window, keys, values, SCALING, ALL)
    config = EvictionConfig.for_policy("snapkv", score=score)
    scorer = scorer_for(config)
    assert isinstance(scorer, OBCacheScorer) and config.gqa == "sum"
    scores = scorer(stats, slice(start, context - window), num_kv_heads)

    slow = slow_stats(q_window, keys, values, SCALING, tail_rows=1)[score.replace("-", "_")]
    per_query_head = [[float(slow[h, p]) for p in range(start, context - window)] for h in range(num_q_heads)]
    assert_scores_close(scores, slow_kv_scores(per_query_head, num_kv_heads, "sum", "max", 7))


@pytest.mark.parametrize(
    "policy, scorer_type, request_fields",
    [
        ("snapkv", WindowAttentionScorer, {"attn_sum"}),
        ("h2o", WindowAttentionScorer, {"attn_sum"}),
        ("tova", LastQueryScorer, {"tail_rows"}),
        ("lava", LavaScorer, {"attn_sum", "value_l1"}),
    ],
)
def test_policies_request_only_the_statistics_their_scorer_reads(policy, scorer_type, request_fields):
    built = build_policy(EvictionConfig.for_policy(policy))
    assert isinstance(built.scorer, scorer_type)
    request = built.stats_request()
    assert {name for name, value in vars(request).items() if value and name != "queries"} == request_fields
    assert request.queries == "window"
