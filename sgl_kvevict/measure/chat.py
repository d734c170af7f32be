"""A served model's chat template and tokenizer as the server uses them, and what its KV holds: the
token counts documents are sized in, the prefix two prompts share, the slots ``/kvevict/stats`` says
a conversation holds."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import aiohttp

from sgl_kvevict.measure.client import STATS_PATH, get_json


def shared_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """Tokens at the start of both sequences."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


class ChatTokens:
    """A chat template rendered as the server renders it: a conversation ending with an assistant message
    continues that message, any other gets the generation prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: str) -> "ChatTokens":
        from transformers import AutoTokenizer

        from sgl_kvevict.models import resolve_model

        return cls(AutoTokenizer.from_pretrained(resolve_model(model, log=lambda m: print(m, file=sys.stderr))))

    def render(self, messages: list[dict], tokenize: bool = True):
        final = messages[-1]["role"] == "assistant"
        return self.tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=not final,
                                                  continue_final_message=final)  # fmt: skip

    def ids(self, messages: list[dict]) -> list[int]:
        ids = self.render(messages)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@dataclass(frozen=True)
class KVHeld:
    """What a server holds after a conversation's turn (``/kvevict/stats``): the KV slots in use, and on a
    model with local layers the share of the global layers' KV its compressed nodes keep (a policy's budget is
    that share). None for stock, which holds every token dense."""

    slots: Optional[int]
    global_layers_share: Optional[float] = None


async def kv_held(session: aiohttp.ClientSession, base_url: str) -> KVHeld:
    stats = await get_json(session, base_url + STATS_PATH)
    if not stats or "kv_slots_total" not in stats:  # stock answers {"policy": "none"}
        return KVHeld(None)
    return KVHeld(stats["kv_slots_total"] - stats["kv_slots_free"], stats.get("kept_share_global_layers"))


def model_token_counter(model: str) -> Callable[[str], int]:
    """Token counts with the served model's own tokenizer (documents are sized in its tokens)."""
    from tokenizers import Tokenizer

    from sgl_kvevict.models import resolve_model

    tokenizer = Tokenizer.from_file(str(resolve_model(model, log=lambda m: print(m, file=sys.stderr)) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def model_context_length(model: str) -> int:
    """The served model's context length (``max_position_embeddings`` of its config)."""
    import json

    from sgl_kvevict.models import resolve_model

    folder = resolve_model(model, log=lambda m: print(m, file=sys.stderr))
    return int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])
