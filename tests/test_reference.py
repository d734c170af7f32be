"""The HF reference engine: exact against plain HF generate, and mask-based eviction exact against removal."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.reference import Mode, PrefillStep, Prompt, ReferenceEngine, Schedule, Segment
from sgl_kvevict.scoring.kvzip import ReconstructionPrompt, reconstruction_chunks
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats, window_stats

DOCUMENT = (
    "the cache key value token layer head budget window prefix radix tree memory request answer question "
    "document pass secret number is what remember find here there model "
) * 4
QUESTION = "what is the secret number here?"


@dataclass(frozen=True)
class WindowOnlyConfig:
    """The one common setting the engine reads from a policy."""

    window: int


class RandomKeepPolicy(Policy):
    """Test-only: keeps ``kept_per_head`` random candidates per (layer, KV head) plus the window.

    Every head of every layer keeps the same number of entries (at different positions), so the kept
    entries can also be stored as an ordinary dense HF cache: the oracle of the exactness tests. Its
    compressors record the statistics they observe.
    """

    def __init__(self, window: int, kept_per_head: int, seed: int = 0):
        super().__init__(WindowOnlyConfig(window))
        self.kept_per_head = kept_per_head
        self.seed = seed
        self.compressors: list[RecordingRandomKeep] = []

    def stats_request(self) -> StatsRequest:
        return StatsRequest(attn_sum=True, value_l1=True)

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        compressor = RecordingRandomKeep(spec, self)
        self.compressors.append(compressor)
        return compressor


class RecordingRandomKeep(SegmentCompressor):
    def __init__(self, spec: SegmentSpec, policy: RandomKeepPolicy):
        super().__init__(spec)
        self.policy = policy
        self.stats: dict[int, WindowStats] = {}

    def observe(self, layer: int, stats: WindowStats) -> None:
        self.stats[layer] = stats

    def plan(self) -> CompressionPlan:
        spec = self.spec
        window = min(self.policy.common.window, spec.length)
        window_positions = torch.arange(spec.end - window, spec.end)
        generator = torch.Generator().manual_seed(self.policy.seed + spec.start)
        layers = []
        for _ in range(spec.num_layers):
            heads = [
                torch.cat(
                    [
                        spec.start + torch.randperm(spec.length - window, generator=generator)[: self.policy.kept_per_head],
                        window_positions,
                    ]
                )
                for _ in range(spec.num_kv_heads)
            ]
            layers.append(LayerPlan.from_heads(heads))
        return CompressionPlan(spec.start, spec.end, tuple(layers))


class RecordingKeepAll(Policy):
    """Test-only: keeps everything, records the statistics of ``request`` it observes per segment."""

    def __init__(self, request: StatsRequest, window: int = 8):
        super().__init__(WindowOnlyConfig(window))
        self.request = request
        self.compressors: list[RecordingKeepAllCompressor] = []

    def stats_request(self) -> StatsRequest:
        return self.request

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        compressor = RecordingKeepAllCompressor(spec)
        self.compressors.append(compressor)
        return compressor


class RecordingKeepAllCompressor(SegmentCompressor):
    def __init__(self, spec: SegmentSpec):
        super().__init__(spec)
        self.stats: dict[int, WindowStats] = {}

    def observe(self, layer: int, stats: WindowStats) -> None:
        assert layer not in self.stats, "observe runs once per layer"
        self.stats[layer] = stats

    def plan(self) -> CompressionPlan:
        spec = self.spec
        return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir) -> ReferenceEngine:
    return ReferenceEngine(tiny_llama_dir)


@pytest.fixture(scope="module")
def tiny_plain(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_prompt(tiny_engine) -> Prompt:
    return tiny_engine.chat_prompt(DOCUMENT, QUESTION)


def full_policy():
    return build_policy(EvictionConfig(policy="full"))


def hf_greedy(model, token_ids, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(token_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1] :].tolist()


# ---- full cache == plain HF ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, block_size", [(Mode.QUESTION_AWARE, None), (Mode.CONTEXT_ONLY, None), (Mode.CONTEXT_ONLY, 32)]
)
def test_full_policy_generates_exactly_hf_greedy(tiny_engine, tiny_plain, tiny_prompt, mode, block_size):
    result = tiny_engine.generate(tiny_prompt, full_policy(), mode, max_new_tokens=12, block_size=block_size)
    assert list(result.output_ids) == hf_greedy(tiny_plain, tiny_prompt.token_ids, 12)
    assert result.kept_fraction() == 1.0
    expected_segments = {None: 1, 32: tiny_prompt.context_end // 32}[block_size]
    assert len(result.plans) == expected_segments


def test_context_only_prefill_logits_match_one_shot_prefill(tiny_engine, tiny_plain, tiny_prompt):
    schedule = Schedule.for_mode(Mode.CONTEXT_ONLY, len(tiny_prompt), tiny_prompt.context_end)
    assert [step.end for step in schedule.steps] == [tiny_prompt.context_end, len(tiny_prompt)]
    _, logits = tiny_engine.prefill(tiny_prompt, full_policy(), schedule)
    with torch.inference_mode():
        one_shot = tiny_plain(torch.tensor([tiny_prompt.token_ids])).logits[0, -1]
    torch.testing.assert_close(logits, one_shot, rtol=0, atol=1e-5)


@pytest.mark.smollm2
def test_full_policy_generates_exactly_hf_greedy_on_smollm2(smollm2_dir):
    engine = ReferenceEngine(smollm2_dir)
    plain = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = engine.chat_prompt(
        "Paris is the capital of France. Berlin is the capital of Germany.", "What is the capital of Germany?"
    )
    expected = hf_greedy(plain, prompt.token_ids, 6)
    assert len(expected) == 6  # no early EOS: six compared tokens
    for mode in Mode:
        assert list(engine.generate(prompt, full_policy(), mode, max_new_tokens=6).output_ids) == expected


# ---- mask-based eviction == physically removed entries ---------------------------------------------


def gathered_cache(cache: DynamicCache, plan: CompressionPlan) -> DynamicCache:
    """A dense HF cache holding only the kept entries of ``[0, plan.segment_end)`` (equal counts per head)."""
    physical = DynamicCache()
    for layer, layer_plan in enumerate(plan.layers):
        positions = torch.stack([layer_plan.head_positions(h) for h in range(layer_plan.num_kv_heads)])  # [H_kv, kept]
        index = positions.view(1, *positions.shape, 1)
        keys, values = cache.layers[layer].keys, cache.layers[layer].values  # [1, H_kv, L, D]
        index = index.expand(1, -1, -1, keys.shape[-1])
        physical.update(torch.gather(keys, 2, index), torch.gather(values, 2, index), layer)
    return physical


@pytest.mark.parametrize("mode", list(Mode))
def test_masked_eviction_equals_physically_removed_entries(tiny_engine, tiny_plain, tiny_prompt, mode):
    compressed_end = len(tiny_prompt) if mode is Mode.QUESTION_AWARE else tiny_prompt.context_end
    policy = RandomKeepPolicy(window=8, kept_per_head=compressed_end // 4)
    ids = tiny_prompt.token_ids

    masked = tiny_engine.new_sequence()
    uncompressed = tiny_engine.new_sequence()
    tiny_engine.extend(masked, ids[:compressed_end], policy, [Segment(0, compressed_end)])
    tiny_engine.extend(uncompressed, ids[:compressed_end])
    (plan,) = masked.plans
    assert len(set(plan.counts().flatten().tolist())) == 1 and plan.kept_fraction() < 0.5
    physical = gathered_cache(masked.cache, plan)

    def physical_extend(token_ids, start):
        with torch.inference_mode():
            out = tiny_plain(
                input_ids=torch.tensor([list(token_ids)]),
                position_ids=torch.arange(start, start + len(token_ids)).unsqueeze(0),
                past_key_values=physical,
                use_cache=True,
            )
        return out.logits[0, -1]

    # The question (several tokens in one forward, when there is one), then forced decode steps.
    feeds = ([ids[compressed_end:]] if compressed_end < len(ids) else []) + [[t] for t in (5, 77, 200, 31)]
    position, max_gap_to_full = compressed_end, 0.0
    for tokens in feeds:
        masked_logits = tiny_engine.extend(masked, tokens)
        full_logits = tiny_engine.extend(uncompressed, tokens)
        torch.testing.assert_close(masked_logits, physical_extend(tokens, position), rtol=0, atol=2e-5)
        max_gap_to_full = max(max_gap_to_full, float((masked_logits - full_logits).abs().max()))
        position += len(tokens)
    assert max_gap_to_full > 1e-3, "the eviction did not change the logits: the test would not catch anything"


# ---- scoring sees post-RoPE queries --------------------------------------------------------------


def test_window_statistics_use_post_rope_queries_of_every_layer(tiny_engine, tiny_plain, tiny_prompt):
    policy = RandomKeepPolicy(window=8, kept_per_head=16)
    tiny_engine.generate(tiny_prompt, policy, Mode.QUESTION_AWARE, max_new_tokens=1)
    (compressor,) = policy.compressors
    ids = torch.tensor([tiny_prompt.token_ids])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        out = tiny_plain(ids, output_hidden_states=True, use_cache=True)
        cos, sin = tiny_plain.model.rotary_emb(out.hidden_states[0], positions)
        for layer, decoder_layer in enumerate(tiny_plain.model.layers):
            attention = decoder_layer.self_attn
            hidden = decoder_layer.input_layernorm(out.hidden_states[layer])
            queries = attention.q_proj(hidden).view(1, ids.shape[1], -1, attention.head_dim).transpose(1, 2)
            queries, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
            cache = out.past_key_values.layers[layer]
            expected = window_stats(
                queries[0, :, -8:], cache.keys[0], cache.values[0], attention.scaling, policy.stats_request()
            )
            torch.testing.assert_close(compressor.stats[layer].attn_sum, expected.attn_sum, rtol=0, atol=1e-5)
            torch.testing.assert_close(compressor.stats[layer].value_l1, expected.value_l1, rtol=0, atol=1e-5)
    assert sorted(compressor.stats) == list(range(tiny_engine.num_layers))


def test_window_stats_over_kept_entries_equals_masked_softmax():
    generator = torch.Generator().manual_seed(0)
    num_q_heads, num_kv_heads, window, length, dim = 4, 2, 5, 40, 8
    q = torch.randn(num_q_heads, window, dim, generator=generator)
    keys = torch.randn(num_kv_heads, length, dim, generator=generator)
    values = torch.randn(num_kv_heads, length, dim, generator=generator)
    kept = torch.rand(num_kv_heads, length, generator=generator) < 0.5
    kept[:, length - window :] = True
    request = StatsRequest(attn_sum=True, tail_rows=2, obc_value=True, value_l1=True)
    stats = window_stats(q, keys, values, 0.3, request, kept=kept)

    group = num_q_heads // num_kv_heads
    logits = torch.einsum("hid,hpd->hip", q, keys.repeat_interleave(group, 0)) * 0.3
    causal = torch.arange(length).view(1, -1) <= torch.arange(length - window, length).view(-1, 1)
    visible = causal.unsqueeze(0) & kept.repeat_interleave(group, 0).unsqueeze(1)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    v_sq = values.square().sum(-1).repeat_interleave(group, 0)
    torch.testing.assert_close(stats.attn_sum, probs.sum(1))
    torch.testing.assert_close(stats.tail_attn, probs[:, -2:])
    torch.testing.assert_close(stats.obc_value, probs.square().sum(1) * v_sq)
    torch.testing.assert_close(stats.value_l1, values.abs().sum(-1) * kept)


# ---- block scope -----------------------------------------------------------------------------------


def test_blocks_fed_one_forward_each_score_over_the_compressed_earlier_block(tiny_engine, tiny_prompt):
    block = 48
    sequential = Schedule(
        (
            PrefillStep(block, (Segment(0, block, block=True),)),
            PrefillStep(2 * block, (Segment(block, 2 * block, block=True),)),
            PrefillStep(len(tiny_prompt)),
        )
    )
    one_shot = Schedule.for_mode(Mode.QUESTION_AWARE, len(tiny_prompt), len(tiny_prompt), block_size=block)
    assert one_shot.segments[:2] == sequential.segments

    def second_block_attention(schedule: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
        policy = RandomKeepPolicy(window=8, kept_per_head=10)
        result = tiny_engine.generate_scheduled(tiny_prompt, policy, schedule, max_new_tokens=1)
        first_block_kept = result.plans[0].keep_mask(0).repeat_interleave(2, 0)  # [H_q, block]
        return policy.compressors[1].stats[0].attn_sum, first_block_kept

    attn, first_kept = second_block_attention(sequential)
    assert attn.shape == (tiny_engine.num_q_heads, 2 * block)
    assert torch.all(attn[:, :block][~first_kept] == 0)
    torch.testing.assert_close(attn.sum(-1), torch.full((tiny_engine.num_q_heads,), 8.0))  # 8 softmax rows
    attn_one_shot, first_kept = second_block_attention(one_shot)
    assert torch.all(attn_one_shot[:, :block][~first_kept] > 0)


def test_schedule_rejects_bad_segments():
    with pytest.raises(ValueError, match="overlaps"):
        Schedule((PrefillStep(100, (Segment(0, 60), Segment(50, 100))),))
    with pytest.raises(ValueError, match="must end inside its step"):
        Schedule((PrefillStep(50), PrefillStep(100, (Segment(0, 40),))))
    blocks = (Segment(0, 32, block=True), Segment(32, 64, block=True))
    assert Schedule.for_mode(Mode.CONTEXT_ONLY, 100, 70, block_size=32).segments == blocks


def test_extend_rejects_a_window_outside_the_forward(tiny_engine, tiny_prompt):
    sequence = tiny_engine.new_sequence()
    tiny_engine.extend(sequence, tiny_prompt.token_ids[:40])
    with pytest.raises(ValueError, match="outside this forward"):
        tiny_engine.extend(sequence, tiny_prompt.token_ids[40:44], RandomKeepPolicy(8, 4), [Segment(0, 44)])


def test_chat_prompt_context_is_a_token_prefix(tiny_engine):
    prompt = tiny_engine.chat_prompt(DOCUMENT, QUESTION, answer_prefix="the number is")
    context_alone = tiny_engine.chat_prompt(DOCUMENT, "another question")
    assert prompt.token_ids[: prompt.context_end] == context_alone.token_ids[: context_alone.context_end]
    text = tiny_engine.tokenizer.decode(prompt.token_ids[prompt.context_end :])
    assert QUESTION in text and text.endswith("the number is")


# ---- KVzip reconstruction passes and learned-score inputs -----------------------------------------

RECONSTRUCTION_MAX = StatsRequest(attn_max=True, queries=RECONSTRUCTION_QUERIES)


@pytest.fixture(scope="module")
def tiny_eager(tiny_llama_dir):
    """The tiny model with transformers' eager attention, which returns its attention probabilities."""
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager").eval()


def naive_reconstruction_max(model, context_ids, prompt: ReconstructionPrompt, start: int) -> list[torch.Tensor]:
    """Per layer fp32 ``[H_q, end]``: for each chunk of ``context_ids[start:]``, one plain HF forward of
    ``context_ids + chunk input`` (the chunk sits right after the context, at positions from ``end``),
    max of the eager attention probabilities of the chunk's rows over the context columns, max over chunks."""
    end = len(context_ids)
    per_layer = None
    for chunk in reconstruction_chunks(context_ids[start:], start, prompt):
        ids = torch.tensor([list(context_ids) + list(chunk.input_ids)])
        with torch.inference_mode():
            attentions = model(ids, output_attentions=True).attentions
        chunk_max = [a[0, :, end:, :end].amax(1) for a in attentions]
        per_layer = chunk_max if per_layer is None else [torch.maximum(a, b) for a, b in zip(per_layer, chunk_max)]
    return per_layer


@pytest.fixture
def small_chunks(tiny_engine):
    """Chunks of 24 tokens (overlap 8), so the tiny prompt needs several passes."""
    original = tiny_engine.reconstruction_prompt
    tiny_engine.reconstruction_prompt = ReconstructionPrompt(
        original.first_instruction, original.later_instruction, original.assistant_opening, chunk_size=24, overlap=8
    )
    yield tiny_engine.reconstruction_prompt
    tiny_engine.reconstruction_prompt = original


def test_kvzip_scores_equal_a_naive_eager_forward_per_chunk(tiny_engine, tiny_eager, tiny_prompt, small_chunks):
    """Question-aware: one segment, the whole prompt; several chunks, each one plain forward."""
    policy = RecordingKeepAll(RECONSTRUCTION_MAX)
    result = tiny_engine.generate(tiny_prompt, policy, Mode.QUESTION_AWARE, max_new_tokens=1)
    (compressor,) = policy.compressors
    chunks = reconstruction_chunks(tiny_prompt.token_ids, 0, small_chunks)
    assert len(chunks) >= 3
    expected = naive_reconstruction_max(tiny_eager, tiny_prompt.token_ids, small_chunks, 0)
    for layer, stats in compressor.stats.items():
        assert stats.window == sum(len(chunk.input_ids) for chunk in chunks)
        torch.testing.assert_close(stats.attn_max, expected[layer], rtol=0, atol=2e-6)
    assert result.kept_fraction() == 1.0


def test_kvzip_blocks_of_one_forward_see_keys_up_to_their_own_end(tiny_engine, tiny_eager, tiny_prompt, small_chunks):
    """Block scope in one forward: block k's reconstruction sees the prompt up to its end only (the
    forward's later tokens are invisible), earlier blocks of the forward dense."""
    block = 40
    schedule = Schedule.for_mode(Mode.QUESTION_AWARE, len(tiny_prompt), len(tiny_prompt), block_size=block)
    policy = RecordingKeepAll(RECONSTRUCTION_MAX)
    tiny_engine.generate_scheduled(tiny_prompt, policy, schedule, max_new_tokens=1)
    assert len(policy.compressors) == len(tiny_prompt) // block >= 2
    for compressor in policy.compressors:
        spec = compressor.spec
        expected = naive_reconstruction_max(tiny_eager, tiny_prompt.token_ids[: spec.end], small_chunks, spec.start)
        for layer, stats in compressor.stats.items():
            assert stats.attn_max.shape[-1] == spec.end
            torch.testing.assert_close(stats.attn_max, expected[layer], rtol=0, atol=2e-6)


def test_kvzip_block_fed_later_sees_the_earlier_block_compressed(tiny_engine, tiny_eager, tiny_prompt):
    """A block prefilled after an earlier one was compressed (a request reusing it): its
    reconstruction attends to the kept entries only, in its statistics and in the attention that
    feeds later layers. Oracle: a plain eager forward of the chunk over a cache that physically holds
    only the kept entries of block 0 and the dense block 1, every layer compared."""
    block = 48
    ids = tiny_prompt.token_ids
    sequence = tiny_engine.new_sequence()
    tiny_engine.extend(sequence, ids[:block], RandomKeepPolicy(window=8, kept_per_head=10), [Segment(0, block)])
    recorder = RecordingKeepAll(RECONSTRUCTION_MAX)
    tiny_engine.extend(sequence, ids[block : 2 * block], recorder, [Segment(block, 2 * block)])
    (first_plan, _) = sequence.plans

    physical = gathered_cache(sequence.cache, first_plan)
    for layer, cached in enumerate(sequence.cache.layers):
        physical.update(cached.keys[:, :, block : 2 * block], cached.values[:, :, block : 2 * block], layer)
    (chunk,) = reconstruction_chunks(ids[block : 2 * block], block, tiny_engine.reconstruction_prompt)
    length = len(chunk.input_ids)
    with torch.inference_mode():
        attentions = tiny_eager(
            input_ids=torch.tensor([chunk.input_ids]),
            position_ids=torch.arange(2 * block, 2 * block + length).unsqueeze(0),
            past_key_values=physical,
            output_attentions=True,
        ).attentions
    group = tiny_engine.num_q_heads // tiny_engine.num_kv_heads
    for layer, probs in enumerate(attentions):
        row_max = probs[0, :, :, : -length].amax(1)  # [H_q, kept_0 + block]: the physical columns
        expected = torch.zeros(tiny_engine.num_q_heads, 2 * block)
        for head in range(tiny_engine.num_q_heads):
            kept_positions = first_plan.layers[layer].head_positions(head // group)
            expected[head, kept_positions] = row_max[head, : len(kept_positions)]
            expected[head, block:] = row_max[head, len(kept_positions) :]
        torch.testing.assert_close(recorder.compressors[0].stats[layer].attn_max, expected, rtol=0, atol=2e-6)


def test_reconstruction_leaves_the_cache_as_the_prefill_left_it(tiny_engine, tiny_plain, tiny_prompt):
    """The chunks' entries are temporary: after the passes, decoding is exactly plain HF greedy."""
    for mode in Mode:
        policy = RecordingKeepAll(RECONSTRUCTION_MAX)
        result = tiny_engine.generate(tiny_prompt, policy, mode, max_new_tokens=8)
        assert list(result.output_ids) == hf_greedy(tiny_plain, tiny_prompt.token_ids, 8)
        assert len(policy.compressors[0].stats) == tiny_engine.num_layers


def test_learned_scores_read_the_attention_inputs_of_the_prefill(tiny_engine, tiny_plain, tiny_prompt):
    """Hidden states = the input layernorm of each layer's input, positions of the segment only."""
    segment = Segment(10, tiny_prompt.context_end)
    sequence = tiny_engine.new_sequence()
    tiny_engine.extend(sequence, tiny_prompt.token_ids[:10])
    policy = RecordingKeepAll(StatsRequest(hidden_states=True))
    tiny_engine.extend(sequence, tiny_prompt.token_ids[10 : segment.end], policy, [segment])
    (compressor,) = policy.compressors
    ids = torch.tensor([tiny_prompt.token_ids[: segment.end]])
    with torch.inference_mode():
        out = tiny_plain(ids, output_hidden_states=True)
        for layer, decoder_layer in enumerate(tiny_plain.model.layers):
            expected = decoder_layer.input_layernorm(out.hidden_states[layer])[0, segment.start :]
            stats = compressor.stats[layer]
            assert stats.hidden_start == segment.start and stats.attn_max is None
            torch.testing.assert_close(stats.hidden_states, expected, rtol=0, atol=1e-5)


def test_learned_scores_refuse_a_segment_that_started_in_an_earlier_forward(tiny_engine, tiny_prompt):
    sequence = tiny_engine.new_sequence()
    tiny_engine.extend(sequence, tiny_prompt.token_ids[:40])
    policy = RecordingKeepAll(StatsRequest(hidden_states=True), window=4)
    with pytest.raises(ValueError, match="scored from hidden states, but this forward starts at 40"):
        tiny_engine.extend(sequence, tiny_prompt.token_ids[40:60], policy, [Segment(0, 60)])


@pytest.mark.smollm2
def test_a_short_chat_stays_dense_on_smollm2(smollm2_dir):
    """The 37-token chat "What is the capital of France?" at budget 0.25: the budget (9 per head)
    leaves nothing to select beside the window (32) and sinks (4), so no policy compresses it, and
    the answer is the full cache's."""
    engine = ReferenceEngine(smollm2_dir)
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert len(ids) == 37
    reference = engine.generate(ids, full_policy(), max_new_tokens=6)
    assert "Paris" in reference.text
    for policy in ("lava", "snapkv", "streaming", "topk"):
        result = engine.generate(ids, build_policy(EvictionConfig.for_policy(policy, budget="0.25")), max_new_tokens=6)
        assert result.kept_fraction() == 1.0 and result.output_ids == reference.output_ids, policy


def test_the_reconstruction_prompt_of_a_chatml_tokenizer(tiny_engine):
    prompt = tiny_engine.reconstruction_prompt
    decode = tiny_engine.tokenizer.decode
    assert decode(prompt.assistant_opening) == "<|im_end|>\n<|im_start|>assistant\n"
    assert decode(prompt.first_instruction) == "\n\nRepeat the previous context exactly."
    assert decode(prompt.later_instruction) == "\n\nRepeat the part of the previous context exactly, starting with"
    assert (prompt.chunk_size, prompt.overlap) == (2048, 8)
