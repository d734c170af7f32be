"""What compression cannot work with yet: every refused SGLang feature, declared once.

Two places refuse these features and both read this table:

* the launcher (``sgl_kvevict.server``), from the command line, before the model loads: each limit
  lists the SGLang flags (every spelling) that turn the feature on, and the values refused;
* the compressed radix tree (``sgl_kvevict.engine.adapter.factory``), when SGLang builds it in the
  scheduler process, from a ``SetupFacts`` record the engine fills from SGLang's resolved
  configuration. This is the safety net for servers started without the launcher (``python -m
  sglang.launch_server --radix-cache-backend sgl_kvevict``, a ``--config`` file), so every limit
  the launcher refuses by flag also has a fact the tree checks, unless the tree cannot exist in that
  set-up at all (``LimitFlag`` only; the docstring of such a limit says why).

Also here: the one SGLang version this plugin is written against, checked by the launcher and by the
plugin's registration in every SGLang process.

Pure Python: no sglang import, so the launcher can refuse before SGLang is imported.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable, Optional

SGLANG_VERSION = "0.5.23"
# The attention backends the plugin replaces with its own (sgl_kvevict.engine.adapter.contacts): the only ones
# that attend over compressed nodes. torch_native runs anywhere; flashinfer is the CUDA path.
WRAPPED_ATTENTION_BACKENDS = ("torch_native", "flashinfer")


class UnsupportedVersion(RuntimeError):
    """The installed SGLang is not the version this plugin hooks into; the message is one line."""


def check_sglang_version(installed: Optional[str] = None) -> None:
    """Refuse any SGLang but ``SGLANG_VERSION``: the engine overrides private methods and relies on
    internals (tree, pools, attention backends) that change between releases without notice."""
    if installed is None:
        try:
            installed = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedVersion(f"SGLang is not installed; sgl-kvevict needs sglang=={SGLANG_VERSION}") from None
    if installed != SGLANG_VERSION:
        raise UnsupportedVersion(
            f"sgl-kvevict works with sglang=={SGLANG_VERSION} only (its engine hooks into that version's "
            f"internals); sglang {installed} is installed"
        )


@dataclass(frozen=True)
class SetupFacts:
    """The facts of one SGLang server that decide whether compression can run in it. Defaults are
    the supported set-up."""

    page_size: int = 1
    prefill_cuda_graphs: bool = False  # a prefill-phase graph is configured
    decode_graphs: str = "disabled"  # the decode graphs captured: disabled, full, breakable, or cpu (torch.compile)
    torch_compile: bool = False
    hierarchical_cache: bool = False
    kv_heads_replicated: bool = False  # more TP ranks than KV heads on CUDA: SGLang replicates heads
    pp_size: int = 1
    dp_size: int = 1
    attention_dp: bool = False  # --enable-dp-attention or an attention-DP size above 1
    radix_cache_disabled: bool = False
    radix_eviction_policy: bool = False  # an eviction policy other than the default (lru), or its config
    session_radix_cache: bool = False
    speculative: bool = False
    mixed_chunk: bool = False
    disaggregation: bool = False
    tokenizer_workers: int = 1
    attention_backend_wrapped: bool = True
    # The model's KV: decided by its architecture (``architectures.model_facts`` reads them from config.json).
    mla_model: bool = False  # multi-head latent attention: one latent per token, not K and V per KV head
    sliding_window_layers: bool = False  # local (sliding-window or chunked) attention layers, but Gemma 3's
    # decode CUDA graphs captured for a model whose local layers the plugin trims (Gemma 3, ``local_layers.py``)
    local_layer_decode_graphs: bool = False
    state_space_layers: bool = False  # Mamba or linear-attention layers beside attention


@dataclass(frozen=True)
class LimitFlag:
    """An SGLang flag (every spelling of it) that turns a limit's feature on: whenever it is given,
    or when its value is above ``above``, or when its value is not one of ``allowed``."""

    spellings: tuple[str, ...]
    above: Optional[int] = None
    allowed: Optional[tuple[str, ...]] = None

    def refuses(self, value: Optional[str]) -> bool:
        if self.above is not None:
            try:
                return int(value) > self.above
            except (TypeError, ValueError):
                return False  # not a number: SGLang's own parser reports it
        if self.allowed is not None:
            return value not in self.allowed
        return True

    def condition(self) -> str:
        """What is refused, for --help and the flag table of docs/flags.md: ``--page-size > 1``."""
        if self.above is not None:
            return f"{self.spellings[0]} > {self.above}"
        if self.allowed is not None:
            return f"{self.spellings[0]} other than {' or '.join(self.allowed)}"
        return self.spellings[0]


@dataclass(frozen=True)
class Limit:
    """One SGLang feature compression cannot work with: why, the flags that enable it, and the
    predicate over ``SetupFacts`` that detects it in a running set-up (None: see the module doc)."""

    name: str
    reason: str
    flags: tuple[LimitFlag, ...] = ()
    violated: Optional[Callable[[SetupFacts], bool]] = None


# The decode graphs that can serve compressed requests (engine/decode_graph.py): SGLang's full CUDA graphs.
DECODE_GRAPH_BACKENDS = ("full", "disabled")
_PREFILL_CUDA_GRAPHS = (
    "a replayed prefill graph skips the segment attention's per-batch metadata and the scoring capture; "
    "decode graphs are supported (--cuda-graph-backend-decode full, CUDA's default), and --cuda-graph-config "
    "is refused because it can set the prefill phase (use the per-phase flags); with a policy the launcher "
    "disables prefill graphs"
)
_DECODE_GRAPH_BACKENDS = (
    "compressed requests replay SGLang's full decode CUDA graphs (a segments graph per batch size); breakable "
    "graphs and CPU graphs (torch.compile on CPU) have no replayable form of the segment attention"
)
_TORCH_COMPILE = "the segment attention's decode graph body has not been traced by torch.compile (untested)"
_REPLICATED_KV_HEADS = (
    "with more TP ranks than KV heads SGLang replicates each KV head on several GPUs and splits its query heads "
    "among them, so no rank sees a head's whole query group; use a --tp-size at most the model's KV heads "
    "(on CPU SGLang pads heads instead, which works)"
)
_DP_ATTENTION = "DP attention splits a batch's attention across ranks; the segment attention runs on one rank"
_MLA = (
    "DeepSeek-V2/V3 and Kimi K2 cache one latent vector per token that every query head reads, not a K and V per "
    "KV head: there is nothing to keep per head, and their pool is not the per-head layout cells address"
)
_SLIDING_WINDOW_LAYERS = (
    "local attention layers in a pool of their own (gpt-oss, Llama 4's chunked layers: SGLang's hybrid SWA pools) "
    "or with Gemma 2's soft-capped attention are not served; Gemma 3's, in the one pool, are (trimmed to their "
    "window)"
)
_LOCAL_LAYER_DECODE_GRAPHS = (
    "the segments decode graph has no windowed part for Gemma 3's local layers (both wrapped backends window "
    "them eagerly, on any number of tensor-parallel ranks): with a policy the launcher turns decode CUDA graphs "
    "off for such a model and refuses --cuda-graph-backend-decode with another value"
)

# The first-version limits (page size 1, no prefill graphs),
# SGLang 0.5.23's features that copy, move or share KV by slot rows, which compressed nodes do not
# hold, and the model architectures whose KV is not per-head K and V in one pool (no flags: the
# launcher reads them from the model's config, ``architectures.py``). Spellings are SGLang 0.5.23's
# (sglang/srt/arg_groups/fields/*.py); a test checks them.
LIMITS = (
    Limit("page size", "compressed segments are token-granular: pages of more than one slot are not supported yet",
          (LimitFlag(("--page-size",), above=1),), lambda f: f.page_size != 1),
    Limit("prefill CUDA graphs", _PREFILL_CUDA_GRAPHS,
          (LimitFlag(("--cuda-graph-backend-prefill",), allowed=("disabled",)),
           LimitFlag(("--cuda-graph-config",))),
          lambda f: f.prefill_cuda_graphs),
    Limit("decode graph backend", _DECODE_GRAPH_BACKENDS,
          (LimitFlag(("--cuda-graph-backend-decode",), allowed=DECODE_GRAPH_BACKENDS),),
          lambda f: f.decode_graphs not in DECODE_GRAPH_BACKENDS),
    Limit("torch.compile", _TORCH_COMPILE, (LimitFlag(("--enable-torch-compile",)),), lambda f: f.torch_compile),
    Limit("hierarchical cache", "HiCache copies tree values slot by slot and compressed nodes hold placeholder slots",
          (LimitFlag(("--enable-hierarchical-cache", "--enable-hicache")),), lambda f: f.hierarchical_cache),
    Limit("replicated KV heads", _REPLICATED_KV_HEADS, (), lambda f: f.kv_heads_replicated),
    Limit("pipeline parallelism", "each pipeline stage sees only its own layers and layer budgets need all of them",
          (LimitFlag(("--pp-size", "--pipeline-parallel-size"), above=1),), lambda f: f.pp_size != 1),
    Limit("data parallelism",
          "each data-parallel scheduler would hold its own tree and arena; run several workers behind the "
          "router instead (--workers)",
          (LimitFlag(("--dp-size", "--data-parallel-size"), above=1),), lambda f: f.dp_size != 1),
    Limit("DP attention", _DP_ATTENTION,
          (LimitFlag(("--attn-dp-size", "--attention-data-parallel-size"), above=1),
           LimitFlag(("--enable-dp-attention",))),
          lambda f: f.attention_dp),
    Limit("another radix-cache backend",
          "compression lives in the plugin's own radix cache (sgl_kvevict), which the launcher selects; with "
          "another backend the compressed tree is never built, so only the launcher can refuse this",
          (LimitFlag(("--radix-cache-backend",)),)),
    Limit("radix eviction policy",
          "the compressed tree evicts dense and compressed leaves in its own GreedyDual-Size-Frequency order "
          "(a compressed leaf costs more to lose per slot freed); SGLang's eviction policies would be ignored",
          (LimitFlag(("--radix-eviction-policy",)), LimitFlag(("--radix-eviction-policy-config",))),
          lambda f: f.radix_eviction_policy),
    Limit("no radix cache", "compressed prompts are kept and reused as radix-tree nodes",
          (LimitFlag(("--disable-radix-cache",)),), lambda f: f.radix_cache_disabled),
    Limit("session radix cache",
          "session caching needs SGLang's unified radix cache, which the compressed tree replaces",
          (LimitFlag(("--enable-session-radix-cache",)),), lambda f: f.session_radix_cache),
    Limit("speculative decoding", "draft and verify passes use attention paths that do not read compressed cells",
          (LimitFlag(("--speculative-algorithm",)),), lambda f: f.speculative),
    Limit("mixed chunks",
          "batches mixing prefill and decode tokens are not handled by scoring capture yet; --prefill-decode-interval "
          "(on by default in CPU mode) lets running requests decode between a long prompt's chunks instead",
          (LimitFlag(("--enable-mixed-chunk",)),), lambda f: f.mixed_chunk),
    Limit("PD disaggregation", "PD disaggregation transfers KV by slot rows and compressed segments hold placeholder slots",
          (LimitFlag(("--disaggregation-mode",), allowed=("null",)),), lambda f: f.disaggregation),
    Limit("several tokenizer workers", "/kvevict/stats is served by the single HTTP process's app",
          (LimitFlag(("--tokenizer-worker-num",), above=1),), lambda f: f.tokenizer_workers != 1),
    Limit("attention backend",
          "only the backends the plugin wraps attend over compressed nodes (torch_native; flashinfer on CUDA)",
          (LimitFlag(("--attention-backend",), allowed=WRAPPED_ATTENTION_BACKENDS),
           LimitFlag(("--prefill-attention-backend",), allowed=WRAPPED_ATTENTION_BACKENDS),
           LimitFlag(("--decode-attention-backend",), allowed=WRAPPED_ATTENTION_BACKENDS)),
          lambda f: not f.attention_backend_wrapped),
    Limit("MLA models", _MLA, (), lambda f: f.mla_model),
    Limit("sliding-window layers", _SLIDING_WINDOW_LAYERS, (), lambda f: f.sliding_window_layers),
    Limit("decode graphs with local layers", _LOCAL_LAYER_DECODE_GRAPHS, (), lambda f: f.local_layer_decode_graphs),
    Limit("state-space layers",
          "Mamba and linear-attention layers (Qwen3-Next, Falcon-H1, Jamba, Nemotron-H) keep a recurrent state per "
          "request beside the KV pool, which the compressed tree neither stores nor restores",
          (), lambda f: f.state_space_layers),
    Limit("config file",
          "a config file could set the flags above past the launcher's checks; give SGLang flags on the command "
          "line (the tree still checks the facts a config file sets)",
          (LimitFlag(("--config",)),)),
)  # fmt: skip


# SGLang's switch that captures each decode graph replay's preparation into a small CUDA graph of its own
# (decode_cuda_graph_runner.py, metadata_glue_graph.py); an environment variable, not a flag, so refused
# apart from the table: by the launcher from its environment, by the plugin's capture hook from SGLang's.
METADATA_GLUE_GRAPH_ENV = "SGLANG_ENABLE_METADATA_GLUE_GRAPH"
METADATA_GLUE_GRAPH_REASON = (
    "it captures the preparation of each decode graph replay into a graph of its own, which would freeze the "
    "segments graphs' per-batch metadata (each request's cells and dense positions, written and planned on the host "
    "before every replay) at its capture-time values; unset it (decode CUDA graphs stay on)"
)


def metadata_glue_graph_enabled(environ) -> bool:
    """Whether ``environ`` turns SGLang's metadata glue graph on (the spellings of SGLang's ``EnvBool``)."""
    return environ.get(METADATA_GLUE_GRAPH_ENV, "").lower() in ("true", "1", "yes", "y")


def violations(facts: SetupFacts) -> list[str]:
    """One line per limit ``facts`` break (empty when compression can run)."""
    return [f"{limit.name}: {limit.reason}" for limit in LIMITS if limit.violated is not None and limit.violated(facts)]


def limit_flags() -> list[tuple[Limit, LimitFlag]]:
    """Every refused flag with its limit, in table order."""
    return [(limit, flag) for limit in LIMITS for flag in limit.flags]
