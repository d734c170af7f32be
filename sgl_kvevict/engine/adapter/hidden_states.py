"""The attention-input hidden states of every layer, for learned scorers (``scoring.learned``).

The attention backend sees post-RoPE q/k/v, not the hidden states a learned scorer maps to scores. A
forward pre-hook on each module that owns a ``RadixAttention`` (the model's ``self_attn``: its input is
the layer's hidden states after the input layernorm, before the q/k/v projections) keeps a reference to
that input for the current forward, keyed by the attention's ``layer_id``; the backend's scoring capture
reads the rows of the segments it scores (``engine.compression.ScoringCapture``). No copy is made, and
nothing is kept past the next forward.
"""

from __future__ import annotations

import inspect

import torch


class HiddenStateCapture:
    def __init__(self, model: torch.nn.Module):
        from sglang.srt.layers.radix_attention import RadixAttention

        self.by_layer: dict[int, torch.Tensor] = {}
        hooked = 0
        for module in model.modules():
            owned = [child for child in module.children() if isinstance(child, RadixAttention)]
            if len(owned) == 1:
                module.register_forward_pre_hook(self._hook(owned[0].layer_id, module), with_kwargs=True)
                hooked += 1
        if hooked == 0:
            raise ValueError("no attention module owning a RadixAttention: learned scores cannot see hidden states")

    def _hook(self, layer_id: int, module: torch.nn.Module):
        position = list(inspect.signature(module.forward).parameters).index("hidden_states")

        def capture(_module, args, kwargs):
            self.by_layer[layer_id] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[position]

        return capture
