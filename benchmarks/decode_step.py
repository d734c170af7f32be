"""The per-step cost of decode through the real server: inter-token latency at equal batch and context,
stock SGLang against the plugin's paths, and where a step's host time goes.

    python -m benchmarks.decode_step                   # batches 1,4,8,16; stock, full, keep-99, the default (block, request)
    python -m benchmarks.decode_step --quick           # ~2 minutes on a GPU: batches 1,4; stock, keep-99, default block
    python -m benchmarks.decode_step --profile-batch 8 # + py-spy on the scheduler during a batch-8 decode
    python -m benchmarks.decode_step --score attn      # a model without learned weights (a random one)
    python -m benchmarks.decode_step --server-arg=--attention-backend=flashinfer   # flags for every server (GPU)

Servers (``--variants``, all with the same ``--max-total-tokens``): ``stock`` (``--kv-evict-policy none``),
``full`` (``--kv-evict-policy full``: a segment kept whole stays dense, so its decode is stock's through
the plugin's backend), ``keep-99`` (the plugin's path keeping 99%: topk, request scope; every prompt
becomes a compressed node, so its decode goes through segment attention with nothing meaningful
evicted), ``default-block`` and ``default-request`` (``make serve``'s topk at 25%, in block and in
request scope). The compressing ones rank by ``--score`` (default ``learned``, as ``make serve``; it
needs weights for the model, checked before any server starts). ``/kvevict/stats`` after the prefills
says how many tokens each compressed. Each is started through the launcher, one at a time, for
``--rounds`` rounds; every round runs every variant, round ``r`` in the order rotated by ``r``, so a
drift of the shared machine's load does not favour one.

Per server: ``max(batches)`` documents of ``--prompt-tokens`` are prefilled once each (``max_tokens``
1), so their prefixes are in the cache (compressed, for the plugin); then for each batch size ``B``
the first ``B`` of them are sent again at once, greedy, ``ignore_eos``, ``--decode-tokens`` each: ``B``
requests of equal context decoding together (their prefixes cached, they are prefilled in one batch).
A stream's step time is the time from its first token to its last over its tokens after the first;
the batch's step time is the median over its streams, and its tokens/s ``B`` over that. Ratios are
tokens/s against stock's and against keep-99's in the same round (a round is summarized once its
stock run has succeeded). Recorded with them: each server's dtype (``/server_info``; CPU mode picks
bf16 or fp32 by the CPU's flags) and its KV pool's (its log), the CPU flags that decide it, and the
load average before each server.

``--profile-batch B`` adds one pass of batch ``B`` per server in every round (after the timed ones,
not timed) with ``py-spy record`` sampling SGLang's scheduler process (py-spy must be on PATH: ``pip
install py-spy``); its samples are sorted into the parts of a decode step (``STEP_PARTS``) by the
innermost frame that names one, and the summary keeps each variant's ms per part and its attention
ms per step (medians over rounds), and its attention over keep-99's in the same round (a sampled
profile moves between passes; one pass is one sample of it). Writes ``<name>.json`` (every sample),
``<name>.md`` and ``<name>.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
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

from benchmarks.cli import add_output_args
from benchmarks.cli import benchmark_parser
from benchmarks.cli import command_line
from benchmarks.cli import exits_on
from benchmarks.cli import log_folder
from benchmarks.cli import parse_command_line
from benchmarks.cli import progress
from benchmarks.engine_overhead import CHAT_PATH, WARM_UP_MESSAGE, MeasurementError, ask, chat_payload, flush
from benchmarks.load.conversations import ConversationSpec, build_conversations
from benchmarks.load.report import heading, save_figure, write_report
from sgl_kvevict.measure.chat import model_token_counter
from sgl_kvevict.measure.client import STATS_PATH, StreamedReply, get_json, stream_completion
from sgl_kvevict.measure.results import pyplot as _pyplot, environment
from sgl_kvevict.measure.servers import ServerError, ServerVariant, check_launcher_accepts, launched_server
from sgl_kvevict.models import ModelError, resolve_model
from sgl_kvevict.scoring import SCORES
from sgl_kvevict.scoring.learned import LEARNED_SCORE
from sgl_kvevict.server.launcher import with_learned_weights
from sgl_kvevict.server.refusals import FlagError
from sgl_kvevict.server.sglang_args import host_cpu_flags

BASELINE = "stock"
KEEP_ALL = "keep-99"  # the compressed path with nothing meaningful evicted: against it, what eviction buys
REFERENCES = (BASELINE, KEEP_ALL)  # every variant's tokens/s is taken against each, round by round
# make serve's compression (Makefile): topk at 25% kept (ranked by the learned score there, by --score here).
DEFAULT_FLAGS = ("--kv-evict-policy", "topk", "--kv-evict-default", "budget=0.25")
VARIANT_FLAGS = {
    BASELINE: ("--kv-evict-policy", "none"),
    "full": ("--kv-evict-policy", "full"),
    # The plugin's path at (nearly) 100% kept: a segment the policy keeps whole stays dense (``full`` compresses
    # nothing, so its decode is stock's), so 99% is the most that goes through segment attention.
    KEEP_ALL: ("--kv-evict-policy", "topk", "--kv-evict-default", "budget=0.99"),
    "default-block": (*DEFAULT_FLAGS, "--kv-evict-scope", "block"),
    "default-request": (*DEFAULT_FLAGS, "--kv-evict-scope", "request"),
}
RANKED_BY_SCORE = (KEEP_ALL, "default-block", "default-request")
DEFAULT_VARIANTS = tuple(VARIANT_FLAGS)
# The CPU flags that decide CPU mode's dtype (bf16 where the CPU multiplies it natively) and its speed.
RECORDED_CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
SCHEDULER_PROCESS = "sglang::scheduler"
SERVER_INFO_PATH = "/server_info"  # SGLang's resolved server arguments: --dtype, --kv-cache-dtype
# SGLang's log line when it allocates the KV pool (memory_pool.py; "VA upper bound" where decode graphs
# are captured): the dtype the KV cache really has ("auto" in the flags is resolved by then).
KV_POOL_LINE = re.compile(r"KV Cache (?:is allocated|VA upper bound)\. dtype: (?:torch\.)?(\w+)")
PROFILE_START_TOKENS = 4  # the profile starts once a stream of the pass has this many tokens
# The parts of a decode step, by the innermost frame of a sample that names one: (part, frame substrings,
# whether the part is the attention backend's).
STEP_PARTS = (
    ("compressed part: segment attention over cells", ("segment_attention.py",), True),
    ("dense part: attention over dense keys", ("dense_attention", "_dense_part"), True),
    ("merge of the two parts", ("merge_states.py",), True),
    ("decode attention (one pass over cells and dense keys)", ("decode_attention", "DecodeKeys"), True),
    ("stock SDPA decode (per request)", ("_run_sdpa_forward_decode",), True),
    ("per-forward metadata (requests, views, cell index, dense layout)", ("batch.py", "forward_begin", "paths.py", "_init_segment_metadata"), True),
    ("rest of the attention backend", ("attention.py", "torch_native_backend.py"), True),
    ("model: projections, MLP, norms, rotary, logits", ("forward_batch_generation", "model_runner.py"), False),
    ("sampling", ("sampler.py",), False),
    ("scheduler: batches, results, streaming out", ("scheduler",), False),
)
ATTENTION_PARTS = frozenset(part for part, _, is_attention in STEP_PARTS if is_attention)
OTHER_PART = "other (idle, IPC)"


def server_variant(name: str, score: str) -> ServerVariant:
    """The server ``name`` (of ``VARIANT_FLAGS``), a compressing one ranking by ``score``."""
    scored = ("--kv-evict-default", f"score={score}") if name in RANKED_BY_SCORE else ()
    return ServerVariant.from_flags(name, (*VARIANT_FLAGS[name], *scored))


class SummaryError(ValueError):
    """Runs that cannot be summarized: a round without its stock run has nothing to take ratios against."""


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
    score: str = LEARNED_SCORE  # what the compressing variants rank by

    def __post_init__(self):
        unknown = [name for name in self.variants if name not in VARIANT_FLAGS]
        if unknown or BASELINE not in self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants {list(self.variants)}: choose from {', '.join(VARIANT_FLAGS)}, {BASELINE} among them, each once")
        if self.score not in SCORES:
            raise ValueError(f"--score {self.score}: choose from {', '.join(SCORES)}")
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

    def round_order(self, round_index: int) -> tuple[str, ...]:
        """The variants in the order round ``round_index`` runs them: rotated by the round, so that every
        variant runs in every round and none always runs first, or after the same one."""
        shift = round_index % len(self.variants)
        return self.variants[shift:] + self.variants[:shift]


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
        info = await get_json(session, base_url + SERVER_INFO_PATH)
        if info is None:
            raise MeasurementError(f"no {SERVER_INFO_PATH}: the dtype the server runs with is unknown")
        samples["dtypes"] = {"dtype": info.get("dtype"), "kv_cache_dtype": info.get("kv_cache_dtype")}
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


def kv_pool_dtype(log_text: str) -> str:
    """The KV pool's dtype (``bfloat16``, ``float32``, ...) from a server's log."""
    found = KV_POOL_LINE.search(log_text)
    if found is None:
        raise MeasurementError("no 'KV Cache is allocated. dtype: ...' line in the server's log: its KV dtype is unknown")
    return found[1]


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
    part named by its innermost frame that names one; ``OTHER_PART`` when none does."""
    for frame in reversed(stack.split(";")):
        for part, markers, _ in STEP_PARTS:
            if any(marker in frame for marker in markers):
                return part
    return OTHER_PART


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


def round_step(run: dict, batch: int) -> float:
    """A run's step time at ``batch``: the median over its streams."""
    return statistics.median(run["samples"]["batches"][batch]["step_seconds"])


def rounds_with_baseline(runs: Sequence[dict]) -> list[int]:
    """The rounds whose stock run succeeded: those a summary can take ratios in."""
    return sorted({run["round"] for run in runs if run["variant"] == BASELINE and not run["error"]})


def summarize(runs: Sequence[dict], config: DecodeStepConfig) -> dict:
    """``rounds``: the rounds summarized. ``steps``: per variant and batch size, the step time of each
    round (median over its streams), its median over rounds and its tokens/s, and per reference of
    ``ratio_pairs`` the tokens/s against the reference's in the same round (``vs[reference]``: rounds,
    by round, median). ``profile``: ``profile_summary``. Raises ``SummaryError`` for a round with a
    successful run but no successful stock run (its ratios would be missing, not zero)."""
    by_round = {(run["round"], run["variant"]): run for run in runs if not run["error"]}
    rounds = sorted({round_index for round_index, _ in by_round})
    missing = [round_index + 1 for round_index in rounds if (round_index, BASELINE) not in by_round]
    if missing:
        raise SummaryError(
            f"round(s) {', '.join(map(str, missing))} have no successful {BASELINE} run: every ratio is taken "
            f"against {BASELINE} in the same round; rerun them, or summarize only rounds with one (rounds_with_baseline)"
        )
    pairs = ratio_pairs(config.variants)
    steps: dict = {}
    for variant in config.variants:
        rows = {}
        ran = [round_index for round_index in rounds if (round_index, variant) in by_round]
        for batch in config.batches if ran else ():
            by_round_steps = [round_step(by_round[(r, variant)], batch) for r in ran]
            ratios = {}
            for reference in [reference for paired, reference in pairs if paired == variant]:
                both = [r for r in ran if (r, reference) in by_round]
                values = [round_step(by_round[(r, reference)], batch) / round_step(by_round[(r, variant)], batch) for r in both]
                if values:
                    ratios[reference] = {"rounds": both, "by_round": values, "median": statistics.median(values)}
            rows[batch] = {
                "rounds": ran,
                "step_ms_by_round": [step * 1000 for step in by_round_steps],
                "step_ms": statistics.median(by_round_steps) * 1000,
                "tokens_per_second": batch / statistics.median(by_round_steps),
                "vs": ratios,
            }
        steps[variant] = rows
    return {"rounds": rounds, "steps": steps, "profile": profile_summary(runs, config.variants)}


def _profile_pass_figures(profile: dict) -> dict:
    """One profiled pass: its step time (median over its streams), each part's ms per step (its share of
    the samples times the step) and the attention backend's ms per step (its parts together)."""
    total, step_ms = sum(profile["samples"].values()), statistics.median(profile["step_seconds"]) * 1000
    ms_per_part = {part: count / total * step_ms for part, count in profile["samples"].items()} if total else {}
    return {"step_ms": step_ms, "samples": total, "ms_per_part": ms_per_part,
            "attention_ms": sum(ms for part, ms in ms_per_part.items() if part in ATTENTION_PARTS)}  # fmt: skip


def profile_summary(runs: Sequence[dict], variants: Sequence[str]) -> dict:
    """Per variant, over its profiled passes (one per round): the batch, the rounds, and the medians over
    rounds of the step time, of each part's ms per step and of the attention backend's ms per step;
    ``attention_by_round``; and ``attention_vs_keep_all``: per round the variant's attention ms over
    keep-99's in the same round, and their median, so that the attention eviction saves reads off one
    number that no single pass decides."""
    passes: dict[str, dict[int, dict]] = {}
    for run in runs:
        profile = None if run["error"] else run["samples"]["profile"]
        if profile:
            passes.setdefault(run["variant"], {})[run["round"]] = _profile_pass_figures(profile) | {"batch": profile["batch"]}
    summary: dict = {}
    for variant in [v for v in variants if v in passes]:
        by_round = passes[variant]
        parts = {part for figures in by_round.values() for part in figures["ms_per_part"]}
        attention = {r: figures["attention_ms"] for r, figures in sorted(by_round.items())}
        summary[variant] = {
            "rounds": sorted(by_round), "batch": next(iter(by_round.values()))["batch"],
            "step_ms": statistics.median(f["step_ms"] for f in by_round.values()),
            "samples": sum(f["samples"] for f in by_round.values()),
            "ms_per_part": {part: statistics.median(f["ms_per_part"].get(part, 0.0) for f in by_round.values()) for part in parts},
            "attention_ms": statistics.median(attention.values()), "attention_by_round": attention,
        }  # fmt: skip
        keep_all = passes.get(KEEP_ALL, {})
        shared = [r for r in attention if r in keep_all and keep_all[r]["attention_ms"]]
        if variant != KEEP_ALL and shared:
            ratios = {r: attention[r] / keep_all[r]["attention_ms"] for r in shared}
            summary[variant]["attention_vs_keep_all"] = {"by_round": ratios, "median": statistics.median(ratios.values())}
    return summary


def _range(values: Sequence[float], digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else ""


def _profile_rows(profiles: dict) -> list[str]:
    """Share of the sampled host time per step part and its ms per step, per profiled variant."""
    if not profiles:
        return []
    shown = list(profiles)
    batch = next(iter(profiles.values()))["batch"]
    profiled_rounds = ", ".join(str(r + 1) for r in sorted({r for profile in profiles.values() for r in profile["rounds"]}))
    lines = [
        "",
        f"Where a decode step's host time goes at batch {batch} (py-spy on SGLang's scheduler process, 200 Hz, "
        "samples sorted by the innermost frame that names a part; ms per step = share x the profiled pass's step time; "
        f"one pass per server in each profiled round ({profiled_rounds}), medians over them; the JSON's `summary.profile` "
        "holds each variant's ms per part, `attention_ms` and its rounds):",
        "",
        "| part | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for part in [part for part, _, _ in STEP_PARTS] + [OTHER_PART]:
        cells = []
        for variant in shown:
            ms, step_ms = profiles[variant]["ms_per_part"].get(part, 0.0), profiles[variant]["step_ms"]
            cells.append(f"{ms / step_ms * 100:.0f}% ({ms:.1f} ms)" if ms else "-")
        if any(cell != "-" for cell in cells):
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
    attention = [f"{profiles[v]['attention_ms']:.1f} ms" for v in shown]
    lines.append("| **attention backend (the parts above the model's)** | " + " | ".join(attention) + " |")
    lines.append("| **step (the profiled pass)** | " + " | ".join(f"{profiles[v]['step_ms']:.1f} ms" for v in shown) + " |")
    if any("attention_vs_keep_all" in profiles[v] for v in shown):
        lines.append(f"| **attention / {KEEP_ALL}'s, same round (median; by round)** | " + " | ".join(attention_share_text(profiles[v]) for v in shown) + " |")
    return lines


def attention_share_text(profile: dict) -> str:
    """``profile_summary``'s attention over keep-99's: the median, then each round's in parentheses."""
    ratio = profile.get("attention_vs_keep_all")
    if ratio is None:
        return "-"
    return f"{ratio['median']:.2f} ({', '.join(f'{value:.2f}' for value in ratio['by_round'].values())})"


def _ratio_cell(row: dict, reference: str) -> str:
    ratio = row["vs"].get(reference)
    return "-" if ratio is None else f"**{ratio['median']:.2f}** {_range(ratio['by_round'], 2)}".strip()


def ratio_pairs(variants: Sequence[str]) -> list[tuple[str, str]]:
    """(variant, reference): each variant against each of ``REFERENCES`` that ran too, but not itself
    (nor stock against keep-99: keep-99 against stock says it)."""
    references = [reference for reference in REFERENCES if reference in variants]
    return [(variant, reference) for variant in variants for reference in references
            if variant != reference and not (variant == BASELINE and reference == KEEP_ALL)]  # fmt: skip


def _columns(variants: Sequence[str]) -> list[tuple[str, str, Optional[str]]]:
    """The step table's columns: (header, variant, reference or None for the step time)."""
    pairs = ratio_pairs(variants)
    columns = []
    for variant in variants:
        columns.append((f"{variant} step (ms)", variant, None))
        columns += [(f"{variant} / {reference} tok/s", variant, reference) for paired, reference in pairs if paired == variant]
    return columns


def _dtypes_text(runs: Sequence[dict]) -> str:
    """Each server's dtype, ``--kv-cache-dtype`` and KV pool dtype, grouped by value."""
    groups: dict[str, list[str]] = {}
    for run in runs:
        if not run["error"]:
            dtypes = run["samples"]["dtypes"]
            value = f"`--dtype {dtypes['dtype']} --kv-cache-dtype {dtypes['kv_cache_dtype']}`, KV pool {dtypes['kv_pool']}"
            groups.setdefault(value, []).append(run["label"])
    return "; ".join(f"{value} ({', '.join(labels)})" for value, labels in groups.items())


def step_table(report: dict) -> list[str]:
    """Per batch size, each variant's step and its tokens/s against stock's and keep-99's (markdown lines;
    also docs/results.md's)."""
    cfg, summary = report["meta"]["config"], report["summary"]
    columns = _columns(cfg["variants"])
    lines = ["| batch | " + " | ".join(header for header, _, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for batch in cfg["batches"]:
        cells = []
        for _, variant, reference in columns:
            rows = summary["steps"][variant]
            row = rows.get(batch, rows.get(str(batch)))  # int keys in a run, strings once read back from its JSON
            if row is None:
                cells.append("-")
            elif reference is None:
                cells.append(f"{row['step_ms']:.1f} {_range(row['step_ms_by_round'], 0)}".strip())
            else:
                cells.append(_ratio_cell(row, reference))
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    meta, summary = report["meta"], report["summary"]
    env, cfg = meta["environment"], meta["config"]
    variants = cfg["variants"]
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in meta["cpu_flags"].items())
    summarized = ", ".join(str(round_index + 1) for round_index in summary["rounds"]) or "none"
    lines = [
        *heading("Decode step: inter-token latency at equal batch and context, stock vs the plugin", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores (CPU flags: {flags}), GPU: {env['gpu']}. SGLang "
        f"{env['sglang']}, torch {env['torch']}, sgl-kvevict {env['git_commit']}"
        f"{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, {env['date']}. Model `{cfg['model']}`, "
        f"every server `--max-total-tokens {cfg['pool_tokens']}`; {cfg['prompt_tokens']}-token documents prefilled "
        f"once, then B of them decoded at once for {cfg['decode_tokens']} tokens (EOS ignored); {cfg['rounds']} "
        f"round(s), each running every server, one at a time, in an order rotated by the round; rounds summarized "
        f"(those whose stock run succeeded): {summarized}.",
        "",
        "Dtypes (`/server_info`; the KV pool's from the server's log): " + (_dtypes_text(report["runs"]) or "no server ran")
        + ". Load average "
        "before each server: " + ", ".join(f"{run['label']} {run['load_average'][0]:.1f}" for run in report["runs"]) + ".",
        "",
        "Variants: " + "; ".join(f"`{name}`: `{' '.join(server_variant(name, cfg['score']).launcher_flags())}`" for name in variants) + ".",
        "",
        "Step time (ms, median over rounds of each round's median over its streams; range over rounds) and tokens/s "
        "against stock's and against keep-99's in the same round (median, range over rounds):",
        "",
    ]
    lines += step_table(report)
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
    lines += _profile_rows(summary["profile"])
    lines += [
        "",
        f"![decode step]({meta['name']}.png)",
        "",
        "Reading it: a step is one forward of the whole batch (every stream one token), measured at the client "
        "from each stream's first token to its last, so it includes the scheduler and the streaming out as well "
        "as the model and its attention. A ratio is the reference's step over the variant's in the same round, "
        "i.e. the variant's tokens/s over the reference's: `full / stock` is what the plugin's backend costs with "
        "nothing compressed, `keep-99 / stock` what the compressed path costs or buys with nothing meaningful "
        "evicted, and a policy's `/ keep-99` what its eviction itself buys per step. The machine is shared with "
        "other sessions' servers and tests (see the load averages): absolute step times move by tens of percent "
        "between rounds; the per-round ratios, taken from servers run minutes apart, move less, and their range "
        "over rounds is shown. The profile's passes are not timed, so their step times "
        "are from another moment than the table's.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Step time and tokens/s against stock by batch size, one line per variant (range over rounds)."""
    plt = _pyplot()
    cfg, steps_by_variant = report["meta"]["config"], report["summary"]["steps"]
    fig, (steps_axis, ratio_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    for variant in cfg["variants"]:
        rows = [(batch, steps_by_variant[variant][batch]) for batch in cfg["batches"] if batch in steps_by_variant[variant]]
        if not rows:
            continue
        batches = [batch for batch, _ in rows]
        steps = [row["step_ms"] for _, row in rows]
        spread = [[s - min(r["step_ms_by_round"]) for s, (_, r) in zip(steps, rows)],
                  [max(r["step_ms_by_round"]) - s for s, (_, r) in zip(steps, rows)]]  # fmt: skip
        steps_axis.errorbar(batches, steps, yerr=spread, marker="o", capsize=3, label=variant)
        if variant != BASELINE:
            ratio_axis.plot(batches, [row["vs"][BASELINE]["median"] for _, row in rows], marker="o", label=variant)
    ratio_axis.axhline(1.0, color="grey", linewidth=0.8)
    steps_axis.set(xlabel="batch (streams decoding at once)", ylabel="ms per step", title="decode step (lower is better)")
    ratio_axis.set(xlabel="batch", ylabel="tokens/s / stock's", title="against stock, same round (higher is better)")
    for axis in (steps_axis, ratio_axis):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # none on the ratio axis while only stock has run
            axis.legend(fontsize=8)
    save_figure(plt, fig, path)


def run(config: DecodeStepConfig, out: Path, name: str, log_dir: Path, argv: Sequence[str], log: Callable[[str], None]) -> dict:
    """Every round, every variant (``DecodeStepConfig.round_order``); the report is rewritten after each
    server, so an interrupted run keeps the servers it finished. Its summary holds the rounds whose stock
    run has succeeded (``rounds_with_baseline``); the other runs stay in the report, listed."""
    if config.profile_batch and shutil.which("py-spy") is None:
        raise MeasurementError("--profile-batch needs py-spy on PATH (pip install py-spy)")
    spec = ConversationSpec(
        users=config.documents, turns=1, document_tokens=config.prompt_tokens, fact_every=1, shared_document=False, seed=config.seed
    )
    prompts = [[{"role": "user", "content": c.user_message(0)}] for c in build_conversations(spec, model_token_counter(config.model))]
    cpu_flags = host_cpu_flags()
    meta = {
        "command": command_line("decode_step", argv),
        "name": name,
        "config": asdict(config),
        "environment": environment(),
        "cpu_flags": {flag: flag in cpu_flags for flag in RECORDED_CPU_FLAGS},
    }
    runs: list[dict] = []
    for round_index in range(config.rounds):
        for variant_name in config.round_order(round_index):
            entry = {"round": round_index, "variant": variant_name, "label": f"{variant_name} r{round_index}",
                     "load_average": os.getloadavg(), "error": None}  # fmt: skip
            log(f"round {round_index + 1}/{config.rounds}, {variant_name}: starting the server (load average {entry['load_average'][0]:.2f})")
            try:
                variant = server_variant(variant_name, config.score)
                with launched_server(config.model, variant, config.pool_tokens, log_dir, config.launcher_extra) as server:
                    profiled = None
                    if config.profile_batch:
                        profiled = (_scheduler_pid(server.descendants), log_dir)
                    entry["samples"] = asyncio.run(_measure(server.base_url, config, prompts, log, profiled))
                    entry["samples"]["dtypes"]["kv_pool"] = kv_pool_dtype(server.child.output())
            except (ServerError, MeasurementError) as error:
                entry["error"] = str(error)
                log(f"  failed: {error}")
            runs.append(entry)
            summarized = set(rounds_with_baseline(runs))
            report = {"meta": meta, "runs": runs, "summary": summarize([r for r in runs if r["round"] in summarized], config)}
            write_report(out, name, report, markdown(report), log)
            plot(report, out / f"{name}.png")
    return report


def check_servers(config: DecodeStepConfig) -> None:
    """Every variant through the launcher's own checks, learned weights included, before any server
    starts (a learned score on a model without weights would fail every compressing server)."""
    model_dir = resolve_model(config.model, log=progress)
    for name in config.variants:
        launch = check_launcher_accepts(config.model, server_variant(name, config.score), config.pool_tokens, config.launcher_extra)
        try:
            with_learned_weights(launch, model_dir)
        except FlagError as error:
            raise ServerError(f"{name}: {error}; or rank by a score that needs no weights (--score attn)") from None


QUICK = dict(batches="1,4", variants="stock,keep-99,default-block", prompt_tokens=1000, decode_tokens=16, rounds=1)


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("decode_step", __doc__)
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated servers of {', '.join(VARIANT_FLAGS)} (default {','.join(DEFAULT_VARIANTS)})",
    )  # fmt: skip
    parser.add_argument(
        "--score", default=LEARNED_SCORE,
        help=f"what {', '.join(RANKED_BY_SCORE)} rank by, of {', '.join(SCORES)} (default {LEARNED_SCORE}: needs weights for the model)",
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


def config_from_args(args: argparse.Namespace) -> DecodeStepConfig:
    """The run's configuration from the parsed command line (``ValueError`` for a bad value)."""
    batches = _csv_ints(args.batches)
    documents = max(batches + ((args.profile_batch,) if args.profile_batch else ()))
    pool = args.pool_tokens or int(documents * (args.prompt_tokens + 100 + args.decode_tokens) * 1.1)
    return DecodeStepConfig(
        model=args.model, variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()), batches=batches,
        prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, rounds=args.rounds, pool_tokens=pool,
        seed=args.seed, profile_batch=args.profile_batch, launcher_extra=tuple(args.server_arg), score=args.score,
    )  # fmt: skip


@exits_on(MeasurementError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        check_servers(config)
    except (ValueError, ServerError, ModelError) as error:
        parser.error(str(error))
    log_dir = log_folder(args.log_dir, "decode-step")
    report = run(config, args.out, args.name, log_dir, argv, progress)
    for variant, reference in ratio_pairs(config.variants):
        rows = report["summary"]["steps"][variant].items()
        ratios = ", ".join(f"B={b} {row['vs'][reference]['median']:.2f}" for b, row in rows if reference in row["vs"])
        print(f"{variant} / {reference} tokens/s: {ratios or 'none measured'}")
    return 1 if any(run["error"] for run in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
