"""Functions that raise a clear error instead of running a kernel this stand-in does not have."""

from __future__ import annotations

from typing import Callable, Iterable


def unavailable(qualified_name: str) -> Callable:
    def raise_unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"{qualified_name} was called, but sgl_kernel is sgl-kvevict's GPU-kit stand-in (the real "
            "sglang-kernel wheel does not load on this machine's torch). The smoke run's flags route a Llama "
            "forward around it (docs/gpu.md); the traceback shows which path did not."
        )

    raise_unavailable.__name__ = qualified_name.rsplit(".", 1)[-1]
    raise_unavailable.__qualname__ = qualified_name
    return raise_unavailable


def unavailable_functions(module: str, names: Iterable[str]) -> dict[str, Callable]:
    return {name: unavailable(f"{module}.{name}") for name in names}
