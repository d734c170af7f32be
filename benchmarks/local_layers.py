"""Gemma 3's local layers trimmed to their window: stock SGLang vs ``full`` (lossless) vs a policy, at equal KV memory.

    python -m benchmarks.local_layers model                    # build the Gemma 3-shaped model once, print its folder
    python -m benchmarks.local_layers multiturn                # the multi-turn workload, request scope, ~8 min here
    python -m benchmarks.local_layers multiturn --scopes request,block --block-size 1024   # and block scope, ~12 min
    python -m benchmarks.local_layers multiturn --policies full --name gemma3_local_layers_repeat   # stock vs full only
    python -m benchmarks.local_layers client --scopes request,block --block-size 1024      # SGLang's own client, ~15 min
    python -m benchmarks.local_layers multiturn --model gemma3-270m --scopes request,block --block-size 1024   # real weights, ~34 min
    python -m benchmarks.local_layers client --model gemma3-270m --scopes request,block --block-size 1024      # real weights, ~16 min

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

``--model gemma3-270m`` (given after the subcommand; default ``tiny``, the random model above) runs the
same drivers on Google's real Gemma 3 270M (base; ``sgl_kvevict.models.resolve_model``: 18 layers, 15
local with window 512, 3 global, 1 KV head), with ``REAL_MULTITURN`` / ``REAL_CLIENT`` as defaults. The
base model has no chat template, and both drivers talk through ``/v1/chat/completions`` (the multi-turn
driver also counts its tokens with the template), so the benchmark serves a copy of the model folder,
``<cache>/gemma3-270m-chat`` (``chat_folder``; ``model --model gemma3-270m`` prints it: built once, the weights and the large tokenizer.json
symlinked, the small json files copied), whose tokenizer_config.json carries Gemma's instruction turn
format (``GEMMA_CHAT_TEMPLATE``, the gemma-it one). A base model's replies are then continuations of
the transcript rather than instruction-tuned answers; the comparison stays fair because stock SGLang,
every plugin server and the driver's token counts all read the one folder, so every server is asked
the same prompts and must answer with stock's tokens to count as the same.
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

# The real model (``--model gemma3-270m``): sized by timing stock SGLang on the 2-core development machine
# (fp32, ~135 prompt tokens/s: a 2.5K-token document takes ~19 s to prefill).
REAL_MODEL = "gemma3-270m"
REAL_NAME = "gemma3_270m_local_layers"
# Policies without learned weights for this model: ``topk`` with the ``attn`` score (its default, ``kvzip``,
# costs an extra pass; ``learned`` has weights only for SmolLM2) and ``snapkv`` (default score ``attn``).
REAL_SCOPES = ("--budgets", "0.25", "--scopes", "request,block", "--block-size", "1024")
# 6 users x 3 turns over ~2.5K-token documents (~16K history tokens); the tight pool holds about a third of
# the final histories dense. Seven servers, 34 min here (stock alone ~6 min).
REAL_MULTITURN = (
    "--pools", "tight", "--tight-fraction", "0.33", "--users", "6", "--turns", "3", "--document-tokens", "2500",
    "--max-tokens", "24", "--policies", "topk:attn,snapkv", *REAL_SCOPES, DTYPE_ARG, "--name", REAL_NAME,
)  # fmt: skip
# 3 groups x 3 chats x 2 turns over 1500-token system prompts (shorter than the multi-turn documents, and
# topk:attn alone besides full: five servers, 16 min here): 4.5K shared + ~1.6K
# per-chat tokens; a 2000-token pool holds about a third of them (one system prompt and its chats) dense.
REAL_CLIENT = (
    "--pool-tokens", "2000", "--groups", "3", "--prompts-per-group", "3", "--turns", "2",
    "--system-prompt-tokens", "1500", "--question-tokens", "64", "--output-tokens", "24", "--concurrency", "3",
    "--policies", "topk:attn", *REAL_SCOPES, DTYPE_ARG, "--name", f"{REAL_NAME}_client",
)  # fmt: skip
MODELS = ("tiny", REAL_MODEL)

# Gemma's instruction-tuned turn format (gemma-it): a system message is folded into the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)
COPIED_MAX_BYTES = 1 << 20  # json files up to this size are copied into the chat folder; the rest is symlinked


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


MANIFEST_NAME = "sgl_kvevict_manifest.json"  # the bundled model's own manifest: not the chat copy's


def _copied(path: Path) -> bool:
    """Whether ``chat_folder`` copies the source's file ``path`` (else it symlinks it)."""
    return path.suffix == ".json" and path.stat().st_size <= COPIED_MAX_BYTES


def _chat_folder_ready(folder: Path, source: Path) -> bool:
    """``folder`` has the template, every file of ``source`` (a dangling symlink counts as missing) and
    the same copied files (a rebuilt source's config is picked up)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        files = [path for path in source.iterdir() if path.is_file() and path.name not in (MANIFEST_NAME, "tokenizer_config.json")]
        return config.get("chat_template") == GEMMA_CHAT_TEMPLATE and all(
            (folder / path.name).is_file() and (not _copied(path) or (folder / path.name).read_bytes() == path.read_bytes())
            for path in files
        )
    except (OSError, ValueError):
        return False


def chat_folder(source: Path, cache: Optional[Path] = None, log=print) -> Path:
    """``<cache>/<source name>-chat``: ``source``'s model with Gemma's chat template, built once (whole or
    not at all) and rebuilt if its template or a file is missing: the small json files copied (the template
    added to tokenizer_config.json), the rest (the weights, the 33 MB tokenizer.json) symlinked to ``source``."""
    from sgl_kvevict.models import cache_dir

    source = Path(source).resolve()
    folder = (cache or cache_dir()) / f"{source.name}-chat"
    if _chat_folder_ready(folder, source):
        return folder
    log(f"building {folder}: {source} with Gemma's chat template")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp's 0700: the folder is read like the converted model's
    try:
        for path in sorted(source.iterdir()):
            if not path.is_file() or path.name == MANIFEST_NAME:
                continue
            target = staging / path.name
            if path.name == "tokenizer_config.json":
                config = json.loads(path.read_text())
                config["chat_template"] = GEMMA_CHAT_TEMPLATE
                target.write_text(json.dumps(config, indent=2) + "\n")
            elif _copied(path):
                shutil.copyfile(path, target)
            else:
                target.symlink_to(path)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def split_model(given: Sequence[str]) -> tuple[str, list[str]]:
    """``--model tiny|gemma3-270m`` taken out of ``given`` (the last one wins; default ``tiny``), and the
    rest; a ``--model`` with any other value (a folder) is left for the driver."""
    rest, model, index = [], "tiny", 0
    while index < len(given):
        item = given[index]
        if item == "--model" and index + 1 < len(given) and given[index + 1] in MODELS:
            model, index = given[index + 1], index + 2
            continue
        if item.startswith("--model=") and item.split("=", 1)[1] in MODELS:
            model = item.split("=", 1)[1]
        else:
            rest.append(item)
        index += 1
    return model, rest


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
        f"Written by `{command}`, which prepared the model's folder (the Gemma 3-shaped model, or the real model's "
        "chat-template copy) and ran the command above. The machine "
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
    command, (model, given) = argv[0], split_model(argv[1:])
    if model == REAL_MODEL:
        from sgl_kvevict.models import resolve_model

        folder, multiturn_defaults, client_defaults, name = chat_folder(resolve_model(REAL_MODEL)), REAL_MULTITURN, REAL_CLIENT, REAL_NAME
    else:
        folder, multiturn_defaults, client_defaults, name = model_folder(), MULTITURN, CLIENT, NAME
    if command == "model":
        print(folder)
        return 0
    if command == "client":
        from benchmarks import sglang_client

        return sglang_client.main(driver_argv(folder, client_defaults, given))
    from benchmarks import multiturn

    code = multiturn.main(["compare", *driver_argv(folder, multiturn_defaults, given)])
    out, name = Path(_option(given, "--out", RESULTS_DIR)), _option(given, "--name", name)
    if (out / f"{name}.json").exists():
        from benchmarks.cli import command_line

        extra = add_answers(out, name, command_line("local_layers", argv))
        for row in (row for row in extra["answers"] if not row["baseline"]):
            print(f"{row['server']}: {row['identical']}/{row['compared']} answers identical to stock's")
    return code


if __name__ == "__main__":
    sys.exit(main())
