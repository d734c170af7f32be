"""What every benchmark's command line shares: its parser built from its docstring, and where its
outputs and server logs go."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Optional

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def benchmark_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.<module>``: the first paragraph of its docstring ``doc`` as
    the description, the rest (usage examples, what it measures) as the epilog, kept as written."""
    description, _, epilog = doc.partition("\n\n")
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}", description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip


def add_output_args(parser, name: str, server_arg_for: Optional[str] = None) -> None:
    """``--out``, ``--name`` and ``--log-dir`` as every benchmark spells them, and ``--server-arg``
    where ``server_arg_for`` says which of its servers take the extra flags."""
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="output folder (default docs/results)")
    parser.add_argument("--name", default=name, help=f"output file stem (default {name})")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary folder)")
    if server_arg_for:
        parser.add_argument(
            "--server-arg", action="append", default=[],
            help=f"extra launcher/SGLang flag for {server_arg_for}, e.g. --server-arg=--kv-evict-window=16 (repeatable)",
        )  # fmt: skip


def log_folder(log_dir: Optional[Path], benchmark: str) -> Path:
    """``--log-dir``, or a new temporary folder named after the benchmark; said on stdout either way."""
    folder = log_dir or Path(tempfile.mkdtemp(prefix=f"{benchmark}-logs-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {folder}", flush=True)
    return folder


def write_atomically(path: Path, text: str) -> None:
    """A run killed mid-write must leave the previous checkpoint, not half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
