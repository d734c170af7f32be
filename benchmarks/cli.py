"""What every benchmark's command line shares: its parser built from its docstring, where its outputs
and server logs go, ``--resume`` from its last output, its progress lines, and its exit on an error."""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

T = TypeVar("T")

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

def add_server_args(parser, policy: tuple[str, str, str], budget_help: str, scopes: Optional[str] = None) -> None:
    """``--model``; the compared policy, ``policy`` = (its flag, default, help); its ``--budget``; with
    ``scopes`` (their default) ``--scopes`` and ``--block-size`` of the policies. Helps end in the default."""
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    flag, default, help_text = policy
    parser.add_argument(flag, default=default, help=f"{help_text} (default {default})")
    parser.add_argument("--budget", default="0.25", help=f"{budget_help} (default 0.25)")
    if scopes is not None:
        parser.add_argument("--scopes", default=scopes, help=f"comma-separated scopes of the policies (default {scopes})")
        parser.add_argument("--block-size", type=int, help="block size in block scope (default: the launcher's)")

def log_folder(log_dir: Optional[Path], benchmark: str) -> Path:
    """``--log-dir``, or a new temporary folder named after the benchmark; said on stdout either way."""
    folder = log_dir or Path(tempfile.mkdtemp(prefix=f"{benchmark}-logs-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {folder}", flush=True)
    return folder

def parse_command_line(
    build_parser: Callable[[], argparse.ArgumentParser], argv: Optional[Sequence[str]]
) -> tuple[argparse.ArgumentParser, list[str], argparse.Namespace]:
    """The benchmark's parser (for its usage errors), ``argv`` as a list (None: this process's
    arguments) and the parser's reading of it."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    return parser, argv, parser.parse_args(argv)

def command_line(module: str, argv: Sequence[str]) -> str:
    """The command as typed, for a report: ``python -m benchmarks.<module> ...`` (quoted for a shell)."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *argv])

def progress(message: str) -> None:
    """A benchmark's progress line: stdout, flushed (a run is followed live or through a pipe)."""
    print(message, flush=True)

def exits_on(*errors: type[BaseException], code: int = 2) -> Callable:
    """Decorates a benchmark's ``main``: one of ``errors`` (a server that failed, a measurement that
    could not be taken) ends it with ``error: ...`` on stderr and exit code ``code``."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except errors as error:
                print(f"error: {error}", file=sys.stderr)
                return code

        return guarded

    return decorate

def add_resume_arg(parser, help: str = "keep the finished servers of --out/<name>.json") -> None:
    parser.add_argument("--resume", action="store_true", help=help)

def checkpoint_path(args: argparse.Namespace) -> Path:
    """Where the last run wrote its results: ``--out/<name>.json``."""
    return args.out / f"{args.name}.json"

def read_checkpoint(path: Path, error: Callable[[str], Exception] = ValueError) -> dict:
    """What a run wrote to ``path``, which must exist (``error`` otherwise)."""
    if not path.exists():
        raise error(f"--resume: {path} does not exist")
    return json.loads(path.read_text())

def checkpoint(args: argparse.Namespace, error: Callable[[str], Exception] = ValueError) -> Optional[dict]:
    """With ``--resume``, what the last run wrote (``read_checkpoint``); None without."""
    return read_checkpoint(checkpoint_path(args), error) if args.resume else None

def as_json(value):
    """``value`` as it reads back from a JSON file (tuples as lists ...), to compare with a checkpoint."""
    return json.loads(json.dumps(value))

def other_configuration(path: Path, error: Callable[[str], Exception] = ValueError) -> Exception:
    """The refusal of a checkpoint at ``path`` that another configuration wrote."""
    return error(f"--resume: {path} is of another configuration")

def run_each(
    items: Sequence[T], label: Callable[[T], str], done: dict[str, dict], measure: Callable[[T], dict],
    write: Callable[[list[dict]], Iterable[Path]],
) -> list[dict]:  # fmt: skip
    """``measure`` every item in turn (``[i/n] label`` on stdout) unless ``done`` has its result (from
    the checkpoint), writing the outputs after each; says at the end which files it wrote."""
    results: list[dict] = []
    paths: Iterable[Path] = ()
    for index, item in enumerate(items, 1):
        name = label(item)
        progress(f"[{index}/{len(items)}] {name}" + (": kept from the checkpoint" if name in done else ""))
        results.append(done.get(name) or measure(item))
        paths = write(results)
    print("wrote " + ", ".join(str(p) for p in paths))
    return results
