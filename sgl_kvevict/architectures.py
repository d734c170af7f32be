"""What a model's config.json says about its KV cache, read before the model loads.

The launcher refuses, in one line, a model whose KV the compressed tree cannot manage (the model
limits of ``limits.py``: MLA, sliding-window layers, state-space layers). It reads the HF config as
saved (the text model's for a multimodal one), with neither transformers nor sglang. The tree checks
the same limits again from SGLang's resolved model (``engine/adapter/factory.py``), which is exact; the rules
here are the signals SGLang 0.5.23 acts on as they appear in configs, and ``tests/test_compat_matrix.py``
holds them to SGLang's own decision for every architecture of the compatibility matrix.

Pure Python: the launcher calls it before SGLang is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from sgl_kvevict.limits import SGLANG_VERSION, WRAPPED_ATTENTION_BACKENDS

# Layer kinds of ``layer_types`` that hold attention KV; any other kind (linear_attention, mamba,
# conv, ...) keeps recurrent state.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
# Model types whose local layers SGLang 0.5.23 keeps in the one KV pool (not a hybrid SWA pool), which
# the plugin serves by trimming those layers to their window (``sgl_kvevict.local_layers``): Gemma 3,
# text-only and multimodal. Gemma 2 is not among them (see ``model_facts``).
ONE_POOL_LOCAL_LAYER_MODELS = frozenset({"gemma3", "gemma3_text"})
# Config fields of the state-space and linear-attention families (Jamba, Falcon-H1, Nemotron-H:
# mamba_*; Qwen3-Next: linear_conv_kernel_dim; Kimi Linear: linear_attn_config).
STATE_SPACE_FIELD_PREFIXES = ("mamba_", "ssm_", "linear_conv", "linear_attn")


# The attention backends SGLang 0.5.23 accepts for these architectures (``arg_groups/model_hook.py`` asserts
# them at start-up; ``arg_groups/model_overrides/`` picks one when none is given), by the architecture name
# of config.json, as SGLang keys them. None is one the plugin attends over compressed nodes with
# (``limits.WRAPPED_ATTENTION_BACKENDS``: torch_native, flashinfer), so a server of one of them could not
# serve a policy even where its local layers could be: the refusal names them (``attention_backends_note``).
# Exaone 4's list holds only when it has local layers (``sliding_window_pattern``); without, SGLang takes
# any backend. ``tests/test_architectures.py`` reads these lists back from SGLang's source.
SGLANG_ATTENTION_BACKENDS = {
    "GptOssForCausalLM": ("triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_amx", "intel_xpu", "aiter"),
    **dict.fromkeys(
        ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4UnifiedForConditionalGeneration"),
        ("trtllm_mha", "triton", "fa4", "ascend", "intel_xpu", "intel_amx", "aiter"),
    ),
    **dict.fromkeys(("Exaone4ForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"), ("fa3", "triton", "trtllm_mha")),
}
# Those SGLang accepts only when the model has local layers.
WINDOWED_ONLY_BACKEND_ARCHITECTURES = frozenset({"Exaone4ForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"})


def attention_backends_of_config(config: Mapping[str, Any]) -> Optional[tuple[str, tuple[str, ...]]]:
    """``(architecture, the attention backends SGLang 0.5.23 accepts for it)`` of a parsed config.json whose
    architecture SGLang runs only on backends of its own choosing (``SGLANG_ATTENTION_BACKENDS``); None
    for any other model."""
    for architecture in config.get("architectures") or ():
        backends = SGLANG_ATTENTION_BACKENDS.get(architecture)
        if backends is None:
            continue
        if architecture in WINDOWED_ONLY_BACKEND_ARCHITECTURES and config.get("sliding_window_pattern") is None:
            return None
        return architecture, backends
    return None


def attention_backends_note(config: Mapping[str, Any]) -> Optional[str]:
    """What a refusal of this model adds, when SGLang 0.5.23 runs it only on attention backends the plugin
    does not attend over compressed nodes with (Gemma 4, gpt-oss, Exaone 4 with local layers); None otherwise."""
    found = attention_backends_of_config(config)
    if found is None:
        return None
    architecture, backends = found
    return (
        f"SGLang {SGLANG_VERSION} runs {architecture} only on the {', '.join(backends[:-1])} or {backends[-1]} "
        f"attention backend, and the plugin attends over compressed KV only in {' and '.join(WRAPPED_ATTENTION_BACKENDS)}"
    )


def model_facts(config: Mapping[str, Any]) -> dict[str, bool]:
    """The ``SetupFacts`` fields a model's config decides (``mla_model``, ``sliding_window_layers``,
    ``state_space_layers``), from a parsed config.json."""
    text = config.get("text_config") or config
    layer_types = set(text.get("layer_types") or ())
    return {
        # DeepSeek-V2/V3, Kimi K2, MiniCPM3: one latent of rank kv_lora_rank per token for every head.
        "mla_model": bool(text.get("kv_lora_rank")),
        # Local layers: layer_types (Gemma 3, gpt-oss, Cohere 2 as transformers 5 saves them), Gemma's
        # older pattern field, HF's hybrid cache marker (Gemma 2), Llama 4's chunked attention. A bare
        # sliding_window (Mistral, Phi-3) is not one: SGLang's models for those attend globally.
        # Gemma 3's are served (``local_attention_layers``).
        "sliding_window_layers": (
            bool(layer_types & {"sliding_attention", "chunked_attention"})
            or text.get("sliding_window_pattern") is not None
            or text.get("cache_implementation") == "hybrid"
            or text.get("attention_chunk_size") is not None
        )
        and config.get("model_type") not in ONE_POOL_LOCAL_LAYER_MODELS,
        "state_space_layers": bool(layer_types - ATTENTION_LAYER_TYPES)
        or any(key.startswith(STATE_SPACE_FIELD_PREFIXES) for key in text),
    }


def model_facts_of(model_dir: Path) -> dict[str, bool]:
    """``model_facts`` of the config.json in ``model_dir``."""
    return model_facts(json.loads((Path(model_dir) / "config.json").read_text()))


def local_layers_of_config(config: Mapping[str, Any]) -> Optional[tuple[tuple[int, ...], int]]:
    """``(local layer indices, window)`` of a model whose local layers the plugin trims (Gemma 3), from its
    parsed config.json; None for any other model. A config without ``layer_types`` (as the Hub ships
    Gemma 3) derives them from ``sliding_window_pattern`` as transformers does: every ``pattern``-th layer
    is global."""
    if config.get("model_type") not in ONE_POOL_LOCAL_LAYER_MODELS:
        return None
    text = config.get("text_config") or config
    layer_types = text.get("layer_types")
    if not layer_types:
        pattern = int(text.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(text["num_hidden_layers"])]
    local = tuple(index for index, kind in enumerate(layer_types) if kind == "sliding_attention")
    return (local, int(text["sliding_window"])) if local and text.get("sliding_window") else None


def local_attention_layers(model_dir: Path) -> Optional[tuple[tuple[int, ...], int]]:
    """``local_layers_of_config`` of the config.json in ``model_dir``."""
    return local_layers_of_config(json.loads((Path(model_dir) / "config.json").read_text()))
