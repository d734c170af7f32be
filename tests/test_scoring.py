"""Window and reconstruction statistics and scorers against slow loop implementations of the formulas.

Loops run in float64 over (query head, window query, key position); the library runs vectorised
in fp32. Shapes are odd on purpose, MHA and GQA, with the window at the end of a longer context
and covering the whole context, and candidates that start after a prefix.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest_policies import HEAD_DIM, SCALING, random_window_inputs
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.scoring import (
    KVzipScorer,
    LastQueryScorer,
    LavaScorer,
    LearnedScorer,
    OBCacheScorer,
    Reduction,
    StatsRequest,
    WindowAttentionScorer,
    WindowStats,
    scorer_for,
    window_stats,
)
from sgl_kvevict.scoring.kvzip import (
    FIRST_INSTRUCTION,
    LATER_INSTRUCTION,
    MIN_CHUNK_TOKENS,
    NoRoomForPasses,
    ReconstructionPrompt,
    merge_chunk_stats,
    reconstruction_chunks,
    reconstruction_stats,
)
from sgl_kvevict.scoring.learned import LearnedWeights
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES

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
    scores = OBCacheScorer("obc-value", Reduction(gqa="sum", pooling="none"))(stats, slice(0, context), num_kv_heads, 0)

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
    scores = OBCacheScorer(score, Reduction(gqa="sum", pooling="none"))(stats, slice(0, context), num_kv_heads, 0)

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
    scores = WindowAttentionScorer(Reduction(gqa, pooling, kernel))(stats, slice(start, context - window), num_kv_heads, 0)

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
    scores = LastQueryScorer(Reduction("mean", "none"))(stats, slice(start, context - window), num_kv_heads, 0)

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
    scores = LavaScorer(Reduction(gqa, pooling, 7))(stats, slice(start, context - window), num_kv_heads, 0)

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
    scorer = scorer_for(config.common, config.score_knobs)
    assert isinstance(scorer, OBCacheScorer) and config.gqa == "sum"
    scores = scorer(stats, slice(start, context - window), num_kv_heads, 0)

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
        ("lava:kvzip", KVzipScorer, {"attn_max"}),
        ("topk", KVzipScorer, {"attn_max"}),
        ("ada-snapkv:learned", LearnedScorer, {"hidden_states"}),
    ],
)
def test_policies_request_only_the_statistics_their_scorer_reads(policy, scorer_type, request_fields):
    name, _, score = policy.partition(":")
    built = build_policy(EvictionConfig.for_policy(name, **({"score": score} if score else {})))
    assert isinstance(built.scorer, scorer_type)
    request = built.stats_request()
    assert {name for name, value in vars(request).items() if value and name != "queries"} == request_fields
    assert request.queries == ("reconstruction" if scorer_type is KVzipScorer else "window")


# ---- KVzip: reconstruction input, statistics, scorer ------------------------------------------------


class CharTokenizer:
    """Duck-typed tokenizer: one id per character (its code point), a ChatML-like template."""

    chat_template = "chatml"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt, **kwargs):
        rendered = "".join(f"<{m['role']}>{m['content']}</>" for m in conversation)
        return rendered + ("<assistant>" if add_generation_prompt else "")


def test_reconstruction_prompt_from_a_duck_typed_tokenizer():
    prompt = ReconstructionPrompt.from_tokenizer(CharTokenizer(), chunk_size=5, overlap=2)
    assert prompt.first_instruction == tuple(ord(c) for c in FIRST_INSTRUCTION)
    assert prompt.later_instruction == tuple(ord(c) for c in LATER_INSTRUCTION)
    assert prompt.assistant_opening == tuple(ord(c) for c in "</><assistant>")
    no_template = CharTokenizer()
    no_template.chat_template = None
    assert ReconstructionPrompt.from_tokenizer(no_template).assistant_opening == (ord("\n"),)


@pytest.mark.parametrize("length, chunk_size, overlap", [(12, 5, 2), (10, 5, 2), (4, 5, 2), (7, 3, 0), (6, 3, 3)])
def test_reconstruction_chunks_cover_the_segment_with_overlapping_instructions(length, chunk_size, overlap):
    prompt = ReconstructionPrompt((1, 1), (2, 2, 2), (9,), chunk_size, overlap)
    start = 100
    ids = list(range(1000, 1000 + length))
    chunks = reconstruction_chunks(ids, start, prompt)
    assert len(chunks) == -(-length // chunk_size)
    for k, chunk in enumerate(chunks):
        first, last = k * chunk_size, min((k + 1) * chunk_size, length)
        assert (chunk.context_start, chunk.context_end) == (start + first, start + last)
        repeated = tuple(ids[first:last])
        if k == 0:
            assert chunk.input_ids == (1, 1, 9) + repeated
        else:
            previous_tail = tuple(ids[first - overlap : first])
            assert chunk.input_ids == (2, 2, 2) + previous_tail + (9,) + repeated
    assert sum(chunk.context_end - chunk.context_start for chunk in chunks) == length


def test_reconstruction_chunks_shrink_to_end_within_the_context_length():
    """Passes are fed from the segment end on: near the model's context length the chunks shrink so that
    every pass ends within it, and a segment with no room for a minimum pass raises."""
    prompt = ReconstructionPrompt((1, 1), (2, 2, 2), (9,), chunk_size=2048, overlap=8)
    assert prompt.fixed_tokens == 3 + 8 + 1
    start, length, limit = 1000, 3000, 4200
    chunks = reconstruction_chunks(list(range(length)), start, prompt, position_limit=limit)
    size = limit - (start + length) - prompt.fixed_tokens
    assert [c.context_end - c.context_start for c in chunks[:-1]] == [size] * (len(chunks) - 1)
    assert sum(c.context_end - c.context_start for c in chunks) == length
    assert max(start + length + len(c.input_ids) for c in chunks) == limit
    far = reconstruction_chunks(list(range(length)), start, prompt, position_limit=start + length + 2048 + 12)
    assert len(far) == 2  # room for the configured chunk size: unchanged
    enough = start + length + prompt.fixed_tokens + MIN_CHUNK_TOKENS
    assert reconstruction_chunks(list(range(length)), start, prompt, position_limit=enough)
    with pytest.raises(NoRoomForPasses, match="ending at 4000 leaves 63 positions"):
        reconstruction_chunks(list(range(length)), start, prompt, position_limit=enough - 1)


def test_reconstruction_prompt_rejects_an_overlap_longer_than_a_chunk():
    with pytest.raises(ValueError, match="overlap 9"):
        ReconstructionPrompt((), (), (), chunk_size=8, overlap=9)


def slow_reconstruction_attention(queries, context_keys, chunk_keys, kept, scaling):
    """Loop form of the contract: chunk query i (position end + i) attends to the kept keys of
    [0, end) and chunk keys 0..i; returns A over the context columns only, float64 ``[H_q, m, end]``."""
    num_q_heads, chunk_length, _ = queries.shape
    num_kv_heads, end, _ = context_keys.shape
    group = num_q_heads // num_kv_heads
    probs = torch.zeros(num_q_heads, chunk_length, end, dtype=torch.float64)
    for h in range(num_q_heads):
        g = h // group
        for i in range(chunk_length):
            q = queries[h, i].double()
            visible = [(p, context_keys[g, p]) for p in range(end) if kept[g, p]]
            visible += [(end + j, chunk_keys[g, j]) for j in range(i + 1)]
            logits = [scaling * float(q @ k.double()) for _, k in visible]
            top = max(logits)
            total = sum(math.exp(z - top) for z in logits)
            for (p, _), z in zip(visible, logits):
                if p < end:
                    probs[h, i, p] = math.exp(z - top) / total
    return probs


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(3, 3), (6, 2)])
def test_reconstruction_stats_follow_the_contract(num_q_heads, num_kv_heads):
    end, chunk_length = 14, 5
    generator = torch.Generator().manual_seed(num_q_heads)
    queries = 2.5 * torch.randn(num_q_heads, chunk_length, HEAD_DIM, generator=generator)
    keys, values = (torch.randn(num_kv_heads, end + chunk_length, HEAD_DIM, generator=generator) for _ in range(2))
    kept = torch.rand(num_kv_heads, end, generator=generator) < 0.6
    request = StatsRequest(attn_max=True, attn_sum=True, value_l1=True, queries=RECONSTRUCTION_QUERIES)
    stats = reconstruction_stats(
        queries, keys[:, :end], values[:, :end], keys[:, end:], values[:, end:], SCALING, request, kept
    )
    probs = slow_reconstruction_attention(queries, keys[:, :end], keys[:, end:], kept, SCALING)
    assert stats.window == chunk_length and stats.attn_max.shape == (num_q_heads, end)
    assert_scores_close(stats.attn_max, probs.amax(1))
    assert_scores_close(stats.attn_sum, probs.sum(1))
    assert torch.all(stats.attn_max[kept.repeat_interleave(num_q_heads // num_kv_heads, 0).logical_not()] == 0)
    torch.testing.assert_close(stats.value_l1, values[:, :end].abs().sum(-1) * kept)


def test_merge_chunk_stats_takes_the_max_adds_the_sums_and_counts_the_queries():
    a = WindowStats(window=3, attn_max=torch.tensor([[0.1, 0.5]]), attn_sum=torch.tensor([[1.0, 2.0]]),
                    value_l1=torch.tensor([[4.0, 5.0]]))  # fmt: skip
    b = WindowStats(window=2, attn_max=torch.tensor([[0.3, 0.2]]), attn_sum=torch.tensor([[0.5, 0.5]]),
                    value_l1=torch.tensor([[4.0, 5.0]]))  # fmt: skip
    assert merge_chunk_stats(None, a) is a
    merged = merge_chunk_stats(a, b)
    assert merged.window == 5
    assert merged.attn_max.tolist() == [[pytest.approx(0.3), pytest.approx(0.5)]]
    assert merged.attn_sum.tolist() == [[1.5, 2.5]] and merged.value_l1.tolist() == [[4.0, 5.0]]


def test_reconstruction_requests_have_no_tail_rows():
    with pytest.raises(ValueError, match="reconstruction pass has no window"):
        StatsRequest(tail_rows=1, queries=RECONSTRUCTION_QUERIES)


@pytest.mark.parametrize("num_q_heads, num_kv_heads, context, window, start", SEGMENTS)
@pytest.mark.parametrize("gqa, pooling", [("max", "none"), ("max", "max"), ("mean", "avg")])
def test_kvzip_scorer(num_q_heads, num_kv_heads, context, window, start, gqa, pooling):
    """KVzip: max over the reconstruction queries, GQA-reduced (max by default), pooled if asked."""
    q_window, keys, values = random_window_inputs(num_q_heads, num_kv_heads, context, window, seed=4 + start)
    stats = window_stats(q_window, keys, values, SCALING, KVzipScorer.request)
    scores = KVzipScorer(Reduction(gqa, pooling, 7))(stats, slice(start, context - window), num_kv_heads, 0)

    probs, _, _ = slow_attention(q_window, keys, values, SCALING)
    candidates = range(start, context - window)
    per_query_head = [[max(float(probs[h, i, p]) for i in range(window)) for p in candidates] for h in range(num_q_heads)]
    assert_scores_close(scores, slow_kv_scores(per_query_head, num_kv_heads, gqa, pooling, 7))


def test_kvzip_defaults_follow_kvzip():
    config = EvictionConfig.for_policy("ada-snapkv", score="kvzip")
    scorer = scorer_for(config.common, config.score_knobs)
    assert isinstance(scorer, KVzipScorer) and (config.gqa, config.pooling) == ("max", "none")
    assert scorer.request == StatsRequest(attn_max=True, queries=RECONSTRUCTION_QUERIES)


@pytest.mark.parametrize("pooling", ["none", "max"])
def test_learned_scorer_is_a_per_layer_linear_map_of_the_hidden_states(pooling):
    """By hand: layer 1 of a 2-layer, 2-KV-head, d_model 3 model; candidates 5..8 of positions 4..9."""
    weight = torch.tensor(
        [[[9.0, 9.0, 9.0], [9.0, 9.0, 9.0]], [[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]]
    )  # layer 0 must not be used
    bias = torch.tensor([[5.0, 5.0], [0.5, -1.0]])
    hidden = torch.tensor(
        [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [4.0, 0.0, 1.0], [0.0, -1.0, 0.0], [2.0, 2.0, 2.0], [7.0, 7.0, 7.0]]
    )  # positions 4..9
    stats = WindowStats(window=1, hidden_states=hidden, hidden_start=4)
    scorer = LearnedScorer(Reduction(pooling=pooling, kernel=3), LearnedWeights(weight, bias, {}))
    scores = scorer(stats, slice(5, 9), num_kv_heads=2, layer=1)
    # head 0: x0 - x2 + 0.5; head 1: 2 x1 - 1 (positions 5, 6, 7, 8)
    expected = torch.tensor([[-1.5, 3.5, 0.5, 0.5], [3.0, -1.0, -3.0, 3.0]])
    if pooling == "max":
        expected = torch.tensor([[3.5, 3.5, 3.5, 0.5], [3.0, 3.0, 3.0, 3.0]])
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected)


def test_learned_scorer_without_weights_says_how_to_bind_it():
    config = EvictionConfig.for_policy("topk", score="learned")
    scorer = scorer_for(config.common, config.score_knobs)
    assert isinstance(scorer, LearnedScorer) and scorer.log_scores and scorer.request == StatsRequest(hidden_states=True)
    with pytest.raises(RuntimeError, match=r"policy.for_model\(model_dir\)"):
        scorer(WindowStats(window=1, hidden_states=torch.zeros(3, 2)), slice(0, 3), 1, 0)
