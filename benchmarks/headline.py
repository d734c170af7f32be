"""The README's headline: one table, one row per workload, every figure read from the results JSON the
row cites (``docs/results/<name>.json``; its page ``<name>.md`` holds the machine, the command and the
caveats).

    python -m benchmarks.headline                    # print the table
    python -m benchmarks.headline --write README.md  # replace the README's generated headline
    python -m benchmarks.headline --check README.md  # exit 1 if it is stale

Columns: what eviction buys (the policy against ``full``, the plugin's path with nothing evicted, in the
same run and scope: the ratio that carries over to a GPU), what the plugin's path costs or buys against
stock SGLang (``full`` / stock), the answers measured beside (or why none were), and the machine. A
figure is a stored value rounded, or 100x one (a percentage) or one of them /100 (a percentage as a
share); ``tests/test_results_readme.py`` holds every number of a row to the JSON it cites. Standard
library only, so it runs without the CPU environment.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from sgl_kvevict.generated_section import GeneratedSection
from sgl_kvevict.generated_section import main as section_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
COMMAND = "python -m benchmarks.headline"
NO_FULL = "no `full`; "
NOT_IN_RUN = "-"
HEADER = (
    "| workload (results page) | what eviction buys: policy / `full` | `full` / stock | answers beside | machine |",
    "| --- | --- | --- | --- | --- |",
)

Cells = tuple[str, str, str, str]  # workload, policy / full, full / stock, answers


def _x(value: float) -> str:
    return f"×{value:.2f}"


def _ratio(report: dict, comparison: str, pool: Optional[str] = None) -> dict:
    """The ``ratios`` row of ``comparison`` (and ``pool``, for a multi-turn run)."""
    for row in report["ratios"]:
        if row["comparison"] == comparison and (pool is None or row["pool"] == pool):
            return row
    raise KeyError(f"no ratio {comparison!r} (pool {pool}) in the report")


def _run(report: dict, label: str, pool: Optional[str] = None) -> dict:
    return next(run for run in report["runs"] if run["label"] == label and (pool is None or run["pool"] == pool))


def _server(report: dict, label: str) -> dict:
    return next(server for server in report["servers"] if server["label"] == label)


def sglang_client(report: dict, again: bool = False) -> Cells:
    w, pool = report["meta"]["workload"], report["meta"]["pool_tokens"]
    policy, full = _ratio(report, "topk:learned@0.25 block / full block"), _ratio(report, "full block / vanilla")
    hit = {run["label"]: run["cache_report"]["cache_hit_rate_pct"] / 100 for run in report["runs"]}
    workload = (
        "the same on another CPU" if again else f"SGLang's own client: {w['groups']} x {w['prompts_per_group']} chats "
        f"on {w['system_prompt_tokens']}-token shared prompts, pool {pool}"
    )
    return (
        workload,
        f"output tok/s **{_x(policy['output_throughput'])}**, ITL mean {_x(policy['mean_itl_ms'])}",
        _x(full["output_throughput"]),
        f"not scored; hit rate {hit['topk:learned@0.25 block']:.2f} (stock {hit['vanilla']:.2f})",
    )


def sweep(report: dict, pool: str = "0.50") -> Cells:
    c, tokens = report["meta"]["conversations"], _ratio(report, "full / vanilla", pool)["pool_tokens"]
    facts = {label: _run(report, label, pool)["metrics"] for label in ("vanilla", "topk:learned@0.25")}
    return (
        f"{c['users']} users x {c['turns']} turns on ~{c['document_tokens']}-token documents, pool {pool} of the "
        f"histories ({tokens} tokens)",
        f"output tok/s **{_x(_ratio(report, 'topk:learned@0.25 / full', pool)['output_tokens_per_second'])}**",
        _x(_ratio(report, "full / vanilla", pool)["output_tokens_per_second"]),
        _facts(facts["topk:learned@0.25"], facts["vanilla"]),
    )


def _facts(policy: dict, stock: dict) -> str:
    return f"facts {policy['fact_correct']}/{policy['fact_questions']}, stock {stock['fact_correct']}/{stock['fact_questions']}"


def decode_step(report: dict, batch: str = "8") -> Cells:
    steps, cfg, profile = report["summary"]["steps"], report["meta"]["config"], report["summary"]["profile"]
    scopes = ("block", "request")
    gain = " / ".join(_x(steps[f"default-{scope}"][batch]["vs"]["keep-99"]["median"]) for scope in scopes)
    attention = " / ".join(_x(profile[f"default-{scope}"]["attention_vs_keep_all"]["median"]) for scope in scopes)
    return (
        f"one decode step, batch {batch} on {cfg['prompt_tokens']}-token documents, block / request scope",
        f"step tok/s **{gain}** of keep-99's (99% kept), attention {attention}",
        _x(steps["full"][batch]["vs"]["stock"]["median"]),
        "not scored",
    )


def engine_overhead(report: dict) -> Cells:
    ratio, memory = report["attribution"], report["policy"]["memory_per_conversation"]
    return (
        f"one stream over a compressed {memory['compressed_tokens']}-token prompt",
        f"decode tok/s **{_x(ratio['policy_vs_full']['decode_tokens_per_second'])}**, prefill TTFT "
        f"{_x(ratio['policy_vs_full']['prefill_ttft'])}; KV held {memory['compressed_ratio']:.3f} of dense",
        f"decode {_x(ratio['full_vs_vanilla']['decode_tokens_per_second'])}",
        "not scored",
    )


def gemma3(report: dict, model: str = "a Gemma-3-shaped random model") -> Cells:
    c, pool = report["meta"]["conversations"], report["meta"]["pools"][0]["tokens"]
    memory = next(m for m in report["local_layers"]["memory"] if m["server"] == "full")
    same = " and ".join(
        f"{a['identical']}/{a['compared']}" for a in report["local_layers"]["answers"] if a["server"].startswith("full")
    )  # `full`'s, request / block scope
    speed = " / ".join(_x(_ratio(report, f"{label} / vanilla")["output_tokens_per_second"]) for label in ("full", "full block 1024"))
    return (
        f"{model}, {c['users']} users x {c['turns']} turns, pool {pool}",
        f"`full` keeps a window in local layers: KV {memory['kept_fraction']:.2f} of stock's",
        f"output tok/s **{speed}** (request / block scope)",
        f"{same} identical to stock's (fp32)",
    )


def reuse_quality(report: dict) -> Cells:
    config = report["meta"]["config"]
    stock, policy = (_server(report, label)["summary"] for label in ("vanilla", "topk:learned@0.25"))
    a = policy["accuracy"]
    return (
        f"{config['samples']} questions on a reused ~{config['document_tokens']}-token document, after a summary turn",
        f"{NO_FULL}turn-2 TTFT {policy['turn2_ttft_median']:.2f} s (stock {stock['turn2_ttft_median']:.2f} s)",
        NOT_IN_RUN,
        f"**{a['value'] * 100:.0f}% [{a['ci95'][0] * 100:.0f}, {a['ci95'][1] * 100:.0f}]**, stock {stock['accuracy']['value'] * 100:.0f}%",
    )


def long_documents(report: dict) -> Cells:
    config, default = report["meta"]["config"], _server(report, "default")
    lengths = [str(n) for n in config["lengths"]]
    asked = "in a new request" if config.get("questions") == "new-request" else "in a later turn after a summary"
    kept = " / ".join(f"{default['summary'][n]['kept_share_mean']:.2f}" for n in lengths)
    return (
        f"{config['documents']} documents of {' / '.join(lengths)} tokens, each question {asked}",
        f"{NO_FULL}KV kept {kept}",
        NOT_IN_RUN,
        "**" + " / ".join(_x(default["vs_stock"][n]) for n in lengths) + "** stock's accuracy",
    )


def longest_prompt(report: dict) -> Cells:
    pool = max(report["meta"]["pool_sizes"])
    served = {run["vanilla"]: run["limit"] for run in report["runs"] if run["pool_tokens"] == pool}
    return (
        f"the longest prompt a pool of {pool} tokens serves",
        f"{NO_FULL}**{served[False]} tokens** (stock {served[True]})",
        NOT_IN_RUN,
        "not scored",
    )


@dataclass(frozen=True)
class Row:
    """One row: ``source`` names the JSON and its page (``docs/results/<source>.json``, ``.md``); ``machine``
    what the JSON does not record about the machine."""

    source: str
    render: Callable[[dict], Cells]
    machine: str = ""

    def report(self, results: Path = RESULTS) -> dict:
        return json.loads((results / f"{self.source}.json").read_text())


ROWS = (
    Row("sglang_client", sglang_client),
    Row("sglang_client_amx", partial(sglang_client, again=True), machine="with AMX"),
    Row("sweep", sweep),
    Row("decode_step", decode_step),
    Row("engine_overhead", engine_overhead),
    Row("gemma3_270m_local_layers", partial(gemma3, model="Gemma 3 270M (real weights)")),
    Row("reuse_quality_kernel", reuse_quality),
    Row("long_documents_new_request", long_documents),
    Row("long_documents", long_documents),
    Row("longest_prompt", longest_prompt),
)


def environment(report: dict) -> dict:
    return report.get("environment") or report["meta"]["environment"]


def machine(report: dict, note: str = "") -> str:
    """``AMD EPYC, 2 cores``: the CPU's name (and AMX, where the report has its flags) and cores, from the
    report's environment."""
    env = environment(report)
    cpu = re.sub(r"\((R|TM)\)| Processor.*$| CPU.*$", "", env["cpu_model"]).strip()
    amx = (report["meta"].get("cpu_flags") or {}).get("amx_bf16")
    notes = [n for n in (note, {True: "with AMX", False: "no AMX"}.get(amx, "")) if n]
    return f"{cpu}, {env['cpu_cores']} cores" + "".join(f", {n}" for n in dict.fromkeys(notes))


def row_line(row: Row, results: Path = RESULTS) -> str:
    report = row.report(results)
    workload, policy, full, answers = row.render(report)
    cells = (f"[{workload}](docs/results/{row.source}.md)", policy, full, answers, machine(report, row.machine))
    return "| " + " | ".join(cells) + " |"


def render(results: Path = RESULTS) -> str:
    return "\n".join([*HEADER, *(row_line(row, results) for row in ROWS)])


SECTION = GeneratedSection("headline", COMMAND, render)


def main(argv: Optional[list[str]] = None) -> int:
    return section_main([SECTION], argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
