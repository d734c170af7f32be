"""PrefillFootprint: the slots a prompt holds at its peak while blocks are compressed chunk by chunk,
against a step-by-step count of the chunks, and the longest prompt a pool serves."""

from __future__ import annotations

import random

import pytest

from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.footprint import PrefillFootprint
from sgl_kvevict.scope import BlockScope, RequestScope


def counted_peak(start: int, end: int, block: int, kept: int, chunk: int) -> int:
    """Slots held during each chunk's forward of ``[start, end)``: the blocks (aligned at 0) that ended in
    an earlier chunk are compressed to ``kept`` slots, everything else prefilled so far is dense."""
    first_boundary = start + (-start) % block
    peak, done = 0, start
    while done < end:
        chunk_end = min(done + chunk, end)
        compressed = max(0, done - first_boundary) // block if done > first_boundary else 0
        dense = (chunk_end - start) - compressed * block
        peak = max(peak, compressed * kept + dense)
        done = chunk_end
    return peak


@pytest.mark.parametrize("seed", range(200))
def test_peak_slots_bound_the_chunk_by_chunk_count(seed):
    rng = random.Random(seed)
    block = rng.choice([32, 64, 128, 256])
    footprint = PrefillFootprint(block, rng.randint(1, block), rng.choice([16, 64, 256, 512, 2048]))
    start = rng.randrange(0, 3000)
    end = start + rng.randrange(1, 9000)
    counted = counted_peak(start, end, block, footprint.kept_per_block, footprint.chunk_size)
    bound = footprint.peak_slots(start, end)
    assert counted < bound  # + 1 for the arena's partly used last slot
    # Never looser than a block and a chunk: the bound counts every block compressed and the most
    # dense tokens any chunk can see, which need not be the same moment.
    assert bound - counted <= block + footprint.chunk_size + 1


@pytest.mark.parametrize("pool", [300, 1000, 3000, 16000])
@pytest.mark.parametrize("kept", [64, 150, 256])  # a block keeping more than half its slots raises the limit too
def test_the_longest_prompt_is_the_last_length_that_fits(pool, kept):
    footprint = PrefillFootprint(block_size=256, kept_per_block=kept, chunk_size=512)
    longest = footprint.longest_prompt(pool, reserved_slots=1)
    assert footprint.peak_slots(0, longest) + 1 <= pool < footprint.peak_slots(0, longest + 1) + 1
    if pool >= 3000 and kept < 256:
        assert longest > pool  # compress while prefilling serves prompts longer than the pool


def test_only_block_scope_with_chunks_and_a_budget_compresses_while_prefilling():
    config = EvictionConfig.for_policy("snapkv", budget="0.25")
    assert PrefillFootprint.of(config, BlockScope(256), 512) == PrefillFootprint(256, 64, 512)
    assert PrefillFootprint.of(config, RequestScope(), 512) is None
    assert PrefillFootprint.of(config, BlockScope(256), None) is None
    assert PrefillFootprint.of(EvictionConfig.for_policy("snapkv", budget="0.25", score="kvzip"), BlockScope(256), 512) is None
    for score in ("attn", "learned", "obc-value", "obc-key", "obc-joint"):  # scored by the prefill itself
        assert PrefillFootprint.of(EvictionConfig.for_policy("snapkv", budget="0.25", score=score), BlockScope(256), 512)


def test_a_prompt_that_fits_dense_never_needs_more_than_its_dense_slots():
    """993 tokens, 512-token blocks, 487-token chunks: block, block in progress and chunk would count
    1122 slots, but a block's cells take its own dense slots, so 993 + 1 is the most it holds, and a
    1000-slot pool serves what stock serves."""
    footprint = PrefillFootprint(block_size=512, kept_per_block=128, chunk_size=487)
    assert footprint.peak_slots(0, 993) == 994
    assert footprint.longest_prompt(1000, reserved_slots=1) >= 998
