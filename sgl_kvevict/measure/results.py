"""What every measurement writes: its JSON and markdown (atomically) and a plot, and the machine and
versions it ran with."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    """The machine and versions a result was measured with."""
    status = _git("status", "--porcelain")
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "gpu": "none (CPU development mode)",
        "python": platform.python_version(),
        "sglang": _version("sglang"),
        "torch": _version("torch"),
        "sgl_kvevict": _version("sgl-kvevict"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_worktree_dirty": bool(status) if status is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_result_files(
    out: Path, name: str, payload: dict, text: str, plot: Optional[Callable[[Path], None]] = None
) -> list[Path]:
    """``<name>.json`` (``payload``) and ``<name>.md`` (``text``) into ``out``, each atomically, then with
    ``plot`` the figure ``<name>.png``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    write_atomically(paths[0], json.dumps(payload, indent=1) + "\n")
    write_atomically(paths[1], text)
    if plot is not None:
        paths.append(out / f"{name}.png")
        plot(paths[2])
    return paths


def write_atomically(path: Path, text: str) -> None:
    """A run killed mid-write must leave the previous checkpoint, not half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
