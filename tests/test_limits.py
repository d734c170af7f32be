"""sgl_kvevict.limits: one table of refused SGLang features for the launcher and the tree, and the
SGLang version guard. Pure, in-process."""

from __future__ import annotations

import dataclasses

import pytest

from sgl_kvevict.limits import (
    LIMITS,
    SGLANG_VERSION,
    LimitFlag,
    SetupFacts,
    UnsupportedVersion,
    check_sglang_version,
    violations,
)

# For each limit the tree checks, a set-up that breaks it (and nothing else).
BROKEN_SETUPS = {
    "page size": {"page_size": 16},
    "prefill CUDA graphs": {"prefill_cuda_graphs": True},
    "decode graph backend": {"decode_graphs": "breakable"},
    "torch.compile": {"torch_compile": True},
    "hierarchical cache": {"hierarchical_cache": True},
    "replicated KV heads": {"kv_heads_replicated": True},
    "pipeline parallelism": {"pp_size": 2},
    "data parallelism": {"dp_size": 2},
    "DP attention": {"attention_dp": True},
    "no radix cache": {"radix_cache_disabled": True},
    "radix eviction policy": {"radix_eviction_policy": True},
    "session radix cache": {"session_radix_cache": True},
    "speculative decoding": {"speculative": True},
    "mixed chunks": {"mixed_chunk": True},
    "PD disaggregation": {"disaggregation": True},
    "several tokenizer workers": {"tokenizer_workers": 4},
    "attention backend": {"attention_backend_wrapped": False},
    "MLA models": {"mla_model": True},
    "sliding-window layers": {"sliding_window_layers": True},
    "decode graphs with local layers": {"local_layer_decode_graphs": True},
    "state-space layers": {"state_space_layers": True},
}
# Limits only the launcher can refuse, each for the reason its text gives.
LAUNCHER_ONLY = {"another radix-cache backend", "config file"}


def test_the_supported_setup_breaks_no_limit():
    assert violations(SetupFacts()) == []


@pytest.mark.parametrize("name", sorted(BROKEN_SETUPS))
def test_the_tree_refuses_each_limit_from_its_facts_alone(name):
    [line] = violations(SetupFacts(**BROKEN_SETUPS[name]))
    limit = next(limit for limit in LIMITS if limit.name == name)
    assert line == f"{name}: {limit.reason}"


def test_every_limit_is_checked_by_the_tree_unless_the_tree_cannot_exist_then():
    checked = {limit.name for limit in LIMITS if limit.violated is not None}
    assert checked == set(BROKEN_SETUPS)
    assert {limit.name for limit in LIMITS} == checked | LAUNCHER_ONLY
    for limit in LIMITS:
        if limit.name in LAUNCHER_ONLY:
            assert limit.flags and "only the launcher" in limit.reason or "the tree still checks" in limit.reason
    every_fact = {field.name for field in dataclasses.fields(SetupFacts)}
    assert every_fact == {fact for setup in BROKEN_SETUPS.values() for fact in setup}


def test_decode_graphs_are_full_cuda_graphs_or_none_and_prefill_graphs_are_refused():
    prefill = next(limit for limit in LIMITS if limit.name == "prefill CUDA graphs")
    decode = next(limit for limit in LIMITS if limit.name == "decode graph backend")
    assert {spelling for flag in prefill.flags for spelling in flag.spellings} == {
        "--cuda-graph-backend-prefill", "--cuda-graph-config"
    }
    [decode_flag] = decode.flags
    assert decode_flag.spellings == ("--cuda-graph-backend-decode",)
    assert [decode_flag.refuses(value) for value in ("full", "disabled", "breakable")] == [False, False, True]
    assert not prefill.flags[0].refuses("disabled") and prefill.flags[0].refuses("full")
    for captured in ("full", "disabled"):
        assert violations(SetupFacts(decode_graphs=captured)) == []
    [line] = violations(SetupFacts(decode_graphs="cpu"))
    assert line.startswith("decode graph backend: compressed requests replay SGLang's full decode CUDA graphs")


def test_flag_conditions():
    above = LimitFlag(("--tp-size",), above=1)
    assert above.refuses("2") and not above.refuses("1") and not above.refuses("two")
    assert above.condition() == "--tp-size > 1"
    allowed = LimitFlag(("--attention-backend",), allowed=("torch_native", "flashinfer"))
    assert allowed.refuses("triton") and not allowed.refuses("flashinfer")
    assert allowed.condition() == "--attention-backend other than torch_native or flashinfer"
    switch = LimitFlag(("--enable-mixed-chunk",))
    assert switch.refuses(None) and switch.condition() == "--enable-mixed-chunk"


def test_only_the_pinned_sglang_version_is_accepted():
    check_sglang_version()  # the installed one
    check_sglang_version(SGLANG_VERSION)
    with pytest.raises(UnsupportedVersion, match=r"sglang==0\.5\.23 only .* sglang 0\.5\.24 is installed"):
        check_sglang_version("0.5.24")


def test_the_plugin_refuses_to_register_in_another_sglang(monkeypatch):
    import importlib.metadata

    from sgl_kvevict.engine.adapter import contacts
    from sgl_kvevict.serving import ENV_VAR, ServingConfig

    monkeypatch.setenv(ENV_VAR, ServingConfig("lava").to_env())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.24" if name == "sglang" else "0")
    with pytest.raises(UnsupportedVersion, match="sglang 0.5.24 is installed"):
        contacts.register()
