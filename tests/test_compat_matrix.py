"""The compatibility matrix (docs/compatibility.md): a tiny random-weight version of each architecture of
``checkpoints.COMPATIBILITY_MATRIX``, served by the real launcher or refused by it in one line before
the model loads.

A served architecture gets a server per scope (request, and block as ``make serve`` starts one) with
``topk`` and the learned score, its weights trained by the project's own command on that model, which
also serves per request ``topk`` with a KVzap scorer folder (random, in the layout NVIDIA publishes) and
``snapkv`` (attention scores). For each: the server keeps exactly the positions the HF reference
engine keeps (every block's, in block scope) and decodes the same greedy tokens (fp32); a later turn
reuses the compressed prefix and still decodes the reference's tokens; after a flush every cell and
slot is back. Gemma 3's local layers keep their window whatever the policy (``local_layers.py``), in
the reference as in the server. A refused architecture
exits the launcher with code 2 and the limit's line, before SGLang starts. Which architectures are
refused is the launcher's reading of config.json (``architectures.py``); the last test holds that
reading to SGLang's own for every architecture of the matrix, and the first the generated tables
(docs/compatibility.md, README.md) to these expectations.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest_policies import kvzap_folder, tiny_training
import engine_client as client
from serving import error_lines, free_port
from sgl_kvevict.architectures import local_attention_layers, model_facts_of
from sgl_kvevict.checkpoints import COMPATIBILITY_MATRIX, build_tiny_model
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.scoring.learned import ModelShape
from sgl_kvevict.server import compat_table

pytestmark = pytest.mark.server

# The matrix's expectations: what each architecture does with a policy (docs/compatibility.md).
SERVED = ("llama3", "qwen2.5", "qwen3", "qwen3-moe", "mistral", "phi3", "gemma3", "olmo2", "granite", "glm4")
SCOPES = ("request", "block")
# Two blocks of a PROMPT_LENGTH prompt, each keeping more than the window at 0.25, and longer than Gemma 3's
# tiny window (64), so local layers save.
BLOCK = 192
REFUSED = {
    "gpt-oss": "sliding-window layers",
    "deepseek-v3": "MLA models",
    "qwen3-next": "state-space layers",
}
PROMPT_LENGTH = 400
MAX_NEW_TOKENS = 6
NEW_TURN_TOKENS = 20


def test_the_expectations_cover_the_whole_matrix_once_and_the_tables_say_them():
    assert sorted([*SERVED, *REFUSED]) == sorted(arch.name for arch in COMPATIBILITY_MATRIX)
    verdicts = {row.arch.name: row.verdict for row in compat_table.rows()}
    assert verdicts == {name: "served" if name in SERVED else f"refused: {REFUSED.get(name)}" for name in verdicts}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Architecture name -> its tiny model folder, built on first use."""
    folders = {}

    def folder(name: str):
        if name not in folders:
            folders[name] = build_tiny_model(tmp_path_factory.mktemp(name), name)
        return folders[name]

    return folder


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


class Served:
    """One architecture's model, learned weights, reference engine and running server."""

    def __init__(self, name, scope, model_dir, weights, kvzap, reference, server, dump_dir):
        self.name, self.scope, self.model_dir, self.weights, self.kvzap = name, scope, model_dir, weights, kvzap
        self.reference, self.server, self.dump_dir = reference, server, dump_dir

    @property
    def block_size(self):
        return BLOCK if self.scope == "block" else None

    def dumped(self, rid: str) -> list[dict]:
        """The plans the server dumped for ``rid``, in position order."""
        if self.scope == "request":
            return [torch.load(self.dump_dir / f"{rid}.pt")]
        return [torch.load(self.dump_dir / f"{rid}.block{block}.pt") for block in range(PROMPT_LENGTH // BLOCK)]

    def config(self, policy: str) -> EvictionConfig:
        if policy == "topk":  # the server's own setting
            return EvictionConfig.for_policy("topk", score="learned", learned_weights=self.weights)
        if policy == "topk-kvzap":  # a KVzap MLP scorer folder for this model, as NVIDIA publishes them
            return EvictionConfig.for_policy("topk", score="learned", learned_weights=str(self.kvzap))
        return EvictionConfig.for_policy(policy)


@pytest.fixture(scope="module")
def scorers(tiny_models, tmp_path_factory):
    """Architecture name -> (learned weights, KVzap folder) for its tiny model, trained on first use."""
    from sgl_kvevict.reference.train_scorer import train

    found = {}

    def of(name: str):
        if name not in found:
            model_dir = tiny_models(name)
            training = tiny_training(model_dir, tmp_path_factory.mktemp(f"{name}-weights"))
            weights = str(train(training, "tests/test_compat_matrix.py", log=lambda line: None))
            shape = ModelShape.of(model_dir)
            kvzap, _ = kvzap_folder(tmp_path_factory.mktemp(f"{name}-kvzap"), shape.num_layers, shape.hidden_size,
                                    shape.num_kv_heads, hidden_dim=32)  # fmt: skip
            found[name] = weights, kvzap
        return found[name]

    return of


@pytest.fixture(scope="module", params=[(name, scope) for name in SERVED for scope in SCOPES], ids="-".join)
def served(request, tiny_models, scorers, tmp_path_factory):
    from sgl_kvevict.reference.engine import ReferenceEngine

    name, scope = request.param
    model_dir = tiny_models(name)
    weights, kvzap = scorers(name)
    dump_dir = tmp_path_factory.mktemp(f"{name}-{scope}-plans")
    scope_flags = ("--kv-evict-scope", "block", "--kv-evict-block-size", str(BLOCK)) if scope == "block" else ()
    flags = ("--kv-evict-policy", "topk", "--kv-evict-score", "learned", "--kv-evict-learned-weights", weights,
             *scope_flags, *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "4096", *client.TINY_SERVER_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp(f"{name}-{scope}-server")
    with client.checked_server(model_dir, log_dir, *flags, dump_dir=dump_dir) as server:
        reference = ReferenceEngine(model_dir, dtype=torch.float32)
        yield Served(name, scope, model_dir, weights, kvzap, reference, server, dump_dir)


def serve(served: Served, policy: str, prompt: list[int], rid: str) -> dict:
    """Greedy tokens of ``prompt``: the server's own setting for ``topk``, else ``policy`` per request."""
    options = None if policy == "topk" else client.request_options(served.config(policy))
    return client.generate(served.server, prompt, MAX_NEW_TOKENS, rid=rid, options=options)


@pytest.mark.parametrize("policy", ["topk", "topk-kvzap", "snapkv"])
def test_the_server_keeps_and_answers_what_the_reference_does(served, policy):
    prompt = random_prompt(PROMPT_LENGTH, seed=1)
    rid = f"{served.name}-{policy}"
    response = serve(served, policy, prompt, rid)
    config = served.config(policy)
    expected = served.reference.generate(
        prompt, build_policy(config), max_new_tokens=MAX_NEW_TOKENS, block_size=served.block_size
    )  # fmt: skip
    dumped = served.dumped(rid)
    assert len(dumped) == len(expected.plans)
    for server_plan, plan in zip(dumped, expected.plans):
        assert plan.total_kept() < plan.segment_length * plan.num_layers * plan.layers[0].num_kv_heads  # compressed
        client.assert_same_plan(server_plan, plan)
    assert tuple(response["output_ids"]) == expected.output_ids
    assert client.stats(served.server)["compressed_nodes"] >= 1
    client.assert_no_leak_after_flush(served.server)


def test_a_later_turn_reuses_the_compressed_prefix(served):
    from sgl_kvevict.reference.engine import Prompt
    from sgl_kvevict.reference.replay import ReplayedPlans
    from sgl_kvevict.reference.schedule import PrefillStep, Schedule, Segment

    config = served.config("topk")
    first = random_prompt(PROMPT_LENGTH, seed=2)
    answer = serve(served, "topk", first, f"{served.name}-turn-1")["output_ids"]
    before = client.stats(served.server)
    second = first + list(answer) + random_prompt(NEW_TURN_TOKENS, seed=3)
    response = serve(served, "topk", second, f"{served.name}-turn-2")
    after = client.stats(served.server)
    assert after["reuse_hits"] == before["reuse_hits"] + 1
    # Request scope reuses the whole prompt; block scope its blocks (its tail after them stays dense).
    reused = PROMPT_LENGTH if served.scope == "request" else PROMPT_LENGTH // BLOCK * BLOCK
    assert response["meta_info"]["cached_tokens"] >= reused
    # The reference reads turn 1's plans (the ones the server dumped for it) and prefills the rest on top.
    turn_one = served.reference.generate(
        first, build_policy(config), max_new_tokens=MAX_NEW_TOKENS, block_size=served.block_size
    )  # fmt: skip
    assert turn_one.output_ids == tuple(answer)
    segments = tuple(Segment(plan.segment_start, plan.segment_end, block=served.scope == "block") for plan in turn_one.plans)
    schedule = Schedule((PrefillStep(PROMPT_LENGTH, segments), PrefillStep(len(second))))
    expected = served.reference.generate_scheduled(
        Prompt.from_ids(second), ReplayedPlans(config, turn_one.plans), schedule, MAX_NEW_TOKENS
    )
    assert tuple(response["output_ids"]) == expected.output_ids
    client.assert_no_leak_after_flush(served.server)


def test_full_decodes_the_dense_models_tokens_and_a_later_turn_reuses_it(served):
    """``full`` per request (nothing evicted, so the prompt stays dense in the tree; Gemma 3's local layers are
    kept to their window, losslessly, in a compressed node): both turns decode the dense model's greedy tokens
    (the reference's, which evicts nothing), the second on the first's cached prefix."""
    full = EvictionConfig.for_policy("full")
    first = random_prompt(PROMPT_LENGTH, seed=4)
    dense = served.reference.generate(first, build_policy(full), max_new_tokens=MAX_NEW_TOKENS)
    assert tuple(serve(served, "full", first, f"{served.name}-full-1")["output_ids"]) == dense.output_ids
    second = first + list(dense.output_ids) + random_prompt(NEW_TURN_TOKENS, seed=5)
    response = serve(served, "full", second, f"{served.name}-full-2")
    reused = PROMPT_LENGTH if served.scope == "request" else PROMPT_LENGTH // BLOCK * BLOCK
    assert response["meta_info"]["cached_tokens"] >= reused
    expected = served.reference.generate(second, build_policy(full), max_new_tokens=MAX_NEW_TOKENS)
    assert tuple(response["output_ids"]) == expected.output_ids
    client.assert_no_leak_after_flush(served.server)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_launcher_refuses_in_one_line_before_the_model_loads(name, tiny_models, monkeypatch, capsys):
    """In-process (the launcher's own main, seconds cheaper than a process each): it returns before it
    starts SGLang, which would be its only way to load the model."""
    from sgl_kvevict.server import launcher

    monkeypatch.setattr(launcher, "run_single", lambda *args: pytest.fail("the launcher started SGLang"))
    assert launcher.main(["--model", str(tiny_models(name)), "--port", str(free_port()), "--kv-evict-policy", "topk"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert f"cannot be served with a --kv-evict-policy: {REFUSED[name]}: " in line
    # gpt-oss runs only on SGLang backends the plugin does not wrap: the line says which.
    assert ("only on the triton, " in line) == (name == "gpt-oss"), line


def sglang_facts(model_dir) -> dict[str, bool]:
    """What SGLang 0.5.23 resolves for the model, without loading it: the facts the tree reads
    (engine/adapter/factory.py) from the model runner, by SGLang's own functions."""
    import types

    from sgl_kvevict.compat import activate_cpu_mode

    activate_cpu_mode()
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state
    from sglang.srt.model_executor.model_runner_components.load_model_utils import resolve_sliding_window_size
    from sglang.srt.models.registry import ModelRegistry

    model_config = ModelConfig(str(model_dir))
    model_class, _ = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
    # The runner asks the loaded model; the method reads only the model's config.
    model = types.SimpleNamespace(config=model_config.hf_config)
    if hasattr(model_class, "get_attention_sliding_window_size"):
        model.get_attention_sliding_window_size = types.MethodType(model_class.get_attention_sliding_window_size, model)
    # The tree serves the local layers of models whose layers SGLang keeps in the one pool (Gemma 3's).
    windowed = resolve_sliding_window_size(model, model_config) is not None and local_attention_layers(model_dir) is None
    return {
        "mla_model": model_config.attention_arch == AttentionArch.MLA,
        "sliding_window_layers": model_config.is_hybrid_swa or windowed,
        "state_space_layers": uses_ssm_state(model_config),
    }


@pytest.mark.parametrize("name", [arch.name for arch in COMPATIBILITY_MATRIX])
def test_the_launchers_reading_of_the_config_is_sglangs(name, tiny_models):
    facts = model_facts_of(tiny_models(name))
    assert facts == sglang_facts(tiny_models(name))
    assert any(facts.values()) == (name in REFUSED)
