"""The real launcher and SGLang server, real HTTP requests, on the tiny model and on SmolLM2."""

from __future__ import annotations

import random
import re

import pytest

from serving import running_server
from sgl_kvevict.compat import cpu_mode_needed
from sgl_kvevict.engine.adapter.start_method import FORK_ANNOUNCEMENT

pytestmark = pytest.mark.server

SUBJECTS = ["The river", "A small town", "The old library", "Our garden", "The mountain road", "The harbor"]
VERBS = ["was busy", "looked calm", "felt warm", "stayed open", "grew quiet", "seemed bright", "was crowded"]
TIMES = ["in the morning", "after lunch", "during the storm", "at dusk", "on Sunday", "before dawn"]


def pass_key_prompt(pass_key: str, depth: float, filler_sentences: int, seed: int) -> str:
    """About 9 tokens per filler sentence of varied text, the needle at ``depth`` of it."""
    rng = random.Random(seed)
    sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(TIMES)}." for _ in range(filler_sentences)]
    sentences.insert(int(depth * filler_sentences), f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key.")
    return (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.\n" + " ".join(sentences) + "\n\nWhat is the pass key? "
        "Answer with the number only."
    )


def test_tiny_model_chat_and_prefix_cache(tiny_llama_dir, tmp_path):
    prompt = "remember the document about the radix tree and the cache " * 12
    with running_server(tiny_llama_dir, tmp_path) as server:
        first = server.chat([{"role": "user", "content": prompt + "first question?"}])
        assert first["choices"][0]["message"]["content"] is not None
        assert first["usage"]["completion_tokens"] > 0
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        second = server.chat([{"role": "user", "content": prompt + "second question?"}])
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # The shared prefix (chat template + repeated sentence) comes back from the radix cache,
        # the differing question does not.
        assert 0.5 * first["usage"]["prompt_tokens"] < cached < second["usage"]["prompt_tokens"]
        log = server.log()
        assert "policy=none" in log
    if cpu_mode_needed():
        # SGLang's warning per model module the CPU mode cannot import, folded into one line
        # (sgl_kvevict/compat/skipped_models.py).
        assert "Ignore import error" not in log
        assert FORK_ANNOUNCEMENT in log  # the scheduler and detokenizer inherit SGLang's modules
        # SGLang's own post-warm-up /freeze_gc is skipped without a warm-up (it raced uvicorn's start and
        # logged a traceback); the launcher's, once healthy, went through.
        assert "Traceback" not in log and "could not freeze the garbage collector" not in log, log[-3000:]
        assert len(re.findall(r"\] \d+ SGLang model modules skipped on CPU \(", log)) == 1, log[-3000:]


@pytest.mark.smollm2
def test_smollm2_finds_pass_key(smollm2_dir, tmp_path):
    cases = [("68213", 0.1), ("40571", 0.5), ("27719", 0.9)]
    with running_server("smollm2", tmp_path) as server:
        for seed, (pass_key, depth) in enumerate(cases):
            response = server.chat(
                [{"role": "user", "content": pass_key_prompt(pass_key, depth, 110, seed)}], max_tokens=12
            )
            prompt_tokens = response["usage"]["prompt_tokens"]
            assert 900 <= prompt_tokens <= 1100, prompt_tokens
            answer = response["choices"][0]["message"]["content"]
            assert re.search(pass_key, answer), (pass_key, depth, answer)
