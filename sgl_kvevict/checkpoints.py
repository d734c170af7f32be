"""Build model folders that SGLang and HF both load: the GGUF conversion and tiny random models.

Both produce a plain HF folder (config.json, model.safetensors, tokenizer files with a chat template; a
base model converted from its GGUF keeps none).
Outside ``reference/`` because the model resolver (``models.py``) needs the conversion and the reference
engine needs the resolver; like ``reference/``, it prepares transformers before importing its models.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

from sgl_kvevict.compat import prepare_transformers

prepare_transformers()

# A ChatML template like SmolLM2's, so chat requests render the same way on both models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def convert_gguf_to_safetensors(
    gguf_file: Path, out_dir: Path, *, chat_template: Optional[str] = CHATML_TEMPLATE, add_bos_token: Optional[bool] = None
) -> None:
    """Dequantise a GGUF checkpoint into a safetensors folder (config, weights, tokenizer, template).

    ``chat_template``: the template of a tokenizer whose GGUF has none (None: a base model keeps none);
    ``add_bos_token``: whether the tokenizer starts every text with BOS (None: as transformers' GGUF
    tokenizer does, which drops the GGUF's ``tokenizer.ggml.add_bos_token`` for Gemma 3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_file.parent), gguf_file.name
    quantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A fresh model from the config drops the GGUF quantization_config, so the folder loads as a plain
    # fp32 checkpoint everywhere (SGLang included) instead of re-entering the GGUF path. Its config is
    # the loaded model's (reading the GGUF's metadata again costs seconds), and it is built on the meta
    # device and given the dequantised tensors (a random initialisation first costs seconds too).
    config = copy.deepcopy(quantised.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template and chat_template is not None:
        tokenizer.chat_template = chat_template
    if add_bos_token is not None:
        tokenizer.add_bos_token = add_bos_token  # rewrites the post-processor that tokenizer.json keeps
    tokenizer.save_pretrained(out_dir)


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on generated text, with ChatML special tokens (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = (
        "the a cache key value token layer head budget window prefix radix tree memory request "
        "answer question document pass secret number is what remember find here there model"
    ).split()
    generator = torch.Generator().manual_seed(0)
    corpus = [
        " ".join(words[i] for i in torch.randint(len(words), (12,), generator=generator).tolist())
        + f" {int(torch.randint(100000, (1,), generator=generator))}."
        for _ in range(400)
    ]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


@dataclass(frozen=True)
class TinyArchitecture:
    """A scaled-down, random-weight version of one HF architecture, for fast tests: 2 layers, 4 query /
    2 KV heads (GQA), fp32, the tiny tokenizer. ``fields`` are the config fields that make it that
    architecture (its rotary variant, head size, sliding windows, MLA, linear attention, ...) beyond
    the common ones; ``examples``: checkpoints of it people serve."""

    name: str
    title: str
    examples: str
    config_class: str
    model_class: str
    head_dim: int = 16
    fields: Mapping[str, Any] = field(default_factory=dict)

    def config(
        self, num_layers: int = 2, num_q_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 512,
        overrides: Mapping[str, Any] = MappingProxyType({}),
    ):  # fmt: skip
        """Its transformers config at these sizes, with the tiny tokenizer's vocabulary and special tokens;
        ``overrides``: config fields over the architecture's own (e.g. Gemma 3's ``layer_types``)."""
        import transformers

        tokenizer = tiny_tokenizer(vocab_size)
        hidden_size = self.fields.get("hidden_size", num_q_heads * self.head_dim)
        common = dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_q_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=4096,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )
        return getattr(transformers, self.config_class)(**{**common, **self.fields, **overrides})


# The model most tests run: head dim 16, hidden size 64.
TINY_LLAMA = TinyArchitecture("llama", "Llama", "SmolLM2", "LlamaConfig", "LlamaForCausalLM",
                              fields=dict(rope_theta=10000.0))  # fmt: skip
# The compatibility matrix (tests/test_compat_matrix.py, docs/compatibility.md): the architectures SGLang
# users serve most, scaled down from the public configs of the named checkpoints with their head
# sizes (Llama 3.2 1B, Qwen2.5 0.5B, Granite 3 2B: 64; Phi-3 mini: 96; Qwen3, Qwen3-MoE, Mistral, OLMo 2,
# GLM-4: 128; Gemma 3: 256), and one of each kind the plugin refuses.
COMPATIBILITY_MATRIX = (
    TinyArchitecture("llama3", "Llama 3", "Llama-3.1-8B-Instruct, Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM",
                     head_dim=64, fields=dict(rope_parameters=dict(
                         rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=1024))),
    TinyArchitecture("qwen2.5", "Qwen2.5", "Qwen2.5-0.5B/7B-Instruct", "Qwen2Config", "Qwen2ForCausalLM",
                     head_dim=64, fields=dict(rope_theta=1000000.0)),
    TinyArchitecture("qwen3", "Qwen3", "Qwen3-0.6B/8B/32B", "Qwen3Config", "Qwen3ForCausalLM",
                     head_dim=128, fields=dict(hidden_size=128, rope_theta=1000000.0)),
    # Qwen3-30B-A3B: q/k norms, sparse MoE blocks (here 4 experts, 2 per token) in every layer.
    TinyArchitecture("qwen3-moe", "Qwen3-MoE", "Qwen3-30B-A3B, Qwen3-235B-A22B", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                     head_dim=128, fields=dict(hidden_size=128, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=64, norm_topk_prob=True)),
    TinyArchitecture("mistral", "Mistral", "Mistral-7B-Instruct-v0.3", "MistralConfig", "MistralForCausalLM",
                     head_dim=128, fields=dict(rope_theta=1000000.0, sliding_window=None)),
    # Phi-3 mini declares a 2047-token sliding window, which SGLang's Phi-3 (its Llama model) does not apply.
    TinyArchitecture("phi3", "Phi-3", "Phi-3-mini-4k-instruct", "Phi3Config", "Phi3ForCausalLM",
                     head_dim=96, fields=dict(sliding_window=2047)),
    TinyArchitecture("gemma3", "Gemma 3", "gemma-3-1b-it (text)", "Gemma3TextConfig", "Gemma3ForCausalLM",
                     head_dim=256, fields=dict(hidden_size=128, sliding_window=64, query_pre_attn_scalar=256, tie_word_embeddings=True,
                                               layer_types=["sliding_attention", "full_attention"])),
    # OLMo 2: norms after attention and MLP (none before), q/k norms over all heads; head dim = hidden / heads.
    TinyArchitecture("olmo2", "OLMo 2", "OLMo-2-1124-7B/13B-Instruct, OLMo-2-0425-1B", "Olmo2Config", "Olmo2ForCausalLM",
                     head_dim=128, fields=dict(rope_theta=500000.0, rms_norm_eps=1e-6)),
    # Granite 3: muP multipliers (attention scale 1/head dim, embeddings, residuals, logits).
    TinyArchitecture("granite", "Granite", "granite-3.1-2b/8b-instruct", "GraniteConfig", "GraniteForCausalLM",
                     head_dim=64, fields=dict(rope_theta=5000000.0, attention_multiplier=1 / 64, embedding_multiplier=12.0,
                                              residual_multiplier=0.22, logits_scaling=8.0)),
    # GLM-4-0414: rotary on half of each head (interleaved), q/k/v biases, norms after attention and MLP too.
    TinyArchitecture("glm4", "GLM-4", "GLM-4-9B-0414, GLM-4-32B-0414", "Glm4Config", "Glm4ForCausalLM",
                     head_dim=128, fields=dict(hidden_size=128, attention_bias=True,
                                               rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                    partial_rotary_factor=0.5))),
    TinyArchitecture("gpt-oss", "gpt-oss", "gpt-oss-20b, gpt-oss-120b", "GptOssConfig", "GptOssForCausalLM",
                     fields=dict(sliding_window=64, num_local_experts=2, num_experts_per_tok=1,
                                 layer_types=["sliding_attention", "full_attention"])),
    TinyArchitecture("deepseek-v3", "DeepSeek-V3", "DeepSeek-V3, DeepSeek-R1, Kimi K2", "DeepseekV3Config",
                     "DeepseekV3ForCausalLM",
                     fields=dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                                 qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=2,
                                 num_experts_per_tok=1, n_group=1, topk_group=1)),
    TinyArchitecture("qwen3-next", "Qwen3-Next", "Qwen3-Next-80B-A3B", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                     fields=dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=64)),
)  # fmt: skip
TINY_ARCHITECTURES = {arch.name: arch for arch in (TINY_LLAMA, *COMPATIBILITY_MATRIX)}


def build_tiny_model(
    out_dir: Path,
    architecture: str = "llama",
    *,
    num_layers: int = 2,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    overrides: Mapping[str, Any] = MappingProxyType({}),
) -> Path:
    """A random-weight fp32 model of ``TINY_ARCHITECTURES[architecture]`` with a real tokenizer, for
    fast tests (``overrides``: config fields, ``TinyArchitecture.config``). Returns ``out_dir``."""
    import transformers

    arch = TINY_ARCHITECTURES[architecture]
    config = arch.config(num_layers, num_q_heads, num_kv_heads, vocab_size, overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model_class)(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny_tokenizer(vocab_size).save_pretrained(out_dir)
    return Path(out_dir)

