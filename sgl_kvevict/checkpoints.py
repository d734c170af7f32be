"""Build model folders that SGLang and HF both load: the GGUF conversion and a tiny random Llama.

Both produce a plain HF folder (config.json, model.safetensors, tokenizer files with a chat template).
Outside ``reference/`` because the model resolver (``models.py``) needs the conversion and the reference
engine needs the resolver; like ``reference/``, it prepares transformers before importing its models.
"""

from __future__ import annotations

from pathlib import Path

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


def convert_gguf_to_safetensors(gguf_file: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into a safetensors folder (config, weights, tokenizer, template)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_file.parent), gguf_file.name
    quantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    # A fresh model from the config drops the GGUF quantization_config, so the folder loads as a plain
    # fp32 checkpoint everywhere (SGLang included) instead of re-entering the GGUF path.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out_dir)


def _train_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE trained on generated text, with ChatML special tokens."""
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
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
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


def build_tiny_llama(
    out_dir: Path,
    *,
    num_layers: int = 2,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """A random-weight fp32 Llama with a real tokenizer, for fast tests. Returns ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=num_q_heads * head_dim,
        intermediate_size=2 * num_q_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
