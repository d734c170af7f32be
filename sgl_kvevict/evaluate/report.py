"""The evaluation's figures from the servers' records, and its verdict.

Per server and length bucket: answers right against the document (or the user's references), equal
to ``full``'s and equal to stock's, kept share, speed against stock and against ``full``. ``full``
against stock is the numerics floor: what another code path's rounding changes with nothing evicted.
Per candidate: its kept answers (of the answers its ``full`` gets right, the share it gets right too)
and their lower bound, the verdict, the held-out check; then the recommendation (``fidelity.py``
says how). Where stock answers fewer than ``JUDGEABLE_ACCURACY`` of the probes right, the probes
cannot tell what eviction loses on this model and no candidate is recommended. Markdown and a plot.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional, Sequence

from sgl_kvevict.evaluate.fidelity import (
    FORMS, Candidate, Cell, Recommendation, answers_needed, bucket_order, document_correlation, exact, length_groups, recommend, token_f1,
)
from sgl_kvevict.evaluate.run import speed
from sgl_kvevict.measure.results import pyplot

SPEED_FIELDS = ("output_tokens_per_second", "itl_mean", "itl_median", "ttft_median", "hit_rate")
# Below this share of probes answered right by stock, a lost answer cannot be told from one the model
# never had: the report says the model cannot be judged on these probes.
JUDGEABLE_ACCURACY = 0.5


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _paired(server: dict, reference: dict) -> list[tuple[dict, dict]]:
    """(the server's answer, the reference's to the same question) for every question both answered."""
    theirs = {(a["document"], a["form"], a["index"]): a for a in reference["answers"]}
    return [(a, theirs[key]) for a in server["answers"] if (key := (a["document"], a["form"], a["index"])) in theirs]


def compare(server: dict, stock: dict, buckets: dict[str, str], reference: Optional[dict] = None) -> dict:
    """Per bucket (and ``all``) and form: answers equal to stock's (``matches``, ``exact``, ``f1``),
    equal to ``reference``'s (``full``'s: ``full_exact``), right (``accuracy``) and the probes' token
    F1 against the document (``document_f1``); and the kept share."""
    with_stock = _paired(server, stock)
    with_full = {(a["document"], a["form"], a["index"]): exact(a["text"], r["text"]) for a, r in _paired(server, reference)} if reference else {}
    cells: dict[str, dict] = {}
    for bucket in sorted(set(buckets.values()), key=bucket_order) + ["all"]:
        names = {d for d, b in buckets.items() if bucket == "all" or b == bucket}
        cell: dict = {"documents": len(names)}
        for form in FORMS:
            pairs = [(a, s) for a, s in with_stock if a["document"] in names and a["form"] == form]
            matches = [exact(a["text"], s["text"]) for a, s in pairs]
            cell[form] = {
                "n": len(pairs),
                "matches": sum(matches),
                "exact": _mean(map(float, matches)),
                "f1": _mean(token_f1(a["text"], s["text"]) for a, s in pairs),
                "full_exact": _mean(float(with_full[k]) for a, _ in pairs if (k := (a["document"], a["form"], a["index"])) in with_full),
                "accuracy": _mean(float(a["correct"]) for a, _ in pairs if a["correct"] is not None),
                "document_f1": _mean(a.get("document_f1") for a, _ in pairs),
            }
        cell["kept_share"] = _mean(d["kept_share"] for d in server["documents"] if d["document"] in names)
        cell["kept_share_global_layers"] = _mean(d.get("kept_share_global_layers") for d in server["documents"] if d["document"] in names)
        cells[bucket] = cell
    return cells


def is_judged(stock: dict) -> bool:
    """Every answer has a reference to be right or wrong against (probes, the user's answers, tasks)."""
    return bool(stock["answers"]) and all(a["correct"] is not None for a in stock["answers"])


def kept_by_document(server: dict, reference: dict, judged: bool) -> dict[str, dict[str, tuple[int, int]]]:
    """Per document and form: (kept, eligible). Judged: eligible are the answers ``reference`` gets
    right, kept those the server gets right too; else every answer, kept where equal to the reference's."""
    counts: dict[str, dict[str, list[int]]] = {}
    for answer, theirs in _paired(server, reference):
        cell = counts.setdefault(answer["document"], {f: [0, 0] for f in FORMS})[answer["form"]]
        if not judged:
            cell[0] += exact(answer["text"], theirs["text"])
            cell[1] += 1
        elif theirs["correct"]:
            cell[0] += bool(answer["correct"])
            cell[1] += 1
    return {d: {f: (c[0], c[1]) for f, c in forms.items()} for d, forms in counts.items()}


def right_by_document(server: dict) -> dict[str, dict[str, tuple[int, int]]]:
    """Per document and form: (answers right, answers)."""
    counts: dict[str, dict[str, list[int]]] = {}
    for answer in server["answers"]:
        cell = counts.setdefault(answer["document"], {f: [0, 0] for f in FORMS})[answer["form"]]
        cell[0] += bool(answer["correct"])
        cell[1] += 1
    return {d: {f: (c[0], c[1]) for f, c in forms.items()} for d, forms in counts.items()}


def correlation_over(counts: dict[str, dict[str, tuple[int, int]]], documents: set[str], forms: Sequence[str]) -> Optional[float]:
    return document_correlation([[counts[d][f] for d in sorted(counts) if d in documents] for f in forms])


def cells_of(counts: dict[str, dict[str, tuple[int, int]]], server: dict, buckets: dict[str, str], documents: set[str]) -> dict[str, Cell]:
    """Per bucket, the kept answers of ``counts`` over ``documents``, and the server's kept share there."""
    shares = {d["document"]: d["kept_share"] for d in server["documents"]}
    cells = {}
    for bucket in sorted({buckets[d] for d in documents}, key=bucket_order):
        names = [d for d in sorted(documents) if buckets[d] == bucket and d in counts]
        if not names:
            continue
        eligible = [d for d in names if any(counts[d][f][1] for f in FORMS)]
        share = _mean(shares.get(d) for d in names)
        cells[bucket] = Cell({f: sum(counts[d][f][0] for d in names) for f in FORMS}, {f: sum(counts[d][f][1] for d in names) for f in FORMS},
                             share, max(1, len(eligible)))  # fmt: skip
    return cells


def reference_of(server: dict, stock: dict, fulls: dict) -> dict:
    """What a candidate's loss is measured against: ``full`` of its scope, else stock."""
    return fulls.get(server.get("scope"), stock)


def analyse(servers: Sequence[dict], buckets: dict[str, str], holdout: set[str], min_kept: float, form: str, confidence: float) -> dict:
    """Per server its tables and speed; per candidate its kept answers, lower bound, verdict and
    held-out check; the numerics floor; the recommendation (calibrated on the documents not held out)."""
    stock = servers[0]
    fulls = {s["scope"]: s for s in servers if s["role"] == "full"}
    forms = FORMS if form == "both" else (form,)
    calibration = set(buckets) - holdout
    judged = is_judged(stock)
    for server in servers:
        server["fidelity"] = compare(server, stock, buckets, reference_of(server, stock, fulls) if server["role"] == "candidate" else None)
        server["speed"] = speed(server["answers"])
        full = fulls.get(server.get("scope"))
        server["vs_stock"] = _ratios(server["speed"], stock["speed"])
        server["vs_full"] = _ratios(server["speed"], full["speed"]) if full is not None and server["role"] == "candidate" else None
    stock_right = right_by_document(stock) if judged else None
    stock_rho = correlation_over(stock_right, calibration, forms) if judged else None
    # The length groups from stock's answers alone, so that no candidate's answers decide them.
    groups = length_groups(_effective_answers(stock, stock_right, buckets, calibration, 1.0 if stock_rho is None else stock_rho), answers_needed(min_kept, confidence))
    candidates, rows = [], {}
    for server in (s for s in servers if s["role"] == "candidate"):
        reference = reference_of(server, stock, fulls)
        counts = kept_by_document(server, reference, judged)
        own = correlation_over(counts, calibration, forms)
        theirs = correlation_over(right_by_document(reference), calibration, forms) if judged else None
        rho = max((r for r in (own, theirs) if r is not None), default=1.0)
        candidate = Candidate(server["label"], tuple(server["family"]), server["knob"], server["value"], tuple(server["recommend_flags"]),
                              cells_of(counts, server, buckets, calibration), rho)  # fmt: skip
        held = Cell.merged(list(cells_of(counts, server, buckets, holdout).values())) if holdout else None
        candidates.append(candidate)
        everywhere = candidate.over(list(candidate.cells))
        rows[server["label"]] = {
            "reference": reference["label"], "rho": rho, "rho_own": own, "rho_reference": theirs,
            "kept_answers": None if everywhere is None else everywhere.measured(form),
            "bound": None if everywhere is None else everywhere.bound(form, rho, confidence),
            "held_out": None if held is None else held.measured(form),
        }  # fmt: skip
    numerics = numerics_floor(servers, judged)
    stock_accuracy = numerics["stock_accuracy"]
    cannot_judge = judged and (stock_accuracy is None or stock_accuracy < JUDGEABLE_ACCURACY)
    recommendation = recommend(candidates, groups, min_kept, form, confidence,
                               held_out=(lambda c: rows[c.label]["held_out"]) if holdout else None,
                               overall=lambda c: rows[c.label]["bound"])  # fmt: skip
    for verdict in recommendation.verdicts:
        rows[verdict.candidate.label] |= {"bounds": verdict.bounds, "passes": verdict.passes}
        if verdict.candidate.label in recommendation.checks:
            rows[verdict.candidate.label]["held_out_holds"] = recommendation.checks[verdict.candidate.label][1]
    result = recommendation_json(recommendation, None if cannot_judge else recommendation.chosen, holdout)
    result |= {"judged": judged, "cannot_judge": cannot_judge, "stock_rho": stock_rho}
    return {"recommendation": result, "candidates": rows, "numerics": numerics}


def _effective_answers(stock: dict, right: Optional[dict], buckets: dict[str, str], documents: set[str], rho: float) -> dict[str, float]:
    """Per bucket, the answers a candidate is judged on there (stock's right ones where judged; the
    fewer form's), divided by the design effect of ``rho``."""
    counts = right if right is not None else {d: {f: (n, n) for f, (_, n) in forms.items()} for d, forms in right_by_document(stock).items()}
    answers = {}
    for bucket in {buckets[d] for d in documents}:
        names = [d for d in documents if buckets[d] == bucket and d in counts]
        per_form = [sum(counts[d][f][0] for d in names) for f in FORMS]
        fewer = min(per_form)
        per_document = fewer / max(1, len(names))
        answers[bucket] = fewer / (1 + max(0.0, per_document - 1) * rho)
    return answers


def numerics_floor(servers: Sequence[dict], judged: bool) -> dict:
    """What rounding alone changes: each ``full``'s answers equal to stock's, and stock's and each
    ``full``'s answers right (the lower form's)."""
    def right(server: dict) -> Optional[float]:
        values = [v for f in FORMS if (v := server["fidelity"]["all"][f]["accuracy"]) is not None]
        return min(values) if values and judged else None

    stock = servers[0]
    fulls = [s for s in servers if s["role"] == "full"]
    return {"stock_accuracy": right(stock),
            "full": {s["label"]: {"equal_to_stock": {f: s["fidelity"]["all"][f]["exact"] for f in FORMS}, "accuracy": right(s)} for s in fulls}}  # fmt: skip


def _ratios(mine: dict, base: dict) -> dict:
    return {f: (mine[f] / base[f] if mine.get(f) is not None and base.get(f) else None) for f in SPEED_FIELDS}


def recommendation_json(recommendation: Recommendation, chosen: Optional[Candidate], holdout: set[str]) -> dict:
    """``chosen``: the recommendation's pick, or None where the model cannot be judged."""
    groups = recommendation.groups
    return {
        "min_kept": recommendation.min_kept,
        "confidence": recommendation.confidence,
        "form": recommendation.form,
        "groups": {label: list(buckets) for label, buckets in groups.items()},
        "answers_needed": None if recommendation.needed == float("inf") else recommendation.needed,
        "order": [v.candidate.label for v in recommendation.verdicts],
        "chosen": None if chosen is None else chosen.label,
        "flags": None if chosen is None else list(chosen.flags),
        "knob": None if chosen is None else chosen.knob,
        "bounds": None if chosen is None else recommendation.verdict_of(chosen.label).bounds,
        "kept_share": None if chosen is None else {label: chosen.over(g).kept_share for label, g in groups.items() if chosen.over(g)},
        "held_out_documents": sorted(holdout),
        "rejected_by_held_out": [label for label, (_, holds) in recommendation.checks.items() if not holds],
    }


# ---- markdown and plot -----------------------------------------------------------------------------


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"x{value:.2f}"


def fidelity_rows(servers: Sequence[dict]) -> list[str]:
    buckets = [b for b in servers[0]["fidelity"] if b != "all"] + ["all"]
    lines = ["| server | length | docs | kept share | right (multi-request / multi-turn) | probes' F1 to the document | equal to full's | equal to stock's |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    pair = lambda cell, key: " / ".join(_fmt(cell[f][key]) for f in FORMS)  # noqa: E731
    for server in servers:
        for bucket in buckets:
            cell = server["fidelity"].get(bucket)
            if cell is None:
                continue
            n = "/".join(str(cell[f]["n"]) for f in FORMS)
            share = _fmt(cell["kept_share"])
            if cell.get("kept_share_global_layers") is not None:  # local layers keep their window whatever the budget
                share += f" (global layers {_fmt(cell['kept_share_global_layers'])})"
            lines.append(f"| {server['label']} | {bucket} | {cell['documents']} | {share} | {pair(cell, 'accuracy')} "
                         f"| {pair(cell, 'document_f1')} | {pair(cell, 'full_exact')} | {pair(cell, 'exact')} (n={n}) |")  # fmt: skip
    return lines


def speed_rows(servers: Sequence[dict]) -> list[str]:
    lines = ["| server | output tok/s | ITL mean (ms) | ITL median (ms) | TTFT median (s) | hit rate | tok/s vs stock | ITL vs stock | tok/s vs full | ITL vs full |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for server in servers:
        s, vs, vf = server["speed"], server["vs_stock"], server["vs_full"] or {}
        ms = lambda v: None if v is None else 1000 * v  # noqa: E731
        lines.append(f"| {server['label']} | {_fmt(s['output_tokens_per_second'], 1)} | {_fmt(ms(s['itl_mean']), 1)} | {_fmt(ms(s['itl_median']), 1)} "
                     f"| {_fmt(s['ttft_median'])} | {_fmt(s['hit_rate'])} | {_ratio(vs['output_tokens_per_second'])} | {_ratio(vs['itl_mean'])} "
                     f"| {_ratio(vf.get('output_tokens_per_second'))} | {_ratio(vf.get('itl_mean'))} |")  # fmt: skip
    return lines


def numerics_lines(payload: dict) -> list[str]:
    """The numerics floor, first: ``full`` against stock, and both against the document."""
    numerics, servers = payload["analysis"]["numerics"], payload["servers"]
    commands = payload["meta"].get("sglang_argv") or {}
    lines = [f"- `{label}` runs SGLang with `{' '.join(argv)}`" for label, argv in commands.items()]
    right = numerics["stock_accuracy"]
    for label, row in numerics["full"].items():
        equal = " / ".join(_fmt(row["equal_to_stock"][f]) for f in FORMS)
        lines.append(f"- **{label}** (nothing evicted) answers as stock on {equal} of the questions (multi-request / multi-turn): "
                     "what the two code paths' rounding changes, which no eviction budget can remove"
                     + (f"; right against the document: stock {_fmt(right)}, {label} {_fmt(row['accuracy'])}" if right is not None else ""))  # fmt: skip
    if not numerics["full"]:
        lines.append(f"- no `full` served (--no-full): candidates are measured against stock, rounding included ({len(servers) - 1} servers)")
    return lines


def recommendation_lines(analysis: dict, dense_flags: Sequence[str]) -> list[str]:
    rec, rows = analysis["recommendation"], analysis["candidates"]
    target, confidence = rec["min_kept"], rec["confidence"]
    measured_as = ("of the answers its `full` gets right against the document, the share it gets right too" if rec["judged"]
                   else "the share of answers equal to its `full`'s (no reference answers to judge them by)")  # fmt: skip
    needed = rec["answers_needed"]
    lines = [f"Kept answers: {measured_as}; the verdict reads their one-sided {confidence:.0%} lower bound (Clopper-Pearson on effective "
             "counts: answers divided by the design effect 1 + (m - 1) x rho, m answers per document, rho the larger of the candidate's "
             "own intraclass correlation and its reference's), the lower form's (" + rec["form"] + "), in every length group "
             + (f"(buckets joined until each has {needed} effective answers, the fewest whose bound can reach {target:g})." if needed else
                f"(no finite sample can show {target:g})."), ""]  # fmt: skip
    lines += ["| candidate | reference | rho | kept answers | lower bound | " + " | ".join(f"bound {g}" for g in rec["groups"])
              + " | >= target | held out | check |", "|---|---|---|---|---|" + "---|" * len(rec["groups"]) + "---|---|---|"]  # fmt: skip
    for label in rec["order"]:
        row = rows[label]
        check = {True: "holds", False: "fails"}.get(row.get("held_out_holds"), "-")
        lines.append(f"| {label} | {row['reference']} | {_fmt(row['rho'])} | {_fmt(row['kept_answers'])} | {_fmt(row['bound'])} | "
                     + " | ".join(_fmt(row["bounds"].get(g)) for g in rec["groups"])
                     + f" | {'yes' if row['passes'] else 'no'} | {_fmt(row['held_out'])} | {check} |")  # fmt: skip
    lines.append("")
    lines += [f"- **{line}**" for line in verdict_lines(analysis, dense_flags)]
    return lines


def verdict_lines(analysis: dict, dense_flags: Sequence[str]) -> list[str]:
    """The recommendation in words: the pick, or why there is none."""
    rec, rows = analysis["recommendation"], analysis["candidates"]
    target = rec["min_kept"]
    if rec["cannot_judge"]:
        return [f"cannot judge: stock answers {_fmt(analysis['numerics']['stock_accuracy'])} of these probes right (under "
                f"{JUDGEABLE_ACCURACY:g}), so a lost answer cannot be told from one the model never had; no budget is recommended. "
                "Use questions this model answers from the document (a JSONL file with answers), or a larger model"]  # fmt: skip
    rejected = [f"{label} (kept {_fmt(rows[label]['held_out'])} on the held-out documents, under its bound {_fmt(rows[label]['bound'])})"
                for label in rec["rejected_by_held_out"]]  # fmt: skip
    said = [f"not recommended after the held-out check: {', '.join(rejected)}"] if rejected else []
    if rec["chosen"] is None:
        return said + [f"no candidate's lower bound reaches {target:g} in every length group" + (" with its held-out check holding" if rejected else "")
                       + f": serve dense (`{' '.join(dense_flags)}`), try larger budgets or lower thresholds, or a lower --min-kept"]  # fmt: skip
    row = rows[rec["chosen"]]
    shares = ", ".join(f"{g} {_fmt(v)}" for g, v in rec["kept_share"].items())
    held = (f"; held out ({len(rec['held_out_documents'])} documents): kept {_fmt(row['held_out'])} >= bound {_fmt(row['bound'])}"
            if rec["held_out_documents"] else "; no document held out: the bound is unchecked (--holdout 0.5 checks it)")  # fmt: skip
    return said + [f"recommended: {rec['chosen']}, lower bound {_fmt(row['bound'])} >= {target:g} of `full`'s right answers kept "
                   f"(measured {_fmt(row['kept_answers'])}); kept share {shares}{held}"]  # fmt: skip


def measured_lines(servers: Sequence[dict], env: dict) -> list[str]:
    """A line naming the commit each server ran on, where any differs from the report's (``--resume``)."""
    def code(on: dict) -> str:
        return f"{on['git_commit']}{' (uncommitted changes)' if on.get('git_worktree_dirty') else ''}"

    here = code(env)
    runs: dict[str, list[dict]] = {}
    for server in servers:
        runs.setdefault(code(server["measured_on"]) if server.get("measured_on") else here, []).append(server)
    if set(runs) == {here}:
        return []
    described = [f"{', '.join(s['label'] for s in ran)}: sgl-kvevict {commit}"
                 + (f" ({ran[0]['measured_on']['date']})" if ran[0].get("measured_on") else "") for commit, ran in runs.items()]  # fmt: skip
    return ["", f"Measured on: {'; '.join(described)}. The report's analysis is sgl-kvevict {here}'s (`--resume` keeps measured servers)."]


def markdown(payload: dict) -> str:
    meta, servers, env = payload["meta"], payload["servers"], payload["environment"]
    config = meta["config"]
    lines = [
        "# Before production: what eviction costs your answers", "",
        f"`{meta['command']}`", "",
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, sgl-kvevict "
        f"{env['git_commit'] or env['sgl_kvevict']}, {env['date']}. Model `{config['model']}` ({meta.get('prompts', 'chat')} prompts), every "
        f"server at --max-total-tokens {config['pool_tokens']}; {len(payload['documents'])} documents ({payload['source']}), "
        f"{sum(s['seconds'] for s in servers) / 60:.1f} min of servers.",
        *measured_lines(servers, env), *([""] + [f"- {note}" for note in meta.get("notes", [])] if meta.get("notes") else []),
        "", "## Numerics: `full` against stock", "",
        *numerics_lines(payload), "",
        "## Answers", "",
        "Right: against the document's own words (a probe's answer says them for as long as it runs) or the user's reference answers; "
        "multi-request: each question in a new request right after the document; multi-turn: each question in a later turn after the "
        "summary and the earlier questions. Kept share = KV slots the document's conversation holds after turn 1 over the tokens "
        "stock holds dense.", "",
        *fidelity_rows(servers), "",
        "## Recommendation", "",
        *recommendation_lines(payload["analysis"], config["dense_flags"]), "",
        f"![kept answers vs kept share]({meta['name']}.png)", "",
        "## Speed (one request at a time)", "",
        *speed_rows(servers), "",
        "## Documents", "",
        "| document | tokens | bucket | held out |", "|---|---|---|---|",
        *[f"| {d['name']} | {d['tokens']} | {d['bucket']} | {'yes' if d['held_out'] else ''} |" for d in payload["documents"]],
    ]  # fmt: skip
    if payload["skipped"]:
        lines += ["", "Skipped: " + "; ".join(payload["skipped"])]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    """Each candidate's kept answers (measured, and its lower bound below) against its kept share."""
    plt = pyplot()
    analysis = payload["analysis"]
    rows, target = analysis["candidates"], analysis["recommendation"]["min_kept"]
    fig, axis = plt.subplots(figsize=(6.4, 4.2))
    for server in (s for s in payload["servers"] if s["role"] == "candidate"):
        row, share = rows[server["label"]], server["fidelity"]["all"]["kept_share"]
        if row["kept_answers"] is None or share is None:
            continue
        axis.errorbar(share, row["kept_answers"], yerr=[[row["kept_answers"] - (row["bound"] or 0)], [0]], fmt="o", capsize=3)
        axis.annotate(server["label"], (share, row["kept_answers"]), fontsize=7, alpha=0.8)
        if row["held_out"] is not None:
            axis.scatter(share, row["held_out"], marker="x", color="black", s=24)
    axis.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    axis.set_xlabel("kept share (KV held / dense)")
    axis.set_ylabel("kept answers (of full's right ones)")
    axis.set_title("o measured on the calibration documents, bar down to its lower bound; x held out", fontsize=8)
    axis.set_xlim(0, 1.05)
    axis.set_ylim(-0.03, 1.03)
    axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
