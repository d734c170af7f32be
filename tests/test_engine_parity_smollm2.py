"""Parity of the SGLang engine with the HF reference engine on SmolLM2 pass-key prompts, per policy.

For every registered policy (and SnapKV with the OBCache joint score), one real fp32 server (every
policy on it, chosen per request with ``--kv-evict-per-request``) answers chat-template pass-key
prompts of about 600 tokens, sent as the token ids the reference engine built
(``ReferenceEngine.chat_prompt``), so both sides see identical ids. In request scope the server
compresses the whole single-turn prompt with its observation window at the end, which is the
reference's question-aware mode. The server's greedy tokens must equal the reference's, and the
positions it keeps per (layer, KV head) (its plan dumps) must equal the reference's plan.

On a token mismatch the failure names the first differing step and the reference's top-2 logit gap
there, so fp32 summation-order noise (a near tie) can be told apart from a real divergence.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kvevict.measure.tasks import make_task
import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.policies import registered_policies
from sgl_kvevict.reference.engine import Mode, Prompt

pytestmark = [pytest.mark.server, pytest.mark.smollm2]

# (seed, depth) of the pass-key tasks; about 600 prompt tokens each with the chat template.
PASSKEY_TASKS = ((0, 0.3), (1, 0.7))
CONTEXT_TOKENS = 560
MAX_NEW_TOKENS = 8
# Every registered policy at its defaults (budget 0.25 where one applies; topk's default score is
# KVzip), plus an OBCache score and the learned score with the bundled SmolLM2 weights under a uniform
# and a layer-budgeted policy. KVzip and learned under the other policies are held to the reference on
# the tiny model (test_engine_parity.py, test_engine_chunked.py): the SmolLM2 run costs a minute a case.
CASES = [(policy, ()) for policy in registered_policies()] + [("snapkv", (("score", "obc-joint"),))] + [
    (policy, (("score", "learned"),)) for policy in ("topk", "lava")
]
# One server serves every case (--kv-evict-per-request); each case answers both prompts.


def case_id(case) -> str:
    policy, overrides = case
    return "-".join([policy, *(value for _, value in overrides)])


def case_options(case) -> str:
    policy, overrides = case
    return ",".join(f"{key}={value}" for key, value in (("policy", policy), *overrides))


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="module")
def server(tmp_path_factory, dump_dir):
    flags = ("--kv-evict-policy", "snapkv", *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "8192", *client.TINY_SERVER_FLAGS)
    log_dir = tmp_path_factory.mktemp("smollm2-parity")
    with client.checked_server("smollm2", log_dir, *flags, dump_dir=dump_dir) as running:
        yield running


@pytest.fixture(scope="module")
def reference():
    from sgl_kvevict.reference.engine import ReferenceEngine

    return ReferenceEngine("smollm2", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(reference) -> list[Prompt]:
    tokenizer = reference.tokenizer

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    built = []
    for seed, depth in PASSKEY_TASKS:
        task = make_task("passkey", seed, CONTEXT_TOKENS, depth, count_tokens)
        prompt = reference.chat_prompt(task.context, task.question, task.answer_prefix)
        assert 550 <= len(prompt) <= 700, len(prompt)
        # The ids are the chat template's rendering tokenized as one piece (the split at the question
        # boundary does not change them), so the server's own tokenization of the chat would agree.
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{task.context}\n\n{task.question}"}], tokenize=False, add_generation_prompt=True
        )
        assert list(prompt.token_ids) == tokenizer.encode(rendered + task.answer_prefix, add_special_tokens=False)
        built.append(prompt)
    return built


def reference_top2_gaps(reference, prompt: Prompt, policy, tokens: tuple[int, ...]) -> list[tuple[int, int, float]]:
    """Per step along ``tokens``: the reference's (top-1 id, top-2 id, logit gap)."""
    from sgl_kvevict.reference.schedule import Schedule

    schedule = Schedule.for_mode(Mode.QUESTION_AWARE, len(prompt), prompt.context_end)
    sequence, logits = reference.prefill(prompt, policy, schedule)
    gaps = []
    for token in tokens:
        top = torch.topk(logits, 2)
        gaps.append((int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])))
        logits = reference.extend(sequence, [token])
    return gaps


def mismatch_report(reference, prompt, policy, served: tuple[int, ...], expected: tuple[int, ...]) -> str:
    step = next((i for i, (a, b) in enumerate(zip(served, expected)) if a != b), min(len(served), len(expected)))
    gaps = reference_top2_gaps(reference, prompt, policy, expected[: step + 1])
    detail = f"; reference top-2 there {gaps[step]} (ids, ids, logit gap)" if step < len(gaps) else ""
    return f"server {served} != reference {expected}: first differing step {step}{detail}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_smollm2_passkey_greedy_parity(case, server, reference, prompts, dump_dir):
    policy, overrides = case
    config = EvictionConfig.for_policy(policy, **dict(overrides))
    for index, prompt in enumerate(prompts):
        rid = f"{case_id(case)}-{index}"
        response = client.generate(server, list(prompt.token_ids), MAX_NEW_TOKENS, rid=rid, options=case_options(case))
        assert response["meta_info"]["prompt_tokens"] == len(prompt)
        policy_object = build_policy(config).for_model(reference.model_dir)
        expected = reference.generate(prompt, policy_object, Mode.QUESTION_AWARE, MAX_NEW_TOKENS)
        (reference_plan,) = expected.plans
        client.assert_same_plan(torch.load(dump_dir / f"{rid}.pt"), reference_plan)
        served = tuple(response["output_ids"])
        assert served == expected.output_ids, mismatch_report(reference, prompt, policy_object, served, expected.output_ids)
        client.assert_no_leak_after_flush(server)
