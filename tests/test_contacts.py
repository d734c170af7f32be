"""Every contact with SGLang is one row of ``engine.adapter.contacts.CONTACTS``: the design document's
table is that table, each handler exists, and registration makes exactly those contacts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sgl_kvevict.engine.adapter import contacts  # noqa: E402
from sgl_kvevict.engine.adapter.contacts import CONTACTS, SECTION, Contact, Kind, Process  # noqa: E402
from sgl_kvevict.serving import ENV_VAR, ServingConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"


def test_the_design_documents_registration_table_is_the_adapters():
    assert SECTION.of(DESIGN.read_text()) == SECTION.fresh(), (
        f"docs/design.md's contact table is stale: run {SECTION.command} --write docs/design.md"
    )


def test_a_new_contact_makes_the_design_table_stale():
    extra = Contact(Process.SCHEDULER, Kind.AFTER, "sglang.srt.x.Y.z", "scheduler_hooks:after_batch", "a test row")
    rendered = SECTION.fresh()
    original = contacts.CONTACTS
    try:
        contacts.CONTACTS = (*original, extra)
        assert SECTION.fresh() != rendered and "sglang.srt.x.Y.z" in SECTION.fresh()
    finally:
        contacts.CONTACTS = original


@pytest.mark.parametrize("contact", [c for c in CONTACTS if "flashinfer" not in c.handler], ids=lambda c: c.handler)
def test_every_handler_resolves(contact):
    """Each handler is importable on CPU (the FlashInfer backend's module needs flashinfer: its tests use
    a faithful fake, tests/fake_flashinfer.py) and, when configured, built from a served config."""
    assert callable(contact.resolve(ServingConfig("snapkv")))


def test_every_hook_target_exists_in_this_sglang():
    import importlib

    for contact in CONTACTS:
        if contact.kind not in (Kind.AFTER, Kind.AROUND, Kind.BEFORE):
            continue
        module_name, owner, attribute = _split(contact.target)
        target = importlib.import_module(module_name)
        for name in filter(None, (owner, attribute)):
            target = getattr(target, name)
        assert callable(target), contact.target


def _split(target: str) -> tuple[str, str, str]:
    """``pkg.module.Class.method`` -> (module, Class, method); ``pkg.module.function`` -> (module, "", function)."""
    parts = target.split(".")
    if parts[-2][0].isupper():
        return ".".join(parts[:-2]), parts[-2], parts[-1]
    return ".".join(parts[:-1]), "", parts[-1]


class Recorder:
    """SGLang's registries, recording what registration makes."""

    def __init__(self, monkeypatch):
        from sglang.srt.layers.attention import attention_registry
        from sglang.srt.mem_cache import registry
        from sglang.srt.plugins.hook_registry import HookRegistry

        self.made: list[tuple[str, str]] = []
        monkeypatch.setattr(HookRegistry, "register", lambda target, handler, kind: self.made.append((kind.name, target)))
        monkeypatch.setattr(HookRegistry, "apply_hooks", lambda: self.made.append(("applied", "")))
        monkeypatch.setattr(registry, "register_radix_cache_backend", lambda name, factory: self.made.append(("radix", name)))
        monkeypatch.setattr(registry, "registered_radix_cache_backends", lambda: [])
        monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS", _Recording(self.made))
        for kind in (Kind.PATCH, Kind.PROBE, Kind.ROUTE):
            for contact in CONTACTS:
                if contact.kind is kind:
                    module_name, attribute = contact.handler.split(":")
                    module = __import__(f"sgl_kvevict.engine.adapter.{module_name}", fromlist=[attribute])
                    monkeypatch.setattr(module, attribute, self._installer(kind, contact))

    def _installer(self, kind: Kind, contact: Contact):
        if contact.configured:
            return lambda serving: lambda *app: self.made.append((kind.name, contact.target))
        return lambda *args: self.made.append((kind.name, contact.target))


class _Recording(dict):
    def __init__(self, made):
        super().__init__()
        self.made = made

    def __setitem__(self, name, factory):
        self.made.append(("attention", name))


def expected(process: Process, enabled: bool) -> list[tuple[str, str]]:
    names = {Kind.ATTENTION_BACKEND: "attention", Kind.RADIX_CACHE_BACKEND: "radix"}
    return [
        (names.get(c.kind, c.kind.name), c.target)
        for c in CONTACTS
        if c.process is process and (enabled or c.stock)
    ]


def test_the_plugin_entry_point_makes_every_scheduler_contact_and_no_other(monkeypatch):
    """On CPU too: the FlashInfer backend's module (it imports flashinfer) loads at its factory's first call."""
    recorder = Recorder(monkeypatch)
    monkeypatch.setenv(ENV_VAR, ServingConfig("snapkv").to_env())
    monkeypatch.delitem(sys.modules, "sgl_kvevict.engine.adapter.flashinfer_backend", raising=False)
    contacts.register()
    assert recorder.made == expected(Process.SCHEDULER, enabled=True)
    assert "sgl_kvevict.engine.adapter.flashinfer_backend" not in sys.modules


def test_stock_sglang_gets_only_the_probe_the_stats_route_and_the_start_and_stop_contacts(monkeypatch):
    """The start and stop contacts: the CPU start method, the SIGTERM watchdog, the early /freeze_gc skipped."""
    recorder = Recorder(monkeypatch)
    monkeypatch.delenv(ENV_VAR, raising=False)
    contacts.register()
    contacts.register_http(app=object(), serving=ServingConfig.from_env())
    stock_http = expected(Process.HTTP, enabled=False)
    assert sorted(kind for kind, _ in stock_http) == ["AFTER", "AROUND", "AROUND", "ROUTE"]
    assert recorder.made == expected(Process.SCHEDULER, enabled=False) + stock_http + [("applied", "")]


def test_the_http_process_makes_its_contacts_then_applies_its_hooks(monkeypatch):
    recorder = Recorder(monkeypatch)
    contacts.register_http(app=object(), serving=ServingConfig("snapkv"))
    assert recorder.made == [*expected(Process.HTTP, enabled=True), ("applied", "")]


def test_the_sigterm_watchdog_hands_over_to_sglangs_once_the_flag_is_set():
    """SGLang's own watchdog looks for the flag every 5 s; the hook waits for it, then runs SGLang's, which
    drains and exits: called once, after SIGTERM, with the flag set."""
    import asyncio
    from types import SimpleNamespace

    from sgl_kvevict.engine.adapter.http import prompt_sigterm_watchdog

    manager = SimpleNamespace(gracefully_exit=False)
    calls = []

    async def sglangs_watchdog(tokenizer_manager):
        calls.append((tokenizer_manager, tokenizer_manager.gracefully_exit))

    async def scenario():
        watchdog = asyncio.create_task(prompt_sigterm_watchdog(sglangs_watchdog, manager))
        await asyncio.sleep(0.3)
        assert not calls and not watchdog.done()  # no SIGTERM yet: still watching
        manager.gracefully_exit = True  # what SGLang's SIGTERM handler sets
        await asyncio.wait_for(watchdog, timeout=2.0)  # well under SGLang's 5-s poll

    asyncio.run(scenario())
    assert calls == [(manager, True)]


@pytest.mark.parametrize("skip_server_warmup, sglangs_freeze_runs", [(True, False), (False, True)])
def test_sglangs_own_freeze_gc_runs_only_after_a_warmup(monkeypatch, skip_server_warmup, sglangs_freeze_runs):
    """Without a warm-up SGLang would post /freeze_gc before uvicorn listens; the launcher freezes then."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as runtime_context

    from sgl_kvevict.engine.adapter.http import freeze_gc_after_warmup_only

    monkeypatch.setattr(runtime_context, "get_serving", lambda: SimpleNamespace(skip_server_warmup=skip_server_warmup))
    calls = []
    freeze_gc_after_warmup_only(calls.append, "server_args")
    assert calls == (["server_args"] if sglangs_freeze_runs else [])


START_METHOD_AFTER_SGLANGS = """
import multiprocessing, sys, threading
from sgl_kvevict.compat import activate_cpu_mode
activate_cpu_mode()
from sgl_kvevict.engine.adapter.start_method import fork_children_on_cpu
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
multiprocessing.set_start_method("spawn", force=True)  # what engine._set_envs_and_config does
fork_children_on_cpu(None, object())
print(multiprocessing.get_start_method())
"""


@pytest.mark.parametrize("threads, start_method", [("none", "fork"), ("thread", "spawn")])
def test_sglangs_children_are_forked_on_cpu_only_from_a_single_threaded_process(threads, start_method):
    """A fork copies one thread, so with a second one (here a Python thread; an OpenMP pool counts the
    same, /proc/self/task) SGLang's spawn stays. A fresh interpreter, as the launcher starts SGLang's
    (one OpenMP thread, so torch starts no pool): the start method is process-wide."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", START_METHOD_AFTER_SGLANGS, threads], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == start_method
