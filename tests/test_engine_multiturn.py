"""Three chat turns over a ~1,500-token document on SmolLM2 under LAVa at budget 0.25.

Each turn's prompt is compressed after its prefill and kept in the radix tree; the next turn's prompt
starts with it, so turns 2 and 3 report the earlier turns as cached tokens and the stats count the
reuse. Mechanics only: a greedy bf16 answer through a compressed cache changes with batch and machine,
so answers are asserted only by the fp32 parity tests, and quality is measured by the benchmarks.
"""

from __future__ import annotations

import random

import pytest

from engine_client import MEMORY_FLAGS, assert_no_leak_after_flush, assert_strict_idle_check_passed, stats
from serving import running_server

pytestmark = [pytest.mark.server, pytest.mark.smollm2]

SUBJECTS = ["The river", "A small town", "The old library", "Our garden", "The mountain road", "The harbor"]
VERBS = ["was busy", "looked calm", "felt warm", "stayed open", "grew quiet", "seemed bright", "was crowded"]
TIMES = ["in the morning", "after lunch", "during the storm", "at dusk", "on Sunday", "before dawn"]
PASS_KEY = "40571"


def document(filler_sentences: int = 165, depth: float = 0.3, seed: int = 7) -> str:
    rng = random.Random(seed)
    sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(TIMES)}." for _ in range(filler_sentences)]
    sentences.insert(int(depth * filler_sentences), f"The pass key is {PASS_KEY}. Remember it. {PASS_KEY} is the pass key.")
    return "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n" + " ".join(sentences)


def test_three_turns_reuse_compressed_history(smollm2_dir, tmp_path):
    flags = ("--kv-evict-policy", "lava", "--kv-evict-budget", "0.25", "--max-total-tokens", "16384", *MEMORY_FLAGS)
    questions = [
        "What is the pass key? Answer with the number only.",
        "Is the text above about a river? Answer yes or no.",
        "Tell me the pass key again. Answer with the number only.",
    ]
    with running_server("smollm2", tmp_path, *flags) as server:
        messages = [{"role": "user", "content": f"{document()}\n\n{questions[0]}"}]
        turns = []
        for turn, question in enumerate(questions):
            if turn:
                messages.append({"role": "user", "content": question})
            response = server.chat(messages, max_tokens=12)
            messages.append({"role": "assistant", "content": response["choices"][0]["message"]["content"]})
            turns.append(response)

        first_prompt_tokens = turns[0]["usage"]["prompt_tokens"]
        assert 1300 <= first_prompt_tokens <= 1800, first_prompt_tokens
        for earlier, later in zip(turns, turns[1:]):
            assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= earlier["usage"]["prompt_tokens"]

        after = stats(server)
        assert after["policy"] == "lava" and after["budget"] == "0.25"
        assert after["reuse_hits"] == 2
        assert after["compressed_nodes"] >= 1  # turns 2 and 3 add fewer new tokens than the window
        # The first prompt alone holds (prompt - window) logical tokens in about a quarter of their cells.
        assert after["compressed_tokens"] >= first_prompt_tokens - 32
        assert after["kept_cells"] <= 0.25 * after["compressed_tokens"] * 30 * 3
        assert_no_leak_after_flush(server)
        assert_strict_idle_check_passed(server)
