"""KVzip (Kim et al. 2025): question-agnostic scores from a pass that reconstructs the context.

A compressed prefix is reused by questions it never saw, so its entries are ranked by how much the
model needs them to *repeat the context*, not by what its last window asked: after the prefill, a
teacher-forced pass feeds a repeat instruction, the chat template's assistant-turn opening and the
context again, and an entry's score is the largest attention any of those queries pays it (per query
head; ``KVzipScorer`` reduces the GQA group by max, as KVzip does).

Reconstruction input (the same in both engines)
-----------------------------------------------
``ReconstructionPrompt.from_tokenizer(tokenizer)`` holds the token ids of the two repeat instructions
and of the text a chat template puts between a user message and the assistant's reply (ChatML:
``<|im_end|>\\n<|im_start|>assistant\\n``). ``reconstruction_chunks(ids, start, prompt)`` cuts a
segment's token ids ``[start, end)`` into chunks of ``chunk_size`` (2048) tokens; each chunk's pass is

* chunk 0: ``"\\n\\nRepeat the previous context exactly."`` + assistant opening + its tokens;
* chunk k > 0: ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` + the last
  ``overlap`` (8) tokens of chunk k - 1 + assistant opening + its tokens.

A pass runs at positions after the segment end, so it must end within the model's context length
(``position_limit``: rotary tables and ``req_to_token`` rows stop there): a segment ending near the
limit gets smaller chunks, and one ending closer than ``MIN_CHUNK_TOKENS`` plus the fixed parts of a
pass cannot be scored (``NoRoomForPasses``: the engines keep it whole).

Every token of the segment is repeated, chat-template tokens included (an engine cannot tell them
apart from the content; see docs/methods/kvzip.md).

Contract with the engines (``StatsRequest(queries="reconstruction")``)
----------------------------------------------------------------------
For a segment ``[start, end)`` compressed after a forward (``end`` is the segment end; in block scope
the block end, so a block depends only on the tokens up to its end):

1. The forward that prefills the segment runs as usual; it computes no statistics for this segment.
2. After that forward, and before any plan of that forward is applied, each chunk runs one extra
   forward of its ``input_ids`` at logical positions ``end, end + 1, ...`` (every chunk starts at
   ``end``). Its queries attend to every key of positions ``[0, end)`` kept at that moment (a reused
   compressed prefix by its kept entries; everything the prefill forward wrote, other segments of it
   included, dense; nothing at or after ``end``) plus the chunk's own keys, causally. The chunk's KV
   entries are temporary: dropped after its pass, never stored or reused.
3. Per layer and chunk, the statistics are ``window_stats`` with the chunk's queries as the window
   over (kept keys of ``[0, end)``, the chunk's keys), cropped to the columns ``[0, end)``:
   ``reconstruction_stats`` is that formula.
4. The chunks of a layer combine with ``merge_chunk_stats`` (``attn_max`` by elementwise max, sums
   added), and ``compressor.observe(layer, stats)`` runs once per layer, after the last chunk.

A segment whose compressor does not need statistics (``needs_stats`` False: kept whole) gets no pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from sgl_kvevict.scoring.base import QueryHeadScorer
from sgl_kvevict.scoring.window import COLUMN_STATS, RECONSTRUCTION_QUERIES, StatsRequest, WindowStats, window_stats

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
LATER_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
DEFAULT_CHUNK_SIZE = 2048
DEFAULT_OVERLAP = 8
# The smallest chunk a segment near the context limit is cut into: below it a pass would be mostly its
# instruction, and the passes' cost (each reads the whole context) would grow without bound.
MIN_CHUNK_TOKENS = 64
# Ends the user message when the chat template is rendered to find the assistant-turn opening: plain
# text, so no template trims it away.
_END_OF_USER_MESSAGE = "KVZIP_END_OF_USER_MESSAGE"


class ChatTokenizer(Protocol):
    """What ``ReconstructionPrompt`` needs of a tokenizer (a HF tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation, **kwargs) -> str: ...


def assistant_turn_opening(tokenizer: ChatTokenizer) -> str:
    """The text the chat template puts between a user message and the assistant's reply; ``"\\n"``
    for a tokenizer without a template (kvpress's choice)."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "context " + _END_OF_USER_MESSAGE}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,  # Qwen3-style templates: the reply starts without a thinking block
    )
    return rendered.split(_END_OF_USER_MESSAGE, 1)[1]


class NoRoomForPasses(ValueError):
    """A segment ends too close to the model's context length for its reconstruction passes."""


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the reconstruction pass's fixed parts, and how the context is chunked."""

    first_instruction: tuple[int, ...]
    later_instruction: tuple[int, ...]
    assistant_opening: tuple[int, ...]
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overlap: int = DEFAULT_OVERLAP

    def __post_init__(self):
        if self.chunk_size < 1 or not 0 <= self.overlap <= self.chunk_size:
            raise ValueError(f"chunk size {self.chunk_size} must be >= 1 and overlap {self.overlap} in [0, chunk size]")

    @classmethod
    def from_tokenizer(
        cls, tokenizer: ChatTokenizer, chunk_size: int = DEFAULT_CHUNK_SIZE, overlap: int = DEFAULT_OVERLAP
    ) -> "ReconstructionPrompt":
        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(
            encode(FIRST_INSTRUCTION),
            encode(LATER_INSTRUCTION),
            encode(assistant_turn_opening(tokenizer)),
            chunk_size,
            overlap,
        )

    @property
    def fixed_tokens(self) -> int:
        """The most tokens a pass feeds besides its chunk (instruction, overlap, assistant opening)."""
        return max(len(self.first_instruction), len(self.later_instruction) + self.overlap) + len(self.assistant_opening)

    def chunk_size_before(self, segment_end: int, position_limit: Optional[int]) -> int:
        """The chunk size whose passes, fed from position ``segment_end``, end within ``position_limit``
        (None: no limit). Raises ``NoRoomForPasses`` when that is under ``MIN_CHUNK_TOKENS`` (or the overlap)."""
        if position_limit is None:
            return self.chunk_size
        room = position_limit - segment_end - self.fixed_tokens
        if room < min(self.chunk_size, max(MIN_CHUNK_TOKENS, self.overlap + 1)):
            raise NoRoomForPasses(
                f"a segment ending at {segment_end} leaves {max(room, 0)} positions for its reconstruction passes "
                f"before the context length {position_limit}"
            )
        return min(self.chunk_size, room)


@dataclass(frozen=True)
class ReconstructionChunk:
    """One reconstruction pass: it repeats positions ``[context_start, context_end)`` and feeds
    ``input_ids`` (instruction, assistant opening, those tokens) at positions from the segment end."""

    context_start: int
    context_end: int
    input_ids: tuple[int, ...]


def reconstruction_chunks(
    segment_ids: Sequence[int], segment_start: int, prompt: ReconstructionPrompt, position_limit: Optional[int] = None
) -> list[ReconstructionChunk]:
    """The reconstruction passes of the segment whose token ids are ``segment_ids`` (positions from
    ``segment_start``), in order, each ending within ``position_limit`` (the model's context length;
    None: no limit). Raises ``NoRoomForPasses`` (``ReconstructionPrompt.chunk_size_before``)."""
    ids = tuple(int(token) for token in segment_ids)
    chunk_size = prompt.chunk_size_before(segment_start + len(ids), position_limit)
    chunks = []
    for offset in range(0, len(ids), chunk_size):
        repeated = ids[offset : offset + chunk_size]
        if offset == 0:
            instruction = prompt.first_instruction
        else:
            instruction = prompt.later_instruction + ids[offset - prompt.overlap : offset]
        chunks.append(
            ReconstructionChunk(
                segment_start + offset,
                segment_start + offset + len(repeated),
                instruction + prompt.assistant_opening + repeated,
            )
        )
    return chunks


def reconstruction_stats(
    queries: torch.Tensor,
    context_keys: torch.Tensor,
    context_values: torch.Tensor,
    chunk_keys: torch.Tensor,
    chunk_values: torch.Tensor,
    scaling: float,
    request: StatsRequest,
    context_kept: Optional[torch.Tensor] = None,
) -> WindowStats:
    """One chunk's statistics for one layer (contract step 3), columns ``[0, end)``.

    queries: ``[H_q, m, D]`` post-RoPE queries of the chunk (positions ``end .. end + m - 1``).
    context_keys, context_values: ``[H_kv, end, D]`` keys and values of positions ``[0, end)``.
    chunk_keys, chunk_values: ``[H_kv, m, D]`` the chunk's own.
    context_kept: optional bool ``[H_kv, end]``: the entries of ``[0, end)`` kept at that moment.
    """
    end = context_keys.shape[1]
    keys = torch.cat([context_keys, chunk_keys], dim=1)
    values = torch.cat([context_values, chunk_values], dim=1)
    kept = None
    if context_kept is not None:
        own = torch.ones(chunk_keys.shape[:2], dtype=torch.bool, device=context_kept.device)
        kept = torch.cat([context_kept, own], dim=1)
    return crop_columns(window_stats(queries, keys, values, scaling, request, kept=kept), end)


def crop_columns(stats: WindowStats, end: int) -> WindowStats:
    """``stats`` with every per-position statistic cut to the columns ``[0, end)``."""
    cropped = {name: getattr(stats, name)[..., :end] for name in COLUMN_STATS if getattr(stats, name) is not None}
    return dataclasses.replace(stats, **cropped)


# How each statistic of a reconstruction request combines over chunks: a max over queries stays a
# max, a sum over queries adds, a per-key statistic is the same in every chunk. (``tail_attn`` is
# refused by ``StatsRequest`` for reconstruction queries.)
_MERGE = {
    "attn_max": torch.maximum,
    "attn_sum": torch.add,
    "obc_value": torch.add,
    "obc_key": torch.add,
    "obc_joint": torch.add,
    "value_l1": lambda first, _: first,
}


def merge_chunk_stats(accumulated: Optional[WindowStats], chunk: WindowStats) -> WindowStats:
    """Fold one chunk's statistics (from ``reconstruction_stats``) into those of the chunks before it
    (``None`` for the first); ``window`` counts every reconstruction query so far."""
    if accumulated is None:
        return chunk
    merged = {
        name: merge(getattr(accumulated, name), getattr(chunk, name))
        for name, merge in _MERGE.items()
        if getattr(accumulated, name) is not None
    }
    return WindowStats(window=accumulated.window + chunk.window, **merged)


class KVzipScorer(QueryHeadScorer):
    """``s[h, p] = max_i A[h, i, p]`` over the reconstruction queries ``i``; the common GQA reduction
    (default max, KVzip's) and pooling then apply."""

    request = StatsRequest(attn_max=True, queries=RECONSTRUCTION_QUERIES)

    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        return stats.attn_max[:, candidates]
