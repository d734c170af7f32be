"""Prefill schedules: which forwards a prompt is fed in, and which segments each one compresses.

A prompt is prefilled in one or more forwards (``PrefillStep``); after a forward, the segments listed
for it are compressed, with observation windows whose queries were computed in that forward. Every
setting of the project is a schedule over the same loop:

* question-aware: one forward over the prompt, compressing the whole prompt;
* context-only: a forward over the context, compressing it, then the question on top, uncompressed
  (the setting of prefix reuse: the compressed context does not depend on the question);
* block scope: the same forwards, but the compressed range is cut into blocks ``[b*B, (b+1)*B)``
  aligned at position 0, each with its own window inside the block, so a block depends only on the
  tokens up to its end. Blocks compressed in the same forward see the full cache before them; a
  block fed in a later forward sees the earlier blocks as compressed (a request reusing them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Mode(str, enum.Enum):
    QUESTION_AWARE = "question-aware"
    CONTEXT_ONLY = "context-only"


@dataclass(frozen=True)
class Segment:
    """A token range ``[start, end)`` compressed once; ``block``: a block of block scope, which keeps its
    observation window in its node (request scope's stays dense after it: ``local_layers``)."""

    start: int
    end: int
    block: bool = False

    def __post_init__(self):
        if not 0 <= self.start < self.end:
            raise ValueError(f"segment [{self.start}, {self.end}) is empty or negative")


@dataclass(frozen=True)
class PrefillStep:
    """Feed tokens up to ``end`` in one forward, then compress ``segments`` (in order)."""

    end: int
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """Consecutive prefill steps covering a prompt of ``steps[-1].end`` tokens.

    Validation: step ends increase; segments are disjoint, in order, and end inside their step (a
    segment's window must be computed in the forward that compresses it).
    """

    steps: tuple[PrefillStep, ...]

    def __post_init__(self):
        if not self.steps:
            raise ValueError("a schedule needs at least one prefill step")
        step_start, compressed_until = 0, 0
        for step in self.steps:
            if step.end <= step_start:
                raise ValueError(f"prefill step ends at {step.end}, not after the previous step ({step_start})")
            for segment in step.segments:
                if segment.start < compressed_until:
                    raise ValueError(f"segment [{segment.start}, {segment.end}) overlaps an earlier segment")
                if not step_start < segment.end <= step.end:
                    raise ValueError(
                        f"segment [{segment.start}, {segment.end}) must end inside its step [{step_start}, {step.end})"
                    )
                compressed_until = segment.end
            step_start = step.end

    @property
    def length(self) -> int:
        return self.steps[-1].end

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(segment for step in self.steps for segment in step.segments)

    @classmethod
    def for_mode(cls, mode: Mode, prompt_length: int, context_end: int, block_size: Optional[int] = None) -> "Schedule":
        """The schedule of ``mode`` for a prompt whose first ``context_end`` tokens are the context.

        block_size: ``None`` compresses the compressed range as one segment; an integer cuts it into
        the full blocks it contains (a partial last block stays uncompressed).
        """
        mode = Mode(mode)
        if not 0 < context_end <= prompt_length:
            raise ValueError(f"context end {context_end} must be in (0, {prompt_length}]")
        compressed_end = prompt_length if mode is Mode.QUESTION_AWARE else context_end
        segments = compressed_segments(compressed_end, block_size)
        if compressed_end == prompt_length:
            return cls((PrefillStep(prompt_length, segments),))
        return cls((PrefillStep(compressed_end, segments), PrefillStep(prompt_length)))


def compressed_segments(end: int, block_size: Optional[int]) -> tuple[Segment, ...]:
    """``[0, end)`` as one segment, or as its full blocks of ``block_size`` tokens."""
    if block_size is None:
        return (Segment(0, end),)
    if block_size < 1:
        raise ValueError(f"block size {block_size} must be >= 1")
    return tuple(Segment(start, start + block_size, block=True) for start in range(0, end - block_size + 1, block_size))
