"""ReferenceEngine: HF-transformers prefill, compression with the project's policies, greedy decode.

The oracle of the SGLang parity tests and the engine of offline quality runs. One sequence at a time:

* ``prompt = engine.chat_prompt(context, question)`` (or ``Prompt.from_ids``) marks where the
  context ends, so the same token ids serve both modes;
* ``engine.generate(prompt, policy, mode, max_new_tokens)`` prefills by a ``Schedule``, compresses
  every segment of it with ``policy`` (per layer ``observe`` during the forward, ``plan`` after it),
  then decodes greedily; the result carries the output and the ``CompressionPlan`` of each segment;
* ``engine.new_sequence()`` + ``engine.extend(sequence, ids, policy, segments)`` is the primitive
  all of that is built from (one forward, then compression of the segments ending in it).

Policies with KVzip scores get their reconstruction passes after the forward (``_reconstruct``,
exactly the contract of ``scoring.kvzip``); learned scores read the forward's attention inputs. A
policy is bound to this engine's model (``policy.for_model``) before it compresses anything.

Supported: decoder-only Llama, Mistral, Phi-3, Qwen2, Qwen3, Qwen3-MoE, OLMo 2, Granite, GLM-4 and Gemma 3 folders
(their attention dispatches through transformers' attention interface, which is where scoring and eviction
happen: see ``attention.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from sgl_kvevict.local_layers import LocalLayers, WindowedLocalLayers
from sgl_kvevict.models import resolve_model
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentSpec
from sgl_kvevict.reference.attention import (
    FORWARD_KWARG,
    ForwardContext,
    PrefillContext,
    ReconstructionContext,
    SegmentScoring,
    register_attention,
    register_hidden_state_capture,
)
from sgl_kvevict.reference.keep_mask import HeadwiseKeepMask
from sgl_kvevict.reference.schedule import Mode, Schedule, Segment
from sgl_kvevict.scoring.kvzip import NoRoomForPasses, ReconstructionPrompt, reconstruction_chunks

SUPPORTED_MODEL_TYPES = ("gemma3_text", "glm4", "granite", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Prompt:
    """Prompt token ids; ``[0, context_end)`` is the context, the rest the question (and template)."""

    token_ids: tuple[int, ...]
    context_end: int

    def __post_init__(self):
        if not 0 < self.context_end <= len(self.token_ids):
            raise ValueError(f"context end {self.context_end} must be in (0, {len(self.token_ids)}]")

    @classmethod
    def from_ids(cls, token_ids: Sequence[int], context_end: Optional[int] = None) -> "Prompt":
        """A prompt of raw ids; without ``context_end`` it is all context (question-aware use)."""
        ids = tuple(int(t) for t in token_ids)
        return cls(ids, len(ids) if context_end is None else context_end)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class ReferenceSequence:
    """One sequence in the engine: dense HF cache (index = position) plus its head-wise keep mask."""

    cache: DynamicCache
    keep_mask: HeadwiseKeepMask
    length: int = 0
    plans: list[CompressionPlan] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationResult:
    """output_ids: the greedy tokens (ending with EOS if one was produced); plans: one per segment."""

    prompt: Prompt
    output_ids: tuple[int, ...]
    text: str
    plans: tuple[CompressionPlan, ...]

    def kept_fraction(self) -> float:
        """Kept entries / entries over every compressed segment (1.0 when nothing was compressed)."""
        cells = sum(plan.segment_length * plan.num_layers * plan.layers[0].num_kv_heads for plan in self.plans)
        return sum(plan.total_kept() for plan in self.plans) / cells if cells else 1.0


class ReferenceEngine:
    """A HF causal LM with head-wise KV eviction. ``model``: ``"smollm2"`` or a HF model folder.

    device: where the model runs. Parity and quality runs use the CPU; ``train_scorer`` may run on a GPU
    (its sequences evict nothing, so keep masks never leave the CPU)."""

    def __init__(
        self, model: str | Path = "smollm2", dtype: torch.dtype = torch.float32, device: str = "cpu",
        trim_local_layers: bool = True,
    ):  # fmt: skip
        """``trim_local_layers``: False leaves a model's local layers to the policy (every layer observed, as
        the scorer's training records them), which no server does."""
        self.model_dir = resolve_model(str(model))
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        config = self.model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{self.model_dir} is a {config.model_type!r} model; the reference engine supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model.set_attn_implementation(register_attention())
        register_hidden_state_capture(self.model)
        self.reconstruction_prompt = ReconstructionPrompt.from_tokenizer(self.tokenizer)
        self.num_layers = config.num_hidden_layers
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.context_length = config.max_position_embeddings
        # Local attention layers (Gemma 3): plans keep what their window can read, as the server's do.
        self.local_layers = LocalLayers.of_model(self.model_dir) if trim_local_layers else None
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())

    # ---- prompts -----------------------------------------------------------------------------

    def chat_prompt(
        self, context: str, question: str, answer_prefix: str = "", system: Optional[str] = None
    ) -> Prompt:
        """The chat-template prompt of one user turn ``context + "\\n\\n" + question``.

        answer_prefix: text that starts the assistant's reply (RULER's answer prefix), part of the question.

        The rendered text is tokenized in two pieces split where the question starts, so the context
        tokens are a prefix of the prompt in both modes (and identical to tokenizing the context turn
        on its own, as a reusing server sees it).
        """
        user_turn = f"{context}\n\n{question}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_turn}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        rendered += answer_prefix
        split = rendered.rindex(user_turn) + len(context)
        context_ids = self.tokenizer.encode(rendered[:split], add_special_tokens=False)
        question_ids = self.tokenizer.encode(rendered[split:], add_special_tokens=False)
        return Prompt(tuple(context_ids + question_ids), len(context_ids))

    # ---- the primitive -----------------------------------------------------------------------

    def new_sequence(self) -> ReferenceSequence:
        return ReferenceSequence(DynamicCache(), HeadwiseKeepMask(self.num_layers, self.num_kv_heads))

    @torch.inference_mode()
    def extend(
        self,
        sequence: ReferenceSequence,
        token_ids: Sequence[int],
        policy: Optional[Policy] = None,
        segments: Sequence[Segment] = (),
    ) -> torch.Tensor:
        """Feed ``token_ids`` in one forward, then compress ``segments`` with ``policy``.

        Each segment must end inside this forward (its observation window is scored from this
        forward's queries; learned scores read this forward's attention inputs, so such a segment
        must also start in it). Reconstruction passes (KVzip) run after the forward, every segment's
        before any plan of this forward is applied. Returns fp32 ``[vocab]``: the next-token logits
        after the last token.
        """
        start, end = sequence.length, sequence.length + len(token_ids)
        if segments and policy is None:
            raise ValueError("compressing segments needs a policy")
        if policy is not None:
            policy = policy.for_model(self.model_dir)
        scorings = [SegmentScoring.start(self._windowed(policy, segment), self._spec(segment)) for segment in segments]
        for scoring in scorings:
            self._check_inside_forward(scoring, start, end)
        sequence.keep_mask.reserve(end)
        logits = self._forward(sequence, token_ids, start, PrefillContext(sequence.keep_mask, start, scorings))
        sequence.length = end
        sequence.token_ids.extend(int(token) for token in token_ids)
        for scoring in scorings:
            if scoring.needs_reconstruction:
                self._reconstruct(sequence, scoring)
        for scoring in scorings:
            plan = scoring.plan()
            sequence.keep_mask.apply(plan)
            sequence.plans.append(plan)
        return logits

    def _forward(
        self, sequence: ReferenceSequence, token_ids: Sequence[int], position: int, context: ForwardContext
    ) -> torch.Tensor:
        """One forward of ``token_ids`` at positions from ``position``, appended to the cache; fp32 ``[vocab]``
        logits after the last token."""
        output = self.model(
            input_ids=torch.tensor([list(token_ids)], dtype=torch.int64, device=self.device),
            position_ids=torch.arange(position, position + len(token_ids), device=self.device).unsqueeze(0),
            past_key_values=sequence.cache,
            use_cache=True,
            logits_to_keep=1,
            **{FORWARD_KWARG: context},
        )
        return output.logits[0, -1].float()

    def _reconstruct(self, sequence: ReferenceSequence, scoring: SegmentScoring) -> None:
        """KVzip's passes for one segment (``scoring.kvzip``, contract steps 2-4): each chunk at positions
        from the segment end, over the context ``[0, end)`` as kept now; its cache entries dropped after. A
        segment whose passes do not fit before the context length is kept whole, as the server keeps it."""
        spec = scoring.spec
        segment_ids = sequence.token_ids[spec.start : spec.end]
        try:
            chunks = reconstruction_chunks(segment_ids, spec.start, self.reconstruction_prompt, self.context_length)
        except NoRoomForPasses:
            scoring.keep_whole()
            return
        for chunk in chunks:
            context = ReconstructionContext(sequence.keep_mask, scoring, cache_length=sequence.length)
            self._forward(sequence, chunk.input_ids, spec.end, context)
            sequence.cache.crop(-len(chunk.input_ids))
        scoring.finish_reconstruction()

    @staticmethod
    def _check_inside_forward(scoring: SegmentScoring, start: int, end: int) -> None:
        spec = scoring.spec
        window_start = spec.end - scoring.window
        if not (start <= window_start and spec.end <= end):
            raise ValueError(
                f"segment [{spec.start}, {spec.end}) has its window at {window_start}, outside this forward [{start}, {end})"
            )
        if scoring.needs_hidden_states and spec.start < start:
            raise ValueError(
                f"segment [{spec.start}, {spec.end}) is scored from hidden states, but this forward starts at {start}"
            )

    # ---- generation --------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, policy: Policy, schedule: Schedule) -> tuple[ReferenceSequence, torch.Tensor]:
        """Run ``schedule`` over ``prompt``; returns the sequence and fp32 ``[vocab]`` next-token logits."""
        if schedule.length != len(prompt):
            raise ValueError(f"schedule covers {schedule.length} tokens, the prompt has {len(prompt)}")
        sequence = self.new_sequence()
        for step in schedule.steps:
            logits = self.extend(sequence, prompt.token_ids[sequence.length : step.end], policy, step.segments)
        return sequence, logits

    def generate(
        self,
        prompt: Prompt | Sequence[int],
        policy: Policy,
        mode: Mode | str = Mode.QUESTION_AWARE,
        max_new_tokens: int = 16,
        block_size: Optional[int] = None,
    ) -> GenerationResult:
        """Prefill ``prompt`` compressed by ``policy`` in ``mode`` (optionally in blocks), decode greedily."""
        if not isinstance(prompt, Prompt):
            prompt = Prompt.from_ids(prompt)
        schedule = Schedule.for_mode(Mode(mode), len(prompt), prompt.context_end, block_size)
        return self.generate_scheduled(prompt, policy, schedule, max_new_tokens)

    def generate_scheduled(
        self, prompt: Prompt, policy: Policy, schedule: Schedule, max_new_tokens: int
    ) -> GenerationResult:
        """``generate`` with an explicit schedule (e.g. blocks fed one forward each)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} must be >= 1")
        sequence, logits = self.prefill(prompt, policy, schedule)
        output: list[int] = []
        while True:
            token = int(logits.argmax())
            output.append(token)
            if token in self.eos_token_ids or len(output) == max_new_tokens:
                break
            logits = self.extend(sequence, [token])
        return GenerationResult(
            prompt=prompt,
            output_ids=tuple(output),
            text=self.tokenizer.decode(output, skip_special_tokens=True),
            plans=tuple(sequence.plans),
        )

    def _windowed(self, policy: Policy, segment: Segment) -> Policy:
        """``policy`` with the model's local layers trimmed as the server's scope trims them (a block keeps
        its observation window in its node; request scope leaves it dense after the node)."""
        local = self.local_layers
        if local is not None:
            local = dataclasses.replace(local, observation_window_dense=not segment.block)
        return WindowedLocalLayers.wrap(policy, local)

    def _spec(self, segment: Segment) -> SegmentSpec:
        return SegmentSpec(segment.start, segment.end, self.num_layers, self.num_kv_heads, self.num_q_heads)
