"""The evaluation's figures from the servers' records: per candidate and length bucket, fidelity to
stock in both question forms (exact and F1), accuracy where references are given, kept share, speed
against stock and against ``full``; the recommendation with its held-out check; markdown and plot."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Optional, Sequence

from sgl_kvevict.evaluate.fidelity import (
    FORMS, Candidate, Cell, Recommendation, bucket_of, bucket_order, document_correlation, exact, recommend, token_f1,
)
from sgl_kvevict.evaluate.run import speed
from sgl_kvevict.measure.results import pyplot

SPEED_FIELDS = ("output_tokens_per_second", "itl_mean", "itl_median", "ttft_median", "hit_rate")
# The prediction's interval: documents drawn with replacement this many times, the central share kept.
BOOTSTRAP_DRAWS = 2000
INTERVAL_LEVEL = 0.9


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def compare(server: dict, stock: dict, buckets: dict[str, str], documents: Optional[set[str]] = None) -> dict:
    """Per bucket (and ``all``): per form the exact-match and F1 fidelity to stock, accuracy, kept share;
    over the documents ``documents`` (None: all)."""
    paired = _paired(server, stock)
    chosen = lambda name: documents is None or name in documents  # noqa: E731
    cells: dict[str, dict] = {}
    for bucket in sorted(set(buckets.values()), key=bucket_order) + ["all"]:
        names = {d for d, b in buckets.items() if (bucket == "all" or b == bucket) and chosen(d)}
        if not names:
            continue
        cell: dict = {"documents": len(names)}
        for form in FORMS:
            pairs = [(a, s) for a, s in paired if a["document"] in names and a["form"] == form]
            judged = [a["correct"] for a, _ in pairs if a["correct"] is not None]
            matches = [exact(a["text"], s["text"]) for a, s in pairs]
            cell[form] = {
                "n": len(pairs),
                "matches": sum(matches),
                "exact": _mean(map(float, matches)),
                "f1": _mean(token_f1(a["text"], s["text"]) for a, s in pairs),
                "accuracy": _mean(map(float, judged)),
            }
        cell["kept_share"] = _mean(d["kept_share"] for d in server["documents"] if d["document"] in names)
        cells[bucket] = cell
    return cells


def _paired(server: dict, stock: dict) -> list[tuple[dict, dict]]:
    """(the server's answer, stock's to the same question) for every question both answered."""
    reference = {(a["document"], a["form"], a["index"]): a for a in stock["answers"]}
    return [(a, reference[key]) for a in server["answers"] if (key := (a["document"], a["form"], a["index"])) in reference]


def _matches_by_document(server: dict, stock: dict, documents: set[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """Per document and form: (answers equal to stock's, answers compared)."""
    counts = {d: {f: [0, 0] for f in FORMS} for d in documents}
    for answer, stocks in _paired(server, stock):
        if answer["document"] in counts:
            cell = counts[answer["document"]][answer["form"]]
            cell[0] += exact(answer["text"], stocks["text"])
            cell[1] += 1
    return {d: {f: (c[0], c[1]) for f, c in forms.items()} for d, forms in counts.items()}


def document_interval(server: dict, stock: dict, documents: set[str], form: str, seed: int = 0) -> Optional[tuple[float, float]]:
    """The ``INTERVAL_LEVEL`` bootstrap interval of the fidelity ``form`` reads over ``documents``, drawing
    whole documents (answers on one document are not independent: a document the model copies badly
    fails most of its probes, so the documents, not the answers, are the sample)."""
    counts = _matches_by_document(server, stock, documents)
    names = sorted(d for d in counts if any(n for _, n in counts[d].values()))
    if not names:
        return None
    forms = FORMS if form == "both" else (form,)
    rng, values = random.Random(seed), []
    for _ in range(BOOTSTRAP_DRAWS):
        drawn = [counts[rng.choice(names)] for _ in names]
        rates = [sum(d[f][0] for d in drawn) / n for f in forms if (n := sum(d[f][1] for d in drawn))]
        values.append(min(rates))
    values.sort()
    tail = (1 - INTERVAL_LEVEL) / 2
    return values[int(tail * (len(values) - 1))], values[int((1 - tail) * (len(values) - 1))]


def analyse(servers: Sequence[dict], buckets: dict[str, str], holdout: set[str], min_fidelity: float, form: str) -> dict:
    """Fidelity tables (all documents, the calibration ones, the held-out ones), speed ratios, and the
    recommendation among the candidates (calibrated on the documents not held out)."""
    stock = servers[0]
    calibration = set(buckets) - holdout
    fulls = {s["scope"]: s for s in servers if s["role"] == "full"}
    for server in servers:
        server["fidelity"] = compare(server, stock, buckets)
        server["fidelity_calibration"] = compare(server, stock, buckets, calibration) if holdout else None
        server["fidelity_holdout"] = compare(server, stock, buckets, holdout) if holdout else None
        server["speed"] = speed(server["answers"])
        full = fulls.get(server.get("scope"))
        server["vs_stock"] = _ratios(server["speed"], stock["speed"])
        server["vs_full"] = _ratios(server["speed"], full["speed"]) if full is not None and server["role"] == "candidate" else None
    candidate_servers = [server for server in servers if server["role"] == "candidate"]
    candidates = [_candidate(server, "fidelity_calibration" if holdout else "fidelity") for server in candidate_servers]
    calibration_buckets = {buckets[d] for d in calibration}
    estimate = calibration_correlation(candidate_servers, stock, calibration, form)
    correlation = 1.0 if estimate is None else estimate
    recommendation = recommend(candidates, calibration_buckets, min_fidelity, form, correlation)
    held_out = held_out_by_server(servers, stock, calibration, form, correlation) if holdout else None
    result = recommendation_json(recommendation, servers, holdout, held_out, form)
    result["correlation_estimated"] = estimate is not None
    return {"recommendation": result, "held_out_by_server": held_out}


def calibration_correlation(candidates: Sequence[dict], stock: dict, calibration: set[str], form: str) -> Optional[float]:
    """The intraclass correlation of the candidates' answers on the calibration documents, in the forms
    ``form`` reads (None: not estimable, e.g. no miss)."""
    forms = FORMS if form == "both" else (form,)
    counts = [_matches_by_document(server, stock, calibration) for server in candidates]
    return document_correlation([[by_document[d][f] for d in sorted(by_document)] for by_document in counts for f in forms])


def _cell(cell: dict) -> Cell:
    """``compare``'s cell as the recommendation reads it."""
    return Cell({f: cell[f]["matches"] for f in FORMS}, {f: cell[f]["n"] for f in FORMS}, cell["kept_share"], cell["documents"])


def held_out_by_server(servers: Sequence[dict], stock: dict, calibration: set[str], form: str, correlation: float) -> dict:
    """Per server, over all lengths: the fidelity the calibration documents predict (the expected
    fidelity the recommendation reads, with the run's ``correlation``), the bootstrap interval of the
    fidelity measured on those documents, and the fidelity measured on the held-out documents (the
    recommendation's check, for every candidate)."""
    rows = {}
    for server in servers[1:]:
        calibrated = _cell(server["fidelity_calibration"]["all"])
        predicted, measured = calibrated.reads(form, correlation), _cell(server["fidelity_holdout"]["all"]).measured(form)
        rows[server["label"]] = {"predicted": predicted, "calibration": calibrated.measured(form), "measured": measured,
                                 "interval": document_interval(server, stock, calibration, form),
                                 "difference": None if predicted is None or measured is None else measured - predicted}  # fmt: skip
    return rows


def _ratios(mine: dict, base: dict) -> dict:
    return {f: (mine[f] / base[f] if mine.get(f) is not None and base.get(f) else None) for f in SPEED_FIELDS}


def _candidate(server: dict, table: str) -> Candidate:
    cells = {bucket: _cell(cell) for bucket, cell in (server[table] or {}).items() if bucket != "all"}
    return Candidate(server["label"], tuple(server["family"]), server["knob"], server["value"], tuple(server["recommend_flags"]), cells)


def _group_check(recommendation: Recommendation, label: str, candidate: Candidate, servers: Sequence[dict], holdout: set[str], form: str) -> dict:
    """A length group's pick: the fidelity its calibration answers predict there and, with held-out
    documents, the share measured on the held-out documents of that group."""
    group = recommendation.groups[label]
    check = {"candidate": candidate.label, "predicted": candidate.over(group).reads(form, recommendation.correlation)}
    if holdout:
        held = _candidate(next(s for s in servers if s["label"] == candidate.label), "fidelity_holdout").over(group)
        check |= {"held_out": None if held is None else held.measured(form), "held_out_documents": 0 if held is None else held.documents}
    return check


def recommendation_json(recommendation: Recommendation, servers: Sequence[dict], holdout: set[str], held_out: Optional[dict], form: str) -> dict:
    """``held_out``: ``held_out_by_server``'s rows for the documents ``holdout`` (None: none held out)."""
    chosen = recommendation.chosen
    result = {
        "min_fidelity": recommendation.min_fidelity,
        "form": form,
        "chosen": None if chosen is None else chosen.label,
        "flags": None if chosen is None else list(chosen.flags),
        "knob": None if chosen is None else chosen.knob,
        "predicted": recommendation.predicted,
        "kept_share": recommendation.kept_share,
        "per_bucket": {b: (c.label if c else None) for b, c in recommendation.per_bucket.items()},
        "per_bucket_check": {b: _group_check(recommendation, b, c, servers, holdout, form) for b, c in recommendation.per_bucket.items() if c},
        "answers_needed": recommendation.needed if recommendation.needed != float("inf") else None,
        "correlation": recommendation.correlation,
        "held_out": None,
    }
    if chosen is not None and held_out:
        server = next(s for s in servers if s["label"] == chosen.label)
        measured = {b: _cell(c).measured(form) for b, c in server["fidelity_holdout"].items()}
        row = held_out[chosen.label]
        result["held_out"] = {
            "documents": sorted(holdout),
            "measured": measured,
            "predicted_all": row["predicted"],
            "calibration_all": row["calibration"],
            "interval_all": row["interval"],
            "difference_all": row["difference"],
        }
    return result


# ---- markdown and plot -----------------------------------------------------------------------------


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"x{value:.2f}"


def fidelity_rows(servers: Sequence[dict], table: str = "fidelity") -> list[str]:
    buckets = [b for b in servers[0][table] if b != "all"] + ["all"]
    lines = ["| server | length | docs | kept share | multi-request exact / F1 | multi-turn exact / F1 | accuracy (multi-request, multi-turn) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for server in servers:
        for bucket in buckets:
            cell = (server[table] or {}).get(bucket)
            if cell is None:
                continue
            forms = [f"{_fmt(cell[f]['exact'])} / {_fmt(cell[f]['f1'])} (n={cell[f]['n']})" for f in FORMS]
            accuracy = ", ".join(_fmt(cell[f]["accuracy"]) for f in FORMS)
            lines.append(f"| {server['label']} | {bucket} | {cell['documents']} | {_fmt(cell['kept_share'])} | {forms[0]} | {forms[1]} | {accuracy} |")
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


def recommendation_lines(result: dict, dense_flags: Sequence[str]) -> list[str]:
    rec = result["recommendation"]
    needed = rec.get("answers_needed")
    lines = [f"Expected fidelity = (answers equal to stock's + 1) / (answers + 2) per form, the lower form read ({rec['form']}), "
             f"on effective counts: divided by the design effect 1 + (m - 1) x rho, m answers per document, {_correlation_text(rec)}; "
             + (f"length buckets joined until each has {needed} effective answers per form, the fewest whose expected fidelity can reach "
                f"{rec['min_fidelity']:g}." if needed is not None else f"no finite sample can show {rec['min_fidelity']:g}."), ""]  # fmt: skip
    for bucket, label in rec["per_bucket"].items():
        check = rec["per_bucket_check"].get(bucket)
        held = "" if check is None or "held_out" not in check else (
            f"; held out: {_fmt(check['held_out'])} over {_documents(check['held_out_documents'])}" if check["held_out_documents"] else "; no held-out document there")
        said = label if check is None else f"{label} (predicted {_fmt(check['predicted'])}{held})"
        lines.append(f"- {bucket}: the most evicting candidate with expected fidelity >= {rec['min_fidelity']:g}: {said or 'none'}")
    if rec["chosen"] is None:
        lines.append(f"- no candidate meets expected fidelity >= {rec['min_fidelity']:g} in every length group: serve dense (`{' '.join(dense_flags)}`), "
                     "or try larger budgets / lower thresholds, or a lower --min-fidelity")  # fmt: skip
        return lines
    predicted = ", ".join(f"{b} {_fmt(v)}" for b, v in rec["predicted"].items())
    shares = ", ".join(f"{b} {_fmt(v)}" for b, v in rec["kept_share"].items())
    lines.append(f"- chosen: **{rec['chosen']}**, predicted fidelity {predicted}; kept share {shares}"
                 + (" (a threshold keeps what the scores earn: the kept share is measured, not a budget)" if rec["knob"] == "threshold" else ""))  # fmt: skip
    held = rec["held_out"]
    if held:
        measured = ", ".join(f"{b} {_fmt(v)}" for b, v in held["measured"].items())
        interval = held.get("interval_all")
        interval = "" if interval is None else f" [{_fmt(interval[0])}, {_fmt(interval[1])}]"
        lines.append(f"- held out ({len(held['documents'])} documents): measured fidelity {measured}; predicted (all calibration "
                     f"documents) {_fmt(held['predicted_all'])}, measured there {_fmt(held.get('calibration_all'))}{interval}, "
                     f"difference {_fmt(held['difference_all'])}")  # fmt: skip
    return lines


def _documents(count: int) -> str:
    return f"{count} document{'' if count == 1 else 's'}"


def _correlation_text(rec: dict) -> str:
    """How the analysis got rho: estimated, or 1 for want of a miss."""
    if rec["correlation_estimated"]:
        return f"rho = {rec['correlation']:.2f}, how alike the answers on one document are (intraclass correlation of the calibration answers)"
    return "rho = 1: the calibration answers hold no miss to estimate it from, so each document counts as one answer"


def held_out_rows(analysis: dict) -> list[str]:
    rows = analysis.get("held_out_by_server")
    if not rows:
        return []
    form = analysis["recommendation"]["form"]
    lines = [f"Held-out check, every server (read as the recommendation reads it: {form}; all lengths; predicted: the expected "
             "fidelity of the calibration documents' effective answers; measured: the share equal to stock's; the interval: the measured share's "
             f"{INTERVAL_LEVEL:.0%} over {BOOTSTRAP_DRAWS} draws of the calibration documents with replacement):", "",
             "| server | predicted (calibration documents) | measured there | interval | measured (held-out documents) | difference |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label, row in rows.items():
        interval = "-" if row.get("interval") is None else f"[{_fmt(row['interval'][0])}, {_fmt(row['interval'][1])}]"
        lines.append(f"| {label} | {_fmt(row['predicted'])} | {_fmt(row.get('calibration'))} | {interval} | {_fmt(row['measured'])} "
                     f"| {_fmt(row['difference'])} |")  # fmt: skip
    return lines + [""]


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
        "# Before production: fidelity to stock on your documents", "",
        f"`{meta['command']}`", "",
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, GPU: {env['gpu']}. SGLang {env['sglang']}, sgl-kvevict "
        f"{env['git_commit'] or env['sgl_kvevict']}, {env['date']}. Model `{config['model']}`, every server at --max-total-tokens "
        f"{config['pool_tokens']}; {len(payload['documents'])} documents ({payload['source']}), {sum(s['seconds'] for s in servers) / 60:.1f} min of servers.",
        *measured_lines(servers, env),
        "",
        "Fidelity = share of answers equal to stock's after normalisation (exact) and their token F1; multi-request: each "
        "question in a new request right after the document; multi-turn: each question in a later turn after the summary "
        "and the earlier questions; with held-out documents the recommendation is calibrated on the others. Kept share = KV slots the document's conversation holds after turn 1 over the tokens "
        "stock holds dense.", "",
        *fidelity_rows(servers), "",
        "## Speed (one request at a time)", "",
        *speed_rows(servers), "",
        "## Recommendation", "",
        *recommendation_lines(payload["analysis"], config["dense_flags"]), "",
        *held_out_rows(payload["analysis"]),
        f"![fidelity vs kept share]({meta['name']}.png)", "",
        "## Documents", "",
        "| document | tokens | bucket | held out |", "|---|---|---|---|",
        *[f"| {d['name']} | {d['tokens']} | {d['bucket']} | {'yes' if d['held_out'] else ''} |" for d in payload["documents"]],
    ]  # fmt: skip
    if payload["skipped"]:
        lines += ["", "Skipped: " + "; ".join(payload["skipped"])]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    """Fidelity (the lower form) against kept share, one panel per length bucket, one point per candidate."""
    plt = pyplot()
    servers = [s for s in payload["servers"] if s["role"] != "stock"]
    buckets = [b for b in payload["servers"][0]["fidelity"] if b != "all"]
    fig, axes = plt.subplots(1, max(1, len(buckets)), figsize=(4.2 * max(1, len(buckets)), 3.8), squeeze=False)
    target = payload["analysis"]["recommendation"]["min_fidelity"]
    for axis, bucket in zip(axes[0], buckets):
        for server in servers:
            cell = server["fidelity"].get(bucket)
            if cell is None:
                continue
            for form, marker in zip(FORMS, ("o", "s")):
                share = 1.0 if cell["kept_share"] is None else cell["kept_share"]
                if cell[form]["exact"] is not None:
                    axis.scatter(share, cell[form]["exact"], marker=marker, s=28)
                    axis.annotate(server["label"], (share, cell[form]["exact"]), fontsize=6, alpha=0.7)
        axis.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        axis.set_title(f"{bucket} tokens (o multi-request, s multi-turn)", fontsize=8)
        axis.set_xlabel("kept share")
        axis.set_ylabel("fidelity to stock (exact)")
        axis.set_xlim(0, 1.05)
        axis.set_ylim(-0.03, 1.03)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


