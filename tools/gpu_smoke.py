"""The GPU smoke run: our launcher on a lent GPU with stock SGLang's GPU defaults (decode CUDA graphs,
the overlap schedule, FlashInfer), checked against stock SGLang in the same run, one report line per
check in ``$OUT/gpu_smoke.md`` (docs/gpu.md, "Run the server on a lent GPU").

    bash tools/gpu_smoke.sh                           on the lent machine: installs gpu-kit/, then this
    python tools/gpu_smoke.py --rehearsal --out DIR   on CPU: every step on a two-layer model, CPU mode;
                                                      what needs a GPU is reported NOT ON CPU
    python tools/gpu_smoke.py --dry-run --out DIR     the report's structure only; nothing starts

Four servers, each ``python -m sgl_kvevict.server`` started one after the other on the same
SmolLM2-shaped model (SmolLM2-135M's config and tokenizer from the kit, random weights made here, see
``write_random_checkpoint``): ``stock`` (``--kv-evict-policy none``), ``full`` (every token kept),
``snapkv`` (25% kept; the default ``topk`` + ``learned`` needs the real weights' fingerprint) and
``snapkv-eager`` (the same, decode graphs off). The report says, per check:

(a) capture: each plugin server's decode graph capture finished; its memory beside stock's;
(b) tokens, over a mixed batch of compressible and short prompts decoding together: ``full`` decodes
    stock's greedy tokens (a plan that keeps every token makes no compressed node, so this is our
    backend's dense path and its ``stock`` graphs); ``snapkv`` decodes the same tokens with graphs as
    eager (the compressed path: the ``segments`` graphs against the eager backend, same kept cells);
    ``/kvevict/stats`` counts compressed requests, graph replays, and no eager fallback;
(c) syncs: host-synchronising calls per compressed decode step (``engine/adapter/sync_probe.py``) vs stock;
(d) ITL: decode inter-token latency, ``snapkv`` vs stock, batch 1 and 8;
(e) kernels: the kernels' GPU tests (docs/gpu.md, section 2);
issue 38's per-step decode benchmark where ``benchmarks.decode_step`` exists; issue 48's evaluate
command on the run's model (mechanics only); and
(f) Gemma 3's local layers on the FlashInfer path: a random Gemma 3-shaped model (5 local layers with a
    128-token window : 1 global, ``GEMMA3_SHAPE``), stock and ``full`` each serving two turns of four
    conversations whose prompts span several windows (the second turn reads the first one's compressed
    node): ``full``'s greedy tokens against stock's, the kept share of the compressed prompts' KV, both pools.

Every step has a time limit inside the whole run's budget; a failed step is a report line and the run
goes on with what does not depend on it. The report is rewritten after every line, so a run cut short
still says what it found. The exit code is 1 where a line FAILs: a rehearsal, whose (a), the graph
replays of (b) and (e) are NOT ON CPU, passes when everything a CPU can run passes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "gpu-kit"
DEFAULT_BUDGET_SECONDS = 500  # inside a device run's 10 minutes
# A rehearsal has no device limit, and CPU-mode servers start in 20-80 s on 2 shared cores (6 of them).
REHEARSAL_BUDGET_SECONDS = 1200
# A token whose greedy choice had a runner-up this close (in log-probability) is a tie that bf16
# rounding may flip between two correct attention paths; a divergence anywhere else is a wrong result.
TIE_MARGIN = 0.05
# Log-probabilities of the same tokens, before any divergence, differ by bf16 rounding only.
LOGPROB_TOLERANCE = 0.1
# tests/test_engine_sync.py's bound: a compressed decode step may add this many syncing calls to stock's.
SYNC_CALLS_ABOVE_STOCK = 4
GPU_TEST_FILES = (
    "tests/test_kernels_window.py", "tests/test_kernels_segment_attention.py", "tests/test_kernels_compaction.py",
    "tests/test_kernels_dispatch.py", "tests/test_engine_decode_graph.py",
)  # fmt: skip
DECODE_STEP_BENCHMARK = "benchmarks.decode_step"  # issue 38: called here once it exists
DECODE_STEP_SECONDS = 90  # --quick: ~2 minutes on a GPU; less than this left, it is reported NOT RUN
DECODE_STEP_LIMIT_SECONDS = 240  # at most this of the budget: ~3 minutes on 2 CPU cores in a rehearsal
EVALUATE_COMMAND = "sgl_kvevict.evaluate"  # issue 48
EVALUATE_SECONDS = 120  # two servers and one document; less than this left, it is reported NOT RUN
EVALUATE_LIMIT_SECONDS = 300
# The run's model has random weights, for which no learned score weights exist: the benchmark's compressing
# servers rank by the observation window's attention instead (as the snapkv servers here do).
DECODE_STEP_SCORE = "attn"
# Rehearsal: SmolLM2's tokenizer and vocabulary, two small layers (a CPU decodes it in milliseconds).
REHEARSAL_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """Prompt and answer lengths, in tokens."""

    long_prompt: int  # compressed by a policy
    short_prompt: int  # below the observation window: never compressed
    mixed_new_tokens: int  # (b): decode steps of every request of the mixed batch
    sync_new_tokens: int  # (c)
    itl_prompt: int  # (d)
    itl_new_tokens: int
    gemma3_prompt: int = 1024  # (f): each turn's new prompt tokens (8 windows of 128), then its answer
    gemma3_new_tokens: int = 64


# (f): Gemma-3-1B's layer pattern, small, a 128-token window; head_dim 64 as the SmolLM2 shape's, whose
# FlashInfer kernels the run has compiled by then.
GEMMA3_SHAPE = {
    "num_layers": 6, "num_q_heads": 4, "num_kv_heads": 1, "vocab_size": 512, "seed": 0,
    "overrides": {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 128, "hidden_size": 256,
                  "intermediate_size": 512, "head_dim": 64, "query_pre_attn_scalar": 64, "max_position_embeddings": 4096,
                  "tie_word_embeddings": True},
}  # fmt: skip
GEMMA3_CONVERSATIONS = 4
GEMMA3_SECONDS = 120  # two servers on a warm machine; less than this left, it is reported NOT RUN
GEMMA3_LIMIT_SECONDS = 300


GPU_WORKLOAD = Workload(long_prompt=512, short_prompt=16, mixed_new_tokens=256, sync_new_tokens=64, itl_prompt=1024, itl_new_tokens=128)
REHEARSAL_WORKLOAD = Workload(long_prompt=256, short_prompt=8, mixed_new_tokens=24, sync_new_tokens=12, itl_prompt=256, itl_new_tokens=12,
                             gemma3_prompt=384, gemma3_new_tokens=12)  # fmt: skip
MIXED_BATCH = 8  # half compressed, half plain


# --- the report ----------------------------------------------------------------------------------


# A rehearsal's status for a check that needs a GPU (decode graphs, the CUDA kernels): neither PASS nor
# FAIL. A GPU run never reports it: there those checks run, and FAIL if they fail.
NOT_ON_CPU = "NOT ON CPU"


@dataclass
class Line:
    check: str
    status: str  # PASS, FAIL, INFO, NOT RUN, NOT ON CPU
    detail: str


def exit_code(lines: list[Line]) -> int:
    """The run's exit code: 1 where a line FAILs, else 0 (what cannot run on CPU and what a short
    budget left out are lines of their own, not failures)."""
    return 1 if any(line.status == "FAIL" for line in lines) else 0


class Report:
    """``gpu_smoke.md``, rewritten after every line; each line is printed as progress too."""

    def __init__(self, path: Path, header: list[str]):
        self.path = path
        self.header = header
        self.lines: list[Line] = []
        self.write()

    def add(self, line: Line) -> None:
        self.lines.append(line)
        progress(f"{line.check}: {line.status}: {line.detail}")
        self.write()

    def write(self) -> None:
        body = [f"- **{line.check}** {line.status}: {line.detail}" for line in self.lines]
        self.path.write_text("\n".join([*self.header, "", *body, ""]))


_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[smoke +{time.monotonic() - _STARTED:5.0f} s] {message}", flush=True)


class Budget:
    """The run's seconds; each step gets at most what is left."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.left() - 5))


# --- steps ---------------------------------------------------------------------------------------


@dataclass
class Step:
    """One step of the run. ``run`` returns report lines and may raise (then it is a FAIL line);
    ``needs`` the seconds it cannot do without; ``requires`` the steps that must have passed;
    ``starts_work`` whether it starts a process or writes a model (a dry run only names those)."""

    name: str
    run: Callable[[], list[Line]]
    needs: float
    requires: tuple[str, ...] = ()
    starts_work: bool = True


class Interrupted(BaseException):
    """SIGTERM: the run's time limit (tools/gpu_smoke.sh) is up. A BaseException, so that no step's
    ``except Exception`` takes it for a failed measurement and goes on."""


def run_steps(steps: list[Step], report: Report, budget: Budget) -> dict[str, bool]:
    """Run each step that has its time and its prerequisites; returns which passed."""
    passed: dict[str, bool] = {}
    for step in steps:
        missing = [name for name in step.requires if not passed.get(name)]
        if missing:
            report.add(Line(step.name, "NOT RUN", f"needs {', '.join(missing)}, which did not pass"))
            passed[step.name] = False
            continue
        if budget.left() < step.needs:
            report.add(Line(step.name, "NOT RUN", f"{budget.left():.0f} s left of the budget, it needs {step.needs:.0f} s"))
            passed[step.name] = False
            continue
        progress(f"{step.name}: starting ({budget.left():.0f} s left)")
        try:
            lines = step.run()
        except Interrupted:
            report.add(Line(step.name, "FAIL", "stopped by the run's time limit"))
            passed[step.name] = False
            break
        except Exception as error:  # a failure found is a result: report it and go on
            lines = [Line(step.name, "FAIL", one_line(error))]
        for line in lines:
            report.add(line)
        passed[step.name] = all(line.status != "FAIL" for line in lines)
    return passed


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    exception_lines = [line for line in text.splitlines() if re.match(r"^\w+(Error|Exception): ", line)]
    first = exception_lines[-1] if exception_lines else (text.splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:300]}"


# --- the model -----------------------------------------------------------------------------------


def write_random_checkpoint(config_dir: Path, out: Path, shape: Optional[dict] = None, seed: int = 0) -> Path:
    """A Llama checkpoint in ``out`` with the config and tokenizer of ``config_dir`` (``shape`` overrides
    sizes) and random weights as a model is initialised (normal, std ``initializer_range``; norms 1).
    Why not ``--load-format dummy``: SGLang fills weights uniform in +-1e-3, which leaves attention's
    share of the residual stream near 1e-4, so equal tokens would not show that attention is right."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for source in config_dir.iterdir():
        if source.is_file() and source.suffix != ".safetensors":
            shutil.copy2(source, out / source.name)
    config = {**json.loads((config_dir / "config.json").read_text()), **(shape or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hidden, inner, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_width, kv_width = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, columns: int) -> torch.Tensor:
        return (torch.randn(rows, columns, generator=generator) * config["initializer_range"]).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes = {
            "self_attn.q_proj": (q_width, hidden), "self_attn.k_proj": (kv_width, hidden), "self_attn.v_proj": (kv_width, hidden),
            "self_attn.o_proj": (hidden, q_width), "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden),
            "mlp.down_proj": (hidden, inner),
        }  # fmt: skip
        tensors.update({f"{prefix}.{name}.weight": matrix(*size) for name, size in shapes.items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def random_prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size - 100) for _ in range(length)]


# --- servers and measurements --------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPlan:
    name: str
    flags: tuple[str, ...]
    startup_seconds: float  # the first server also waits for FlashInfer's JIT
    measures: tuple[str, ...]  # of MEASURES, in order
    sync_probe: bool = False


SNAPKV = ("--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25")
SERVER_PLANS = (
    ServerPlan("stock", ("--kv-evict-policy", "none"), 300, ("capture", "tokens", "syncs", "itl"), sync_probe=True),
    ServerPlan("full", ("--kv-evict-policy", "full"), 180, ("capture", "tokens")),
    ServerPlan("snapkv", SNAPKV, 180, ("capture", "tokens", "syncs", "itl", "stats"), sync_probe=True),
    ServerPlan("snapkv-eager", (*SNAPKV, "--cuda-graph-backend-decode", "disabled"), 120, ("tokens", "stats")),
)


def common_flags(rehearsal: bool) -> list[str]:
    """Stock SGLang's GPU defaults, less what needs the real sgl_kernel (docs/gpu.md); the same for every
    server. Decode graphs up to batch 8 (the largest this run decodes) keep the four captures short."""
    flags = ["--sampling-backend", "pytorch", "--cuda-graph-backend-prefill", "disabled"]
    if not rehearsal:
        flags += ["--attention-backend", "flashinfer", "--dtype", "bfloat16", "--cuda-graph-max-bs-decode", "8"]
    return flags


@dataclass
class Smoke:
    """One run: where things are, the workload, and what each server measured (``results[server][what]``)."""

    out: Path
    work: Path
    model: Path
    workload: Workload
    rehearsal: bool
    budget: Budget
    vocab_size: int = 0
    results: dict[str, dict] = field(default_factory=dict)

    def prompt(self, seed: int, length: int) -> list[int]:
        return random_prompt(seed, length, self.vocab_size)


def repository_importable() -> None:
    """The repository's packages (benchmarks, tools) and tests/ importable from this script."""
    sys.path[:0] = [folder for folder in (str(REPO / "tests"), str(REPO)) if folder not in sys.path]


def serving_helpers():
    """The project's own server starter and clients (tests/serving.py, sgl_kvevict/measure/client.py)."""
    repository_importable()
    import serving

    return serving


def set_environment(values: dict[str, Optional[str]]) -> None:
    """Set each variable, or unset it where its value is None."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextmanager
def environment(**values: Optional[str]) -> Iterator[None]:
    """The variables set for the servers started inside the block (they inherit this environment)."""
    saved = {name: os.environ.get(name) for name in values}
    set_environment(values)
    try:
        yield
    finally:
        set_environment(saved)


def generate(server, input_ids: list[int], new_tokens: int, logprobs: bool = False, timeout: float = 120) -> dict:
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": input_ids, "sampling_params": sampling}
    if logprobs:
        payload.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=len(input_ids) - 1)
    return server.post("/generate", payload, timeout=timeout)


def get_json(server, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(server.base_url + path, headers=server.headers()), timeout=30) as response:
        return json.loads(response.read())


CAPTURE_END = re.compile(r"Capture target decode .*? end\. bs=(\[[^\]]*\]), elapsed=([\d.]+) s, mem usage=([\d.]+) GB, avail mem=([\d.]+) GB")
SCHEDULER_MEMORY = re.compile(r"max_total_num_tokens=(\d+),.*available_gpu_mem=([\d.]+) GB")


def measure_capture(smoke: Smoke, plan: ServerPlan, server) -> dict:
    """The decode graph capture's end line and the scheduler's pool size, from the server's log."""
    log = server.log()
    capture, pool = CAPTURE_END.search(log), SCHEDULER_MEMORY.search(log)
    found = {"captured": capture is not None}
    if capture:
        found.update(batch_sizes=capture[1], seconds=float(capture[2]), mem_usage_gb=float(capture[3]), avail_after_gb=float(capture[4]))
    if pool:
        found.update(pool_tokens=int(pool[1]), available_gpu_gb=float(pool[2]))
    return found


def token_record(reply: dict) -> dict:
    """What ``compare_tokens`` reads of a ``/generate`` reply with logprobs."""
    meta = reply["meta_info"]
    return {"output_ids": reply["output_ids"], "token_logprobs": [item[0] for item in meta["output_token_logprobs"]],
            "top2": [[item[0] for item in top[:2]] for top in meta["output_top_logprobs"]]}  # fmt: skip


def generate_together(server, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Greedy replies with logprobs to ``prompts`` sent at once, so that they decode in the same batches."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate(server, ids, new_tokens, logprobs=True), prompts))


def measure_tokens(smoke: Smoke, plan: ServerPlan, server) -> dict:
    """The mixed batch: half the requests with a compressible prompt, half with one too short to
    compress, sent together so that they decode in the same batches."""
    work = smoke.workload
    prompts = [smoke.prompt(seed, work.long_prompt if seed % 2 == 0 else work.short_prompt) for seed in range(MIXED_BATCH)]
    return {"replies": [token_record(reply) for reply in generate_together(server, prompts, work.mixed_new_tokens)]}


def probe_path(smoke: Smoke, plan: ServerPlan) -> Path:
    return smoke.work / f"{plan.name}-probe.json"


def read_probe(path: Path) -> dict:
    return json.loads(path.read_text())["decode"]


def measure_syncs(smoke: Smoke, plan: ServerPlan, server) -> dict:
    """Syncing calls per decode forward while one request decodes over a compressed prompt (as
    tests/test_engine_sync.py measures it): its short neighbours open and close the interval."""
    probe = probe_path(smoke, plan)
    generate(server, smoke.prompt(1001, 8), 1)  # an extend only
    before = read_probe(probe)
    generate(server, smoke.prompt(1002, smoke.workload.long_prompt), smoke.workload.sync_new_tokens)
    generate(server, smoke.prompt(1003, 8), 1)  # its extend closes the last decode interval
    after = read_probe(probe)
    forwards = after["forwards"] - before["forwards"]
    # A policy server says whether the prompt was compressed (stock answers {"policy": "none"}).
    compressed = get_json(server, "/kvevict/stats").get("compressed_nodes")
    return {"forwards": forwards, "calls_per_forward": (after["calls"] - before["calls"]) / max(forwards, 1), "compressed_nodes": compressed}


def measure_itl(smoke: Smoke, plan: ServerPlan, server) -> dict:
    """Median decode inter-token latency over streamed requests, batch 1 and 8, after a warm-up batch
    (the first compressed decode compiles its Triton kernels)."""
    from sgl_kvevict.measure.client import stream_completion

    import aiohttp

    work = smoke.workload

    async def batch(seeds: range, new_tokens: int) -> list[float]:
        payloads = [{"model": "default", "prompt": smoke.prompt(seed, work.itl_prompt), "max_tokens": new_tokens,
                     "temperature": 0, "ignore_eos": True} for seed in seeds]  # fmt: skip
        async with aiohttp.ClientSession(headers=server.headers(), timeout=aiohttp.ClientTimeout(total=120)) as session:
            replies = await asyncio.gather(*(stream_completion(session, server.base_url + "/v1/completions", p) for p in payloads))
        problems = [reply.error or "; ".join(reply.problems) for reply in replies if reply.error or reply.problems]
        if problems:
            raise RuntimeError(f"streamed completion failed: {problems[0]}")
        return [(reply.latency - reply.ttft) / (reply.completion_tokens - 1) * 1000 for reply in replies]

    asyncio.run(batch(range(2000, 2008), 8))
    one = asyncio.run(batch(range(2100, 2101), work.itl_new_tokens))
    eight = asyncio.run(batch(range(2200, 2208), work.itl_new_tokens))
    return {"batch_1_ms": statistics.median(one), "batch_8_ms": statistics.median(eight)}


def measure_stats(smoke: Smoke, plan: ServerPlan, server) -> dict:
    return get_json(server, "/kvevict/stats")


MEASURES: dict[str, Callable[[Smoke, ServerPlan, object], dict]] = {
    "capture": measure_capture, "tokens": measure_tokens, "syncs": measure_syncs, "itl": measure_itl, "stats": measure_stats,
}  # fmt: skip


def server_step(smoke: Smoke, plan: ServerPlan) -> list[Line]:
    """Start the server, take each measure (a failing one is a line, the others still run), stop it."""
    serving = serving_helpers()
    folder = smoke.work / plan.name
    folder.mkdir(parents=True, exist_ok=True)
    probe = str(probe_path(smoke, plan)) if plan.sync_probe else None
    flags = (*plan.flags, *common_flags(smoke.rehearsal))
    lines = []
    started = time.monotonic()
    with environment(KVEVICT_SYNC_PROBE=probe):
        with serving.running_server(smoke.model, folder, *flags, startup_timeout=smoke.budget.limit(plan.startup_seconds)) as server:
            progress(f"{plan.name}: serving after {time.monotonic() - started:.0f} s")
            results = smoke.results.setdefault(plan.name, {})
            for what in plan.measures:
                try:
                    results[what] = MEASURES[what](smoke, plan, server)
                except Exception as error:
                    lines.append(Line(f"{plan.name} {what}", "FAIL", one_line(error)))
    lines.append(Line(f"{plan.name} server", "INFO", f"started, measured and stopped in {time.monotonic() - started:.0f} s: {' '.join(flags)}"))
    return lines


# --- the checks: report lines from what the servers measured --------------------------------------


def first_divergence(expected: list[int], actual: list[int]) -> Optional[int]:
    for index, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return index
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def compare_tokens(reference: dict, other: dict) -> tuple[str, str]:
    """Status and detail: the same greedy tokens, or divergences only at near-ties (``TIE_MARGIN``) with
    the tokens before them scored alike (``LOGPROB_TOLERANCE``)."""
    identical, ties, wrong, worst_logprob = 0, [], [], 0.0
    for index, (ref, got) in enumerate(zip(reference["replies"], other["replies"])):
        at = first_divergence(ref["output_ids"], got["output_ids"])
        shared = len(ref["output_ids"]) if at is None else at
        deltas = [abs(a - b) for a, b in zip(ref["token_logprobs"][:shared], got["token_logprobs"][:shared])]
        worst_logprob = max([worst_logprob, *deltas])
        if at is None:
            identical += 1
            continue
        top = ref["top2"][at] if at < len(ref["top2"]) else []
        margin = top[0] - top[1] if len(top) == 2 else float("inf")
        (ties if margin < TIE_MARGIN else wrong).append(f"request {index} at step {at} (stock's top-2 margin {margin:.3f})")
    total = len(reference["replies"])
    detail = f"{identical}/{total} requests identical over {len(reference['replies'][0]['output_ids'])} steps; max |logprob difference| before any divergence {worst_logprob:.3g}"
    if wrong or worst_logprob > LOGPROB_TOLERANCE:
        return "FAIL", f"{detail}; diverged beyond a near-tie: {', '.join(wrong) or 'none'}"
    if ties:
        return "PASS", f"{detail}; diverged only at near-ties (< {TIE_MARGIN}): {', '.join(ties)}"
    return "PASS", detail


def measured(results: dict, server: str, what: str) -> Optional[dict]:
    return results.get(server, {}).get(what)


def not_measured(check: str, *needed: tuple[str, str]) -> Line:
    return Line(check, "NOT RUN", "no " + " / ".join(f"{what} of the {server} server" for server, what in needed))


def check_capture(results: dict, on_gpu: bool) -> list[Line]:
    lines = []
    stock = measured(results, "stock", "capture")
    for name in ("full", "snapkv"):
        mine, check = measured(results, name, "capture"), f"(a) capture {name}"
        if not on_gpu:
            lines.append(Line(check, NOT_ON_CPU, "CPU mode captures no decode graphs"))
        elif mine is None or stock is None:
            lines.append(not_measured(check, ("stock", "capture"), (name, "capture")))
        elif not mine["captured"]:
            lines.append(Line(check, "FAIL", "no 'Capture target decode ... end' line in its log"))
        else:
            lines.append(Line(check, "PASS", (
                f"decode graphs bs={mine['batch_sizes']} captured in {mine['seconds']:.1f} s (stock {stock.get('seconds', '?')} s); "
                f"capture used {mine['mem_usage_gb']:.2f} GB (stock {stock.get('mem_usage_gb', '?')}); KV pool "
                f"{mine.get('pool_tokens', '?')} tokens (stock {stock.get('pool_tokens', '?')}); GPU memory left "
                f"{mine.get('available_gpu_gb', '?')} GB (stock {stock.get('available_gpu_gb', '?')})"
            )))  # fmt: skip
    return lines


def check_tokens(results: dict, on_gpu: bool) -> list[Line]:
    lines = []
    for name, reference in (("full", "stock"), ("snapkv-eager", "snapkv")):
        mine, theirs, check = measured(results, name, "tokens"), measured(results, reference, "tokens"), f"(b) tokens {name} vs {reference}"
        if mine is None or theirs is None:
            lines.append(not_measured(check, (reference, "tokens"), (name, "tokens")))
        else:
            lines.append(Line(check, *compare_tokens(theirs, mine)))
    for name, graphs in (("snapkv", on_gpu), ("snapkv-eager", False)):
        stats, check = measured(results, name, "stats"), f"(b) stats {name}"
        if stats is None:
            lines.append(not_measured(check, (name, "stats")))
            continue
        counts = {key: stats.get(key) for key in ("requests_compressed", "graph_decodes", "decode_graph_fallbacks", "overlap_waits")}
        # The mixed batch compressed its long prompts, the graphs replayed them (or, eager or on CPU, never did), no fallback.
        ok = bool(counts["requests_compressed"]) and counts["decode_graph_fallbacks"] == 0 and bool(counts["graph_decodes"]) == graphs
        detail = ", ".join(f"{key} {value}" for key, value in counts.items())
        if name == "snapkv" and not on_gpu:
            detail += " (graph replays: not on CPU, where there are none)"
        lines.append(Line(check, "PASS" if ok else "FAIL", detail))
    return lines


def check_syncs(results: dict) -> list[Line]:
    stock, mine = measured(results, "stock", "syncs"), measured(results, "snapkv", "syncs")
    if stock is None or mine is None:
        return [not_measured("(c) syncs", ("stock", "syncs"), ("snapkv", "syncs"))]
    ok = bool(mine["compressed_nodes"]) and mine["calls_per_forward"] <= stock["calls_per_forward"] + SYNC_CALLS_ABOVE_STOCK
    detail = (f"snapkv {mine['calls_per_forward']:.2f} syncing calls per compressed decode step over {mine['forwards']} steps "
              f"({mine['compressed_nodes']} compressed nodes), stock {stock['calls_per_forward']:.2f} (bound: stock + {SYNC_CALLS_ABOVE_STOCK})")  # fmt: skip
    return [Line("(c) syncs", "PASS" if ok else "FAIL", detail)]


def check_itl(results: dict) -> list[Line]:
    stock, mine = measured(results, "stock", "itl"), measured(results, "snapkv", "itl")
    if stock is None or mine is None:
        return [not_measured("(d) ITL", ("stock", "itl"), ("snapkv", "itl"))]
    parts = [f"batch {n}: snapkv {mine[f'batch_{n}_ms']:.2f} ms, stock {stock[f'batch_{n}_ms']:.2f} ms "
             f"(x{mine[f'batch_{n}_ms'] / stock[f'batch_{n}_ms']:.2f})" for n in (1, 8)]  # fmt: skip
    return [Line("(d) ITL", "INFO", "; ".join(parts) + " (snapkv: 25% kept, SnapKV's window score; the default learned score needs real weights)")]


def checks(results: dict, on_gpu: bool) -> list[Line]:
    """(a)-(d) from what the servers measured (``on_gpu``: False in a rehearsal, whose servers capture
    no decode graphs)."""
    return [*check_capture(results, on_gpu), *check_tokens(results, on_gpu), *check_syncs(results), *check_itl(results)]


def checks_step(smoke: Smoke) -> list[Line]:
    """(a)-(d) from what the servers measured; a check whose measurements are missing says so."""
    (smoke.out / "measurements.json").write_text(json.dumps(smoke.results, indent=1))
    return checks(smoke.results, on_gpu=not smoke.rehearsal)


# --- the other steps -----------------------------------------------------------------------------


def run_command(command: list[str], timeout: float, log: Path, env: Optional[dict] = None) -> tuple[int, str]:
    """Exit code and output of ``command`` (written to ``log`` too); 124 where it ran out of time."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = 124, f"{expired.stdout or ''}{expired.stderr or ''}\n(timed out after {timeout:.0f} s)"
        output = output if isinstance(output, str) else output.decode(errors="replace")
    log.write_text(output)
    return code, output


def imports_step(smoke: Smoke) -> list[Line]:
    report = smoke.work / "imports.json"
    # A CPU machine has no FlashInfer: the rehearsal imports our backend against tests/fake_flashinfer.py.
    fake = ["--fake-flashinfer"] if smoke.rehearsal else []
    command = [sys.executable, "tools/gpu_launch_imports.py", *fake, "--json", str(report)]
    code, output = run_command(command, smoke.budget.limit(120), smoke.work / "imports.log")
    if not report.exists():
        return [Line("imports", "FAIL", f"exit {code}: {output.strip().splitlines()[-1:]}")]
    result = json.loads(report.read_text())
    failed = [f"{item['module']} ({item['error']})" for item in result["imports"] if item["error"]]
    seconds = sum(item["seconds"] for item in result["imports"])
    detail = f"{len(result['imports'])} modules in {seconds:.1f} s; sgl_kernel {result['sgl_kernel']}; from {result['origins']}"
    if failed:
        return [Line("imports", "FAIL", f"{'; '.join(failed[:3])}; {detail}")]
    return [Line("imports", "PASS", detail)]


def model_config_folder(smoke: Smoke) -> Path:
    """SmolLM2's config and tokenizer: the kit's; a rehearsal without a kit (``make gpu-kit`` downloads
    the wheels) copies them from the bundled model as the kit's builder does."""
    if (KIT / "model").is_dir() or not smoke.rehearsal:
        return KIT / "model"
    repository_importable()
    from tools.gpu_kit import copy_model_config

    return copy_model_config(smoke.work / "model-config")


def model_step(smoke: Smoke) -> list[Line]:
    shape = REHEARSAL_SHAPE if smoke.rehearsal else None
    started = time.monotonic()
    source = model_config_folder(smoke)
    write_random_checkpoint(source, smoke.model, shape)
    config = json.loads((smoke.model / "config.json").read_text())
    smoke.vocab_size = config["vocab_size"]
    return [Line("model", "INFO", f"random bf16 weights, {config['num_hidden_layers']} layers x hidden {config['hidden_size']}, "
                                  f"written in {time.monotonic() - started:.1f} s; config and tokenizer from {source}")]  # fmt: skip


def kernel_tests_step(smoke: Smoke) -> list[Line]:
    if smoke.rehearsal:
        return [Line("(e) kernel tests", NOT_ON_CPU, "the kernels' GPU tests compile and run CUDA kernels")]
    # docs/gpu.md section 2's command, on several processes (pytest-xdist): compiling the kernels is CPU work.
    workers = str(min(8, os.cpu_count() or 1))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, "-m", "gpu", *GPU_TEST_FILES]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code, output = run_command(command, smoke.budget.limit(240), smoke.work / "kernel_tests.log", {**env, "KVEVICT_GPU_TESTS": "1"})
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), f"exit {code}")
    return [Line("(e) kernel tests", "PASS" if code == 0 else "FAIL", summary.strip("= "))]


def decode_step_command(smoke: Smoke) -> list[str]:
    """The short per-step run on this run's model with the servers' GPU flags; its report lands in ``$OUT``."""
    flags = [f"--server-arg={flag}" for flag in common_flags(smoke.rehearsal)]
    return [sys.executable, "-m", DECODE_STEP_BENCHMARK, "--quick", "--model", str(smoke.model), "--score", DECODE_STEP_SCORE,
            *flags, "--out", str(smoke.out), "--log-dir", str(smoke.work / "decode_step_logs")]  # fmt: skip


def decode_step_benchmark_step(smoke: Smoke) -> list[Line]:
    """Issue 38's slot: the per-step decode benchmark, once ``benchmarks/decode_step.py`` exists."""
    if importlib.util.find_spec(DECODE_STEP_BENCHMARK) is None:
        return [Line(DECODE_STEP_SLOT, "NOT RUN", f"{DECODE_STEP_BENCHMARK} is not present")]
    if smoke.budget.left() < DECODE_STEP_SECONDS:
        return [Line(DECODE_STEP_SLOT, "NOT RUN", f"{smoke.budget.left():.0f} s left of the budget, it needs {DECODE_STEP_SECONDS} s")]
    code, output = run_command(decode_step_command(smoke), smoke.budget.limit(DECODE_STEP_LIMIT_SECONDS), smoke.work / "decode_step.log")
    tail = " / ".join(output.strip().splitlines()[-3:])
    return [Line(DECODE_STEP_SLOT, "PASS" if code == 0 else "FAIL", f"exit {code}: {tail}")]


def evaluate_command(smoke: Smoke) -> list[str]:
    """``python -m sgl_kvevict.evaluate`` on this run's model with the servers' GPU flags, as small as it goes:
    stock and one candidate ranked by the window's attention (no learned weights fit the random model), one
    bundled document; its report lands in ``$OUT``. Mechanics only: a random model's answers mean nothing."""
    flags = [f"--server-arg={flag}" for flag in common_flags(smoke.rehearsal)]
    return [sys.executable, "-m", EVALUATE_COMMAND, "--model", str(smoke.model), "--bundled-documents", "1",
            "--policies", f"topk:{DECODE_STEP_SCORE}", "--budgets", "0.5", "--no-full", *flags,
            "--out", str(smoke.out), "--name", "evaluate_smoke", "--log-dir", str(smoke.work / "evaluate_logs")]  # fmt: skip


def evaluate_step(smoke: Smoke) -> list[Line]:
    """Issue 48's slot: the evaluate command runs end to end and prints, last, the flags it recommends or
    why there are none (``no recommendation: ...``: the smoke model's random weights answer no probe)."""
    if smoke.budget.left() < EVALUATE_SECONDS:
        return [Line(EVALUATE_SLOT, "NOT RUN", f"{smoke.budget.left():.0f} s left of the budget, it needs {EVALUATE_SECONDS} s")]
    code, output = run_command(evaluate_command(smoke), smoke.budget.limit(EVALUATE_LIMIT_SECONDS), smoke.work / "evaluate.log")
    last = output.strip().splitlines()[-1:]
    passed = code == 0 and bool(last) and last[0].startswith(("--kv-evict-policy", "no recommendation: "))
    return [Line(EVALUATE_SLOT, "PASS" if passed else "FAIL", f"exit {code}: {' / '.join(last)}")]


def measure_gemma3_turns(smoke: Smoke, server) -> dict:
    """Two turns of ``GEMMA3_CONVERSATIONS`` conversations, each turn's requests sent together: the first
    turn's prompts span several windows; the second turn's are the first's followed by as many new tokens
    (not the first answer, so that stock and ``full`` read the same prompts whatever they answered), reading
    the first prompt's node. Greedy tokens of both turns, the second turn's cached tokens, the pool's size."""
    work = smoke.workload
    first = [random_prompt(3000 + seed, work.gemma3_prompt, GEMMA3_SHAPE["vocab_size"]) for seed in range(GEMMA3_CONVERSATIONS)]
    second = [ids + random_prompt(4000 + seed, work.gemma3_prompt, GEMMA3_SHAPE["vocab_size"]) for seed, ids in enumerate(first)]
    replies = generate_together(server, first, work.gemma3_new_tokens)
    later = generate_together(server, second, work.gemma3_new_tokens)
    pool = SCHEDULER_MEMORY.search(server.log())
    return {"replies": [token_record(reply) for reply in replies + later], "pool_tokens": int(pool[1]) if pool else None,
            "cached_tokens": [reply["meta_info"].get("cached_tokens") for reply in later]}  # fmt: skip


def check_gemma3(results: dict) -> Line:
    """(f) from the two Gemma 3 servers' ``turns`` and ``full``'s ``/kvevict/stats``: PASS when ``full``
    decodes stock's tokens (up to near-ties), kept less than the compressed prompts' whole KV (the local
    layers' trim) and every second turn read cached tokens."""
    stock, full, stats = (results.get(name) for name in ("stock", "full", "stats"))
    if stock is None or full is None or stats is None:
        return Line(GEMMA3_SLOT, "NOT RUN", "no " + " / ".join(name for name, got in (("stock", stock), ("full", full), ("stats", stats)) if got is None))
    status, detail = compare_tokens(stock, full)
    tokens, per_slot = stats.get("compressed_tokens") or 0, stats.get("arena_cells_per_slot") or 0
    kept = stats["kept_cells"] / (tokens * per_slot) if tokens and per_slot else None
    reused = full["cached_tokens"]
    trimmed = kept is not None and kept < 1
    ok = status == "PASS" and trimmed and all(reused)
    return Line(GEMMA3_SLOT, "PASS" if ok else "FAIL", (
        f"full vs stock over two turns: {detail}; kept share {'none compressed' if kept is None else f'{kept:.2f}'} of "
        f"{tokens} compressed prompt tokens' KV; second turns' cached tokens {reused} (stock {stock['cached_tokens']}); "
        f"KV pool {full['pool_tokens']} tokens (stock {stock['pool_tokens']})"
    ))  # fmt: skip


def gemma3_step(smoke: Smoke) -> list[Line]:
    """(f): the Gemma 3-shaped model built, stock and ``full`` started one after the other with the servers'
    GPU flags (``full`` gets the launcher's ``--cuda-graph-backend-decode disabled``), each measured, stopped."""
    if smoke.budget.left() < GEMMA3_SECONDS:
        return [Line(GEMMA3_SLOT, "NOT RUN", f"{smoke.budget.left():.0f} s left of the budget, it needs {GEMMA3_SECONDS} s")]
    repository_importable()
    from sgl_kvevict.checkpoints import build_tiny_model

    model = smoke.work / "gemma3"
    if not (model / "config.json").exists():
        build_tiny_model(model, "gemma3", **GEMMA3_SHAPE)
    serving, results = serving_helpers(), {}
    deadline = time.monotonic() + smoke.budget.limit(GEMMA3_LIMIT_SECONDS)
    for name in ("stock", "full"):
        folder = smoke.work / f"gemma3-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        flags = ("--kv-evict-policy", "none" if name == "stock" else "full", *common_flags(smoke.rehearsal))
        with serving.running_server(model, folder, *flags, startup_timeout=max(10.0, deadline - time.monotonic())) as server:
            results[name] = measure_gemma3_turns(smoke, server)
            if name == "full":
                results["stats"] = get_json(server, "/kvevict/stats")
    return [check_gemma3(results)]


CHECKS_STEP = "checks (a)-(d)"
DECODE_STEP_SLOT = "decode step benchmark (issue 38)"
EVALUATE_SLOT = "evaluate (issue 48)"
GEMMA3_SLOT = "(f) Gemma 3 local layers"


def plan_steps(smoke: Smoke, install: Line) -> list[Step]:
    steps = [Step("install", lambda: [install], 0, starts_work=False), Step("imports", lambda: imports_step(smoke), 20, ("install",)),
             Step("model", lambda: model_step(smoke), 10, ("imports",))]  # fmt: skip
    # A plugin server runs even where stock did not start: its capture and stats are results of their own.
    steps += [Step(plan.name, lambda plan=plan: server_step(smoke, plan), 60, ("model",)) for plan in SERVER_PLANS]
    steps += [Step(CHECKS_STEP, lambda: checks_step(smoke), 0, starts_work=False),
              Step(GEMMA3_SLOT, lambda: gemma3_step(smoke), 0, ("imports",)),
              Step("(e) kernel tests", lambda: kernel_tests_step(smoke), 60, ("install",)),
              Step(DECODE_STEP_SLOT, lambda: decode_step_benchmark_step(smoke), 0, ("install",)),
              Step(EVALUATE_SLOT, lambda: evaluate_step(smoke), 0, ("model",))]  # fmt: skip
    return steps


def dry_steps(steps: list[Step]) -> list[Step]:
    """The same steps in the same order, those that start work only named: the report's structure
    (every check's line, the benchmark slot) without a server."""
    return [step if not step.starts_work else Step(step.name, lambda name=step.name: [Line(name, "NOT RUN", "dry run")], 0)
            for step in steps]  # fmt: skip


# --- the run -------------------------------------------------------------------------------------


def command_output(command: list[str]) -> str:
    """``command``'s output, stripped; empty where the program is missing or fails."""
    if shutil.which(command[0]) is None:
        return ""
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    return result.stdout.strip() if result.returncode == 0 else ""


def header(smoke: Smoke, mode: str) -> list[str]:
    manifest = json.loads((KIT / "manifest.json").read_text()) if (KIT / "manifest.json").exists() else {}
    lines = ["# GPU smoke run (tools/gpu_smoke.sh)", "",
             f"- mode: {mode}; budget {smoke.budget.left():.0f} s; tie margin {TIE_MARGIN}, logprob tolerance {LOGPROB_TOLERANCE}",
             f"- kit: built {manifest.get('built', '?')} from {manifest.get('commit', '?')}"]  # fmt: skip
    if mode != "dry run":
        gpu = command_output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        nvcc = command_output(["nvcc", "--version"]).splitlines()
        lines += [f"- GPU: {gpu or 'none'}", f"- nvcc (FlashInfer's JIT): {nvcc[-1] if nvcc else 'not on PATH'}",
                  f"- versions: {command_output([sys.executable, '-c', VERSIONS]) or 'unreadable'}"]  # fmt: skip
    return lines


VERSIONS = """
import importlib.metadata as m, sys
names = ("torch", "triton", "transformers", "sglang", "flashinfer-python", "apache-tvm-ffi", "xgrammar")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print(f"python {sys.version.split()[0]}, " + ", ".join(f"{n} {version(n)}" for n in names))
"""


def archive_logs(smoke: Smoke) -> None:
    """Every server log and step log in one file (a device run returns at most 8 files)."""
    with tarfile.open(smoke.out / "logs.tar.gz", "w:gz") as archive:
        for path in sorted(smoke.work.rglob("*.log")):
            archive.add(path, arcname=str(path.relative_to(smoke.work)))


def install_line(status: str) -> Line:
    """``--install`` from tools/gpu_smoke.sh: ``ok:<seconds>`` or ``failed:<why>``; absent: this venv."""
    if status.startswith("ok:"):
        return Line("install", "PASS", f"gpu-kit/ wheels and sgl-kvevict installed in {status[3:]} s")
    if status.startswith("failed:"):
        return Line("install", "FAIL", status[len("failed:") :])
    return Line("install", "INFO", f"not installed from the kit: {status}")


def on_sigterm(signum, frame) -> None:
    raise Interrupted()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-smoke-out")))
    parser.add_argument(
        "--budget", type=float,
        help=f"seconds for the whole run (default {DEFAULT_BUDGET_SECONDS}, rehearsal {REHEARSAL_BUDGET_SECONDS})",
    )  # fmt: skip
    parser.add_argument("--install", default="this venv", help="set by tools/gpu_smoke.sh: ok:<seconds> or failed:<why>")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rehearsal", action="store_true", help="on CPU: every step on a two-layer model")
    mode.add_argument("--dry-run", action="store_true", help="the report's structure only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("SMOKE_WORK", "/tmp/gpu-smoke-work"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    budget = Budget(args.budget if args.budget is not None else REHEARSAL_BUDGET_SECONDS if args.rehearsal else DEFAULT_BUDGET_SECONDS)
    smoke = Smoke(args.out, work, work / "model", REHEARSAL_WORKLOAD if args.rehearsal else GPU_WORKLOAD, args.rehearsal, budget)
    mode_name = "dry run" if args.dry_run else "rehearsal on CPU" if args.rehearsal else "GPU"
    report = Report(args.out / "gpu_smoke.md", header(smoke, mode_name))
    signal.signal(signal.SIGTERM, on_sigterm)
    steps = plan_steps(smoke, install_line(args.install))
    try:
        run_steps(dry_steps(steps) if args.dry_run else steps, report, smoke.budget)
    except Interrupted:
        report.add(Line("run", "FAIL", "stopped by the run's time limit"))
    finally:
        if not args.dry_run and not any(line.check.startswith("(a)") for line in report.lines):
            for line in checks_step(smoke):  # cut short before the checks: report what was measured
                report.add(line)
        archive_logs(smoke)
    counts = Counter(line.status for line in report.lines)
    progress(f"report: {report.path} ({len(report.lines)} lines: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + ")")
    return exit_code(report.lines)


if __name__ == "__main__":
    sys.exit(main())
