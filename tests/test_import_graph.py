"""The package's import graph has no cycle and keeps the layering of docs/design.md.

Read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` is an import of ``b`` (or
of a name from ``b``) anywhere in ``a``, inside functions and under ``if TYPE_CHECKING:`` too: an
import made only for type annotations is still a dependency, and a cycle through one means a module
knows a type it should not (the policies would know the config that builds them). Importing
``pkg.mod`` also runs ``pkg/__init__``, so that counts as an edge too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml's package-dir: import prefix -> source folder.
PACKAGE_DIRS = {"sgl_kvevict": ROOT / "sgl_kvevict", "sgl_kvevict.kernels": ROOT / "kernels", "sgl_kvevict.server": ROOT / "server"}
# The math knows no engine; only engine/adapter/ imports sglang, only reference/ imports transformers models.
# Nor does it know the config that builds it: policies and scores take narrow settings types.
PURE_PACKAGES = (
    "sgl_kvevict.scoring", "sgl_kvevict.budget", "sgl_kvevict.policies", "sgl_kvevict.plan", "sgl_kvevict.settings",
    "sgl_kvevict.settings", "sgl_kvevict.sharding",
)  # fmt: skip
# The engine's core knows no SGLang: every contact with it lives in the adapter (engine/adapter/).
ENGINE_ADAPTER = "sgl_kvevict.engine.adapter"


def package_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    modules = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute names imported anywhere in ``tree`` (``from x import y`` gives ``x`` and ``x.y``)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (and the packages whose ``__init__`` that runs)."""
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        imported = _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py")
        edges = set()
        for name in imported:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != module and not module.startswith(prefix + "."):
                    edges.add(prefix)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path ``[a, b, ..., a]``, or ``[]``."""
    visiting, done = [], set()

    def walk(node: str) -> list[str]:
        if node in visiting:
            return visiting[visiting.index(node) :] + [node]
        if node in done:
            return []
        visiting.append(node)
        for successor in sorted(graph[node]):
            cycle = walk(successor)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return []

    for start in sorted(graph):
        cycle = walk(start)
        if cycle:
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle_through_a_package_init():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": set()}
    assert find_cycle(graph) == ["p", "p.a", "p.b", "p"]
    assert find_cycle({"p": {"p.a"}, "p.a": set()}) == []


def test_relative_imports_resolve_to_absolute_modules_and_type_checking_imports_count():
    tree = ast.parse("from . import x\nfrom ..b import y\nif TYPE_CHECKING:\n    import z\n")
    assert _imported_names(tree, "pkg.sub.mod", is_package=False) == {"pkg.sub", "pkg.sub.x", "pkg.b", "pkg.b.y", "z"}


def test_no_module_imports_another_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "forbidden", ["sglang", "transformers", "sgl_kvevict.engine", "sgl_kvevict.reference", "sgl_kvevict.config"]
)
def test_the_math_imports_no_engine(forbidden):
    assert offending_imports(lambda module: module.startswith(PURE_PACKAGES), forbidden) == {}


def offending_imports(selected, forbidden: str) -> dict[str, list[str]]:
    """Module -> the names under ``forbidden`` it imports, for the modules ``selected`` accepts."""
    offenders = {}
    for module, path in package_modules().items():
        if not selected(module):
            continue
        imported = _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py")
        bad = sorted(name for name in imported if name == forbidden or name.startswith(forbidden + "."))
        if bad:
            offenders[module] = bad
    return offenders


def in_engine_core(module: str) -> bool:
    return module.startswith("sgl_kvevict.engine") and not module.startswith(ENGINE_ADAPTER)


@pytest.mark.parametrize("forbidden", ["sglang", ENGINE_ADAPTER, "sgl_kvevict.server"])
def test_the_engine_core_imports_no_sglang_and_no_adapter(forbidden):
    assert offending_imports(in_engine_core, forbidden) == {}


def test_only_the_adapter_imports_sglang_in_the_package():
    """Outside the adapter, the product imports SGLang only to run it: the launcher's SGLang process."""
    outside = offending_imports(lambda module: not module.startswith(ENGINE_ADAPTER), "sglang")
    assert set(outside) == {"sgl_kvevict.server.sglang_entry"}


def test_the_core_check_sees_an_sglang_import():
    """The rule fails on a core module that imports SGLang (the parser sees imports inside functions)."""
    tree = ast.parse("def f():\n    from sglang.srt.mem_cache.radix_cache import RadixCache\n")
    assert "sglang.srt.mem_cache.radix_cache" in _imported_names(tree, "sgl_kvevict.engine.coordinator", False)
    assert in_engine_core("sgl_kvevict.engine.coordinator") and not in_engine_core("sgl_kvevict.engine.adapter.factory")
