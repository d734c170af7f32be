"""The SGLang flags the launcher refuses or owns, checked before any model loads.

With a policy set, every flag of ``sgl_kvevict.limits`` is refused with its limit's reason (the tree
refuses the same limits again when SGLang builds it, for servers started without the launcher).
Whatever the policy, the flags the launcher sets itself are refused, and so are abbreviations of
any flag the launcher inspects: SGLang's parser would expand ``--tp 2`` to ``--tp-size 2`` behind
the launcher's back.
"""

from __future__ import annotations

import json
from pathlib import Path

from sgl_kvevict.architectures import attention_backends_note, local_attention_layers, model_facts
from sgl_kvevict.limits import (
    LIMITS,
    METADATA_GLUE_GRAPH_ENV,
    METADATA_GLUE_GRAPH_REASON,
    SetupFacts,
    limit_flags,
    metadata_glue_graph_enabled,
    violations,
)
from sgl_kvevict.server.sglang_args import flag_value, has_flag, int_flag_value, largest_chunk_beside_block
from sgl_kvevict.serving import ServingConfig

KV_EVICT_PREFIX = "--kv-evict-"
# SGLang flags the launcher owns whatever the policy; passing them through would contradict our own.
RESERVED_SGLANG_FLAGS = ("--model-path", "--host", "--port")
# SGLang flags the launcher reads or sets (besides the refused ones); the keys are flags of ours that
# the launcher passes on, listed so that an abbreviation of them is refused rather than passed on.
READ_SGLANG_FLAGS = (
    "--max-total-tokens", "--mem-fraction-static", "--device", "--dtype",
    "--kv-cache-dtype", "--served-model-name", "--base-gpu-id", "--api-key", "--admin-api-key",
    "--tp-size", "--tensor-parallel-size",
)  # fmt: skip


class FlagError(ValueError):
    """A bad command line; the message is one line naming the flag and what is wrong."""


def inspected_flags() -> list[str]:
    refused = [spelling for _, flag in limit_flags() for spelling in flag.spellings]
    return [*RESERVED_SGLANG_FLAGS, *READ_SGLANG_FLAGS, *refused]


def check_reserved_flags(sglang_args: list[str]) -> None:
    for flag in RESERVED_SGLANG_FLAGS:
        if has_flag(sglang_args, flag):
            raise FlagError(f"{flag} is set by the launcher; use --model/--host/--port instead")


def check_flag_spellings(sglang_args: list[str], our_flags: list[str]) -> None:
    """Refuse what the launcher could not see through: an unknown --kv-evict-* flag (a typo would
    otherwise reach SGLang and fail only after it imports), and abbreviations of inspected flags."""
    inspected = inspected_flags()
    for token in sglang_args:
        name = token.split("=", 1)[0]
        if name.startswith(KV_EVICT_PREFIX):
            raise FlagError(f"{name} is not a flag of ours; valid: {', '.join(our_flags)}")
        if name.startswith("--") and name not in inspected:
            expansions = [flag for flag in inspected if flag.startswith(name)]
            if expansions:
                raise FlagError(f"{name} abbreviates {expansions[0]}; spell it in full so the launcher can check it")


def check_compression_compatible(sglang_args: list[str]) -> None:
    for limit, flag in limit_flags():
        for spelling in filter(lambda name: has_flag(sglang_args, name), flag.spellings):
            value = flag_value(sglang_args, spelling)
            if flag.refuses(value):
                shown = spelling if value is None else f"{spelling} {value}"
                raise FlagError(f"{shown} cannot be used with a --kv-evict-policy: {limit.reason}")


def check_chunked_prefill(serving: ServingConfig, sglang_args: list[str]) -> None:
    """With a policy and chunked prefill: a chunk holds the observation window (a window's queries come
    from one or two forwards, not a dozen), and in block scope a block and a chunk fit the KV pool
    together (a block is compressed at the chunk it ends in, so both are dense at once)."""
    chunk = int_flag_value(sglang_args, "--chunked-prefill-size")
    if not serving.enabled or chunk is None or chunk <= 0:
        return
    window = serving.eviction.window
    if chunk < window:
        raise FlagError(
            f"--chunked-prefill-size {chunk} is smaller than the {window}-token observation window "
            f"(--kv-evict-window): use chunks of {window} tokens or more"
        )
    pool = int_flag_value(sglang_args, "--max-total-tokens")
    block_size = getattr(serving.scope, "block_size", None)
    if block_size is not None and pool is not None and chunk > largest_chunk_beside_block(block_size, pool):
        raise FlagError(
            f"--kv-evict-block-size {block_size} and --chunked-prefill-size {chunk} do not fit together in "
            f"--max-total-tokens {pool}: a block is compressed at the chunk it ends in, so both are dense at once"
        )


def check_cpu_graphs(serving: ServingConfig, sglang_args: list[str], cpu_mode: bool) -> None:
    """On CPU SGLang's decode "graphs" are its torch.compile runner (CPUGraphRunner), which the CPU backend
    has no replayable form for (limits: decode graph backend)."""
    backend = flag_value(sglang_args, "--cuda-graph-backend-decode")
    if serving.enabled and cpu_mode and backend not in (None, "disabled"):
        raise FlagError(
            f"--cuda-graph-backend-decode {backend} cannot be used with a --kv-evict-policy in CPU mode: SGLang "
            f"captures CPU decode graphs with torch.compile, and the CPU attention backend has no graph form"
        )


def check_environment(serving: ServingConfig, environ) -> None:
    """With a policy: the SGLang switches set in the environment the servers inherit (limits: the metadata
    glue graph)."""
    if serving.enabled and metadata_glue_graph_enabled(environ):
        raise FlagError(
            f"{METADATA_GLUE_GRAPH_ENV}={environ[METADATA_GLUE_GRAPH_ENV]} cannot be used with a --kv-evict-policy: "
            f"{METADATA_GLUE_GRAPH_REASON}"
        )


def check_tensor_parallel(tp: int, model_kv_heads: int, cpu_mode: bool) -> None:
    """On CUDA, SGLang replicates KV heads when ranks outnumber them (limits: replicated KV heads)."""
    if tp > model_kv_heads and not cpu_mode:
        raise FlagError(
            f"--tp-size {tp} cannot be used with a --kv-evict-policy on a model with {model_kv_heads} KV heads: "
            f"{next(limit.reason for limit in LIMITS if limit.name == 'replicated KV heads')}"
        )


def check_model_architecture(model_dir: Path) -> None:
    """With a policy: the model keeps K and V per KV head in SGLang's one pool (limits: MLA, sliding-window
    and state-space layers), as its config.json says, before it loads; the line names the attention
    backends SGLang would need for a model it runs on backends of its own only (gpt-oss, Gemma 4, Exaone 4)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    problems = violations(SetupFacts(**model_facts(config)))
    if problems:
        note = attention_backends_note(config)
        raise FlagError(
            f"the model in {model_dir} cannot be served with a --kv-evict-policy: {problems[0]}"
            f"{'' if note is None else '; ' + note} (docs/compatibility.md)"
        )


def check_local_layers(model_dir: Path, sglang_args: list[str]) -> None:
    """With a policy, a model whose local attention layers the plugin trims to their window (Gemma 3, from
    its config.json): decode CUDA graphs have no windowed part for them (limit "decode graphs with local
    layers"), so a ``--cuda-graph-backend-decode`` other than ``disabled`` is refused before the weights load
    (``with_local_layer_defaults`` turns them off where the user chose none). ``sglang_args``: every flag
    SGLang gets, the launcher's included."""
    local = local_attention_layers(model_dir)
    graphs = flag_value(sglang_args, "--cuda-graph-backend-decode")
    if local is None or graphs in (None, "disabled"):
        return
    layers, window = local
    reason = next(limit.reason for limit in LIMITS if limit.name == "decode graphs with local layers")
    raise FlagError(
        f"--cuda-graph-backend-decode {graphs} cannot be used with a --kv-evict-policy on the model in {model_dir}, "
        f"which has {len(layers)} local attention layers (window {window}): {reason} (docs/compatibility.md)"
    )
