"""Build the GPU kit: what a lent GPU machine needs to start our launcher, in one ignored folder.

    make gpu-kit          (.venv/bin/python tools/gpu_kit.py)

The lent machine (docs/gpu.md, "Run the server on a lent GPU") has torch 2.11 + CUDA 13, Triton,
transformers and no network; a device run carries at most 64 MiB. This script, on the CPU machine
with PyPI:

1. downloads the pinned wheels for that machine (``requirements/gpu-kit.txt``: Python 3.12, manylinux
   x86_64), and for this machine the few distributions FlashInfer's import needs here
   (``requirements/gpu-kit-trace.txt``, never carried);
2. traces the launch path's imports with CUDA faked (``tools/gpu_launch_imports.py``) against the
   downloaded FlashInfer and the kit's stand-in ``sgl_kernel``, and refuses a kit that would miss a
   distribution the lent machine lacks;
3. trims SGLang (its Rust server, bench, gRPC and multimodal extensions, the diffusion runtime, its test
   kits) and FlashInfer (the modules the trace imported, its top-level modules and JIT generators,
   and the headers and top-level sources its JIT compiles), and replaces
   ``sglang/kernels/ops/gemm/cutedsl_dual_gemm.py`` with ``tools/gpu_kit_files/cutedsl_dual_gemm.py``;
4. writes the stand-in ``sgl_kernel`` (``tools/gpu_kit_files/standin``) as a wheel and SmolLM2's
   config and tokenizer (no weights: the smoke run makes its own) into ``gpu-kit/model``;
5. checks that the kit and the working tree together fit the carry limit, and only then replaces
   ``gpu-kit/``.
"""

from __future__ import annotations

import base64
import csv
import datetime
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "gpu-kit"
PINS = REPO / "requirements" / "gpu-kit.txt"
TRACE_PINS = REPO / "requirements" / "gpu-kit-trace.txt"
MACHINE_PACKAGES = REPO / "requirements" / "gpu-machine.txt"
DOWNLOADS = REPO / "build" / "gpu-kit-downloads"
KIT_FILES = REPO / "tools" / "gpu_kit_files"
STANDIN_SOURCE = KIT_FILES / "standin"
DUAL_GEMM_PATH = "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py"

MIB = 1 << 20
# What one device run carries: the working tree and the carried folders together.
CARRY_LIMIT_BYTES = 64 * MIB
LENT_MACHINE_PLATFORMS = (
    "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
)  # fmt: skip
STANDIN_DISTRIBUTION = ("sgl_kvevict_sgl_kernel_standin", "0.1.0")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Imported on this CPU machine only because they are installed here (transformers imports soundfile
# where it finds it); the lent machine lacks them and the launch path does not need them.
IMPORTED_ONLY_WHERE_INSTALLED = frozenset({"soundfile", "cffi"})

# SGLang's parts the launch path never imports (checked against the trace): the Rust extensions of its
# own server, bench, gRPC and multimodal paths (23 of its 36 MiB), the diffusion runtime, test kits.
SGLANG_DROPPED = (
    re.compile(r"sglang/srt/rust_extensions/_(server|bench|grpc|multimodal)\.[^/]*\.so$"),
    re.compile(r"sglang/multimodal_gen/"),
    re.compile(r"sglang/test/"),
)
# FlashInfer's data the JIT compiles attention from: its headers, CUTLASS (the sm_90 kernels), its
# vendored CCCL and spdlog, and the top-level sources (each kernel family's own folder stays out).
FLASHINFER_DATA_KEPT = (
    re.compile(r"flashinfer/data/(include|cutlass|cccl|spdlog)/"),
    re.compile(r"flashinfer/data/csrc/[^/]+$"),
)


class KitError(RuntimeError):
    """The kit cannot be built; the message says why and what to do."""


def progress(message: str) -> None:
    print(f"[gpu-kit] {message}", flush=True)


def mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path) -> list[str]:
    """The non-comment lines of a requirements file (``name==version`` or a bare name)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pinned_names(path: Path) -> set[str]:
    return {normalised(line.split("==")[0]) for line in read_requirements(path)}


# --- downloads -----------------------------------------------------------------------------------


def wheel_distribution(wheel: Path) -> tuple[str, str]:
    """(normalised name, version) from a wheel's file name."""
    name, version = wheel.name.split("-")[:2]
    return normalised(name), version


def pip_download(requirements: Path, dest: Path, for_lent_machine: bool) -> list[Path]:
    """The wheels ``requirements`` pins, without dependencies (every one is pinned), into ``dest``
    (a cache: wheels of earlier pins stay there and are not returned)."""
    dest.mkdir(parents=True, exist_ok=True)
    target = ["--python-version", "3.12", "--implementation", "cp"] if for_lent_machine else []
    for platform in LENT_MACHINE_PLATFORMS if for_lent_machine else ():
        target += ["--platform", platform]
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
    command += ["--only-binary=:all:", *target, "-d", str(dest), "-r", str(requirements)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise KitError(f"pip download of {requirements.relative_to(REPO)} failed:\n{result.stderr[-3000:]}")
    pins = {normalised(name): version for name, version in (line.split("==") for line in read_requirements(requirements))}
    wheels = [wheel for wheel in sorted(dest.glob("*.whl")) if pins.get(wheel_distribution(wheel)[0]) == wheel_distribution(wheel)[1]]
    found = [wheel_distribution(wheel)[0] for wheel in wheels]
    if sorted(found) != sorted(pins):
        raise KitError(f"{dest}: expected one wheel per pin, found {sorted(found)} for {sorted(pins)}")
    return wheels


def wheel_named(wheels: Iterable[Path], distribution: str) -> Path:
    return next(wheel for wheel in wheels if wheel_distribution(wheel)[0] == normalised(distribution))


# --- the import trace ----------------------------------------------------------------------------


def trace_launch_imports(python_path: list[Path]) -> dict:
    """``tools/gpu_launch_imports.py --fake-cuda`` with ``python_path`` ahead of this venv."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "trace.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(path) for path in python_path))
        command = [sys.executable, str(REPO / "tools" / "gpu_launch_imports.py"), "--fake-cuda", "--json", str(report)]
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if not report.exists():
            raise KitError(f"the import trace crashed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
        trace = json.loads(report.read_text())
    failed = [f"{item['module']}: {item['error']}" for item in trace["imports"] if item["error"]]
    if failed:
        raise KitError("the launch path does not import with the kit (CUDA faked):\n  " + "\n  ".join(failed))
    return trace


def missing_distributions(imported: Iterable[str], carried: set[str], on_machine: set[str]) -> list[str]:
    """The distributions the launch path imports that neither the kit carries nor the machine has."""
    provided = carried | on_machine | {"sgl-kvevict"} | IMPORTED_ONLY_WHERE_INSTALLED
    return sorted(name for name in map(normalised, imported) if name not in provided)


def check_trace(trace: dict) -> None:
    missing = missing_distributions(trace["distributions"], pinned_names(PINS), pinned_names(MACHINE_PACKAGES))
    if missing:
        raise KitError(
            f"the launch path imports {', '.join(missing)}, which the lent machine lacks "
            f"({MACHINE_PACKAGES.relative_to(REPO)}): pin them in {PINS.relative_to(REPO)}"
        )
    dropped = [path for path in trace["loaded"]["sglang"] if not sglang_keeps(path)]
    if dropped:
        raise KitError(f"the launch path imports SGLang files the kit drops (SGLANG_DROPPED): {dropped[:5]}")


# --- trimming and wheels -------------------------------------------------------------------------


def sglang_keeps(path: str) -> bool:
    return not any(rule.match(path) for rule in SGLANG_DROPPED)


def flashinfer_keeper(imported: set[str]) -> Callable[[str], bool]:
    """What the kit keeps of FlashInfer: the dist-info, the modules the launch path imported, the
    top-level modules and the JIT generators (the wrappers import those when they first plan), and the
    data the JIT compiles attention from."""

    def keeps(path: str) -> bool:
        if not path.startswith("flashinfer/"):
            return True  # the dist-info and three small top-level files
        if path.startswith("flashinfer/data/"):
            return any(rule.match(path) for rule in FLASHINFER_DATA_KEPT)
        return path in imported or path.count("/") == 1 or path.startswith("flashinfer/jit/")

    return keeps


def record_row(name: str, data: bytes) -> tuple[str, str, int]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return name, f"sha256={digest}", len(data)


def write_wheel(path: Path, files: list[tuple[str, bytes]]) -> None:
    """A wheel of ``files`` (its dist-info included), with the RECORD written for exactly these files."""
    dist_info = next(name.split("/")[0] for name, _ in files if name.split("/")[0].endswith(".dist-info"))
    record_name = f"{dist_info}/RECORD"
    entries = [(name, data) for name, data in files if name != record_name]
    record = io.StringIO()
    # CSV: a few of SGLang's file names hold commas.
    csv.writer(record, lineterminator="\n").writerows([*(record_row(name, data) for name, data in entries), (record_name, "", "")])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in [*entries, (record_name, record.getvalue().encode())]:
            archive.writestr(name, data)


@dataclass
class Trimmed:
    wheel: Path
    kept: int
    dropped: int
    replaced: list[str]


def trim_wheel(source: Path, dest_dir: Path, keeps: Callable[[str], bool], replacements: dict[str, bytes]) -> Trimmed:
    """``source`` rewritten into ``dest_dir`` (same file name) with only the files ``keeps`` and the
    ``replacements`` (path -> new content; each must exist in the wheel)."""
    with zipfile.ZipFile(source) as archive:
        names = [info.filename for info in archive.infolist() if not info.is_dir()]
        absent = sorted(set(replacements) - set(names))
        if absent:
            raise KitError(f"{source.name} has no {absent}: the pin moved, update tools/gpu_kit.py")
        kept = [name for name in names if keeps(name) or name in replacements]
        files = [(name, replacements[name] if name in replacements else archive.read(name)) for name in kept]
    target = dest_dir / source.name
    write_wheel(target, files)
    return Trimmed(target, len(kept), len(names) - len(kept), sorted(replacements))


def standin_wheel(dest_dir: Path) -> Path:
    """The stand-in ``sgl_kernel`` package as an installable wheel."""
    name, version = STANDIN_DISTRIBUTION
    dist_info = f"{name}-{version}.dist-info"
    files = [
        (path.relative_to(STANDIN_SOURCE).as_posix(), path.read_bytes())
        for path in sorted(STANDIN_SOURCE.rglob("*.py"))
    ]
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: sgl-kvevict GPU-kit stand-in for sgl_kernel\n"
    wheel = "Wheel-Version: 1.0\nGenerator: sgl-kvevict tools/gpu_kit.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files += [(f"{dist_info}/METADATA", metadata.encode()), (f"{dist_info}/WHEEL", wheel.encode())]
    target = dest_dir / f"{name}-{version}-py3-none-any.whl"
    write_wheel(target, files)
    return target


# --- sizes ---------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def working_tree_bytes(repo: Path = REPO) -> int:
    """What a device run sends besides the carried folders: tracked and untracked, not ignored, files."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = (repo / name for name in listed.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def check_carry_size(kit_bytes: int, tree_bytes: int, limit: int = CARRY_LIMIT_BYTES) -> str:
    """One line on what a device run would carry; ``KitError`` where it exceeds ``limit``. Counted
    uncompressed (the wheels are compressed already), so it is an upper bound."""
    total = kit_bytes + tree_bytes
    line = f"gpu-kit/ {mib(kit_bytes)} + working tree {mib(tree_bytes)} = {mib(total)} of the {mib(limit)} a device run carries"
    if total > limit:
        raise KitError(
            f"{line}: over the limit by {mib(total - limit)}. Trim more (SGLANG_DROPPED, FLASHINFER_DATA_KEPT "
            f"in tools/gpu_kit.py) or carry fewer wheels ({PINS.relative_to(REPO)})."
        )
    return line


# --- the build -----------------------------------------------------------------------------------


def check_build_environment() -> None:
    import sglang

    wanted = next(line.split("==")[1] for line in read_requirements(PINS) if line.startswith("sglang=="))
    if sglang.__version__ != wanted:
        raise KitError(f"this venv has sglang {sglang.__version__}, the kit pins {wanted}: run make setup")


def unpack(wheel: Path, folder: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(folder)
    return folder


def copy_model_config(dest: Path) -> Path:
    """SmolLM2-135M-Instruct's config and tokenizer (the bundled model, converted once); no weights."""
    from sgl_kvevict.models import resolve_model

    source = resolve_model("smollm2", log=progress)
    dest.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy2(source / name, dest / name)
    return dest


def git_commit() -> str:
    result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def write_kit_wheels(wheels: list[Path], flashinfer_imported: set[str], dest: Path) -> dict:
    """Every pinned wheel into ``dest``, SGLang and FlashInfer trimmed, plus the stand-in; their sizes."""
    dest.mkdir(parents=True)
    stub = {DUAL_GEMM_PATH: (KIT_FILES / "cutedsl_dual_gemm.py").read_bytes()}
    trims = {"sglang": (sglang_keeps, stub), "flashinfer-python": (flashinfer_keeper(flashinfer_imported), {})}
    sizes = {}
    for wheel in wheels:
        distribution = wheel_distribution(wheel)[0]
        if distribution not in trims:
            shutil.copy2(wheel, dest / wheel.name)
            sizes[wheel.name] = {"bytes": wheel.stat().st_size}
            continue
        trimmed = trim_wheel(wheel, dest, *trims[distribution])
        size = trimmed.wheel.stat().st_size
        progress(f"{wheel.name}: {mib(wheel.stat().st_size)} -> {mib(size)} ({trimmed.dropped} files dropped)")
        sizes[wheel.name] = {"bytes": size, "downloaded_bytes": wheel.stat().st_size, "files_kept": trimmed.kept,
                             "files_dropped": trimmed.dropped, "replaced": trimmed.replaced}  # fmt: skip
    standin = standin_wheel(dest)
    sizes[standin.name] = {"bytes": standin.stat().st_size}
    return sizes


def check_trimmed_imports(kit_wheels: Path, helpers: Path, scratch: Path) -> None:
    """The launch path imports again, now from the kit's trimmed SGLang and FlashInfer and its stand-in."""
    tree = scratch / "trimmed"
    for pattern in ("sglang-*.whl", "flashinfer_python-*.whl", f"{STANDIN_DISTRIBUTION[0]}-*.whl"):
        unpack(next(kit_wheels.glob(pattern)), tree)
    trace = trace_launch_imports([tree, helpers])
    origins = {package: trace["origins"].get(package, "not imported") for package in ("sglang", "flashinfer", "sgl_kernel")}
    elsewhere = {package: origin for package, origin in origins.items() if not origin.startswith(str(tree))}
    if elsewhere:
        raise KitError(f"the re-trace imported {sorted(elsewhere)} from outside the kit: {elsewhere}")


def build(kit: Path = KIT) -> dict:
    check_build_environment()
    progress(f"downloading {len(read_requirements(PINS))} pinned wheels for the lent machine (cp312, manylinux)")
    wheels = pip_download(PINS, DOWNLOADS / "lent-machine", for_lent_machine=True)
    progress("downloading what FlashInfer's import needs on this machine, for the import trace only")
    trace_wheels = pip_download(TRACE_PINS, DOWNLOADS / "trace", for_lent_machine=False)
    partial = kit.with_name(kit.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch:
            scratch_path = Path(scratch)
            helpers = scratch_path / "helpers"
            for wheel in trace_wheels:
                unpack(wheel, helpers)
            flashinfer_tree = unpack(wheel_named(wheels, "flashinfer-python"), scratch_path / "flashinfer")
            progress("tracing the launch path's imports with CUDA faked (about 20 s)")
            trace = trace_launch_imports([STANDIN_SOURCE, flashinfer_tree, helpers])
            check_trace(trace)
            progress(f"trace: {len(trace['loaded']['sglang'])} SGLang and {len(trace['loaded']['flashinfer'])} FlashInfer files imported")
            sizes = write_kit_wheels(wheels, set(trace["loaded"]["flashinfer"]), partial / "wheels")
            progress("tracing again from the trimmed wheels")
            check_trimmed_imports(partial / "wheels", helpers, scratch_path)
        copy_model_config(partial / "model")
        kit_bytes, tree_bytes = folder_bytes(partial), working_tree_bytes()
        size_line = check_carry_size(kit_bytes, tree_bytes)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    manifest = {
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "pins": read_requirements(PINS),
        "wheels": sizes,
        "kit_bytes": kit_bytes,
        "working_tree_bytes": tree_bytes,
        "carry_limit_bytes": CARRY_LIMIT_BYTES,
    }
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(kit, ignore_errors=True)
    partial.rename(kit)
    progress(size_line)
    progress(f'ready: {kit.relative_to(REPO)}/ (carry it: run(carry=["gpu-kit"], command="bash tools/gpu_smoke.sh", timeout_s=540))')
    return manifest


def main() -> int:
    try:
        build()
    except KitError as error:
        print(f"[gpu-kit] error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
