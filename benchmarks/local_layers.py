"""Gemma 3's local layers trimmed to their window: stock SGLang vs ``full`` (lossless) vs a policy, at equal KV memory.

    python -m benchmarks.local_layers model                    # build the Gemma 3-shaped model once, print its folder
    python -m benchmarks.local_layers multiturn                # the multi-turn workload, request scope, ~8 min here
    python -m benchmarks.local_layers multiturn --scopes request,block --block-size 1024   # and block scope, ~12 min
    python -m benchmarks.local_layers multiturn --policies full --name gemma3_local_layers_repeat   # stock vs full only
    python -m benchmarks.local_layers client --scopes request,block --block-size 1024      # SGLang's own client, ~15 min

Gemma 3 attends in 5 of every 6 layers over a sliding window only; for such models every compressed
radix node keeps, in local layers, just the node's last ``sliding_window`` positions (what a later
query can still read), so ``full`` (nothing evicted in global layers) answers exactly as stock while
holding far less. This module builds a random-weight model of Gemma-3-1B's layer pattern (every 6th
layer global), scaled to run on a CPU (``SHAPE``: 12 layers, 4 query heads / 1 KV head of 64, hidden
384, window 256, fp32), into ``$KVEVICT_CACHE`` (default ``~/.cache/sgl-kvevict``), then runs the
existing drivers with it: ``multiturn`` is ``python -m benchmarks.multiturn compare`` and ``client``
is ``python -m benchmarks.sglang_client``, each with ``MULTITURN`` / ``CLIENT`` as defaults (any of
their flags given after the subcommand overrides them; ``--help`` after it lists them). The policy is
``topk:attn`` (the project's default score, ``learned``, has no weights for a random model).

``multiturn`` then adds to its JSON and markdown what the driver does not report: whether each
server's answers are token-for-token those of stock (the same text for every (user, turn): later
turns re-send the history, so one different answer changes every later prompt of that user), and the
memory each server held per conversation after the run (``/kvevict/stats``: kept cells over users,
in token slots, against the dense history a stock server holds).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.cli import RESULTS_DIR
from sgl_kvevict.measure.results import write_atomically

# Gemma-3-1B's pattern (5 local : 1 global) at a size this CPU runs: documents of ~2K tokens are 8 windows.
SHAPE = {
    "num_layers": 12,
    "num_q_heads": 4,
    "num_kv_heads": 1,
    "vocab_size": 512,
    "seed": 0,
    "overrides": {
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)],
        "sliding_window": 256,
        "hidden_size": 384,
        "intermediate_size": 768,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,  # SGLang ties Gemma 3's lm_head to the embeddings
    },
}
NAME = "gemma3_local_layers"
DTYPE_ARG = "--server-arg=--dtype=float32"  # deterministic greedy answers, so stock and full compare token for token
# 6 users x 4 turns over ~2K-token documents (~14K history tokens); a 7000-token pool holds about half of
# them dense, and every history trimmed.
MULTITURN = (
    "--pools", "tight", "--tight-pool", "7000", "--users", "6", "--turns", "4", "--document-tokens", "2000",
    "--policies", "topk:attn", "--budgets", "0.25", DTYPE_ARG, "--name", NAME,
)  # fmt: skip
CLIENT = ("--policies", "topk:attn", "--budgets", "0.25", DTYPE_ARG, "--name", f"{NAME}_client")


def model_folder(cache: Optional[Path] = None, shape: dict = SHAPE, log=print) -> Path:
    """The folder of the model of ``shape`` under ``cache`` (default: the project's model cache), built on first use."""
    from sgl_kvevict.models import cache_dir

    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:10]
    folder = (cache or cache_dir()) / f"gemma3-local-layers-{digest}"
    if (folder / "config.json").exists():
        return folder
    from sgl_kvevict.checkpoints import build_tiny_model

    log(f"building the Gemma 3-shaped model into {folder}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        build_tiny_model(staging, "gemma3", **shape)
        staging.rename(folder)  # whole or not at all: a stopped build leaves no half model behind
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def driver_argv(model: Path, defaults: Sequence[str], given: Sequence[str]) -> list[str]:
    """The driver's arguments: the model, ``defaults``, then ``given`` (argparse keeps the last value of a flag)."""
    return ["--model", str(model), *defaults, *given]


def differing_replies(records: Sequence[dict], baseline: Sequence[dict]) -> tuple[list, list]:
    """The (user, turn) keys both runs' ``records`` answered (no error), sorted, and those whose reply text
    differs from ``baseline``'s."""
    theirs = {(r["user"], r["turn"]): r["reply"] for r in baseline if r.get("error") is None}
    mine = {(r["user"], r["turn"]): r["reply"] for r in records if r.get("error") is None}
    both = sorted(theirs.keys() & mine.keys())
    return both, [key for key in both if theirs[key] != mine[key]]


def answers(runs: Sequence[dict]) -> list[dict]:
    """Per finished server, at its pool: how many of its replies are stock's (the vanilla server of that
    pool, ``baseline`` in its own row) text for the same (user, turn), the first (user, turn) that
    differs, and the run's wall time."""
    done = [r for r in runs if not r.get("error") and "records" in r]
    rows = []
    for run in done:
        stock = next((r for r in done if r["variant"]["policy"] == "none" and r["pool_tokens"] == run["pool_tokens"]), None)
        if stock is None:
            continue
        both, differing = differing_replies(run["records"], stock["records"])
        rows.append({
            "server": run["label"], "pool_tokens": run["pool_tokens"], "compared": len(both),
            "identical": len(both) - len(differing), "first_differing": list(differing[0]) if differing else None,
            "baseline": run is stock, "wall_seconds": run["metrics"]["wall_seconds"],
        })  # fmt: skip
    return rows


def memory(runs: Sequence[dict], users: int) -> list[dict]:
    """Per finished server: what ``/kvevict/stats`` says it held after the run (the peak in brackets in
    the driver's table), per conversation, in token slots (cells / cells per slot); stock: None."""
    rows = []
    for run in runs:
        last = ((run.get("kvevict_stats") or {}).get("last")) or {}
        per_slot = last.get("arena_cells_per_slot")
        if run.get("error") or "kept_cells" not in last or not per_slot:
            continue
        tokens = last.get("compressed_tokens") or 0
        rows.append({
            "server": run["label"], "pool_tokens": run["pool_tokens"], "compressed_nodes": last.get("compressed_nodes"),
            "compressed_tokens": tokens, "kept_cells": last["kept_cells"], "cells_per_token_dense": per_slot,
            "kept_fraction": last["kept_cells"] / (tokens * per_slot) if tokens else None,
            "slots_per_conversation": last["kept_cells"] / per_slot / users,
            "dense_slots_per_conversation": tokens / users,
        })  # fmt: skip
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _row(*cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def answers_markdown(answer_rows: Sequence[dict], memory_rows: Sequence[dict], command: str) -> str:
    lines = [
        "",
        "## Answers and memory (`benchmarks.local_layers`)",
        "",
        f"Written by `{command}`, which builds the Gemma 3-shaped model and ran the command above. The machine "
        "was shared with other engineers' tests and servers while it ran (load averages before each server are in "
        "the JSON): compare the ratios of this one run, not absolute figures across runs. Same answers: the "
        "server's reply to each (user, turn) is stock's text (greedy, fp32); a user's later prompts re-send its "
        "earlier answers, so a difference changes the rest of that conversation. Run wall time: the workload "
        "alone, server start-up not included.",
        "",
        "| server | pool | same answers as stock | first differing (user, turn) | run wall time (s) |",
        "|---|---|---|---|---|",
    ]
    for row in answer_rows:
        first = "-" if row["first_differing"] is None else f"({row['first_differing'][0]}, {row['first_differing'][1]})"
        same = "(stock)" if row["baseline"] else f"{row['identical']}/{row['compared']}"
        lines.append(_row(row["server"], row["pool_tokens"], same, first, _fmt(row["wall_seconds"], 1)))
    lines += [
        "",
        "Memory after the run (`/kvevict/stats`): compressed prefixes held, the cells they keep against the same "
        "tokens dense (every layer, every KV head), and per conversation in token slots (cells / cells per slot, "
        "over the users) against those tokens dense.",
        "",
        "| server | pool | compressed nodes | compressed tokens | kept cells | kept / dense | slots per conversation "
        "(dense) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in memory_rows:
        cells = [row[name] for name in ("server", "pool_tokens", "compressed_nodes", "compressed_tokens", "kept_cells")]
        slots = f"{row['slots_per_conversation']:.0f} ({row['dense_slots_per_conversation']:.0f})"
        lines.append(_row(*cells, _fmt(row["kept_fraction"]), slots))
    return "\n".join(lines) + "\n"


def add_answers(out: Path, name: str, command: str) -> dict:
    """Adds ``answers`` and ``memory`` (with ``command``) to ``<out>/<name>.json`` and their tables to ``.md``."""
    path = out / f"{name}.json"
    payload = json.loads(path.read_text())
    users = payload["meta"]["conversations"]["users"]
    extra = {"command": command, "answers": answers(payload["runs"]), "memory": memory(payload["runs"], users)}
    payload["local_layers"] = extra
    write_atomically(path, json.dumps(payload, indent=1) + "\n")
    markdown = out / f"{name}.md"
    text = markdown.read_text().split("\n## Answers and memory")[0].rstrip("\n") + "\n"
    write_atomically(markdown, text + answers_markdown(extra["answers"], extra["memory"], command))
    return extra


def _option(argv: Sequence[str], flag: str, default):
    """The last value of ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), else ``default``."""
    value = default
    for index, item in enumerate(argv):
        if item == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


USAGE = __doc__.split("\n\n")[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("model", "multiturn", "client"):
        print(f"usage:\n{USAGE}", file=sys.stderr)
        return 2
    command, given = argv[0], argv[1:]
    folder = model_folder()
    if command == "model":
        print(folder)
        return 0
    if command == "client":
        from benchmarks import sglang_client

        return sglang_client.main(driver_argv(folder, CLIENT, given))
    from benchmarks import multiturn

    code = multiturn.main(["compare", *driver_argv(folder, MULTITURN, given)])
    out, name = Path(_option(given, "--out", RESULTS_DIR)), _option(given, "--name", NAME)
    if (out / f"{name}.json").exists():
        from benchmarks.cli import command_line

        extra = add_answers(out, name, command_line("local_layers", argv))
        for row in (row for row in extra["answers"] if not row["baseline"]):
            print(f"{row['server']}: {row['identical']}/{row['compared']} answers identical to stock's")
    return code


if __name__ == "__main__":
    sys.exit(main())
