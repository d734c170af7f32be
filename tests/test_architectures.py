"""The launcher's reading of a model's config.json (``architectures.model_facts``) on the fields of
published configs as they are saved on the hub: older spellings included, which the tiny models of the
matrix (saved by transformers 5) do not show; and Gemma 3's local layers from those configs
(``local_layers_of_config``); and the attention backends SGLang runs Gemma 4, gpt-oss and Exaone 4 on, which a
refusal of them names, read back from SGLang's source. Pure, in-process."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from sgl_kvevict.architectures import (
    SGLANG_ATTENTION_BACKENDS,
    attention_backends_note,
    attention_backends_of_config,
    local_layers_of_config,
    model_facts,
)
from sgl_kvevict.limits import WRAPPED_ATTENTION_BACKENDS

NONE = {"mla_model": False, "sliding_window_layers": False, "state_space_layers": False}

# The fields that decide, copied from each model's published config.json (other fields left out).
CONFIGS = {
    # SGLang's models for these attend globally whatever their sliding_window says.
    "Mistral-7B-v0.1": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}, {}),
    "Phi-3-mini-4k": ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 2047}, {}),
    "Qwen2.5-7B": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 131072,
                    "use_sliding_window": False, "max_window_layers": 28}, {}),
    "Gemma-2-9B": ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 4096,
                    "cache_implementation": "hybrid"}, {"sliding_window_layers": True}),
    # Gemma 3's local layers are in the one pool: served, trimmed to their window (local_layers.py).
    "Gemma-3-1B (first upload)": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                   "sliding_window": 512, "sliding_window_pattern": 6}, {}),
    "Gemma-3-4B (multimodal)": ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                 "text_config": {"model_type": "gemma3_text", "sliding_window": 1024,
                                                 "sliding_window_pattern": 6}}, {}),
    "Llama-4-Scout": ({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                       "text_config": {"attention_chunk_size": 8192}}, {"sliding_window_layers": True}),
    "DeepSeek-V2-Lite": ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                          "kv_lora_rank": 512, "q_lora_rank": None}, {"mla_model": True}),
    "Jamba-v0.1": ({"architectures": ["JambaForCausalLM"], "model_type": "jamba", "mamba_d_state": 16,
                    "attn_layer_period": 8}, {"state_space_layers": True}),
    "Falcon-H1-1.5B": ({"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "mamba_d_ssm": 1536},
                       {"state_space_layers": True}),
    "LFM2-1.2B": ({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
                   "layer_types": ["conv", "conv", "full_attention"]}, {"state_space_layers": True}),
    # SGLang runs these only on attention backends of its own (SGLANG_ATTENTION_BACKENDS), none the plugin's.
    "gpt-oss-20b": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "sliding_window": 128,
                     "layer_types": ["sliding_attention", "full_attention"]}, {"sliding_window_layers": True}),
    "Gemma-4 (multimodal)": ({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                              "text_config": {"model_type": "gemma4_text", "sliding_window": 1024,
                                              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}},
                             {"sliding_window_layers": True}),
    "EXAONE-4.0-32B": ({"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "sliding_window": 4096,
                        "sliding_window_pattern": "LLLG"}, {"sliding_window_layers": True}),
}  # fmt: skip
BACKEND_BOUND = ("gpt-oss-20b", "Gemma-4 (multimodal)", "EXAONE-4.0-32B")


@pytest.mark.parametrize("name", CONFIGS)
def test_each_published_config_is_read_as_sglang_serves_it(name):
    config, refused = CONFIGS[name]
    assert model_facts(config) == {**NONE, **refused}


def test_gemma_3s_local_layers_are_read_from_its_published_configs():
    one_b = {**CONFIGS["Gemma-3-1B (first upload)"][0], "num_hidden_layers": 26}
    local, window = local_layers_of_config(one_b)
    assert window == 512 and len(local) == 26 - 26 // 6 and 5 not in local and 11 not in local
    four_b = CONFIGS["Gemma-3-4B (multimodal)"][0]
    four_b = {**four_b, "text_config": {**four_b["text_config"], "num_hidden_layers": 34}}
    assert local_layers_of_config(four_b)[1] == 1024 and len(local_layers_of_config(four_b)[0]) == 34 - 34 // 6


def sglangs_backend_lists() -> dict[str, tuple[str, ...]]:
    """Architecture -> the attention backends SGLang 0.5.23's start-up asserts for it: each list assigned to
    ``supported_backends`` / ``accepted_backends`` in a ``model_arch`` branch of ``arg_groups/model_hook.py``."""
    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt/arg_groups/model_hook.py"
    found = {}
    for branch in ast.walk(ast.parse(source.read_text())):
        test = getattr(branch, "test", None)
        if not isinstance(branch, ast.If) or not isinstance(test, ast.Compare):
            continue
        if getattr(test.left, "id", None) != "model_arch":
            continue
        compared = test.comparators[0]
        names = [node.value for node in ast.walk(compared) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        for statement in branch.body:
            for node in ast.walk(statement):
                target = getattr(node.targets[0], "id", None) if isinstance(node, ast.Assign) else None
                if target in ("supported_backends", "accepted_backends"):
                    found.update(dict.fromkeys(names, tuple(item.value for item in node.value.elts)))
    return found


def test_the_backends_a_refusal_names_are_the_ones_sglang_asserts():
    sglangs = sglangs_backend_lists()
    assert {name: sglangs.get(name) for name in SGLANG_ATTENTION_BACKENDS} == SGLANG_ATTENTION_BACKENDS
    assert not any(set(backends) & set(WRAPPED_ATTENTION_BACKENDS) for backends in SGLANG_ATTENTION_BACKENDS.values())


@pytest.mark.parametrize("name", BACKEND_BOUND)
def test_gemma_4_gpt_oss_and_exaone_4s_refusals_name_the_backends_sglang_runs_them_on(name):
    config, _ = CONFIGS[name]
    architecture, backends = attention_backends_of_config(config)
    note = attention_backends_note(config)
    assert architecture == config["architectures"][0] and f"runs {architecture} only on the " in note
    assert all(backend in note for backend in (*backends, *WRAPPED_ATTENTION_BACKENDS))


def test_no_other_model_gets_a_backends_note():
    assert all(attention_backends_note(config) is None for name, (config, _) in CONFIGS.items() if name not in BACKEND_BOUND)
    # Exaone 4 without local layers (no sliding_window_pattern) runs on any backend in SGLang.
    assert attention_backends_note({"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4"}) is None
