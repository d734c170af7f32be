"""The launcher's reading of a model's config.json (``architectures.model_facts``) on the fields of
published configs as they are saved on the hub: older spellings included, which the tiny models of the
matrix (saved by transformers 5) do not show. Pure, in-process."""

from __future__ import annotations

import pytest

from sgl_kvevict.architectures import model_facts

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
    "Gemma-3-1B (first upload)": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                   "sliding_window": 512, "sliding_window_pattern": 6}, {"sliding_window_layers": True}),
    "Gemma-3-4B (multimodal)": ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                 "text_config": {"model_type": "gemma3_text", "sliding_window": 1024,
                                                 "sliding_window_pattern": 6}}, {"sliding_window_layers": True}),
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
