"""Answers on long documents through the server: document lengths x servers, several questions per
compressed document, each asked after the document was reused.

    python -m benchmarks.long_documents                          # stock, the make-serve default, request scope
    python -m benchmarks.long_documents --lengths 7000 --documents 3 --name probe     # a quick look
    python -m benchmarks.long_documents --server "default 1500=--kv-evict-policy topk ... --max-total-tokens 1500"
    python -m benchmarks.long_documents ... --resume                                  # after an interruption

Per document (``sgl_kvevict/measure/tasks.py``'s ``facts``: natural-language filler with three numbered facts of
different kinds spread over it): turn 1 is the document and
a question-agnostic instruction ("Summarise the text above in one sentence."), so a policy server
compresses the document before it knows any question. Then every question of the document is asked
once, in its own request that reuses the compressed document and starts the reply with the question's
answer prefix (``continue_final_message``); the greedy answer is scored by exact match. ``--questions``
says what that request is:

* ``after-summary`` (the default): turn 2 of the chat, turn 1 and its summary re-sent, the question
  after them;
* ``new-request``: a new one-turn conversation, the same document followed by the question (another
  user asking about a shared document; the question right after the document, as in the papers'
  context-only setting).

One request at a time, the cache flushed before each document.

A server is a label and its launcher flags (``--server "LABEL=FLAGS"``, repeatable); stock SGLang
(``--kv-evict-policy none``) is always the first, with a pool every document fits dense. Reported
per (server, length): accuracy with its 95% Wilson interval and its ratio to stock's at that length;
the reuse rate (the question's cached tokens cover every token its prompt shares with turn 1's); the **kept share**: KV slots the
document's conversation holds after turn 1 (``kv_slots_total - kv_slots_free``) over the tokens it
holds dense in stock (prompt + summary), so a policy that keeps 60% of a document is reported as 60%
whatever its budget says; and the median turn-1 TTFT. Writes ``<name>.json`` (every answer) and
``<name>.md`` (with a plot ``<name>.png``) into ``--out`` after each server.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp

from benchmarks.cli import add_output_args
from benchmarks.cli import add_resume_arg
from benchmarks.cli import as_json
from benchmarks.cli import benchmark_parser
from benchmarks.cli import checkpoint
from benchmarks.cli import checkpoint_path
from benchmarks.cli import command_line
from benchmarks.cli import exits_on
from benchmarks.cli import log_folder
from benchmarks.cli import other_configuration
from benchmarks.cli import parse_command_line
from benchmarks.cli import progress
from benchmarks.cli import run_each
from benchmarks.load.report import heading
from benchmarks.reuse_quality import SUMMARY_INSTRUCTION
from sgl_kvevict.measure.chat import ChatTokens, kv_held, model_token_counter, shared_prefix
from sgl_kvevict.measure.client import flush_when_idle, ask
from sgl_kvevict.measure.intervals import Proportion, wilson
from sgl_kvevict.measure.results import write_result_files, pyplot as _pyplot, environment
from sgl_kvevict.measure.servers import ServerError
from sgl_kvevict.measure.servers import ServerVariant
from sgl_kvevict.measure.servers import check_launcher_accepts
from sgl_kvevict.measure.servers import check_lineup
from sgl_kvevict.measure.servers import launched_server
from sgl_kvevict.measure.tasks import TASK_KINDS, Question, Task, make_task
from sgl_kvevict.server.sglang_args import int_flag_value

DEFAULT_LENGTHS = (2000, 4000, 7000)
DEFAULT_KINDS = ("facts",)
# The make-serve default, and the same compression over each prompt whole.
DEFAULT_SERVERS = (
    "default=--kv-evict-policy topk --kv-evict-score learned --kv-evict-budget 0.25 --kv-evict-scope block",
    "request scope=--kv-evict-policy topk --kv-evict-score learned --kv-evict-budget 0.25 --kv-evict-scope request",
)
STOCK_LABEL = "stock"
# --questions: where each question is asked (the module docstring says how).
QUESTION_FORMATS = ("after-summary", "new-request")
POOL_FLAG = "--max-total-tokens"


class LongDocumentsError(ValueError):
    """A bad setting, or a checkpoint of another run; the message says which."""


@dataclass(frozen=True)
class Server:
    """label: the name in the report; flags: its launcher flags (policy, scope, pool ...)."""

    label: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> "Server":
        label, sep, flags = spec.partition("=")
        if not sep or not label.strip():
            raise LongDocumentsError(f"--server {spec!r}: expected LABEL=FLAGS")
        return cls(label.strip(), tuple(shlex.split(flags)))

    @property
    def is_stock(self) -> bool:
        return self.label == STOCK_LABEL


@dataclass(frozen=True)
class LongDocumentsConfig:
    model: str
    servers: tuple[Server, ...]  # stock first
    lengths: tuple[int, ...]
    documents: int  # per length
    kinds: tuple[str, ...]
    seed: int
    summary_tokens: int
    answer_tokens: int
    pool_tokens: int  # every server's pool unless its flags give one (stock: this one)
    questions: str = QUESTION_FORMATS[0]

    def __post_init__(self):
        if self.questions not in QUESTION_FORMATS:
            raise LongDocumentsError(f"--questions {self.questions!r}: choose from {', '.join(QUESTION_FORMATS)}")
        labels = [server.label for server in self.servers]
        check_lineup(labels, bool(self.servers) and self.servers[0].is_stock, LongDocumentsError,
                     "the first server must be stock", "server labels must differ")  # fmt: skip
        if self.documents < 1 or self.summary_tokens < 1 or self.answer_tokens < 1:
            raise LongDocumentsError("--documents, --summary-tokens and --answer-tokens must be >= 1")
        if not self.lengths or min(self.lengths) < 64:
            raise LongDocumentsError(f"--lengths {list(self.lengths)}: each must be >= 64 tokens")
        unknown = [kind for kind in self.kinds if kind not in TASK_KINDS]
        if unknown or not self.kinds:
            raise LongDocumentsError(f"--kinds {list(self.kinds)}: choose from {', '.join(TASK_KINDS)}")
        if self.pool_tokens < max(self.lengths) + 1024:
            raise LongDocumentsError(f"--pool-tokens {self.pool_tokens}: stock needs every document dense (+1024)")

    def tasks(self, length: int, count_tokens: Callable[[str], int]) -> list[Task]:
        """The documents of one length: kinds cycled, needle depths spread, the same for every server."""
        depths = [(i + 0.5) / self.documents for i in range(self.documents)]
        return [
            make_task(self.kinds[i % len(self.kinds)], self.seed * 100_003 + length + i, length, depths[i], count_tokens)
            for i in range(self.documents)
        ]


@dataclass(frozen=True)
class AnswerRecord:
    """One question about one document. TTFT in seconds."""

    length: int
    document: int
    kind: str
    question: str
    answer: str
    output: str
    correct: bool
    cached_tokens: int
    prompt_tokens: int
    reused: bool  # the question's cached tokens cover every token its prompt shares with turn 1's
    ttft: float


@dataclass(frozen=True)
class DocumentRecord:
    length: int
    document: int
    kind: str
    prompt_tokens: int
    summary: str
    summary_tokens: int
    ttft: float
    slots_held: Optional[int]  # KV slots held after turn 1 (None: stock, which holds the conversation dense)

    @property
    def kept_share(self) -> Optional[float]:
        """Slots held over the tokens stock holds dense for the same conversation."""
        return None if self.slots_held is None else self.slots_held / (self.prompt_tokens + self.summary_tokens)


def turn_one(task: Task) -> list[dict]:
    return [{"role": "user", "content": f"{task.context}\n\n{SUMMARY_INSTRUCTION}"}]


def turn_two(task: Task, summary: str, question: Question) -> list[dict]:
    return turn_one(task) + [
        {"role": "assistant", "content": summary},
        {"role": "user", "content": question.question},
        {"role": "assistant", "content": question.answer_prefix},
    ]


def new_request(task: Task, question: Question) -> list[dict]:
    return [
        {"role": "user", "content": f"{task.context}\n\n{question.question}"},
        {"role": "assistant", "content": question.answer_prefix},
    ]


def question_messages(questions: str, task: Task, summary: str, question: Question) -> list[dict]:
    """The request asking ``question`` in the ``--questions`` format ``questions``."""
    return turn_two(task, summary, question) if questions == "after-summary" else new_request(task, question)


async def run_document(
    session: aiohttp.ClientSession, base_url: str, config: LongDocumentsConfig, length: int, index: int, task: Task,
    chat: ChatTokens,
) -> tuple[DocumentRecord, list[AnswerRecord]]:
    if not await flush_when_idle(session, base_url, timeout=60):
        raise ServerError(f"{base_url} did not flush its cache")
    first = await ask(session, base_url, turn_one(task), config.summary_tokens)
    document = DocumentRecord(length, index, task.kind, first.prompt_tokens, first.text, first.completion_tokens,
                              first.ttft, (await kv_held(session, base_url)).slots)  # fmt: skip
    answers = []
    turn_one_ids = chat.ids(turn_one(task))  # what a question may reuse: the prefix its prompt shares with these
    for question in task.questions:
        messages = question_messages(config.questions, task, first.text, question)
        reply = await ask(session, base_url, messages, config.answer_tokens)
        answers.append(
            AnswerRecord(length, index, task.kind, question.question, question.answer, reply.text,
                         question.is_correct(reply.text), reply.cached_tokens, reply.prompt_tokens,
                         reply.cached_tokens >= shared_prefix(turn_one_ids, chat.ids(messages)), reply.ttft)  # fmt: skip
        )
    return document, answers


async def run_lengths(
    base_url: str, config: LongDocumentsConfig, suites: dict[int, list[Task]], log: Callable[[str], None]
) -> tuple[list[DocumentRecord], list[AnswerRecord]]:
    documents, answers = [], []
    total, started = sum(len(tasks) for tasks in suites.values()), time.perf_counter()
    chat = ChatTokens.for_model(config.model)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for length, tasks in suites.items():
            for index, task in enumerate(tasks):
                document, asked = await run_document(session, base_url, config, length, index, task, chat)
                documents.append(document)
                answers += asked
                done = len(documents)
                eta = (time.perf_counter() - started) / done * (total - done) / 60
                share = "-" if document.kept_share is None else f"{document.kept_share:.2f}"
                log(f"  {length} tokens, document {index + 1}/{len(tasks)} ({task.kind}): "
                    f"{sum(a.correct for a in asked)}/{len(asked)} right, kept share {share}, "
                    f"TTFT {document.ttft:.1f} s (ETA {eta:.1f} min)")  # fmt: skip
    return documents, answers


def summarize(documents: Sequence[DocumentRecord], answers: Sequence[AnswerRecord]) -> dict:
    """Per length: accuracy, reuse rate, kept share (mean, max), median turn-1 TTFT."""
    summary = {}
    for length in sorted({d.length for d in documents}):
        asked = [a for a in answers if a.length == length]
        shares = [d.kept_share for d in documents if d.length == length and d.kept_share is not None]
        summary[str(length)] = {
            "accuracy": wilson(sum(a.correct for a in asked), len(asked)).as_json(),
            "reuse_rate": sum(a.reused for a in asked) / len(asked),
            "kept_share_mean": statistics.mean(shares) if shares else None,
            "kept_share_max": max(shares) if shares else None,
            "prompt_tokens_median": statistics.median(d.prompt_tokens for d in documents if d.length == length),
            "turn1_ttft_median": statistics.median(d.ttft for d in documents if d.length == length),
        }
    return summary


def run_server(
    config: LongDocumentsConfig, server: Server, suites: dict[int, list[Task]], log_dir: Path, log: Callable[[str], None]
) -> dict:
    """One server over every length; its flags' own pool, or ``--pool-tokens``."""
    given = int_flag_value(list(server.flags), POOL_FLAG)
    pool = config.pool_tokens if given is None else given
    log(f"{server.label}: starting ({' '.join(server.flags)}, pool {pool} tokens)")
    variant = ServerVariant.from_flags(server.label, server.flags)
    with launched_server(config.model, variant, pool, log_dir) as running:
        documents, answers = asyncio.run(run_lengths(running.base_url, config, suites, log))
    summary = summarize(documents, answers)
    for length, cell in summary.items():
        log(f"{server.label} @ {length}: {wilson_of(cell).percent()}, kept share {_fmt(cell['kept_share_mean'])}")
    return {"label": server.label, "flags": list(server.flags), "pool_tokens": pool, "summary": summary,
            "documents": [asdict(d) | {"kept_share": d.kept_share} for d in documents],
            "answers": [asdict(a) for a in answers]}  # fmt: skip


def wilson_of(cell: dict) -> Proportion:
    accuracy = cell["accuracy"]
    return wilson(accuracy["successes"], accuracy["n"])


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- report ----------------------------------------------------------------------------------------


def with_ratios(servers: list[dict]) -> list[dict]:
    """Each server's accuracy over stock's at every length (``vs_stock``; None for stock)."""
    stock = servers[0]["summary"]
    for server in servers:
        server["vs_stock"] = None if server is servers[0] else {
            length: (cell["accuracy"]["value"] / stock[length]["accuracy"]["value"]
                     if stock.get(length) and stock[length]["accuracy"]["value"] else None)
            for length, cell in server["summary"].items()
        }  # fmt: skip
    return servers


def accuracy_table(payload: dict) -> list[str]:
    """Markdown rows: per server its pool, and per length its accuracy [Wilson 95%] (x stock's) and kept share."""
    lengths = [str(length) for length in payload["meta"]["config"]["lengths"]]
    lines = [
        "| server | pool | " + " | ".join(f"~{int(length) // 1000}K accuracy | kept" for length in lengths) + " |",
        "|---|---|" + "---|---|" * len(lengths),
    ]
    for server in payload["servers"]:
        cells = []
        for length in lengths:
            cell = server["summary"].get(length)
            if cell is None:
                cells += ["-", "-"]
                continue
            ratio = (server.get("vs_stock") or {}).get(length)
            cells += [f"{wilson_of(cell).percent()}" + ("" if ratio is None else f" (x{ratio:.2f})"),
                      _fmt(cell["kept_share_mean"])]  # fmt: skip
        lines.append(f"| {server['label']} | {server['pool_tokens']} | " + " | ".join(cells) + " |")
    return lines


def asked_how(config: dict) -> str:
    """How the report's questions were asked (``config``: the run's config as JSON)."""
    if config.get("questions", QUESTION_FORMATS[0]) == "after-summary":
        return "each fact asked in its own later turn that re-sends the document and the summary"
    return "each fact asked in a new one-turn request, the same document followed by the question"


def markdown(payload: dict) -> str:
    meta, servers, env = payload["meta"], payload["servers"], payload["environment"]
    config = meta["config"]
    lines = [
        *heading("Answers on long documents after reuse, by document length", meta),
        f"Machine: {env['cpu_model']}, {env['cpu_cores']} cores, no GPU (CPU development mode). SGLang {env['sglang']}, "
        f"sgl-kvevict {env['git_commit']}{' (uncommitted changes)' if env['git_worktree_dirty'] else ''}, {env['date']}. "
        f"Model `{config['model']}`. Per length {config['documents']} documents ({', '.join(config['kinds'])}, seed "
        f"{config['seed']}); turn 1 asks for a summary (up to {config['summary_tokens']} tokens) and the server "
        f"compresses the document in it; then {asked_how(config)}, reusing the compressed document; answers up to "
        f"{config['answer_tokens']} tokens after the question's answer prefix, exact match.",
        "",
        "Accuracy [95% Wilson interval] (ratio to stock at that length); kept share = KV slots held after turn 1 over "
        "the tokens stock holds dense (prompt + summary), mean over documents (max in the detail below).",
        "",
        *accuracy_table(payload),
    ]
    lines += ["", "| server | flags | length | n | prompt tokens (median) | reuse rate | kept share max | TTFT turn 1 (s) |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for server in servers:
        for length, cell in server["summary"].items():
            lines.append(
                f"| {server['label']} | `{' '.join(server['flags']) or '(stock)'}` | {length} | {cell['accuracy']['n']} "
                f"| {cell['prompt_tokens_median']:.0f} | {cell['reuse_rate']:.2f} | {_fmt(cell['kept_share_max'])} "
                f"| {cell['turn1_ttft_median']:.1f} |"
            )
    lines += ["", f"![accuracy by length]({meta['name']}.png)", "",
              "Greedy bf16 answers through a compressed cache are not bit-identical across machines; compare the intervals."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> None:
    """Accuracy by document length, one line per server, 95% Wilson error bars."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6.4, 4.2))
    for offset, server in enumerate(payload["servers"]):
        cells = sorted((int(length), wilson_of(cell)) for length, cell in server["summary"].items())
        x = [length + 60 * (offset - len(payload["servers"]) / 2) for length, _ in cells]  # apart, readable
        y = [100 * p.value for _, p in cells]
        error = [[v - 100 * p.low for v, (_, p) in zip(y, cells)], [100 * p.high - v for v, (_, p) in zip(y, cells)]]
        axis.errorbar(x, y, yerr=error, marker="o", markersize=4, capsize=3, linewidth=1, label=server["label"])
    axis.set_xlabel("document length (tokens)")
    axis.set_ylabel("answers right (%), 95% Wilson interval")
    axis.set_ylim(-3, 103)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(servers: list[dict], meta: dict, out: Path) -> list[Path]:
    payload = {"environment": environment(), "meta": meta, "servers": with_ratios(servers)}
    return write_result_files(out, meta["name"], payload, markdown(payload), lambda path: plot(payload, path))


# ---- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("long_documents", __doc__)
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument(
        "--server", action="append", default=[], metavar="LABEL=FLAGS",
        help="a server besides stock: its label and launcher flags, e.g. \"default=--kv-evict-policy topk "
        "--kv-evict-score learned --kv-evict-scope block\"; its own --max-total-tokens overrides --pool-tokens "
        "(repeatable; default: the make-serve default and the same in request scope)",
    )  # fmt: skip
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="document lengths in model tokens (default 2000,4000,7000)")
    parser.add_argument("--documents", type=int, default=8, help="documents per length (default 8: 24 questions with the default kind)")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="task kinds, cycled (default facts)")
    parser.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    parser.add_argument("--summary-tokens", type=int, default=32, help="turn 1's answer cap (default 32)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="each answer's cap (default 8)")
    parser.add_argument("--questions", default=QUESTION_FORMATS[0], choices=QUESTION_FORMATS,
                        help="where each question is asked: in turn 2 after the summary (default), or in a new "
                        "one-turn request, the same document followed by the question")  # fmt: skip
    parser.add_argument("--pool-tokens", type=int, default=16384, help="--max-total-tokens of stock and of servers that give none (default 16384)")
    add_output_args(parser, "long_documents")
    add_resume_arg(parser)
    return parser


def parse_config(args: argparse.Namespace) -> LongDocumentsConfig:
    specs = args.server or list(DEFAULT_SERVERS)
    return LongDocumentsConfig(
        model=args.model,
        servers=(Server(STOCK_LABEL, ("--kv-evict-policy", "none")), *map(Server.parse, specs)),
        lengths=tuple(int(length) for length in args.lengths.split(",") if length.strip()),
        documents=args.documents,
        kinds=tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip()),
        seed=args.seed,
        summary_tokens=args.summary_tokens,
        answer_tokens=args.answer_tokens,
        pool_tokens=args.pool_tokens,
        questions=args.questions,
    )


def _resumed(args: argparse.Namespace, config: LongDocumentsConfig) -> dict[str, dict]:
    """The finished servers of a run with this configuration (by label)."""
    previous = checkpoint(args, LongDocumentsError)
    if previous is None:
        return {}
    keys = ("model", "lengths", "documents", "kinds", "seed", "summary_tokens", "answer_tokens", "pool_tokens", "questions")
    mine, theirs = as_json(asdict(config)), {"questions": QUESTION_FORMATS[0], **previous["meta"]["config"]}
    if any(theirs[key] != mine[key] for key in keys):
        raise other_configuration(checkpoint_path(args), LongDocumentsError)
    return {server["label"]: server for server in previous["servers"]}


@exits_on(ServerError, code=2)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser, argv, args = parse_command_line(build_parser, argv)
    try:
        config = parse_config(args)
        for server in config.servers:  # the launcher's own refusal, before minutes of stock's documents
            given = int_flag_value(list(server.flags), POOL_FLAG)
            check_launcher_accepts(config.model, ServerVariant.from_flags(server.label, server.flags),
                                   config.pool_tokens if given is None else given, ())  # fmt: skip
        done = _resumed(args, config)
    except (LongDocumentsError, ServerError, ValueError) as error:
        parser.error(str(error))
    count_tokens = model_token_counter(config.model)
    suites = {length: config.tasks(length, count_tokens) for length in config.lengths}
    meta = {"command": command_line("long_documents", argv), "config": asdict(config), "name": args.name}
    log_dir = log_folder(args.log_dir, "long-documents")
    run_each(
        config.servers, lambda server: server.label, done,
        lambda server: run_server(config, server, suites, log_dir, progress),
        lambda servers: write_outputs(servers, meta, args.out),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
