"""Shared fixtures: model folders built once per test session, CPU mode, thread count."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_kvevict.compat import prepare_transformers

prepare_transformers()
# One thread is faster than two for these small models on the 2-core machines (measured:
# docs/cpu-mode.md#threads), and leaves the other core to the server processes the tests start.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Triton-interpreter tests run only in a process that has the interpreter on (their module's
    driver test starts one), tests of the torch twins only where it is off, and the CUDA kernel tests (mark ``gpu``) only with ``KVEVICT_GPU_TESTS=1``;
    elsewhere they are deselected, so nothing is reported as skipped."""
    from sgl_kvevict.kernels.runtime import TRITON_INTERPRETED
    from test_kernels_support import GPU_TESTS_VARIABLE

    excluded_marks = {"triton_interpreter_driver", "torch_twins"} if TRITON_INTERPRETED else {"triton_interpreter"}
    if os.environ.get(GPU_TESTS_VARIABLE) != "1":
        excluded_marks.add("gpu")
    selected = [item for item in items if not any(item.get_closest_marker(mark) for mark in excluded_marks)]
    if len(selected) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = servers_first(selected)


def servers_first(items: list) -> list:
    """Modules that start a server (mark ``server``) before the others, each module's tests in their
    order. ``make test`` hands whole modules to two workers (pytest-xdist ``--dist loadfile``) in this
    order: the long server modules start early and the quick ones fill the gaps, so neither worker
    ends with a long module while the other idles."""
    server_modules = {item.module for item in items if item.get_closest_marker("server")}
    return sorted(items, key=lambda item: item.module not in server_modules)


def pytest_runtest_setup(item):
    """A selected CUDA kernel test fails, never skips or passes, where it cannot run compiled on a GPU."""
    if item.get_closest_marker("gpu") is None:
        return
    from sgl_kvevict.kernels.runtime import TRITON_INTERPRETED
    from test_kernels_support import GPU_TESTS_VARIABLE

    if TRITON_INTERPRETED:
        pytest.fail("gpu tests check compiled kernels, but TRITON_INTERPRET=1 is set: unset it", pytrace=False)
    if not torch.cuda.is_available():
        message = f"{GPU_TESTS_VARIABLE}=1 selects the CUDA kernel tests, but torch sees no CUDA device"
        pytest.fail(f"{message} (torch {torch.__version__}, CUDA build {torch.version.cuda})", pytrace=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> "Path":
    """A random-weight fp32 Llama (2 layers, 4 query heads, 2 KV heads, head_dim 16) with a tokenizer."""
    from sgl_kvevict.checkpoints import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The fp32 reference engine on the tiny model: the parity tests' ground truth (a module may bring
    its own, e.g. on SmolLM2)."""
    from sgl_kvevict.reference.engine import ReferenceEngine

    return ReferenceEngine(tiny_llama_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def learned_weights(tiny_llama_dir, tmp_path_factory) -> str:
    """A learned scorer for the tiny model, trained by the project's own command (about a second)."""
    from conftest_policies import tiny_training
    from sgl_kvevict.reference.train_scorer import train

    config = tiny_training(tiny_llama_dir, tmp_path_factory.mktemp("weights"))
    return str(train(config, "tests/conftest.py", log=lambda line: None))


@pytest.fixture(scope="session")
def smollm2_dir() -> "Path":
    """The bundled SmolLM2-135M-Instruct as a safetensors folder (converted once, then cached)."""
    from sgl_kvevict.models import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_dir() -> "Path":
    """The bundled Gemma 3 270M (base) as a safetensors folder (converted once, about a minute, then cached)."""
    from sgl_kvevict.models import resolve_model

    return resolve_model("gemma3-270m")
