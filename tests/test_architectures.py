"""The launcher's reading of a model's config.json (``architectures.model_facts``) on the fields of
published configs as they are saved on the hub: older spellings included, which the tiny models of the
matrix (saved by transformers 5) do not show; and Gemma 3's local layers from those configs
(``local_layers_of_config``). Pure, in-process."""

from __future__ import annotations

import pytest

from sgl_kvevict.architectures import local_layers_of_config, model_facts

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
}  # fmt: skip


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
