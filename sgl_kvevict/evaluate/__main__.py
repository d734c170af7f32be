"""What does eviction cost my answers? Serve the documents with stock SGLang, with `full` (the plugin
with nothing evicted) and with each candidate at the same --max-total-tokens, judge every answer, and
print the flags to start the server with.

    python -m sgl_kvevict.evaluate --model /models/Llama-3.1-8B-Instruct --documents my_docs/ --holdout 0.5
    python -m sgl_kvevict.evaluate --model smollm2                            # the bundled task set
    python -m sgl_kvevict.evaluate --documents qa.jsonl --budgets 0.2,0.3,0.5 --scopes request,block
    python -m sgl_kvevict.evaluate --thresholds=-3,-4,-5 --server-arg=--kv-evict-learned-weights=/models/KVzap-mlp-Llama-3.1-8B
    python -m sgl_kvevict.evaluate --url "stock=http://127.0.0.1:30000" --url "0.25=http://127.0.0.1:30001"
    python -m sgl_kvevict.evaluate ... --resume                              # after an interruption

Documents: a folder of .txt/.md files, or a JSONL file of {"document", "questions", "answers"} (questions
and answers optional); none: the bundled task set (--bundled-documents of 2-5K tokens, with reference
answers). Without questions, each document gets --questions-per-document probes whose answer is in
the document (continue a quoted sentence; name the sentence that follows one). Each question is asked
in two forms: in a new request right after the document (multi-request) and in a later turn of the
conversation, after a summary and the earlier questions (multi-turn). A model without a chat template
(a base model) is asked through the completions API, its BOS first. A document longer than the
context is skipped with a line saying so. Stock is started with the SGLang flags that decide the
plugin's numerics (attention backend, prefill chunk, page size, graphs, dtype), so `full` against
stock shows what rounding alone changes; the report prints that first.

Every answer is judged against the document (or the reference answers), against `full` and against
stock. A candidate's kept answers: of the answers its `full` gets right, the share it gets right too
(without references: the share equal to `full`'s). The verdict is their one-sided --confidence lower
bound, with the document as the unit (effective counts: answers on one document count less the more
alike they are), in every length group (buckets joined until each can show --min-kept). The
recommendation: of the candidates whose bound reaches --min-kept, the one keeping the least KV; with
--holdout, a share of the documents is kept out of the calibration, and a candidate whose kept answers
there fall under its bound is not recommended (the next is checked). Where stock answers fewer than
half the probes right, the model cannot be judged on them and nothing is recommended. The last line
is the flags to use, or why there are none. Writes <name>.json (every answer), <name>.md and <name>.png
into --out. docs/before-production.md explains the report and what it cannot see.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from sgl_kvevict.evaluate.fidelity import FIDELITY_FORMS, bucket_of
from sgl_kvevict.evaluate.inputs import InputError, bundled_documents, read_documents, with_questions
from sgl_kvevict.evaluate.report import analyse, markdown, plot, verdict_lines
from sgl_kvevict.evaluate.run import CompletionPrompts, Prompts, prompts_for, run_documents
from sgl_kvevict.measure.results import environment, write_result_files
from sgl_kvevict.measure.servers import (
    SCOPES, ServerError, ServerVariant, check_launcher_accepts, check_model_takes, launched_server, sglang_argv,
)
from sgl_kvevict.server.sglang_args import numerics_args

PROG = "python -m sgl_kvevict.evaluate"
DEFAULT_POLICIES = "topk:learned"
DEFAULT_BUDGETS = "0.25,0.4,0.6"
DEFAULT_SCOPES = "block"
STOCK = "stock"
DENSE_FLAGS = ("--kv-evict-policy", "none")
# The flags are checked before the documents are read and the pool is known: with a pool any prompt fits.
PROVISIONAL_POOL = 1 << 20
QUESTION_ROOM = 48
# The scores a --thresholds candidate is made for: KVzap's usage, log-space question-agnostic scores.
THRESHOLD_SCORES = ("learned", "kvzip")
# The default candidates' score where the model has no learned weights: KVzip's, question-agnostic too,
# which needs none (it reconstructs the context from the KV to score it).
NO_WEIGHTS_POLICIES = "topk:kvzip"


class EvaluateError(ValueError):
    """A bad setting; the message is the one line the command prints before it exits with 2."""


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``error: ...``) and exit 2, as the command's other refusals."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    description, _, epilog = __doc__.partition("\n\n")
    parser = OneLineParser(prog=PROG, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2", help="bundled model name or HF model folder, as the launcher takes it (default smollm2)")
    add("--documents", type=Path, help="a folder of .txt/.md files or a JSONL file of {document, questions[, answers]} (default: the bundled task set)")
    add("--bundled-documents", type=int, default=6, help="without --documents: how many bundled documents, 2K/3.5K/5K tokens cycled (default 6)")
    add("--questions-per-document", type=int, default=3, help="probes made per document that has no questions (default 3)")
    add("--policies", help=f"candidate policies name[:score], comma-separated, e.g. topk:learned,lava:learned,ada-snapkv:attn (default {DEFAULT_POLICIES}; "
        f"{NO_WEIGHTS_POLICIES} for a model without learned-score weights, bundled or given)")
    add("--budgets", default=DEFAULT_BUDGETS, help=f"candidate budgets, comma-separated (default {DEFAULT_BUDGETS}; empty: none)")
    add("--scopes", default=DEFAULT_SCOPES, help=f"candidate scopes, comma-separated: request, block (default {DEFAULT_SCOPES})")
    add("--block-size", type=int, help="block scope's --kv-evict-block-size for `full` and the candidates (default: the launcher's; Gemma 3 saves in local layers only with blocks longer than their window)")
    add("--thresholds", default="", help="KVzap-style score thresholds (--kv-evict-score-threshold), comma-separated, for the policies with a learned or kvzip score, e.g. -3,-4,-5 (default none)")
    add("--threshold-cap", default="0.99", help="the budget that caps a threshold candidate (default 0.99: the threshold decides)")
    add("--learned-weights", help="the learned score's weights for the candidates with score learned: a train_scorer .safetensors or a KVzap checkpoint folder (default: the bundled ones for the model)")
    add("--candidate", action="append", default=[], metavar="LABEL=FLAGS", help="a further candidate: its label and launcher flags (repeatable)")
    add("--no-full", action="store_true", help="do not serve `full` (the plugin with nothing evicted) in each scope")
    add("--server-arg", action="append", default=[], metavar="FLAG", help="a launcher/SGLang flag for every server, e.g. --server-arg=--dtype=float32 (repeatable)")
    add("--max-total-tokens", type=int, help="every server's KV pool (default: the longest conversation + 512, rounded up to 1024)")
    add("--url", action="append", default=[], metavar="LABEL=URL [FLAGS]", help="a running server instead of starting one: 'stock=URL' first, then candidates, each optionally with the eviction flags it was started with (default: read from /kvevict/stats) (repeatable)")
    add("--api-key", help="with --url: the key the running servers take")
    add("--min-kept", type=float, default=0.9, help="the lower bound of kept answers (of full's right answers, the share a candidate gets right too) a recommendation must reach in every length group (default 0.9; at --confidence 0.9 that needs 22 effective answers per form, 0.95 needs 45)")
    add("--confidence", type=float, default=0.9, help="the one-sided confidence of the lower bound (default 0.9)")
    add("--form", default="both", choices=FIDELITY_FORMS, help="which question form the verdict reads; both: the lower of the two (default both)")
    add("--holdout", type=float, default=0.0, help="share of the documents kept out of the calibration; a pick whose kept answers there fall under its lower bound is not recommended (default 0: none)")
    add("--summary-tokens", type=int, default=32, help="turn 1's summary cap (default 32)")
    add("--answer-tokens", type=int, default=32, help="each answer's cap (default 32)")
    add("--seed", type=int, default=0, help="probe and bundled-document seed (default 0)")
    add("--out", type=Path, default=Path("evaluate-results"), help="output folder (default ./evaluate-results)")
    add("--name", default="evaluate", help="output file stem (default evaluate)")
    add("--log-dir", type=Path, help="server logs (default: a new temporary folder)")
    add("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start (default 900)")
    add("--resume", action="store_true", help="keep the servers already measured in <out>/<name>.json (same configuration)")
    return parser


# ---- the servers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """label; role: stock, full or candidate; flags: its launcher flags; url: a running one; family and
    knob/value: what the recommendation compares (candidates)."""

    label: str
    role: str
    flags: tuple[str, ...]
    scope: Optional[str] = None
    url: Optional[str] = None
    knob: Optional[str] = None
    value: Optional[float] = None

    @property
    def variant(self) -> ServerVariant:
        return ServerVariant.from_flags(self.label, self.flags)

    @property
    def family(self) -> tuple[str, ...]:
        """The flags but the knob's, and the knob: budgets and thresholds of one policy are two families
        (a threshold candidate's budget is its cap, not its knob)."""
        return (*_without(self.flags, ("--kv-evict-budget", "--kv-evict-score-threshold")), f"knob={self.knob}")

    def as_json(self) -> dict:
        return {"label": self.label, "role": self.role, "flags": list(self.flags), "scope": self.scope, "url": self.url,
                "knob": self.knob, "value": self.value, "family": list(self.family), "recommend_flags": list(self.flags)}  # fmt: skip


def _without(flags: Sequence[str], names: Sequence[str]) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        elif not any(flag.startswith(name + "=") for name in names):
            out.append(flag)
    return out


def _value(flags: Sequence[str], name: str) -> Optional[str]:
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def candidate(label: str, flags: Sequence[str]) -> Server:
    """A candidate from its launcher flags: a threshold candidate's knob is its threshold, else its budget."""
    flags = tuple(flags)
    threshold, budget = _value(flags, "--kv-evict-score-threshold"), _value(flags, "--kv-evict-budget")
    scope = _value(flags, "--kv-evict-scope") or "request"
    if threshold is not None:
        return Server(label, "candidate", flags, scope, knob="threshold", value=float(threshold))
    if budget is None or budget.endswith("t"):
        raise EvaluateError(f"candidate {label!r}: give it a ratio --kv-evict-budget (or a --kv-evict-score-threshold) to compare")
    return Server(label, "candidate", flags, scope, knob="budget", value=float(budget.rstrip("%")) / (100 if budget.endswith("%") else 1))


def scope_flags(scope: str, block_size: Optional[int]) -> list[str]:
    """``--kv-evict-scope`` and, in block scope, ``--kv-evict-block-size`` where one is given."""
    return ["--kv-evict-scope", scope] + (["--kv-evict-block-size", str(block_size)] if scope == "block" and block_size else [])


def policy_flags(policy: str, scope: str, learned_weights: Optional[str], block_size: Optional[int] = None) -> list[str]:
    """A candidate's flags but its knob; the learned score's weights where it has that score."""
    name, _, score = policy.partition(":")
    weights = ["--kv-evict-learned-weights", learned_weights] if score == "learned" and learned_weights else []
    return ["--kv-evict-policy", name] + (["--kv-evict-score", score] if score else []) + scope_flags(scope, block_size) + weights


def lineup(args: argparse.Namespace) -> list[Server]:
    """Stock, ``full`` per scope, then every candidate (started here), or the ``--url`` servers."""
    if args.url:
        return url_lineup(args.url)
    scopes = _split(args.scopes)
    if not scopes or any(s not in SCOPES for s in scopes):
        raise EvaluateError(f"--scopes {args.scopes!r}: choose from {', '.join(SCOPES)}")
    policies, budgets, thresholds = _split(args.policies or DEFAULT_POLICIES), _split(args.budgets), _split(args.thresholds)
    servers = [Server(STOCK, "stock", DENSE_FLAGS)]
    if not args.no_full:
        servers += [Server(f"full {scope}", "full", ("--kv-evict-policy", "full", *scope_flags(scope, args.block_size)), scope) for scope in scopes]
    for scope in scopes:
        for policy in policies:
            for budget in budgets:
                servers.append(candidate(f"{policy}@{budget} {scope}", [*policy_flags(policy, scope, args.learned_weights, args.block_size), "--kv-evict-budget", budget]))
            for threshold in thresholds if policy.partition(":")[2] in THRESHOLD_SCORES else ():
                _float(threshold, "--thresholds")
                servers.append(candidate(f"{policy} threshold {threshold} {scope}",
                                         [*policy_flags(policy, scope, args.learned_weights, args.block_size), "--kv-evict-score-threshold", threshold, "--kv-evict-budget", args.threshold_cap]))  # fmt: skip
    for spec in args.candidate:
        label, sep, flags = spec.partition("=")
        if not sep or not label.strip():
            raise EvaluateError(f"--candidate {spec!r}: expected LABEL=FLAGS")
        servers.append(candidate(label.strip(), shlex.split(flags)))
    if len(servers) == 1 + (0 if args.no_full else len(scopes)):
        raise EvaluateError("no candidate to evaluate: give --budgets, --thresholds or --candidate")
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise EvaluateError(f"two servers with the same label: {labels}")
    return servers


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise EvaluateError(f"{flag}: {text!r} is not a number") from None


def url_lineup(specs: Sequence[str]) -> list[Server]:
    servers = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        words = shlex.split(rest)
        if not sep or not words or not words[0].startswith(("http://", "https://")):
            raise EvaluateError(f"--url {spec!r}: expected LABEL=URL [FLAGS]")
        url, flags = words[0].rstrip("/"), tuple(words[1:])
        if not servers:
            if label.strip() != STOCK:
                raise EvaluateError("--url: the first server must be stock=URL (answers are compared with stock's)")
            servers.append(Server(STOCK, "stock", DENSE_FLAGS, url=url))
        elif _value(flags, "--kv-evict-policy") == "full":
            servers.append(Server(label.strip(), "full", flags, _value(flags, "--kv-evict-scope") or "request", url=url))
        else:
            servers.append(Server(label.strip(), "pending", flags, url=url))
    return servers


def described(server: Server, stats: Optional[dict]) -> Server:
    """A ``--url`` server given without flags: its flags from ``/kvevict/stats``'s configuration."""
    if server.role != "pending":
        return server
    flags = list(server.flags)
    if not flags:
        if not stats or "policy" not in stats:
            raise ServerError(f"{server.label}: {server.url} reports no /kvevict/stats policy; give its flags after the URL")
        flags = ["--kv-evict-policy", stats["policy"], "--kv-evict-scope", stats.get("scope") or "request"]
        flags += ["--kv-evict-score", stats["score"]] if stats.get("score") else []
        flags += ["--kv-evict-budget", stats["budget"]] if stats.get("budget") else []
    if _value(flags, "--kv-evict-policy") == "full":
        return Server(server.label, "full", tuple(flags), _value(flags, "--kv-evict-scope") or "request", url=server.url)
    made = candidate(server.label, flags)
    return Server(made.label, made.role, made.flags, made.scope, server.url, made.knob, made.value)


# ---- documents -------------------------------------------------------------------------------------


def load_documents(args: argparse.Namespace, prompts: Prompts) -> tuple[list, list[str], str]:
    """The documents that fit the context (with their questions), the lines of those skipped, the source."""
    from sgl_kvevict.measure.chat import model_context_length, model_token_counter

    if args.documents is None:
        documents, source = bundled_documents(args.bundled_documents, model_token_counter(args.model), args.seed), "the bundled task set"
    else:
        documents, source = read_documents(args.documents), str(args.documents)
    documents = [with_questions(d, args.questions_per_document, args.seed * 7919 + i) for i, d in enumerate(documents)]
    context = model_context_length(args.model)
    kept, skipped = [], []
    for document in documents:
        if not document.questions:
            skipped.append(f"{document.name}: no sentence to make a probe of and no questions")
            continue
        tokens = prompts.tokens(prompts.first(document))
        need = conversation_tokens(tokens, len(document.questions), args)
        limit = min(context, args.max_total_tokens or context)
        if need > limit:
            skipped.append(f"{document.name}: {tokens} tokens, {need} with its questions and answers, longer than the context ({limit} tokens)")
            continue
        kept.append((document, tokens))
    return kept, skipped, source


def conversation_tokens(document_tokens: int, questions: int, args: argparse.Namespace) -> int:
    """The multi-turn conversation's last prompt: the document, the summary, every question and answer."""
    return document_tokens + args.summary_tokens + questions * (QUESTION_ROOM + args.answer_tokens)


def held_out(names_by_length: Sequence[str], share: float) -> set[str]:
    """Every 1/share-th document in length order (so each length has documents on both sides)."""
    return {name for i, name in enumerate(names_by_length) if int((i + 1) * share) > int(i * share)}


# ---- running ---------------------------------------------------------------------------------------


def measure(server: Server, args: argparse.Namespace, prompts: Prompts, documents: list, pool: int, log_dir: Path, log: Callable[[str], None]) -> dict:
    """The server's records over every document; started and stopped here unless it is a ``--url`` one."""
    import aiohttp

    from sgl_kvevict.measure.client import STATS_PATH, get_json

    async def stats_of(url: str) -> Optional[dict]:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        async with aiohttp.ClientSession(headers=headers) as session:
            return await get_json(session, url + STATS_PATH)

    def records(url: str) -> dict:
        return asyncio.run(run_documents(url, prompts, [d for d, _ in documents], args.summary_tokens, args.answer_tokens, log, args.api_key))

    started = time.perf_counter()
    if server.url is not None:
        server = described(server, asyncio.run(stats_of(server.url)))
        result = records(server.url)
    else:
        extra = tuple(args.server_arg)
        with launched_server(args.model, server.variant, pool, log_dir, extra=extra, startup_timeout=args.startup_timeout) as running:
            log(f"  serving on {running.base_url} ({time.perf_counter() - started:.0f} s to start)")
            result = records(running.base_url)
    return server.as_json() | result | {"seconds": time.perf_counter() - started, "measured_on": measured_on(environment())}


def measured_on(env: dict) -> dict:
    """What a server's answers were measured with, kept with them: a ``--resume`` may analyse them with
    later code, and its page then says on which commit each server ran."""
    return {key: env.get(key) for key in ("git_commit", "git_worktree_dirty", "date")}


def configuration(args: argparse.Namespace, documents: list, pool: int, servers: Sequence[Server]) -> dict:
    digest = hashlib.sha256(json.dumps([[d.name, d.text, [q.text for q in d.questions]] for d, _ in documents]).encode()).hexdigest()[:16]
    return {"model": args.model, "documents_sha256": digest, "pool_tokens": pool, "summary_tokens": args.summary_tokens,
            "answer_tokens": args.answer_tokens, "server_args": list(args.server_arg), "dense_flags": list(DENSE_FLAGS),
            "stock_flags": list(servers[0].flags), "servers": [s.label for s in servers]}  # fmt: skip


def resumed(path: Path, config: dict) -> dict[str, dict]:
    if not path.exists():
        raise EvaluateError(f"--resume: {path} does not exist")
    previous = json.loads(path.read_text())
    mine = {k: v for k, v in config.items() if k != "servers"}
    theirs = {k: v for k, v in previous["meta"]["config"].items() if k != "servers"}
    if mine != theirs:
        raise EvaluateError(f"--resume: {path} is of another configuration (model, documents, pool or answer caps differ)")
    return {server["label"]: server | {"measured_on": server.get("measured_on") or measured_on(previous["environment"])} for server in previous["servers"]}


def progress(message: str) -> None:
    print(message, flush=True)


def preflight(servers: Sequence[Server], args: argparse.Namespace, pool: int, model: bool) -> None:
    """The launcher's own refusals for every server to start (no model read), or with ``model`` the
    model's too (its architecture, the learned score's weights): before any server starts."""
    extra = tuple(args.server_arg)
    for server in (s for s in servers if s.url is None):
        try:
            (check_model_takes if model else check_launcher_accepts)(args.model, server.variant, pool, extra)
        except ServerError as error:
            raise ServerError(str(error).replace(server.variant.label, repr(server.label))) from None


def has_learned_weights(args: argparse.Namespace) -> bool:
    """Whether the learned score has weights for the model: given, or bundled for its fingerprint."""
    from sgl_kvevict.models import resolve_model
    from sgl_kvevict.scoring.learned import bundled_weights_for
    from sgl_kvevict.settings import ConfigError

    if args.learned_weights or any(a.startswith("--kv-evict-learned-weights") for a in args.server_arg):
        return True
    try:
        bundled_weights_for(resolve_model(args.model, log=progress))
    except ConfigError:
        return False
    return True


def with_stock_numerics(servers: list[Server], args: argparse.Namespace, pool: int, cpu_mode: bool) -> list[Server]:
    """Stock started with the SGLang flags that decide the first plugin server's numerics (its attention
    backend, prefill chunk, page size, graph settings, dtype), where stock is started here and the user
    did not set them for every server."""
    stock, plugin = servers[0], next((s for s in servers[1:] if s.url is None), None)
    if stock.url is not None or plugin is None:
        return servers
    numerics = numerics_args(sglang_argv(args.model, plugin.variant, pool, tuple(args.server_arg), cpu_mode))
    given = {a.split("=", 1)[0] for a in args.server_arg}
    added = [item for flag, value in zip(numerics[::2], numerics[1::2]) if flag not in given for item in (flag, value)]
    return [Server(STOCK, "stock", (*DENSE_FLAGS, *added)), *servers[1:]]


def command_lines(servers: Sequence[Server], args: argparse.Namespace, pool: int, cpu_mode: bool) -> dict[str, list[str]]:
    """The SGLang flags of stock and of the first plugin server started here, for the report's header."""
    return {s.label: sglang_argv(args.model, s.variant, pool, tuple(args.server_arg), cpu_mode) for s in servers[:2] if s.url is None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    try:
        if not 0 < args.min_kept < 1:
            raise EvaluateError(f"--min-kept {args.min_kept}: must be in (0, 1) (no finite sample shows 1)")
        if not 0 < args.confidence < 1:
            raise EvaluateError(f"--confidence {args.confidence}: must be in (0, 1)")
        if not 0 <= args.holdout < 1:
            raise EvaluateError(f"--holdout {args.holdout}: must be in [0, 1)")
        if min(args.bundled_documents, args.questions_per_document, args.summary_tokens, args.answer_tokens) < 1:
            raise EvaluateError("--bundled-documents, --questions-per-document, --summary-tokens and --answer-tokens must be >= 1")
        servers = lineup(args)
        preflight(servers, args, args.max_total_tokens or PROVISIONAL_POOL, model=False)  # before the model is read
        notes = []
        if args.policies is None and not args.url and not has_learned_weights(args):
            args.policies = NO_WEIGHTS_POLICIES
            notes.append(f"the learned score has no weights for this model (none bundled, none given): the default candidates are {NO_WEIGHTS_POLICIES}")
            progress(notes[-1])
            servers = lineup(args)
        preflight(servers, args, args.max_total_tokens or PROVISIONAL_POOL, model=True)
        prompts = prompts_for(args.model)
        if isinstance(prompts, CompletionPrompts):
            notes.append("the model has no chat template: every question is a text to continue, sent to /v1/completions with the model's BOS")
        documents, skipped, source = load_documents(args, prompts)
        for line in skipped:
            progress(f"skipping {line}")
        if not documents:
            raise EvaluateError("no document left to evaluate (every one skipped above)")
        pool = args.max_total_tokens or _rounded(max(conversation_tokens(t, len(d.questions), args) for d, t in documents) + 512)
        from sgl_kvevict.compat import cpu_mode_needed

        cpu_mode = cpu_mode_needed()
        servers = with_stock_numerics(servers, args, pool, cpu_mode)
        preflight(servers, args, pool, model=False)  # with the pool the documents need
        config = configuration(args, documents, pool, servers)
        done = resumed(args.out / f"{args.name}.json", config) if args.resume else {}
    except (EvaluateError, InputError, ServerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    order = sorted(documents, key=lambda item: item[1])
    holdout = held_out([d.name for d, _ in order], args.holdout) if args.holdout else set()
    buckets = {d.name: bucket_of(t) for d, t in documents}
    progress(f"{len(documents)} documents ({source}), {sum(len(d.questions) for d, _ in documents)} questions x 2 forms; "
             f"{len(servers)} servers at --max-total-tokens {pool}; buckets {sorted(set(buckets.values()))}"
             + (f"; held out: {', '.join(sorted(holdout))}" if holdout else ""))  # fmt: skip
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvevict-evaluate-logs-"))
    progress(f"server logs in {log_dir}")
    meta = {"command": shlex.join([*PROG.split(), *argv]), "config": config, "name": args.name, "notes": notes,
            "prompts": "completion" if isinstance(prompts, CompletionPrompts) else "chat", "sglang_argv": command_lines(servers, args, pool, cpu_mode)}  # fmt: skip
    results: list[dict] = []
    # Ctrl-C as KeyboardInterrupt wherever it lands: asyncio.run installs its own handler only over Python's
    # default one, and that handler cancels the running task, which a coroutine awaiting a cancelled task of
    # its own may take for that task's cancellation and swallow (the run would then go on to the end).
    signal.signal(signal.SIGINT, _interrupt)
    try:
        for index, server in enumerate(servers, 1):
            if server.label in done:
                progress(f"[{index}/{len(servers)}] {server.label}: kept from {args.out / args.name}.json")
                results.append(done[server.label])
            else:
                progress(f"[{index}/{len(servers)}] {server.label}: {' '.join(server.flags)}" + (f" at {server.url}" if server.url else ""))
                results.append(measure(server, args, prompts, documents, pool, log_dir, progress))
            write(results, meta, documents, skipped, source, buckets, holdout, args, began, final=False)
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: every server started was stopped; --resume continues from {args.out / args.name}.json", file=sys.stderr)
        return 130
    payload = write(results, meta, documents, skipped, source, buckets, holdout, args, began, final=True)
    for line in summary_lines(payload):
        progress(line)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _rounded(tokens: int, step: int = 1024) -> int:
    return -(-tokens // step) * step


def write(results, meta, documents, skipped, source, buckets, holdout, args, began, final: bool) -> dict:
    """The report so far (after each server; a stopped run keeps what finished)."""
    payload = {
        "environment": environment(), "meta": meta, "source": source, "skipped": skipped,
        "documents": [{"name": d.name, "tokens": t, "bucket": buckets[d.name], "held_out": d.name in holdout,
                       "questions": [q.text for q in d.questions]} for d, t in documents],
        "servers": results, "wall_seconds": time.perf_counter() - began, "complete": final,
    }  # fmt: skip
    if len(results) > 1 and any(r["role"] == "candidate" for r in results):
        payload["analysis"] = analyse(results, buckets, holdout, args.min_kept, args.form, args.confidence)
        text, draw = markdown(payload), (lambda path: plot(payload, path))
    else:
        text, draw = f"# Before production: in progress\n\n{len(results)} server(s) measured.\n", None
    paths = write_result_files(args.out, args.name, payload, text, draw)
    if final:
        progress("wrote " + ", ".join(map(str, paths)))
    return payload


def summary_lines(payload: dict) -> list[str]:
    """What the command prints last: the numerics floor, each candidate's kept answers and bound, the
    verdict, and the flags to use (the last line; ``no recommendation: ...`` where there are none)."""
    analysis, config = payload["analysis"], payload["meta"]["config"]
    lines = ["", "numerics (nothing evicted), answers equal to stock's, multi-request / multi-turn:"]
    for label, row in analysis["numerics"]["full"].items():
        lines.append(f"  {label}: {_f(row['equal_to_stock']['multi-request'])} / {_f(row['equal_to_stock']['multi-turn'])}")
    if analysis["numerics"]["stock_accuracy"] is not None:
        lines.append(f"  stock answers {_f(analysis['numerics']['stock_accuracy'])} of the questions right (the lower form)")
    lines += ["", f"kept answers and their {analysis['recommendation']['confidence']:.0%} lower bound (calibration documents), kept share:"]
    for server in (s for s in payload["servers"] if s["role"] == "candidate"):
        row = analysis["candidates"][server["label"]]
        held = "" if row["held_out"] is None else f", held out {_f(row['held_out'])}"
        lines.append(f"  {server['label']}: {_f(row['kept_answers'])}, bound {_f(row['bound'])}{held}, kept share {_f(server['fidelity']['all']['kept_share'])}")
    lines += ["", *verdict_lines(analysis, config["dense_flags"])]
    rec = analysis["recommendation"]
    if rec["flags"] is None:
        return lines + ["", "no recommendation: " + ("the probes cannot judge this model" if rec["cannot_judge"] else "no candidate is safe at this target")]
    return lines + ["", f"recommended server flags (kept answers' lower bound >= {rec['min_kept']:g} in every length group, {rec['form']}):",
                    " ".join([*rec["flags"], *config["server_args"]])]  # fmt: skip


def _f(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
