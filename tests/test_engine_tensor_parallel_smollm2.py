"""SmolLM2 (3 KV heads, 9 query heads) at ``--tp-size 3``, one KV head and its query group per rank:
the ranks keep exactly what the HF reference keeps with the whole model on one device, and decode the
same greedy tokens, on test_engine_parity_smollm2.py's pass-key prompts (about 600 tokens). Three
ranks on this machine's two cores: the slowest server of the suite per request, so one prompt a case:
the methods that allocate across heads and layers, and the uniform ones, with both score sources.
"""

from __future__ import annotations

import pytest

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.reference.engine import Mode
from test_engine_parity_smollm2 import case_id, case_options, mismatch_report, prompts, reference  # noqa: F401
from test_engine_tensor_parallel import ranks_plan

pytestmark = [pytest.mark.server, pytest.mark.smollm2]

TP = 3
CASES = [
    (policy, overrides) for policy in ("topk", "lava", "ada-snapkv", "pyramidkv", "snapkv")
    for overrides in ((("score", "attn"),), (("score", "learned"),))
]  # fmt: skip


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tp3-plans")


@pytest.fixture(scope="module")
def server(tmp_path_factory, dump_dir):
    flags = ("--kv-evict-policy", "snapkv", "--tp-size", str(TP), *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "8192",
             *client.TINY_SERVER_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp("smollm2-tp3")
    with client.checked_server("smollm2", log_dir, *flags, dump_dir=dump_dir) as running:
        yield running


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_smollm2_ranks_keep_what_one_device_keeps(case, server, reference, prompts, dump_dir):  # noqa: F811
    policy, overrides = case
    prompt = prompts[0]
    rid = f"tp3-{case_id(case)}"
    response = client.generate(server, list(prompt.token_ids), 8, rid=rid, options=case_options(case))
    policy_object = build_policy(EvictionConfig.for_policy(policy, **dict(overrides))).for_model(reference.model_dir)
    expected = reference.generate(prompt, policy_object, Mode.QUESTION_AWARE, 8)
    (reference_plan,) = expected.plans
    merged, per_rank = ranks_plan(dump_dir, rid, TP)
    client.assert_same_plan(merged, reference_plan)
    served = tuple(response["output_ids"])
    assert served == expected.output_ids, mismatch_report(reference, prompt, policy_object, served, expected.output_ids)
    assert client.stats(server)["tp_size"] == TP and len(per_rank) == TP
    client.assert_no_leak_after_flush(server)
