"""Import the modules our launcher's GPU path imports at start-up, one by one, and say what loaded.

    python tools/gpu_launch_imports.py [--fake-cuda] [--fake-flashinfer] [--json FILE]

Three users, one list of modules:

* the lent GPU machine (``tools/gpu_smoke.py``): the kit's fast import check before any server starts;
* ``tools/gpu_kit.py`` on the CPU machine that builds the kit (``--fake-cuda``): which FlashInfer
  modules the launch path imports (the kit keeps those) and which distributions (the kit must carry
  those the lent machine lacks);
* ``tests/test_gpu_kit.py`` in CI (``--fake-cuda --fake-flashinfer``): the stand-in ``sgl_kernel`` and
  the installed SGLang still import along the CUDA branches.

``--fake-cuda`` makes torch report one sm_90 device, so SGLang takes its CUDA branches at import time
(nothing runs on a device). ``--fake-flashinfer`` puts ``tests/fake_flashinfer.py`` in place of
FlashInfer for our backend, after SGLang's modules have imported without it. Prints one line per
module; exit code 1 if any failed to import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What the launcher's SGLang process and its scheduler import on CUDA, in the order they first do.
SGLANG_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.entrypoints.http_server",
    "sglang.launch_server",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.models.llama",
)
FLASHINFER_MODULES = ("flashinfer", "flashinfer.prefill", "flashinfer.decode", "flashinfer.cascade")
PLUGIN_MODULES = (
    "sgl_kvevict.server.launcher",
    "sgl_kvevict.server.sglang_entry",
    "sgl_kvevict.engine.adapter.contacts",
    "sgl_kvevict.engine.adapter.flashinfer_backend",
)
TRACED_PACKAGES = ("sglang", "flashinfer")
ORIGIN_PACKAGES = ("sglang", "flashinfer", "sgl_kernel", "sgl_kvevict")


def fake_cuda() -> None:
    """torch as it looks on one H100, for import-time checks only."""
    import torch

    torch.version.cuda = "13.0"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3 (faked)"


def install_fake_flashinfer() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import fake_flashinfer

    # install() takes pytest's monkeypatch and uses its setitem only; here the fake stays for good.
    fake_flashinfer.install(types.SimpleNamespace(setitem=lambda mapping, key, value: mapping.__setitem__(key, value)))


def import_one(name: str) -> dict:
    started = time.perf_counter()
    try:
        importlib.import_module(name)
        error = None
    except BaseException as failure:  # a SystemExit or a native crash's exception is a result too
        error = f"{type(failure).__name__}: {failure}".splitlines()[0][:400]
        traceback.print_exc(limit=-3)
    return {"module": name, "seconds": round(time.perf_counter() - started, 2), "error": error}


def loaded_files(package: str) -> list[str]:
    """The files of ``package`` that are imported now, relative to the folder holding the package."""
    files = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == package or name.startswith(package + ".")) and path:
            # flashinfer.jit.core -> flashinfer/jit/core.py; a package adds its __init__.py.
            depth = name.count(".") + 1 + (Path(path).stem == "__init__")
            files.add("/".join(Path(path).parts[-depth:]))
    return sorted(files)


def imported_distributions() -> list[str]:
    owners = importlib.metadata.packages_distributions()
    tops = {name.split(".")[0] for name in list(sys.modules)}
    return sorted({dist for top in tops for dist in owners.get(top, ())})


def origins() -> dict[str, str]:
    """Where each imported package of ``ORIGIN_PACKAGES`` was found (the folder holding it)."""
    found = {}
    for package in ORIGIN_PACKAGES:
        path = getattr(sys.modules.get(package), "__file__", None)
        if path:
            found[package] = str(Path(path).parent.parent)
    return found


def sgl_kernel_kind() -> str:
    module = sys.modules.get("sgl_kernel")
    if module is None:
        return "not imported"
    return "stand-in" if getattr(module, "__sgl_kvevict_standin__", False) else "real"


def sgl_kernel_submodules() -> list[str]:
    """The ``sgl_kernel`` submodules imported now (SGLang's CUDA branches import some; CPU mode none)."""
    return sorted(name for name in sys.modules if name.startswith("sgl_kernel.") and not name.startswith("sgl_kernel._"))


def run(fake_cuda_device: bool, fake_flashinfer_module: bool) -> dict:
    if fake_cuda_device:
        fake_cuda()
    results = [import_one(name) for name in SGLANG_MODULES]
    if fake_flashinfer_module:
        install_fake_flashinfer()
    else:
        results += [import_one(name) for name in FLASHINFER_MODULES]
    results += [import_one(name) for name in PLUGIN_MODULES]
    return {
        "imports": results,
        "sgl_kernel": sgl_kernel_kind(),
        "sgl_kernel_submodules": sgl_kernel_submodules(),
        "origins": origins(),
        "loaded": {package: loaded_files(package) for package in TRACED_PACKAGES},
        "distributions": imported_distributions(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake-cuda", action="store_true", help="make torch report one sm_90 device")
    parser.add_argument("--fake-flashinfer", action="store_true", help="tests/fake_flashinfer.py for our backend")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    report = run(args.fake_cuda, args.fake_flashinfer)
    for result in report["imports"]:
        status = "ok  " if result["error"] is None else "FAIL"
        print(f"{status} {result['seconds']:6.2f} s  {result['module']}{'' if result['error'] is None else ': ' + result['error']}")
    print(f"sgl_kernel: {report['sgl_kernel']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(result["error"] is None for result in report["imports"]) else 1


if __name__ == "__main__":
    sys.exit(main())
