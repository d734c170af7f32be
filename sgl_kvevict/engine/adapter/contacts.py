"""Every contact of sgl-kvevict with SGLang, in one table, and the two functions that make them.

SGLang spawns its processes, so registries filled in the launcher do not reach the scheduler. Two
entry points read ``CONTACTS``:

* ``register``: the ``sglang.srt.plugins`` entry point (pyproject.toml), run by SGLang's plugin loader
  in every SGLang process, the scheduler included (docs/sglang.md#processes-and-plugin-loading; a
  scheduler forked in CPU development mode inherits what it made in the HTTP process). It makes the
  ``SCHEDULER`` contacts when a policy is set (the launcher's ``KVEVICT_SERVING``);
* ``register_http``: called by the launcher's SGLang process (``sgl_kvevict.server.sglang_entry``) with
  SGLang's FastAPI app, for the ``HTTP`` contacts.

The contacts marked ``stock`` are made for stock SGLang too (no policy): the debug probe (it acts only
with its own variable set) and the stats route, so stock servers are measured and polled the same way,
and the prompt SIGTERM watchdog, the CPU start method and the skipped early ``/freeze_gc``, so every
server the launcher starts starts and stops as fast and as quietly.

A handler is named ``module:attribute`` inside this package and imported when its contact is made,
except a backend factory's, imported when SGLang first calls it (the FlashInfer backend's module
needs CUDA): everything heavy loads only in the processes that need it. A ``configured`` handler is a factory
called with the server's ``ServingConfig`` (read once, at registration) that returns what is
registered. docs/design.md's "Registration" table is generated from ``CONTACTS``
(``python -m sgl_kvevict.engine.adapter.contacts --write docs/design.md``) and checked by a test.
"""

from __future__ import annotations

import enum
import functools
import importlib
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from sgl_kvevict.generated_section import GeneratedSection
from sgl_kvevict.generated_section import main as section_main
from sgl_kvevict.limits import check_sglang_version
from sgl_kvevict.serving import RADIX_CACHE_BACKEND, ServingConfig


class Kind(enum.Enum):
    RADIX_CACHE_BACKEND = "radix-cache backend"  # register_radix_cache_backend
    ATTENTION_BACKEND = "attention backend"  # replaces the stock factory in ATTENTION_BACKENDS
    AFTER = "hook after"  # HookRegistry, HookType.AFTER
    AROUND = "hook around"
    BEFORE = "hook before"
    PATCH = "patched method"  # the handler installs it (idempotent)
    ROUTE = "HTTP route"  # the handler adds it to SGLang's FastAPI app
    PROBE = "debug probe"  # the handler installs it when its environment variable is set


class Process(enum.Enum):
    SCHEDULER = "scheduler"
    HTTP = "HTTP server"


@dataclass(frozen=True)
class Contact:
    """target: what of SGLang is touched (a dotted name, a backend or route name); handler:
    ``module:attribute`` in ``sgl_kvevict.engine.adapter``; why: one line for the design document;
    stock: made without a policy too."""

    process: Process
    kind: Kind
    target: str
    handler: str
    why: str
    configured: bool = False
    stock: bool = False

    def resolve(self, serving: ServingConfig):
        module_name, attribute = self.handler.split(":")
        handler = getattr(importlib.import_module(f"{__package__}.{module_name}"), attribute)
        return handler(serving) if self.configured else handler

    def registered(self, serving: ServingConfig):
        """What registration hands SGLang: the handler, or for a backend factory one that resolves it at
        its first call."""
        if self.kind not in _FACTORY_KINDS:
            return self.resolve(serving)
        return functools.partial(_call_resolved, self, serving)


def _call_resolved(contact: Contact, serving: ServingConfig, *args, **kwargs):
    return contact.resolve(serving)(*args, **kwargs)


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
S, H = Process.SCHEDULER, Process.HTTP
CONTACTS: tuple[Contact, ...] = (
    Contact(S, Kind.PROBE, "torch.Tensor syncing methods, ModelRunner.forward", "sync_probe:install",
            "counts host-synchronising calls per forward (KVEVICT_SYNC_PROBE; tests/test_engine_sync.py)", stock=True),
    Contact(S, Kind.PATCH, "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal",
            "pool:install_contiguous_kv_buffers", "every layer's K/V in one allocation, so cells can hold any layer's entry"),
    Contact(S, Kind.RADIX_CACHE_BACKEND, RADIX_CACHE_BACKEND, "factory:radix_cache_factory",
            "the compressed radix tree and the engine behind it (the launcher passes --radix-cache-backend)",
            configured=True),
    Contact(S, Kind.ATTENTION_BACKEND, "torch_native", "attention:KVEvictTorchBackend",
            "scoring capture and segment attention on CPU; the stock name keeps every gate keyed on it"),
    Contact(S, Kind.ATTENTION_BACKEND, "flashinfer", "flashinfer_backend:create_backend",
            "scoring capture and segment attention on CUDA (FlashInfer ragged/paged kernels)"),
    Contact(S, Kind.AFTER, f"{_SCHEDULER}.process_batch_result", "scheduler_hooks:after_batch",
            "one piece of queued KVzip reconstruction between batches; a finished request's plans stored"),
    Contact(S, Kind.BEFORE, f"{_SCHEDULER}.get_new_batch_prefill", "scheduler_hooks:weigh_waiting_queue",
            "under pressure mode: a waiting queue whose new tokens exceed the pool's free room puts the tree under pressure"),
    Contact(S, Kind.AROUND, f"{_SCHEDULER}.get_next_batch_to_run", "scheduler_hooks:settle_before_next_batch",
            "overlap schedule: a batch whose checkpoints store compressed segments is processed before the next forms"),
    Contact(S, Kind.AFTER, "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info",
            "admission:length_limits", "the longest prompt accepted: what the pool holds once compressed", configured=True),
    Contact(S, Kind.AROUND, "sglang.srt.managers.schedule_policy.PrefillAdder._check_prefill_budget",
            "admission:prefill_admission", "a prompt admitted by its compressed peak footprint (under pressure: once the pool cannot take it dense)", configured=True),
    Contact(S, Kind.AROUND, "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.max_new_tokens_for_memory",
            "admission:answer_clip", "the answer length allowed a prompt, by its compressed footprint", configured=True),
    Contact(S, Kind.AROUND, f"{_DECODE_GRAPH_RUNNER}.capture", "scheduler_hooks:capture_graph_variants",
            "decode CUDA graphs captured per variant: a stock and a segments graph per batch size"),
    Contact(S, Kind.AROUND, f"{_DECODE_GRAPH_RUNNER}.can_run_graph", "scheduler_hooks:replays_only_fitting_batches",
            "a batch whose cells exceed the segments graph's buffers decodes eagerly"),
    Contact(H, Kind.ROUTE, "GET /kvevict/stats", "http:stats_route",
            "the scheduler's compression statistics over HTTP", configured=True, stock=True),
    Contact(H, Kind.AFTER, "sglang.srt.entrypoints.api_contract.generate_contract_error", "http:check_generate_body",
            "/generate refuses eviction options the server does not serve (HTTP 400)", configured=True),
    Contact(H, Kind.BEFORE, "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            "http:check_generate_request", "every other route refuses them too (HTTP 400)", configured=True),
    Contact(H, Kind.AFTER, "sglang.srt.entrypoints.engine._set_envs_and_config", "start_method:fork_children_on_cpu",
            "CPU development mode: the scheduler and detokenizer forked, not spawned (no re-import of SGLang)",
            stock=True),
    Contact(H, Kind.AROUND, "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog",
            "http:prompt_sigterm_watchdog", "SIGTERM noticed within 50 ms, not SGLang's 5-s poll; the drain is SGLang's",
            stock=True),
    Contact(H, Kind.AROUND, "sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup",
            "http:freeze_gc_after_warmup_only", "with --skip-server-warmup, no /freeze_gc before uvicorn listens (the "
            "launcher freezes once /health answers)", stock=True),
)  # fmt: skip
_HOOK_KINDS = (Kind.AFTER, Kind.AROUND, Kind.BEFORE)
_FACTORY_KINDS = (Kind.ATTENTION_BACKEND, Kind.RADIX_CACHE_BACKEND)


def register() -> None:
    """The plugin entry point: this process's scheduler contacts."""
    serving = ServingConfig.from_env()
    _make(serving, Process.SCHEDULER, app=None)


def register_http(app, serving: ServingConfig) -> None:
    """The HTTP process's contacts, on SGLang's FastAPI ``app`` (stock SGLang, no policy: none)."""
    _make(serving, Process.HTTP, app)


def _make(serving: ServingConfig, process: Process, app) -> None:
    contacts = [c for c in CONTACTS if c.process is process and (serving.enabled or c.stock)]
    if serving.enabled:
        check_sglang_version()  # the engine hooks into one SGLang version's internals
    if not contacts:
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for contact in contacts:
        handler = contact.registered(serving)
        if contact.kind in _HOOK_KINDS:
            HookRegistry.register(contact.target, handler, HookType[contact.kind.name])
        elif contact.kind is Kind.ATTENTION_BACKEND:
            ATTENTION_BACKENDS[contact.target] = handler
        elif contact.kind is Kind.RADIX_CACHE_BACKEND:
            if contact.target not in registered_radix_cache_backends():
                register_radix_cache_backend(contact.target, handler)
        elif contact.kind is Kind.ROUTE:
            handler(app)
        else:  # PATCH, PROBE
            handler()
    if process is Process.HTTP and any(contact.kind in _HOOK_KINDS for contact in contacts):
        HookRegistry.apply_hooks()  # the plugin loader applied the scheduler's; this process is past it


def render_table() -> str:
    lines = ["| process | kind | SGLang target | handler (`engine/adapter/`) | why |", "|---|---|---|---|---|"]
    for contact in CONTACTS:
        kind = f"{contact.kind.value} (stock too)" if contact.stock else contact.kind.value
        lines.append(f"| {contact.process.value} | {kind} | `{contact.target}` | `{contact.handler}` | {contact.why} |")
    return "\n".join(lines)


SECTION = GeneratedSection("sglang-contacts", "python -m sgl_kvevict.engine.adapter.contacts", render_table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return section_main([SECTION], argv, "the table of every contact with SGLang (docs/design.md)")


if __name__ == "__main__":
    sys.exit(main())
