"""How much of the KV pool a prompt holds at its peak, and the longest prompt a pool can serve.

SGLang admits a prefill only when the whole prompt fits dense in the pool, and its tokenizer refuses a
prompt longer than the pool before the scheduler sees it. With block scope and chunked prefill the
engine *compresses while prefilling*: a block is stored compressed, and its dense slots go back to the
pool, at the chunk in which it ends, before the next chunk is prefilled. A prompt then holds, at its
peak, its compressed blocks, the dense tokens of the block in progress, the chunk being prefilled,
and the dense tail after its last block. ``PrefillFootprint`` is that count; the engine gives it to
SGLang's admission and length checks (``engine.adapter.admission``).

Everything else holds a prompt dense until its end: request scope (one segment, compressed after the
prompt's last chunk), no chunking, a policy without a budget (it decides per input), and scores that
come from passes after the prefill (KVzip: a block waits dense for its passes).

Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sgl_kvevict.architectures import local_layers_of_config
from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.scope import BlockScope, Scope
from sgl_kvevict.scoring import SCORE_KINDS


@dataclass(frozen=True)
class LocalShare:
    """A model's local attention layers (Gemma 3), which a compressed block holds only the last ``window``
    positions of (``sgl_kvevict.local_layers``): ``local`` of its ``layers`` layers."""

    local: int
    layers: int
    window: int

    @classmethod
    def of_model(cls, model_dir: Path) -> Optional["LocalShare"]:
        """The share of the model in ``model_dir`` (its config.json); None for a model without local layers."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        found = local_layers_of_config(config)
        if found is None:
            return None
        local, window = found
        return cls(len(local), int((config.get("text_config") or config)["num_hidden_layers"]), window)

    def kept_slots(self, global_kept: int, block_size: int) -> int:
        """The slots' worth a block holds when its global layers keep ``global_kept`` per (layer, KV head) on
        average: a policy's budget is the global layers' share, however it moves it between them
        (``local_layers.WindowedLocalLayers``), and a slot's cells hold any layer's entries."""
        local_kept = min(block_size, self.window)
        return -(-(global_kept * (self.layers - self.local) + local_kept * self.local) // self.layers)


@dataclass(frozen=True)
class PrefillFootprint:
    """block_size: tokens per block; kept_per_block: the slots one compressed block holds (its budget per
    (layer, KV head): a slot is every layer's and head's entry of one token); chunk_size: tokens per
    prefill forward."""

    block_size: int
    kept_per_block: int
    chunk_size: int

    @classmethod
    def of(
        cls, config: EvictionConfig, scope: Scope, chunk_size: Optional[int], local: Optional[LocalShare] = None
    ) -> Optional["PrefillFootprint"]:
        """The footprint of prompts served with ``config`` in ``scope`` (``local``: the model's local layers,
        which every policy trims, ``full`` included); None when they are held dense."""
        if not isinstance(scope, BlockScope) or chunk_size is None or chunk_size <= 0:
            return None
        if (config.budget is None and local is None) or SCORE_KINDS[config.score].scored_by_passes:
            return None
        kept = scope.block_size if config.budget is None else min(config.budget.per_head(scope.block_size), scope.block_size)
        if local is not None:
            kept = local.kept_slots(kept, scope.block_size)
        return cls(scope.block_size, kept, chunk_size)

    def peak_slots(self, start: int, end: int) -> int:
        """Slots a prompt's own tokens ``[start, end)`` (after its cached prefix) hold at their peak, an
        upper bound: every block compressed, plus the dense tokens before the first block boundary
        (blocks are aligned at position 0), the block in progress and the chunk in flight; and never more
        than the tokens dense (a block's cells take its own dense slots, so compressing needs no room)."""
        size = self.block_size
        head = (-start) % size
        blocks = max(0, end - start - head) // size
        dense = min(end - start, head + size + self.chunk_size)
        # + 1: the arena's last slot may be partly used
        return min(blocks * self.kept_per_block + dense, end - start) + 1

    def longest_prompt(self, pool_slots: int, reserved_slots: int) -> int:
        """The longest prompt (from position 0) whose peak leaves ``reserved_slots`` of ``pool_slots`` free."""
        # Past ``high`` the compressed blocks alone outgrow the pool (a bound rounded up: a block keeping
        # more than half its slots, 0.58 of Gemma 3's with the trim, still raises the limit).
        high = -(-pool_slots * self.block_size // max(1, self.kept_per_block)) + self.block_size + self.chunk_size
        low = 0
        while low < high:  # peak_slots grows with the prompt: the largest length that fits
            middle = (low + high + 1) // 2
            if self.peak_slots(0, middle) + reserved_slots <= pool_slots:
                low = middle
            else:
                high = middle - 1
        return low
