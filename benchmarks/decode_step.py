"""The per-step cost of decode through the real server: inter-token latency at equal batch and context,
stock SGLang against the plugin's paths, and where a step's host time goes.

    python -m benchmarks.decode_step                   # batches 1,4,8,16; stock, keep-99, the default (block, request)
    python -m benchmarks.decode_step --quick           # ~2 minutes on a GPU: batches 1,4; stock, keep-99, default block
    python -m benchmarks.decode_step --profile-batch 8 # + py-spy on the scheduler during a batch-8 decode
    python -m benchmarks.decode_step --server-arg=--attention-backend=flashinfer   # flags for every server (GPU)

Servers (``--variants``, all with the same ``--max-total-tokens``): ``stock`` (``--kv-evict-policy none``),
``keep-99`` (the plugin's path keeping 99%: topk + learned, request scope; every prompt becomes a
compressed node, so its decode goes through segment attention), ``default-block`` and
``default-request`` (``make serve``'s topk + learned at 25%, in block and in request scope), and on
request ``full`` (``--kv-evict-policy full``: a segment kept whole stays dense, so its decode is stock's
through the plugin's backend). ``/kvevict/stats`` after the prefills says how many tokens each compressed. Each is started through the launcher, one at a time, for ``--rounds`` rounds (the
order reversed every other round, so a drift of the shared machine's load does not favour one).

Per server: ``max(batches)`` documents of ``--prompt-tokens`` are prefilled once each (``max_tokens``
1), so their prefixes are in the cache (compressed, for the plugin); then for each batch size ``B``
the first ``B`` of them are sent again at once, greedy, ``ignore_eos``, ``--decode-tokens`` each: ``B``
requests of equal context decoding together (their prefixes cached, they are prefilled in one batch).
A stream's step time is the time from its first token to its last over its tokens after the first;
the batch's step time is the median over its streams, and its tokens/s ``B`` over that. Ratios are against stock in the same round.

``--profile-batch B`` adds one pass of batch ``B`` per server (after the timed ones, not timed) with
``py-spy record`` sampling SGLang's scheduler process (py-spy must be on PATH: ``pip install py-spy``);
its samples are sorted into the parts of a decode step (``STEP_PARTS``) by the innermost frame that
names one. Writes ``<name>.json`` (every sample), ``<name>.md`` and ``<name>.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp
import psutil

from benchmarks.cli import add_output_args, benchmark_parser, command_line, exits_on, log_folder, parse_command_line, progress
from benchmarks.engine_overhead import CHAT_PATH, WARM_UP_MESSAGE, MeasurementError, ask, chat_payload, flush
from benchmarks.load.client import STATS_PATH, StreamedReply, get_json, stream_completion
from benchmarks.load.conversations import ConversationSpec, build_conversations, model_token_counter
from benchmarks.load.report import _pyplot, environment, heading, save_figure, write_report
from benchmarks.load.servers import ServerError, ServerVariant, launched_server

# make serve's compression (Makefile): topk ranked by the learned score, 25% kept.
DEFAULT_FLAGS = ("--kv-evict-policy", "topk", "--kv-evict-default", "budget=0.25", "--kv-evict-default", "score=learned")
VARIANTS = {
    "stock": ServerVariant.from_flags("stock", ("--kv-evict-policy", "none")),
    # The plugin's path at (nearly) 100% kept: a segment the policy keeps whole stays dense (``full`` compresses
    # nothing, so its decode is stock's), so 99% is the most that goes through segment attention.
    "keep-99": ServerVariant.from_flags(
        "keep-99", ("--kv-evict-policy", "topk", "--kv-evict-default", "budget=0.99", "--kv-evict-default", "score=learned")
    ),
    "default-block": ServerVariant.from_flags("default-block", (*DEFAULT_FLAGS, "--kv-evict-scope", "block")),
    "default-request": ServerVariant.from_flags("default-request", (*DEFAULT_FLAGS, "--kv-evict-scope", "request")),
    "full": ServerVariant.from_flags("full", ("--kv-evict-policy", "full")),
}
DEFAULT_VARIANTS = ("stock", "keep-99", "default-block", "default-request")
BASELINE = "stock"
SCHEDULER_PROCESS = "sglang::scheduler"
PROFILE_START_TOKENS = 4  # the profile starts once a stream of the pass has this many tokens
# The parts of a decode step, by the innermost frame of a sample that names one: (part, frame substrings).
STEP_PARTS = (
    ("compressed part: segment attention over cells", ("segment_attention.py",)),
    ("dense part: attention over dense keys", ("dense_attention", "_dense_part")),
    ("merge of the two parts", ("merge_states.py",)),
    ("decode attention (one pass over cells and dense keys)", ("decode_attention", "DecodeKeys")),
    ("stock SDPA decode (per request)", ("_run_sdpa_forward_decode",)),
    ("per-forward metadata (requests, views, cell index, dense layout)", ("batch.py", "forward_begin", "paths.py", "_init_segment_metadata")),
    ("rest of the attention backend", ("attention.py", "torch_native_backend.py")),
    ("model: projections, MLP, norms, rotary, logits", ("forward_batch_generation", "model_runner.py")),
    ("sampling", ("sampler.py",)),
    ("scheduler: batches, results, streaming out", ("scheduler",)),
)


@dataclass(frozen=True)
class DecodeStepConfig:
    model: str
    variants: tuple[str, ...]
    batches: tuple[int, ...]
    prompt_tokens: int
    decode_tokens: int
    rounds: int
    pool_tokens: int
    seed: int
    profile_batch: Optional[int] = None
    launcher_extra: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [name for name in self.variants if name not in VARIANTS]
        if unknown or BASELINE not in self.variants:
            raise ValueError(f"variants {list(self.variants)}: choose from {', '.join(VARIANTS)}, {BASELINE} among them")
        if not self.batches or min(self.batches) < 1:
            raise ValueError("--batches must be positive integers")
        if self.decode_tokens <= PROFILE_START_TOKENS + 2:
            raise ValueError(f"--decode-tokens must be above {PROFILE_START_TOKENS + 2}")
        if self.rounds < 1 or self.prompt_tokens < 64:
            raise ValueError("--rounds must be at least 1 and --prompt-tokens at least 64")
        if self.profile_batch is not None and self.profile_batch < 1:
            raise ValueError("--profile-batch must be positive")

    @property
    def documents(self) -> int:
        return max(self.batches + ((self.profile_batch,) if self.profile_batch else ()))


def step_seconds(reply: StreamedReply) -> float:
    """One stream's time per token after its first: from its first content chunk to its last, over its
    tokens after the first (the detokenizer may send several tokens in one chunk)."""
    return (reply.token_times[-1] - reply.token_times[0]) / (reply.completion_tokens - 1)


async def _decode_batch(session, base_url: str, prompts: Sequence[list], decode_tokens: int, on_token=None) -> list:
    """The prompts sent at once, ``decode_tokens`` each (EOS ignored); their replies, checked."""
    payloads = [chat_payload(messages, decode_tokens, ignore_eos=True) for messages in prompts]
    replies = await asyncio.gather(
        *(stream_completion(session, base_url + CHAT_PATH, payload, on_token=on_token) for payload in payloads)
    )
    for reply in replies:
        if reply.error or reply.problems or reply.completion_tokens != decode_tokens:
            raise MeasurementError(f"a stream failed: {reply.error or reply.problems or f'{reply.completion_tokens} tokens'}")
    return list(replies)


async def _measure(base_url: str, config: DecodeStepConfig, prompts: Sequence[list], log: Callable[[str], None], profiled) -> dict:
    """One server: the prefills that cache the prompts, then every batch size; ``profiled``: None, or
    ``(scheduler pid, work folder)`` for the profile pass."""
    samples: dict = {"batches": {}, "stats": None, "profile": None}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await ask(session, base_url, chat_payload([{"role": "user", "content": WARM_UP_MESSAGE}], 4))
        await flush(session, base_url)
        for messages in prompts:
            await ask(session, base_url, chat_payload(messages, 1))
        samples["stats"] = await get_json(session, base_url + STATS_PATH)
        for batch in config.batches:
            replies = await _decode_batch(session, base_url, prompts[:batch], config.decode_tokens)
            steps = [step_seconds(reply) for reply in replies]
            samples["batches"][batch] = {
                "step_seconds": steps,
                "prompt_tokens": [reply.prompt_tokens for reply in replies],
                "cached_tokens": [reply.cached_tokens for reply in replies],
            }
            log(f"  batch {batch}: step {statistics.median(steps) * 1000:.1f} ms (median of {batch} streams)")
        if profiled is not None:
            samples["profile"] = await _profile_pass(session, base_url, prompts[: config.profile_batch], config, *profiled)
    return samples


def _scheduler_pid(descendants: Sequence[psutil.Process]) -> int:
    for process in descendants:
        try:
            if process.name() == SCHEDULER_PROCESS or SCHEDULER_PROCESS in " ".join(process.cmdline()):
                return process.pid
        except psutil.NoSuchProcess:
            continue
    raise MeasurementError(f"no {SCHEDULER_PROCESS} process among the server's")


def step_part(stack: str) -> str:
    """The ``STEP_PARTS`` part of one collapsed py-spy stack (frames root first, ``;``-separated): the
    part named by its innermost frame that names one; ``other`` when none does."""
    for frame in reversed(stack.split(";")):
        for part, markers in STEP_PARTS:
            if any(marker in frame for marker in markers):
                return part
    return "other (idle, IPC)"


def profile_parts(collapsed: str) -> dict[str, int]:
    """Samples per step part of py-spy's ``--format raw`` output (``stack count`` per line)."""
    parts: Counter = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            parts[step_part(stack)] += int(count)
    return dict(parts)


async def _profile_pass(session, base_url: str, prompts: Sequence[list], config: DecodeStepConfig, pid: int, work: Path) -> dict:
    """``prompts`` decoded at once with py-spy sampling the scheduler (``pid``) from the moment each stream
    has ``PROFILE_START_TOKENS`` tokens on average until the first stream is one token from its end, so
    that only steps of the whole batch are sampled. Returns the samples per step part and the streams'
    step times (py-spy does not pause the process: ``--nonblocking``)."""
    raw = work / f"py-spy-{pid}.txt"
    recorder: list[subprocess.Popen] = []
    tokens = Counter()

    def on_token(_seconds: float) -> None:
        tokens["all"] += 1
        if not recorder and tokens["all"] >= PROFILE_START_TOKENS * len(prompts):
            command = ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--nonblocking",
                       "--output", str(raw)]  # fmt: skip
            recorder.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        elif recorder and recorder[0].poll() is None and tokens["all"] >= (config.decode_tokens - 3) * len(prompts):
            recorder[0].send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT

    replies = await _decode_batch(session, base_url, prompts, config.decode_tokens, on_token)
    if not recorder:
        raise MeasurementError("the profile pass ended before py-spy started")
    if recorder[0].poll() is None:
        recorder[0].send_signal(signal.SIGINT)
    if recorder[0].wait(timeout=60) != 0 or not raw.exists():
        raise MeasurementError(f"py-spy did not record the scheduler (exit {recorder[0].returncode}): run as root or allow ptrace")
    return {"samples": profile_parts(raw.read_text()), "step_seconds": [step_seconds(r) for r in replies], "batch": len(prompts)}


def summarize(runs: Sequence[dict], config: DecodeStepConfig) -> dict:
    """Per variant and batch size: the step time of each round (median over its streams), its median and
    range over rounds, tokens/s, and tokens/s against stock's in the same round (median and range)."""
    by_round = {(run["round"], run["variant"]): run for run in runs if not run["error"]}
    summary: dict = {}
    for variant in config.variants:
        rows = {}
        for batch in config.batches:
            steps, ratios = [], []
            for round_index in range(config.rounds):
                run, base = by_round.get((round_index, variant)), by_round.get((round_index, BASELINE))
                if run is None:
                    continue
                step = statistics.median(run["samples"]["batches"][batch]["step_seconds"])
                steps.append(step)
                if base is not None:
                    ratios.append(statistics.median(base["samples"]["batches"][batch]["step_seconds"]) / step)
            if steps:
                rows[batch] = {
                    "step_ms_by_round": [step * 1000 for step in steps],
                    "step_ms": statistics.median(steps) * 1000,
                    "tokens_per_second": batch / statistics.median(steps),
                    "vs_stock_by_round": ratios,
                    "vs_stock": statistics.median(ratios) if ratios else None,
                }
        summary[variant] = rows
    return summary


def _range(values: Sequence[float], digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else ""


def _profile_rows(runs: Sequence[dict], variants: Sequence[str]) -> list[str]:
    """Share of the sampled host time per step part and its ms per step, per variant (the first round's profile)."""
    profiles = {}
    for run in runs:
        profile = None if run["error"] else run["samples"]["profile"]
        if profile and run["variant"] not in profiles:
            profiles[run["variant"]] = profile
    if not profiles:
        return []
    shown = [v for v in variants if v in profiles]
    batch = next(iter(profiles.values()))["batch"]
    lines = [
        "",
        f"Where a decode step's host time goes at batch {batch} (py-spy on SGLang's scheduler process, 200 Hz, "
        "samples sorted by the innermost frame that names a part; ms per step = share x the profiled pass's step time):",
        "",
        "| part | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    parts = [part for part, _ in STEP_PARTS] + ["other (idle, IPC)"]
    for part in parts:
        cells = []
        for variant in shown:
            profile = profiles[variant]
            total = sum(profile["samples"].values())
            share = profile["samples"].get(part, 0) / total if total else 0.0
            cells.append(f"{share * 100:.0f}% ({share * statistics.median(profile['step_seconds']) * 1000:.1f} ms)" if share else "-")
        if any(cell != "-" for cell in cells):
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
    steps = [f"{statistics.median(profiles[v]['step_seconds']) * 1000:.1f} ms" for v in shown]
    lines.append("| **step (the profiled pass)** | " + " | ".join(steps) + " |")
    return lines


def markdown(report: dict) -> str:
    meta, summary = report["meta"], report["summary"]
    env, cfg = meta["environment"], meta["config"]
    variants = cfg["variants"]
    lines = [
        *heading("Decode step: inter-token latency at equal batch and context, stock vs the plugin", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, torch "
        f"{env['torch']}, sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, "
        f"{env['date']}. Model `{cfg['model']}`, every server `--max-total-tokens {cfg['pool_tokens']}`; "
        f"{cfg['prompt_tokens']}-token documents prefilled once, then B of them decoded at once for "
        f"{cfg['decode_tokens']} tokens (EOS ignored); {cfg['rounds']} round(s), one server at a time. Load average "
        "before each server: " + ", ".join(f"{run['label']} {run['load_average'][0]:.1f}" for run in report["runs"]) + ".",
        "",
        "Variants: " + "; ".join(f"`{name}`: `{' '.join(VARIANTS[name].launcher_flags())}`" for name in variants) + ".",
        "",
        "Step time (ms, median over rounds of each round's median over its streams; range over rounds) and "
        "tokens/s against stock's in the same round (median, range):",
        "",
        "| batch | " + " | ".join(f"{v} step (ms)" + ("" if v == BASELINE else f" | {v} / stock tok/s") for v in variants) + " |",
        "|---|" + "---|" * (2 * len(variants) - 1),
    ]
    for batch in cfg["batches"]:
        cells = []
        for variant in variants:
            row = summary[variant].get(batch)
            if row is None:
                cells += ["-"] if variant == BASELINE else ["-", "-"]
                continue
            cells.append(f"{row['step_ms']:.1f} {_range(row['step_ms_by_round'], 0)}".strip())
            if variant != BASELINE:
                ratio = row["vs_stock"]
                cells.append("-" if ratio is None else f"**{ratio:.2f}** {_range(row['vs_stock_by_round'], 2)}".strip())
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    compressed = [
        f"{run['variant']} {run['samples']['stats'].get('compressed_tokens', 0)}"
        for run in report["runs"]
        if not run["error"] and run["round"] == 0 and run["samples"]["stats"]
    ]
    if compressed:
        lines += ["", "Compressed tokens after the prefills (`/kvevict/stats`, first round): " + ", ".join(compressed) + "."]
    failed = [f"{run['label']}: {run['error']}" for run in report["runs"] if run["error"]]
    if failed:
        lines += ["", "Failed: " + "; ".join(failed)]
    lines += _profile_rows(report["runs"], variants)
    lines += [
        "",
        f"![decode step]({meta['name']}.png)",
        "",
        "Reading it: a step is one forward of the whole batch (every stream one token), measured at the client "
        "from each stream's first token to its last, so it includes the scheduler and the streaming out as well "
        "as the model and its attention. The ratio column is stock's step over the variant's in the same round, "
        "i.e. the variant's tokens/s over stock's. The machine is shared with other sessions' servers and tests "
        "(see the load averages): absolute step times move by tens of percent between rounds; the per-round "
        "ratios, taken from servers run minutes apart, move less, and their range over rounds is shown. The "
        "profile is one pass per server (not timed), so its step times are from another moment than the table's.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Step time and tokens/s against stock by batch size, one line per variant (range over rounds)."""
    plt = _pyplot()
    cfg, summary = report["meta"]["config"], report["summary"]
    fig, (steps_axis, ratio_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    for variant in cfg["variants"]:
        rows = [(batch, summary[variant][batch]) for batch in cfg["batches"] if batch in summary[variant]]
        if not rows:
            continue
        batches = [batch for batch, _ in rows]
        steps = [row["step_ms"] for _, row in rows]
        spread = [[s - min(r["step_ms_by_round"]) for s, (_, r) in zip(steps, rows)],
                  [max(r["step_ms_by_round"]) - s for s, (_, r) in zip(steps, rows)]]  # fmt: skip
        steps_axis.errorbar(batches, steps, yerr=spread, marker="o", capsize=3, label=variant)
        if variant != BASELINE:
            ratio_axis.plot(batches, [row["vs_stock"] for _, row in rows], marker="o", label=variant)
    ratio_axis.axhline(1.0, color="grey", linewidth=0.8)
    steps_axis.set(xlabel="batch (streams decoding at once)", ylabel="ms per step", title="decode step (lower is better)")
    ratio_axis.set(xlabel="batch", ylabel="tokens/s / stock's", title="against stock, same round (higher is better)")
    for axis in (steps_axis, ratio_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    save_figure(plt, fig, path)


def run(config: DecodeStepConfig, out: Path, name: str, log_dir: Path, argv: Sequence[str], log: Callable[[str], None]) -> dict:
    """Every round, every variant in turn (reversed every other round); the report is rewritten after
    each server, so an interrupted run keeps the servers it finished."""
    if config.profile_batch and shutil.which("py-spy") is None:
        raise MeasurementError("--profile-batch needs py-spy on PATH (pip install py-spy)")
    spec = ConversationSpec(
        users=config.documents, turns=1, document_tokens=config.prompt_tokens, fact_every=1, shared_document=False, seed=config.seed
    )
    prompts = [[{"role": "user", "content": c.user_message(0)}] for c in build_conversations(spec, model_token_counter(config.model))]
    meta = {
        "command": command_line("decode_step", argv),
        "name": name,
        "config": asdict(config),
        "environment": environment(),
    }
    runs: list[dict] = []
    for round_index in range(config.rounds):
        order = config.variants if round_index % 2 == 0 else tuple(reversed(config.variants))
        for variant_name in order:
            variant = VARIANTS[variant_name]
            entry = {"round": round_index, "variant": variant_name, "label": f"{variant_name} r{round_index}",
                     "load_average": os.getloadavg(), "error": None}  # fmt: skip
            log(f"round {round_index + 1}/{config.rounds}, {variant_name}: starting the server (load average {entry['load_average'][0]:.2f})")
            try:
                with launched_server(config.model, variant, config.pool_tokens, log_dir, config.launcher_extra) as server:
                    profiled = None
                    if config.profile_batch and round_index == 0:
                        profiled = (_scheduler_pid(server.descendants), log_dir)
                    entry["samples"] = asyncio.run(_measure(server.base_url, config, prompts, log, profiled))
            except (ServerError, MeasurementError) as error:
                entry["error"] = str(error)
                log(f"  failed: {error}")
            runs.append(entry)
            report = {"meta": meta, "runs": runs, "summary": summarize(runs, config)}
            write_report(out, name, report, markdown(report), log)
            plot(report, out / f"{name}.png")
    return report


QUICK = dict(batches="1,4", variants="stock,keep-99,default-block", prompt_tokens=1000, decode_tokens=16, rounds=1)


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("decode_step", __doc__)
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated servers of {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--batches", default="1,4,8,16", help="comma-separated batch sizes (default 1,4,8,16)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="document length in model tokens (default 2000)")
    parser.add_argument("--decode-tokens", type=int, default=24, help="tokens each stream decodes (default 24)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every server (default 2)")
    parser.add_argument(
        "--pool-tokens", type=int,
        help="--max-total-tokens of every server (default: every document and its answer dense, plus 10%%)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="document seed (default 0)")
    parser.add_argument("--profile-batch", type=int, help="batch size of the py-spy profile pass (default: none)")
    parser.add_argument(
        "--quick", action="store_true",
        help="a short run (~2 minutes on a GPU): " + ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items()),
    )  # fmt: skip
    add_output_args(parser, "decode_step", server_arg_for="every server (e.g. a GPU's attention backend)")
    return parser


@exits_on(MeasurementError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    try:
        batches = _csv_ints(args.batches)
        documents = max(batches + ((args.profile_batch,) if args.profile_batch else ()))
        pool = args.pool_tokens or int(documents * (args.prompt_tokens + 100 + args.decode_tokens) * 1.1)
        config = DecodeStepConfig(
            model=args.model, variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()), batches=batches,
            prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, rounds=args.rounds, pool_tokens=pool,
            seed=args.seed, profile_batch=args.profile_batch, launcher_extra=tuple(args.server_arg),
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    log_dir = log_folder(args.log_dir, "decode-step")
    report = run(config, args.out, args.name, log_dir, argv, progress)
    for variant, rows in report["summary"].items():
        if variant != BASELINE:
            ratios = ", ".join(f"B={b} {row['vs_stock']:.2f}" for b, row in rows.items() if row["vs_stock"] is not None)
            print(f"{variant} / stock tokens/s: {ratios}")
    return 1 if any(run["error"] for run in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
